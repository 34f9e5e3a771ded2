"""Pausing Python's cyclic garbage collector during bulk bookkeeping.

Planning a checkpoint of tens of thousands of tensors allocates hundreds of thousands of small objects;
each allocation burst triggers collections that rescan every live object of the process (a large one
when torch is imported), which tripled the per-item cost of planning and manifest decoding. Nothing we
build in these phases forms reference cycles, so reference counting frees it all. The pause is
reference-counted across threads and restores the collector's previous state.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

_lock = threading.Lock()
_depth = 0
_was_enabled = False


@contextlib.contextmanager
def paused(enabled: bool = True) -> Iterator[None]:
    """Disable the cyclic collector inside the block (nested and concurrent uses are fine).

    Args:
        enabled: ``False`` makes the block a no-op.
    """
    global _depth, _was_enabled
    if not enabled:
        yield
        return
    with _lock:
        if _depth == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _was_enabled:
                gc.enable()
