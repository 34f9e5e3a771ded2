"""Keeping Python's cyclic garbage collector from stalling the event loop during bulk bookkeeping.

Planning a checkpoint of tens of thousands of tensors allocates hundreds of thousands of small objects.
Left alone, those allocation bursts set off collections of the older generations, which rescan every
live object of the process (a large heap once torch is imported: 100 ms and more, holding the GIL), and
tripled the per-item cost of planning and manifest decoding. Turning the collector off for the duration
is not enough either: whatever is still alive when it is turned back on (a decoded manifest of 20,000
tensors holds 120,000 tuples of shapes, offsets and checksums) is scanned by the first collection after
the pause, a 7 ms stall on the event loop's thread, and then promoted towards a full collection.

So during a pause only the youngest generation is collected. Each such collection scans just the
objects allocated since the previous one (a few hundred), frees young cycles, and untracks tuples that
hold only atomic values, which is most of what a manifest is made of, so those never reach the older
generations. Collections of the older generations wait until the last pause ends. The pause is
reference-counted across threads and restores the previous thresholds. On Python 3.14 and later, whose
collector is incremental and reads the thresholds differently, the collector is disabled instead. A
process forked during a pause starts with the previous settings and no pause (see :func:`_forget`).
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
import threading
from collections.abc import Iterator

_lock = threading.Lock()
_depth = 0
# The settings of before the first pause, while one is in force (set before the collector is changed,
# cleared after it is restored: a fork in between finds them). ``_was_enabled``: Python 3.14 and later.
_saved: tuple[int, int, int] | None = None
_was_enabled: bool | None = None
# Bumped in a forked child: pauses begun before the fork are not counted there (see _forget).
_generation = 0
# Generation 1 is collected after this many generation-0 collections, generation 2 after this many of
# generation 1: never, within one pause.
_NEVER = 1 << 30
_INCREMENTAL = sys.version_info >= (3, 14)


def _begin() -> None:
    global _saved, _was_enabled
    if _INCREMENTAL:
        _was_enabled = gc.isenabled()
        gc.disable()
    else:
        threshold = gc.get_threshold()
        _saved = (threshold[0], threshold[1], threshold[2])
        # A threshold0 of 0 means the collector is off: leave it so.
        gc.set_threshold(_saved[0], _NEVER, _NEVER)


def _end() -> None:
    global _saved, _was_enabled
    if _INCREMENTAL:
        if _was_enabled:
            gc.enable()
        _was_enabled = None
    elif _saved is not None:
        gc.set_threshold(*_saved)
        _saved = None


def _forget() -> None:
    """In a forked child: restore the collector's settings of before the parent's pauses, and count none.

    The child has none of the parent's saves or loads, and no thread of the parent: without this, its
    older generations were never collected again, and a lock held by a parent's thread at the fork was
    held for good.
    """
    global _lock, _depth, _generation
    _lock = threading.Lock()
    _end()
    _depth = 0
    _generation += 1


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget)


def collect_young() -> None:
    """Collect the youngest generation now, if the collector is on (see the module's docstring)."""
    if gc.isenabled() and gc.get_threshold()[0]:
        gc.collect(0)


@contextlib.contextmanager
def paused(enabled: bool = True) -> Iterator[None]:
    """Collect only the youngest generation inside the block (nested and concurrent uses are fine).

    Args:
        enabled: ``False`` makes the block a no-op.
    """
    global _depth
    if not enabled:
        yield
        return
    with _lock:
        if _depth == 0:
            _begin()
        _depth += 1
        generation = _generation
    try:
        yield
    finally:
        with _lock:
            # A pause begun before a fork, ended in the child, was never counted there.
            if generation == _generation:
                _depth -= 1
                if _depth == 0:
                    _end()
