"""``aiockpt.convert``: any readable checkpoint written anew in another format.

Targets: an aiockpt checkpoint, a ``torch.save`` file, safetensors (one file or a Hugging Face
directory) or a DCP directory.

The source is read whole into CPU memory (:func:`aiockpt.read`), then written by the target's writer into
a temporary name next to the destination, made durable (fsync) and renamed into place without ever
replacing an existing path; a failed or cancelled conversion leaves nothing behind.
"""

from __future__ import annotations

import json
import os
import uuid
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
from .._fs import TMP_PREFIX, fsync_dir, remove_tree, rename_noreplace
from .._handle import SaveMetrics
from .._memory import StagingPool, byte_view, nbytes_of
from .._options import IOConfig
from .._save import SaveRequest, run_save
from .._storage import local
from .._threads import run_sync
from .._tree import dtype_name, render
from .._world import LocalWorld
from ._names import join
from ._safetensors import INDEX_NAME, NAMES, SINGLE_NAME, SUFFIX

__all__ = ["DEFAULT_MAX_SHARD_SIZE", "Target", "convert", "named_tensors"]

Target = Literal["aiockpt", "torch", "safetensors", "dcp"]
Progress = Callable[[int, int], None]

DEFAULT_MAX_SHARD_SIZE = 5 * 10**9  # Hugging Face's default "5GB"


def _tensors(tree: Mapping[Key, object]) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []

    def walk(obj: object) -> None:
        if isinstance(obj, torch.Tensor):
            out.append(obj)
        elif isinstance(obj, Mapping):
            for v in obj.values():
                walk(v)
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                walk(v)

    walk(tree)
    return out


# The header entry of a safetensors file that holds its metadata, not a tensor.
_METADATA = "__metadata__"


def named_tensors(tree: Mapping[Key, object], *, drop_non_tensors: bool) -> list[tuple[str, torch.Tensor]]:
    """The tensors of ``tree`` by safetensors name: key paths joined with ``"."``.

    Raises:
        StateError: ``tree`` holds values other than tensors (all listed) and ``drop_non_tensors`` is
            false, two paths join to one name, a name is ``__metadata__``, or a dtype has no safetensors
            name.
    """
    out: dict[str, torch.Tensor] = {}
    others: list[KeyPath] = []

    def walk(obj: object, path: KeyPath) -> None:
        if isinstance(obj, torch.Tensor):
            name = join(path)
            if name in out:
                raise StateError(f"two keys are both named {name!r} once joined with '.'", key=render(path))
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
    """Write ``items`` into the new directory ``directory`` in the Hugging Face layout. Blocking."""
    os.mkdir(directory)
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


def write_torch(file: Path, tree: Mapping[Key, object]) -> None:
    """``torch.save`` ``tree`` into the new file ``file`` and fsync it. Blocking."""
    with open(file, "xb") as f:
        torch.save(_compact(tree, {}), f)
        f.flush()
        os.fsync(f.fileno())


