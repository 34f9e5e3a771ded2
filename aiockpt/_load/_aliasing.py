"""Target memory that two destinations of a load share: keys the target ties, the checkpoint holds apart.

A target can hold one memory under two keys (tied weights: ``head.weight = emb.weight``) where the
checkpoint stores two tensors. The matcher finds such destinations once, after matching
(:func:`aliasing`), both to refuse a pair of other values and to tell the reader which ones to stage.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .._memory import plain_cpu

if TYPE_CHECKING:
    from ._match import Destination

# A destination's memory, as a load writes it in place: its address, its extent in bytes, and whether it
# is a plain CPU tensor's (read into straight, see ``_whole_view``); ``None`` for a fresh tensor.
Memory = tuple[int, int, bool] | None


def _extent(t: torch.Tensor) -> int:
    """Bytes from ``t``'s first element to past its last (its ``nbytes`` where it is contiguous)."""
    if t.is_contiguous():
        return t.nbytes
    if not t.numel():
        return 0
    last = sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))
    return (last + 1) * t.element_size()


# A destination's memory range, for telling overlaps: (start address, stop address, destination order).
Span = tuple[int, int, int]


def memory_of(destinations: Mapping[int, Destination]) -> tuple[list[Memory], list[Span]]:
    """Each destination's memory (see ``Memory``), in destination order, and its span where it has bytes.

    One pass, a few calls per destination; the spans are :func:`aliased`'s.
    """
    memory: list[Memory] = []
    spans: list[Span] = []
    for order, dest in enumerate(destinations.values()):
        if dest.fresh:  # (its memory is new: it overlaps nothing)
            memory.append(None)
            continue
        t = dest.tensor
        start, plain = t.data_ptr(), plain_cpu(t)
        n = t.nbytes if plain else _extent(t)
        memory.append((start, n, plain))
        if n:
            spans.append((start, start + n, order))
    return memory, spans


def aliased(destinations: Mapping[int, Destination], spans: list[Span] | None = None) -> set[int]:
    """The destinations whose memory overlaps that of an earlier one (keys tied in the target).

    Two keys of a target can share memory (tied weights: ``head.weight = emb.weight``) while the
    checkpoint stores them apart. Read in place, the later key's bytes would overwrite the earlier one's
    before its checksum is verified there. Memory is compared by address ranges, CPU and GPU alike (one
    virtual address space under CUDA's unified addressing; were ranges of two devices ever to coincide,
    the later destination would only be staged for nothing). Where the ranges of a run of destinations
    overlap, all but the first in destination order are returned. ``spans`` are :func:`memory_of`'s,
    if the caller has them (they are sorted here). About 0.2 us per destination when none overlaps.
    """
    if spans is None:
        spans = memory_of(destinations)[1]
    spans.sort()  # by start: addresses of a template's tensors mostly ascend already (timsort: ~linear)
    reach = 0
    for start, stop, _ in spans:
        if start < reach:
            return _overlapping(destinations, spans)
        if stop > reach:
            reach = stop
    return set()


def _overlapping(destinations: Mapping[int, Destination], spans: list[Span]) -> set[int]:
    """:func:`aliased`'s answer, once some of the ``spans`` (sorted by start) are known to overlap.

    Per run of overlapping spans, every destination but the first in destination order.
    """
    indices = list(destinations)
    out: set[int] = set()
    run: list[int] = []  # destination orders of a run of spans, each overlapping one before it
    reach = 0
    for start, stop, order in spans:
        if run and start < reach:
            run.append(order)
            reach = max(reach, stop)
            continue
        out.update(indices[o] for o in sorted(run)[1:])
        run, reach = [order], stop
    out.update(indices[o] for o in sorted(run)[1:])
    return out


@dataclass(frozen=True, slots=True)
class Aliasing:
    """A load's destinations' memory (see ``Memory``), in destination order, and the ``aliased`` ones.

    Made by the matcher (:func:`aliasing`) and used by the reader for the same destinations, so that the
    pass over 10^4 targets is made once.
    """

    memory: list[Memory]
    tied: set[int]


def aliasing(destinations: Mapping[int, Destination]) -> Aliasing:
    """Each destination's memory, and those whose memory overlaps an earlier one's (:func:`aliased`)."""
    memory, spans = memory_of(destinations)
    return Aliasing(memory, aliased(destinations, spans))
