"""Foreign checkpoints: reading DCP directories, safetensors files and ``torch.save`` files, and conversion.

One module per format (``_dcp.py``, ``_safetensors.py``, ``_torchfile.py``); each translates its metadata
into an aiockpt :class:`~aiockpt._format.Manifest`, so the native matcher (strictness, DTensor chunk
intersection, Statefuls, in-place filling) plans every load. ``_convert.py`` writes any source as any
format.
"""

from __future__ import annotations

import os
import stat
from collections.abc import MutableMapping
from pathlib import Path
from typing import Literal

import anyio

from .._cuda import noting
from .._errors import StorageError
from .._format import Key
from .._load import assign, hand_over, readable, settle
from .._load._match import match
from .._options import IOConfig
from .._threads import acquire_sync, responsive, run_sync
from ._dcp import METADATA_NAME, DcpSource
from ._safetensors import SUFFIX, SafetensorsSource, is_hf_dir
from ._source import Source
from ._torchfile import TorchFileSource, is_torch_file

__all__ = ["Kind", "detect", "load_foreign", "open_source", "read_foreign"]

Kind = Literal["aiockpt", "dcp", "safetensors", "torch"]


def detect(path: Path) -> Kind:
    """The kind of checkpoint at ``path``, from its shape alone (reads no data). Blocking.

    A directory with ``.metadata`` is DCP; a ``*.safetensors`` file or a directory with
    ``model.safetensors.index.json`` or ``model.safetensors`` is safetensors; a file that starts like a
    ``torch.save`` file (a zip archive, or the legacy pickle magic) is one; anything else is taken for an
    aiockpt checkpoint (whose reader reports a path that is none, or missing).

    Raises:
        StorageError: ``path`` cannot be looked up for another reason than being missing (a name too
            long, a directory on the way that may not be searched, an I/O error); names the path.
    """
    try:
        mode = os.stat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return "aiockpt"  # (the reader's CheckpointNotFoundError says so)
    except OSError as exc:
        # ``Path.is_dir`` swallows a few errnos only: the others escaped bare from read, load and the rest.
        raise StorageError(f"cannot read {path}: {exc.strerror or exc}", path=str(path)) from exc
    if stat.S_ISDIR(mode):
        if os.path.isfile(path / METADATA_NAME):
            return "dcp"
        if is_hf_dir(path):
            return "safetensors"
        return "aiockpt"
    if stat.S_ISREG(mode):
        if path.name.endswith(SUFFIX):
            return "safetensors"
        if is_torch_file(path):
            return "torch"
    return "aiockpt"


def open_source(path: Path, kind: Kind, *, allow_pickle: bool) -> Source:
    """Open the foreign checkpoint at ``path`` (its metadata is read and validated). Blocking."""
    if kind == "dcp":
        return DcpSource(path, allow_pickle=allow_pickle)
    if kind == "safetensors":
        return SafetensorsSource(path)
    if kind == "torch":
        return TorchFileSource(path, allow_pickle=allow_pickle)
    raise ValueError(f"{kind!r} is not a foreign checkpoint kind")


async def load_foreign(
    state: MutableMapping[str, object],
    path: Path,
    kind: Kind,
    *,
    strict: bool,
    allow_pickle: bool,
    io: IOConfig,
    limiter: anyio.CapacityLimiter | None = None,
) -> None:
    """Load a foreign checkpoint into ``state`` in place, with the semantics of :func:`aiockpt.load`."""
    with responsive(io), noting():
        source = await acquire_sync(lambda: open_source(path, kind, allow_pickle=allow_pickle), limiter)
        try:
            manifest, extra = await run_sync(lambda: source.shaped(state), limiter)
            plan = await run_sync(
                lambda: match(manifest, state, allow_pickle=allow_pickle, data=source.data), limiter
            )
            plan.differences[:0] = extra
            settle(plan, path, strict=strict)
            await source.fill(manifest, plan.destinations, threads=io.thread_count, limiter=limiter)
            await hand_over(plan, limiter)
            assign(plan)
        finally:
            with anyio.CancelScope(shield=True):
                await run_sync(source.close, limiter)


async def read_foreign(
    path: Path,
    kind: Kind,
    *,
    allow_pickle: bool,
    io: IOConfig,
    limiter: anyio.CapacityLimiter | None = None,
) -> dict[Key, object]:
    """Read a foreign checkpoint into a fresh tree of CPU tensors (see :func:`aiockpt.read`)."""
    with responsive(io):
        source = await acquire_sync(lambda: open_source(path, kind, allow_pickle=allow_pickle), limiter)
        try:
            plan = await run_sync(
                lambda: match(source.manifest, None, allow_pickle=allow_pickle, data=source.data), limiter
            )
            readable(plan, path)
            await source.fill(source.manifest, plan.destinations, threads=io.thread_count, limiter=limiter)
            return plan.result
        finally:
            with anyio.CancelScope(shield=True):
                await run_sync(source.close, limiter)
