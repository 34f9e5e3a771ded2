"""Every error survives pickle, copy and a process pool with its message and its attributes intact."""

from __future__ import annotations

import concurrent.futures
import copy
import pickle
from collections.abc import Callable

import pytest

import aiockpt
from aiockpt import CheckpointError, sync


def _subclasses(cls: type[CheckpointError]) -> set[type[CheckpointError]]:
    found = set(cls.__subclasses__())
    for sub in list(found):
        found |= _subclasses(sub)
    return found


# One instance of each error, built with the arguments aiockpt passes where it raises it.
EXAMPLES: dict[type[CheckpointError], CheckpointError] = {
    CheckpointError: CheckpointError("S3Options.part_size must be an int from 1 to 2**40, not 0"),
    aiockpt.CheckpointNotFoundError: aiockpt.CheckpointNotFoundError("no checkpoint at /tmp/x"),
    aiockpt.CheckpointExistsError: aiockpt.CheckpointExistsError("step 3 exists in /tmp/run"),
    aiockpt.FormatError: aiockpt.FormatError("cannot decode the manifest", file="/tmp/x/manifest"),
    aiockpt.CorruptionError: aiockpt.CorruptionError("checksum mismatch", file="/tmp/x/d0", key="a/b"),
    aiockpt.StateError: aiockpt.StateError("unsupported object", key="opt/0"),
    aiockpt.StateMismatchError: aiockpt.StateMismatchError(
        ["w: the target is [3], the checkpoint [4]", "b: missing from the target"], rank=3
    ),
    aiockpt.StorageError: aiockpt.StorageError("cannot write", path="/tmp/x/d0"),
    aiockpt.BusyError: aiockpt.BusyError("2 saves in flight"),
    aiockpt.SaveSkippedError: aiockpt.SaveSkippedError("step 4 was skipped"),
    aiockpt.CheckpointCancelledError: aiockpt.CheckpointCancelledError("step 5 was cancelled"),
    aiockpt.DistributedError: aiockpt.DistributedError("rank 1 did not answer", ranks=[1, 2]),
    sync._PortalStopped: sync._PortalStopped("the Checkpointer is closed"),
}


def test_the_examples_cover_every_error() -> None:
    assert set(EXAMPLES) == _subclasses(CheckpointError) | {CheckpointError}


def _pickled(exc: CheckpointError) -> CheckpointError:
    restored = pickle.loads(pickle.dumps(exc))
    assert isinstance(restored, CheckpointError)
    return restored


def _raise(exc: CheckpointError) -> None:
    raise exc


def _same(restored: BaseException, exc: BaseException) -> None:
    assert type(restored) is type(exc)
    assert str(restored) == str(exc)
    assert restored.args == exc.args
    assert vars(restored) == vars(exc)


@pytest.mark.parametrize("exc", list(EXAMPLES.values()), ids=lambda e: type(e).__name__)
@pytest.mark.parametrize(
    "round_trip", [_pickled, copy.copy, copy.deepcopy], ids=["pickle", "copy", "deepcopy"]
)
def test_round_trip_keeps_message_and_attributes(
    exc: CheckpointError, round_trip: Callable[[CheckpointError], CheckpointError]
) -> None:
    exc.__dict__["step"] = 7  # an attribute set after construction (as ``add_note`` would) is kept too
    try:
        _same(round_trip(exc), exc)
    finally:
        del exc.__dict__["step"]


def test_state_mismatch_error_keeps_its_differences_and_rank() -> None:
    exc = EXAMPLES[aiockpt.StateMismatchError]
    assert isinstance(exc, aiockpt.StateMismatchError)
    restored = _pickled(exc)
    assert isinstance(restored, aiockpt.StateMismatchError)
    assert restored.differences == exc.differences
    assert restored.rank == 3
    assert str(restored).startswith("checkpoint and state on rank 3 differ in 2 place(s):")


def test_a_process_pool_returns_the_error_whole() -> None:
    exc = EXAMPLES[aiockpt.StateMismatchError]
    with (
        concurrent.futures.ProcessPoolExecutor(1) as pool,
        pytest.raises(aiockpt.StateMismatchError) as info,
    ):
        pool.submit(_raise, exc).result()
    _same(info.value, exc)
