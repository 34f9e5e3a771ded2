"""Stage 2, every rank: describe what this rank would write. Pure, no I/O."""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from .._format import KeyPath
from .._threads import OFFER_ITEMS, yield_gil
from .._tree import Flattened, dtype_name
from ._stage import Spec


class WriteItem(msgspec.Struct, frozen=True, kw_only=True, gc=False, array_like=True):
    """One chunk of one tensor held by this rank.

    ``offsets``/``sizes`` place the chunk in the global tensor of shape ``shape``. ``replicated`` chunks may
    be held by several ranks with identical contents (the global plan writes them once); other chunks are
    this rank's alone.
    """

    path: KeyPath
    dtype: str
    shape: tuple[int, ...]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    nbytes: int
    replicated: bool


class LocalPlan(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """Every chunk this rank holds, in the order of its tensors (``items[i]`` is tensor ``i``)."""

    rank: int
    items: tuple[WriteItem, ...]


def local_plan(rank: int, flat: Flattened, specs: Sequence[Spec]) -> LocalPlan:
    """Plan the writes of ``rank``: one chunk per tensor, the whole tensor or its DTensor shard.

    Each tensor is described by its ``specs`` entry (as staged), not by ``flat.tensors``: once an async
    save returned, the caller may have resized a tensor, or changed its dtype, in place.
    """
    zeros = [(0,) * n for n in range(8)]
    items: list[WriteItem] = []
    for path, (dtype, sizes, nbytes), box in zip(flat.paths, specs, flat.boxes, strict=True):
        if not len(items) % OFFER_ITEMS:
            yield_gil()
        if box is None:  # a plain tensor: the whole of it, identical wherever it is held
            nd = len(sizes)
            shape, offsets, replicated = sizes, zeros[nd] if nd < 8 else (0,) * nd, True
        else:
            shape, offsets, replicated = box.shape, box.offsets, box.replicated
        items.append(
            WriteItem(
                path=path,
                dtype=dtype_name(dtype),
                shape=shape,
                offsets=offsets,
                sizes=sizes,
                nbytes=nbytes,
                replicated=replicated,
            )
        )
    return LocalPlan(rank=rank, items=tuple(items))