def write_dcp(directory: Path, tree: Mapping[Key, object]) -> None:
    """Save ``tree`` as a DCP directory with ``dcp.save``, in this process alone. Blocking."""
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.checkpoint.state_dict_saver import save

    with warnings.catch_warnings():
        # dcp.save warns that it saves in a single process even when asked to (no_dist=True).
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        try:
            save(dict(tree), storage_writer=FileSystemWriter(directory, sync_files=True), no_dist=True)
        except CheckpointException as exc:  # a BaseException: made an ordinary error here
            raise RuntimeError(f"dcp.save failed: {exc}") from exc
    fsync_dir(directory)


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
    then written under a temporary name next to ``dst``, made durable and renamed into place.

    Args:
        src: The checkpoint to read.
        dst: The path to create; it must not exist.
        to: ``"aiockpt"`` (a checkpoint directory), ``"torch"`` (one ``torch.save`` file), ``"dcp"`` (a
            ``torch.distributed.checkpoint`` directory, written by ``dcp.save``) or ``"safetensors"``: a
            ``dst`` ending in ``.safetensors`` is one file; any other ``dst`` is a Hugging Face directory,
            ``model.safetensors`` or, past ``max_shard_size``, ``model-00001-of-0000N.safetensors`` shards
            and ``model.safetensors.index.json``. Tensor names are key paths joined with ``"."``.
        allow_pickle: Read pickled objects of the source (only for sources you trust) and let the
            target store them.
        drop_non_tensors: For safetensors, leave out values that are not tensors instead of refusing.
        max_shard_size: Bytes of tensor data per safetensors shard (a larger tensor gets its own shard).
        progress: Called on the event loop thread with ``(bytes written, total bytes)`` of tensor data:
            at the start, as safetensors tensors are written (every 0.5 % or so), and at the end.
        io: I/O tuning for reading the source and writing an aiockpt checkpoint.
        rank: Whose per-rank state to convert, for a source saved by several ranks whose states differ
            (see :func:`aiockpt.read`, which reads it): ``None`` is this process's rank, 0 outside a
            distributed job. The result holds that rank's state alone.

    Returns:
        The absolute path of the new checkpoint.

    Raises:
        CheckpointExistsError: ``dst`` exists.
        CheckpointNotFoundError: ``src`` is not a checkpoint.
        StateError: The source holds what the target cannot (non-tensor values for safetensors, pickled
            objects without ``allow_pickle``, objects the target's writer refuses); the message lists the
            keys where known.
        FormatError: The source is unreadable.
        StorageError: Writing failed; nothing is left at ``dst``.
        CheckpointError: ``to`` or ``max_shard_size`` is invalid (as for every other bad argument).
    """
    from .._api import read

    if to not in ("aiockpt", "torch", "safetensors", "dcp"):
        raise CheckpointError(f"to must be 'aiockpt', 'torch', 'safetensors' or 'dcp', not {to!r}")
    if max_shard_size <= 0:
        raise CheckpointError(f"max_shard_size must be positive, not {max_shard_size}")
    io = io or IOConfig()
    target = local(dst, "convert")
    if await run_sync(lambda: os.path.lexists(target)):
        raise CheckpointExistsError(f"{target} already exists; convert never overwrites")
    # torch.save writes a tensor's whole storage, and DCP clones a tensor whose storage is larger than it:
    # for those, large tensors are read into storages of their own, not mapped from the data files.
    mapped = to in ("aiockpt", "safetensors")
    tree = await read(
        src, allow_pickle=allow_pickle, io=io if mapped else replace(io, map_reads=False), rank=rank
    )
    items = named_tensors(tree, drop_non_tensors=drop_non_tensors) if to == "safetensors" else []
    tensors = [t for _, t in items] if to == "safetensors" else _tensors(tree)
    total = sum(nbytes_of(t) for t in tensors)
    done = reported = 0
    step = max(total // 200, 1)

    def advance(n: int) -> None:
        # Called from the writer thread; the callback itself runs on the event loop thread.
        nonlocal done, reported
        done += n
        if progress is not None and (done - reported >= step or done == total):
            reported = done
            anyio.from_thread.run_sync(progress, done, total)

    if progress is not None:
        progress(0, total)
    if to == "aiockpt":
        state = cast("dict[str, object]", tree)  # read() returns str keys at the top
        req = SaveRequest(state=state, path=target, allow_pickle=allow_pickle, io=io)
        pool = StagingPool()
        try:
            await run_save(req, world=LocalWorld(), pool=pool, metrics=SaveMetrics(), report=lambda _: None)
        finally:
            with anyio.CancelScope(shield=True):
                await run_sync(pool.close)
        if progress is not None:
            progress(total, total)
        return target

    tmp = target.with_name(f"{TMP_PREFIX}{target.name}-{uuid.uuid4().hex}")

    def write() -> None:
        if to == "torch":
            write_torch(tmp, tree)
        elif to == "dcp":
            write_dcp(tmp, tree)
        elif target.name.endswith(SUFFIX):
            write_safetensors(tmp, items, advance)
        else:
            write_hf_dir(tmp, items, max_shard_size, advance)
        rename_noreplace(tmp, target)
        fsync_dir(target.parent)

    try:
        await run_sync(lambda: target.parent.mkdir(parents=True, exist_ok=True))
        await run_sync(write)
    except FileExistsError as exc:
        raise CheckpointExistsError(f"{target} already exists; convert never overwrites") from exc
    except OSError as exc:
        raise StorageError(f"cannot write {target}: {exc.strerror or exc}", path=str(target)) from exc
    except CheckpointError:
        raise
    except Exception as exc:  # torch.save or dcp.save refusing a value of the source
        raise StateError(f"cannot write {target} as {to}: {exc}") from exc
    finally:
        with anyio.CancelScope(shield=True):
            await run_sync(lambda: remove_tree(tmp) if os.path.lexists(tmp) else None)
    if progress is not None and reported < total:
        progress(total, total)
    return target
