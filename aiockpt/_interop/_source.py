"""A foreign checkpoint seen as an aiockpt manifest, and the fill step of sources that decode their chunks.

A source translates its own metadata into a :class:`~aiockpt._format.Manifest` (tensors with their chunk
boxes, a tree for :func:`aiockpt.read`) so that the native matcher plans the load, and fills the
matcher's destinations. Sources whose bytes lie raw in files (safetensors) fill through the native
reader; sources whose chunks must be decoded first (DCP's ``torch.save`` blobs, a ``torch.save`` file)
decode each chunk a destination needs and copy the intersection into place.
"""

from __future__ import annotations

import math
import threading
from abc import ABC, abstractmethod
from collections.abc import Mapping
from functools import partial
from pathlib import Path

import anyio
import msgspec
import torch

from .._errors import CorruptionError
from .._format import DictNode, KeyPath, Manifest, Node
from .._load._aliasing import aliased
from .._load._match import Destination
from .._load._read import _check_covered, _overlap
from .._memory import filling
from .._threads import Aborted, run_sync, run_workers
from .._tree import dtype_name, render
from ._names import shaped_like


class Source(ABC):
    """A readable foreign checkpoint.

    Attributes:
        location: The file or directory, for messages.
        manifest: Its tensors (``tree`` is the one :func:`aiockpt.read` returns).
        names: Its values by flat name when the format addresses them so (DCP, safetensors); loads then
            match the target by joined key path. ``None``: the tree is matched as is (``torch.save``).
        paths: DCP's original key path of each name, when recorded.
        data: The directory whose files the manifest's chunks are byte ranges of (``file``, ``offset``,
            ``nbytes``), so that the matcher makes a large fresh tensor only once its chunks lie inside
            their files and hold as many bytes as it (metadata can claim any shape). ``None``: the
            chunks are no byte ranges (a ``torch.save`` file, decoded whole when opened).
    """

    location: Path
    manifest: Manifest
    names: Mapping[str, Node] | None = None
    paths: Mapping[str, KeyPath] | None = None
    data: Path | None = None

    def shaped(self, state: Mapping[str, object]) -> tuple[Manifest, list[str]]:
        """The manifest to match ``state`` against, and differences found while shaping it. Blocking."""
        if self.names is None:
            return self.manifest, []
        tree, differences = shaped_like(state, self.names, self.paths)
        return _with_tree(self.manifest, tree), differences

    @abstractmethod
    async def fill(
        self,
        manifest: Manifest,
        destinations: dict[int, Destination],
        *,
        threads: int,
        limiter: anyio.CapacityLimiter | None,
    ) -> None:
        """Fill every destination (tensor ``index`` of ``manifest``, or the part of it the box covers).

        Raises:
            CorruptionError: Stored data is missing, truncated or undecodable (names the key and file).
            StorageError: A file cannot be read.
        """

    def close(self) -> None:  # noqa: B027 (most sources hold nothing open)
        """Release what the source holds. Blocking."""


def _with_tree(manifest: Manifest, tree: DictNode) -> Manifest:
    return msgspec.structs.replace(manifest, tree=tree)


class DecodingSource(Source):
    """A source whose chunks are decoded into tensors one at a time, then copied into destinations."""

    @abstractmethod
    def chunk(self, index: int, number: int) -> torch.Tensor:
        """Chunk ``number`` of tensor ``index``, decoded (a CPU tensor of the chunk's sizes). Blocking."""

    def _check(self, index: int, number: int, t: object) -> torch.Tensor:
        entry = self.manifest.tensors[index]
        c = entry.chunks[number]
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != c.sizes or dtype_name(t.dtype) != entry.dtype:
            got = f"{dtype_name(t.dtype)}{list(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise CorruptionError(
                f"{self.location / c.file}: the data of key {render(entry.path)!r} at offset {c.offset} "
                f"is {got}, the metadata says {entry.dtype}{list(c.sizes)}",
                file=str(self.location / c.file),
                key=render(entry.path),
            )
        return t

    async def fill(
        self,
        manifest: Manifest,
        destinations: dict[int, Destination],
        *,
        threads: int,
        limiter: anyio.CapacityLimiter | None,
    ) -> None:
        """Decode the chunks each destination overlaps and copy the overlap into place (in threads).

        Destinations whose memory an earlier one shares (keys tied in the target) are filled after the
        others, one at a time in destination order: the later key's values win, as with
        ``load_state_dict``.
        """
        tied = await run_sync(partial(aliased, destinations), limiter)  # a pass over every destination
        todo = sorted((d for i, d in destinations.items() if i not in tied), key=lambda d: d.index)
        later = [destinations[i] for i in destinations if i in tied]
        lock = threading.Lock()

        def worker(abort: threading.Event) -> None:
            while True:
                if abort.is_set():
                    raise Aborted
                with lock:
                    if not todo:
                        return
                    dest = todo.pop()
                self._copy_into(dest)

        if todo:
            await run_workers(worker, max(1, min(threads, len(todo))), limiter)
        if later:

            def fill_later() -> None:
                for dest in later:
                    self._copy_into(dest)

            await run_sync(fill_later, limiter)

    def _copy_into(self, dest: Destination) -> None:
        entry = self.manifest.tensors[dest.index]
        target = dest.tensor
        d_size = tuple(target.shape)
        d_off = dest.offsets if dest.offsets is not None else (0,) * len(d_size)
        # The chunks that overlap the destination, each box once. Their elements in it, counted, must be
        # all of it before anything is decoded: metadata whose chunks leave a hole would otherwise leave
        # those elements as they were (uninitialized memory, for aiockpt.read). As for native reads, a
        # count that differs (a hole, or overlapping boxes) is checked exactly.
        wanted: list[tuple[int, list[tuple[int, int]]]] = []
        boxes: set[tuple[tuple[int, ...], tuple[int, ...]]] = set()
        covered = 0
        for number, c in enumerate(entry.chunks):
            inter = _overlap(c.offsets, c.sizes, d_off, d_size)
            if inter is None or (c.offsets, c.sizes) in boxes:
                continue
            boxes.add((c.offsets, c.sizes))
            covered += math.prod(hi - lo for lo, hi in inter)  # (1 for a 0-d tensor: all of it)
            wanted.append((number, inter))
        if covered != math.prod(d_size):
            _check_covered(entry, d_off, d_size, str(self.location))
        for number, inter in wanted:
            c = entry.chunks[number]
            data = self._check(dest.index, number, self.chunk(dest.index, number))
            with filling():  # (the copies only: decoded tensors may be cached and handed out)
                if not d_size:  # a 0-d tensor: its one chunk is all of it
                    target.copy_(data)
                    continue
                src = tuple(slice(lo - o, hi - o) for (lo, hi), o in zip(inter, c.offsets, strict=True))
                dst = tuple(slice(lo - o, hi - o) for (lo, hi), o in zip(inter, d_off, strict=True))
                target[dst].copy_(data[src])
        with filling():
            for other in dest.also:
                other.copy_(target)
