"""``aiockpt.convert``: any readable checkpoint written anew in another format.

Targets: an aiockpt checkpoint, a ``torch.save`` file, safetensors (one file or a Hugging Face
directory) or a DCP directory.

The source is read whole into CPU memory (:func:`aiockpt.read`), then written by the target's writer into
a temporary directory next to the destination (a directory output is that directory, a file output lies
in it), made durable (fsync) and renamed into place without ever replacing an existing path; a failed or
cancelled conversion leaves nothing behind. The temporary directory is a save's (``open_tmp``): named
``.tmp-...`` and owner-locked, so garbage collection (a Checkpointer opening the destination's directory,
``aiockpt prune``) leaves a conversion in progress alone and removes a crashed one's at once.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Literal, cast

import anyio
import anyio.from_thread
import torch

from .._errors import CheckpointError, CheckpointExistsError, StateError, StorageError
from .._format import Key, KeyPath
from .._fs import OwnerLock, fsync_dir, not_a_directory, rename_noreplace
from .._handle import SaveMetrics
from .._insulate import insulated
from .._load import run_metadata
from .._load._ranks import checked_rank
from .._memory import StagingPool, byte_view, nbytes_of
from .._options import IOConfig, check_flags, io_config
from .._save import SaveRequest, UserMetadata, discard_tmp, open_tmp, run_save
from .._storage import S3Path, local, resolve
from .._threads import acquire_sync, run_sync
from .._tree import dtype_name, nested, render
from .._verify import check_progress
from .._world import LocalWorld
from . import detect
from ._names import is_leaf, join, restore_optimizer_ids
from ._safetensors import INDEX_NAME, NAMES, SINGLE_NAME, SUFFIX

__all__ = ["DEFAULT_MAX_SHARD_SIZE", "Target", "convert", "named_tensors"]

Target = Literal["aiockpt", "torch", "safetensors", "dcp"]
Progress = Callable[[int, int], object]  # (what it returns is ignored: a tqdm-style update will do)

DEFAULT_MAX_SHARD_SIZE = 5 * 10**9  # Hugging Face's default "5GB"


def _tensors(tree: Mapping[Key, object]) -> list[torch.Tensor]:
    """The tensors of ``tree``, each once: a tie (one tensor under two keys) is stored, and counted, once."""
    return list({id(obj): obj for obj in nested(tree) if isinstance(obj, torch.Tensor)}.values())


# The header entry of a safetensors file that holds its metadata, not a tensor.
_METADATA = "__metadata__"


def _claim(names: dict[str, KeyPath], path: KeyPath) -> str:
    """Record in ``names`` the flat name of ``path`` (its keys joined with ``"."``), and return it.

    safetensors and DCP store each value under such a name, so two paths must never share one.

    Raises:
        StateError: Another path of ``names`` has that name; names both keys.
    """
    name = join(path)
    if name in names:
        raise StateError(
            f"two keys are both named {name!r} once joined with '.': {render(names[name])!r} and "
            f"{render(path)!r} (rename one)",
            key=render(path),
        )
    names[name] = path
    return name


def check_dcp_names(tree: Mapping[Key, object]) -> None:
    """Refuse ``tree`` if ``dcp.save`` would store two of its values under one name.

    Values are named as DCP flattens them (see ``_names.is_leaf``), before it sees them: its own
    refusal arrives wrapped in every rank's traceback.

    Raises:
        StateError: Two key paths join to one name (names both).
    """
    names: dict[str, KeyPath] = {}

    def walk(obj: object, path: KeyPath) -> None:
        if is_leaf(obj):
            _claim(names, path)
        elif isinstance(obj, Mapping):
            for k, v in obj.items():
                walk(v, (*path, k))
        else:
            assert isinstance(obj, list)  # (is_leaf: a list that holds a tensor or a mapping)
            for i, v in enumerate(obj):
                walk(v, (*path, i))

    for k, v in tree.items():
        walk(v, (k,))


def named_tensors(tree: Mapping[Key, object], *, drop_non_tensors: bool) -> list[tuple[str, torch.Tensor]]:
    """The tensors of ``tree`` by safetensors name: key paths joined with ``"."``.

    Raises:
        StateError: ``tree`` holds values other than tensors (all listed) and ``drop_non_tensors`` is
            false, two paths join to one name, a name is ``__metadata__``, or a dtype has no safetensors
            name.
    """
    out: dict[str, torch.Tensor] = {}
    names: dict[str, KeyPath] = {}
    others: list[KeyPath] = []

    def walk(obj: object, path: KeyPath) -> None:
        if isinstance(obj, torch.Tensor):
            name = _claim(names, path)
            if name == _METADATA:
                raise StateError(
                    f"safetensors reserves the name {_METADATA!r} (for its header's metadata): rename "
                    f"{render(path)!r}",
                    key=render(path),
                )
            if dtype_name(obj.dtype) not in NAMES:
                raise StateError(
                    f"safetensors cannot hold {render(path)!r}: dtype {dtype_name(obj.dtype)}",
                    key=render(path),
                )
            out[name] = obj
        elif isinstance(obj, Mapping):
            for k, v in obj.items():
                walk(v, (*path, k))
        elif isinstance(obj, (list, tuple)) and any(
            isinstance(v, (torch.Tensor, Mapping, list, tuple)) for v in obj
        ):
            for i, v in enumerate(obj):
                walk(v, (*path, i))
        else:
            others.append(path)

    walk(tree, ())
    if others and not drop_non_tensors:
        shown = ", ".join(repr(render(p)) for p in others[:20]) + (" ..." if len(others) > 20 else "")
        raise StateError(
            f"safetensors holds only tensors; the source also holds {len(others)} other value(s): {shown}. "
            "Pass drop_non_tensors=True (--drop-non-tensors on the command line) to leave them out",
            key=render(others[0]),
        )
    return list(out.items())


def _write_all(fd: int, view: memoryview) -> None:
    while view:
        view = view[os.write(fd, view) :]


def write_safetensors(
    file: Path, items: list[tuple[str, torch.Tensor]], advance: Callable[[int], None]
) -> None:
    """Write ``items`` as a new safetensors file and fsync it. Blocking.

    Raises:
        OSError: Writing failed (``file`` may be left partly written; the caller removes it).
    """
    header: dict[str, object] = {_METADATA: {"format": "pt"}}
    offset = 0
    for name, t in items:
        n = nbytes_of(t)
        header[name] = {
            "dtype": NAMES[dtype_name(t.dtype)],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + n],
        }
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned, as the reference writer does
    fd = os.open(file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        _write_all(fd, memoryview(len(raw).to_bytes(8, "little") + raw))
        for _, t in items:
            _write_all(fd, byte_view(t.detach().cpu().contiguous()))
            advance(nbytes_of(t))
        os.fsync(fd)
    finally:
        os.close(fd)


def _shards(items: list[tuple[str, torch.Tensor]], max_size: int) -> list[list[tuple[str, torch.Tensor]]]:
    """Greedy split in order; a tensor larger than ``max_size`` gets a shard of its own."""
    shards: list[list[tuple[str, torch.Tensor]]] = [[]]
    size = 0
    for name, t in items:
        n = nbytes_of(t)
        if shards[-1] and size + n > max_size:
            shards.append([])
            size = 0
        shards[-1].append((name, t))
        size += n
    return shards


def write_hf_dir(
    directory: Path, items: list[tuple[str, torch.Tensor]], max_size: int, advance: Callable[[int], None]
) -> None:
    """Write ``items`` into the empty directory ``directory`` in the Hugging Face layout. Blocking."""
    shards = _shards(items, max_size)
    if len(shards) == 1:
        write_safetensors(directory / SINGLE_NAME, items, advance)
    else:
        weight_map: dict[str, str] = {}
        for i, shard in enumerate(shards, 1):
            name = f"model-{i:05d}-of-{len(shards):05d}{SUFFIX}"
            write_safetensors(directory / name, shard, advance)
            weight_map.update((n, name) for n, _ in shard)
        index = {
            "metadata": {"total_size": sum(nbytes_of(t) for _, t in items)},
            "weight_map": dict(sorted(weight_map.items())),
        }
        fd = os.open(directory / INDEX_NAME, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            _write_all(fd, memoryview(json.dumps(index, indent=2).encode()))
            os.fsync(fd)
        finally:
            os.close(fd)
    fsync_dir(directory)


def _compact(obj: object, clones: dict[int, torch.Tensor]) -> object:
    """``obj`` with every tensor that views a larger storage cloned (tied tensors stay tied).

    ``torch.save`` writes whole storages, and :func:`aiockpt.read` carves small tensors out of shared
    slabs: saved as they are, each slab would be written in full.
    """
    if isinstance(obj, torch.Tensor):
        if obj.untyped_storage().nbytes() == nbytes_of(obj):
            return obj
        if id(obj) not in clones:
            clones[id(obj)] = obj.clone()
        return clones[id(obj)]
    if isinstance(obj, Mapping):
        return {k: _compact(v, clones) for k, v in obj.items()}
    if type(obj) in (list, tuple):
        return type(obj)(_compact(v, clones) for v in obj)  # type: ignore[call-arg, attr-defined]
    return obj


def _write_error(exc: BaseException) -> OSError | None:
    """The OSError that ``exc`` (or an error it was raised from, or while handling) began with, if any.

    ``torch.save``'s writer turns a failed write (a full disk) into a RuntimeError ("unexpected pos
    ..."), raised while handling the OSError.
    """
    seen: set[int] = set()
    at: BaseException | None = exc
    while at is not None and id(at) not in seen:
        if isinstance(at, OSError):
            return at
        seen.add(id(at))
        at = at.__cause__ or at.__context__
    return None


def write_torch(file: Path, tree: Mapping[Key, object]) -> None:
    """``torch.save`` ``tree`` into the new file ``file`` and fsync it. Blocking.

    Raises:
        OSError: Writing failed (the disk is full, say).
    """
    with open(file, "xb") as f:
        try:
            torch.save(_compact(tree, {}), f)
        except RuntimeError as exc:
            if (error := _write_error(exc)) is not None:
                raise error from exc
            raise
        f.flush()
        os.fsync(f.fileno())


def write_dcp(directory: Path, tree: Mapping[Key, object]) -> None:
    """Save ``tree`` into the empty directory ``directory`` with ``dcp.save``, in this process only. Blocking.

    ``tree`` has passed :func:`check_dcp_names`.

    Raises:
        OSError: Writing failed (the disk is full, say): the error of DCP's writer.
        RuntimeError: ``dcp.save`` failed otherwise.
    """
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.checkpoint.state_dict_saver import save

    with warnings.catch_warnings():
        # dcp.save warns that it saves in a single process even when asked to (no_dist=True).
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        try:
            save(dict(tree), storage_writer=FileSystemWriter(directory, sync_files=True), no_dist=True)
        except CheckpointException as exc:  # a BaseException: made an ordinary error here
            for failure in exc.failures.values():  # (each an exception, with its traceback's summary)
                if (error := _write_error(failure[0] if isinstance(failure, tuple) else failure)) is not None:
                    raise error from exc
            raise RuntimeError(f"dcp.save failed: {exc}") from exc
    fsync_dir(directory)


def _not_a_directory(target: Path) -> StorageError | None:
    """The error for a ``target`` that cannot be created because an ancestor is not a directory. Blocking.

    ``None`` where the nearest ancestor of ``target`` that exists is a directory (or none exists). The
    error names that ancestor: ``mkdir`` would report it as ``FileExistsError`` of a path that does not
    exist (``dst``'s parent), and the caller would take it for ``dst`` itself.
    """
    ancestor = not_a_directory(target.parent)
    if ancestor is None:
        return None
    return StorageError(f"cannot write {target}: {ancestor} is not a directory", path=str(ancestor))


async def _carried(src: str | os.PathLike[str]) -> tuple[int | None, UserMetadata]:
    """The step and ``metadata=`` of an aiockpt source, which an aiockpt copy keeps (no other has them)."""
    location = resolve(src)
    if not isinstance(location, S3Path) and await run_sync(lambda: detect(location)) != "aiockpt":
        return None, {}
    meta = await run_metadata(location)
    return meta.step, dict(meta.user_metadata)


async def _is_dcp(src: str | os.PathLike[str]) -> bool:
    """Whether ``src`` is a DCP directory (as :func:`aiockpt.read` tells it)."""
    location = resolve(src)
    return not isinstance(location, S3Path) and await run_sync(lambda: detect(location)) == "dcp"


async def _check_rank(src: str | os.PathLike[str], rank: int, *, given: bool) -> None:
    """Refuse ``rank`` where the aiockpt checkpoint ``src`` was saved by fewer ranks.

    Such a rank took no part in the save: its state would be only what every rank shared, without the
    per-rank state the caller meant to export. Foreign sources hold no per-rank state: any rank reads
    them. ``given``: ``rank`` was passed, not this process's.

    Raises:
        CheckpointError: ``rank`` is not below the saving world's size (names both).
        CheckpointNotFoundError: ``src`` is not a committed checkpoint (as :func:`aiockpt.read`).
        FormatError: Its manifest is unreadable (as :func:`aiockpt.read`).
    """
    location = resolve(src)
    if not isinstance(location, S3Path):
        kind = await run_sync(lambda: detect(location))
        if kind != "aiockpt":
            return
    world = (await run_metadata(location)).world_size
    if rank >= world:
        which = f"rank {rank}" if given else f"rank {rank} (this process's rank in torch.distributed)"
        raise CheckpointError(
            f"{which} is not one of the {world} rank(s) that saved {location}: pass a rank from 0 to "
            f"{world - 1} (--rank on the command line)"
        )


@insulated
async def convert(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    to: Target,
    allow_pickle: bool = False,
    drop_non_tensors: bool = False,
    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
    progress: Progress | None = None,
    io: IOConfig | None = None,
    rank: int | None = None,
) -> Path:
    """Convert the checkpoint ``src`` into a new checkpoint ``dst`` of format ``to``.

    ``src`` is anything :func:`aiockpt.read` reads: an aiockpt checkpoint, a DCP directory, a
    safetensors file or Hugging Face directory, or a ``torch.save`` file. It is read whole into CPU memory,
    then written into an owner-locked temporary directory next to ``dst`` (as a save is, so that garbage
    collection in ``dst``'s directory spares it), made durable and renamed into place.

    Args:
        src: The checkpoint to read.
        dst: The path to create; it must not exist.
        to: ``"aiockpt"`` (a checkpoint directory), ``"torch"`` (one ``torch.save`` file), ``"dcp"`` (a
            ``torch.distributed.checkpoint`` directory, written by ``dcp.save``) or ``"safetensors"``: a
            ``dst`` ending in ``.safetensors`` is one file; any other ``dst`` is a Hugging Face directory,
            ``model.safetensors`` or, past ``max_shard_size``, ``model-00001-of-0000N.safetensors`` shards
            and ``model.safetensors.index.json``. Tensor names (safetensors) and DCP's names are key paths
            joined with ``"."``.
        allow_pickle: Read pickled objects of the source (only for sources you trust) and let the
            target store them.
        drop_non_tensors: For safetensors, leave out values that are not tensors instead of refusing.
        max_shard_size: Bytes of tensor data per safetensors shard (a larger tensor gets its own shard): an
            int of at least 1. Hugging Face's size strings (``"5GB"``, ``"512MiB"``) are taken by the
            command line's ``--max-shard-size`` only.
        progress: Called on the event loop thread with ``(bytes written, total bytes)`` of tensor data:
            at the start, as safetensors tensors are written (every 0.5 % or so), and at the end; what
            it returns is ignored.
        io: I/O tuning for reading the source and writing an aiockpt checkpoint.
        rank: Whose per-rank state to convert, for a source saved by several ranks whose states differ
            (see :func:`aiockpt.read`, which reads it): ``None`` is this process's rank, 0 outside a
            distributed job. The result holds that rank's state alone. For an aiockpt source it must be
            one of the ranks that saved it.

    Returns:
        The absolute path of the new checkpoint.

    Raises:
        CheckpointExistsError: ``dst`` exists.
        CheckpointNotFoundError: ``src`` is not a checkpoint.
        StateError: The source holds what the target cannot (non-tensor values for safetensors, pickled
            objects without ``allow_pickle``, objects the target's writer refuses, two keys that join to
            one name for safetensors or DCP); the message names the keys where known.
        FormatError: The source is unreadable.
        StorageError: Writing failed, or an ancestor of ``dst`` is a file, not a directory (names it);
            nothing is left at ``dst``.
        CheckpointError: ``to``, ``max_shard_size`` or ``progress`` is invalid, ``src`` or ``dst`` is an
            empty path (as for every other bad argument), or ``rank`` is not a rank of the world that
            saved an aiockpt ``src`` (names the rank and the world's size).
    """
    from .._api import read

    check_flags(allow_pickle=allow_pickle, drop_non_tensors=drop_non_tensors)
    if to not in ("aiockpt", "torch", "safetensors", "dcp"):
        raise CheckpointError(f"to must be 'aiockpt', 'torch', 'safetensors' or 'dcp', not {to!r}")
    if not (isinstance(max_shard_size, int) and not isinstance(max_shard_size, bool) and max_shard_size >= 1):
        raise CheckpointError(f"max_shard_size must be an int (bytes) of at least 1, not {max_shard_size!r}")
    check_progress(progress)
    if not os.fspath(dst):  # (which would name the working directory)
        raise CheckpointError("dst is an empty path: name the checkpoint to create")
    chosen = checked_rank(rank)
    io = io_config(io)
    target = local(dst, "convert")
    if await run_sync(lambda: os.path.lexists(target)):
        raise CheckpointExistsError(f"{target} already exists; convert never overwrites")
    if (blocked := await run_sync(lambda: _not_a_directory(target))) is not None:
        raise blocked  # (before the source is read: no writer could create dst)
    if chosen > 0:  # (rank 0 saved every checkpoint)
        await _check_rank(src, chosen, given=rank is not None)
    # torch.save writes a tensor's whole storage, and DCP clones a tensor whose storage is larger than it:
    # for those, large tensors are read into storages of their own, not mapped from the data files.
    mapped = to in ("aiockpt", "safetensors")
    tree = await read(
        src, allow_pickle=allow_pickle, io=io if mapped else replace(io, map_reads=False), rank=chosen
    )
    from_dcp = await _is_dcp(src)

    def prepare() -> tuple[list[tuple[str, torch.Tensor]], list[torch.Tensor]]:
        # Walks of the whole tree: in a worker, as a list of 10^5 plain values takes a while.
        if from_dcp:
            # What a load straight from the DCP directory gives an optimizer (``restore_optimizer_ids``).
            restore_optimizer_ids(tree)
        items = named_tensors(tree, drop_non_tensors=drop_non_tensors) if to == "safetensors" else []
        if to == "dcp":
            check_dcp_names(tree)
        return items, [t for _, t in items] if to == "safetensors" else _tensors(tree)

    items, tensors = await run_sync(prepare)
    total = sum(nbytes_of(t) for t in tensors)
    done = reported = 0
    step = max(total // 200, 1)
    failed: list[BaseException] = []  # what ``progress`` raised, which reaches the caller as it is

    def advance(n: int) -> None:
        # Called from the writer thread; the callback itself runs on the event loop thread.
        nonlocal done, reported
        done += n
        if progress is not None and (done - reported >= step or done == total):
            reported = done
            try:
                anyio.from_thread.run_sync(progress, done, total)
            except BaseException as exc:
                failed.append(exc)
                raise

    if progress is not None:
        progress(0, total)
    if to == "aiockpt":
        state = cast("dict[str, object]", tree)  # read() returns str keys at the top
        saved_step, user_metadata = await _carried(src)
        req = SaveRequest(
            state=state,
            path=target,
            step=saved_step,
            user_metadata=user_metadata,
            allow_pickle=allow_pickle,
            io=io,
        )
        pool = StagingPool()
        try:
            await run_save(req, world=LocalWorld(), pool=pool, metrics=SaveMetrics(), report=lambda _: None)
        finally:
            with anyio.CancelScope(shield=True):
                await run_sync(pool.close)
        if progress is not None:
            progress(total, total)
        return target

    directory = to == "dcp" or (to == "safetensors" and not target.name.endswith(SUFFIX))

    def write(tmp: Path) -> None:
        # The temp dir stays locked until it is gone: a directory output is renamed away from it, a file
        # output out of it, and discard_tmp removes what is left, then the lock.
        out = tmp if directory else tmp / target.name
        if to == "torch":
            write_torch(out, tree)
        elif to == "dcp":
            write_dcp(out, tree)
        elif directory:
            write_hf_dir(out, items, max_shard_size, advance)
        else:
            write_safetensors(out, items, advance)
        rename_noreplace(out, target)
        fsync_dir(target.parent)

    def make_tmp() -> tuple[Path, OwnerLock]:
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
        except (FileExistsError, NotADirectoryError) as exc:
            # An ancestor became a file since the check in ``convert``: not ``dst`` existing.
            raise (_not_a_directory(target) or exc) from exc
        return open_tmp(target)

    try:
        tmp, lock = await acquire_sync(make_tmp)
        try:
            await run_sync(lambda: write(tmp))
        finally:
            with anyio.CancelScope(shield=True):
                await run_sync(lambda: discard_tmp(tmp, lock))
    except FileExistsError as exc:
        raise CheckpointExistsError(f"{target} already exists; convert never overwrites") from exc
    except OSError as exc:
        raise StorageError(f"cannot write {target}: {exc.strerror or exc}", path=str(target)) from exc
    except CheckpointError:
        raise
    except Exception as exc:  # torch.save or dcp.save refusing a value of the source
        if exc in failed:
            raise
        raise StateError(f"cannot write {target} as {to}: {exc}") from exc
    if progress is not None and reported < total:
        progress(total, total)
    return target
