"""The exception tree of aiockpt.

Every error the library raises on purpose derives from :class:`CheckpointError`::

    CheckpointError
    ├── CheckpointNotFoundError     path missing, not a checkpoint, step not committed
    ├── CheckpointExistsError       the target checkpoint (path or step) already exists
    ├── FormatError                 unreadable or unsupported manifest
    │   └── CorruptionError         checksum mismatch, truncated or missing data
    ├── StateError                  a state that cannot be saved (unsupported object, bad key)
    │   └── StateMismatchError      checkpoint and load target disagree (lists every difference)
    ├── StorageError                the operating system refused a read or write (cause chained)
    ├── BusyError                   ``on_busy="error"`` and ``max_inflight`` saves are in flight
    │   └── SaveSkippedError        awaiting a save that ``on_busy="skip"`` dropped
    ├── CheckpointCancelledError    the awaited save was cancelled
    └── DistributedError            a collective failed or timed out (names the ranks)

Messages name the key path (rendered ``a/b/0/c``), the file and the rank where one is known; the same facts
are available as attributes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class CheckpointError(Exception):
    """Base class of every error raised by aiockpt."""


class CheckpointNotFoundError(CheckpointError):
    """The checkpoint (or the requested step) does not exist or is not a committed checkpoint."""


class CheckpointExistsError(CheckpointError):
    """A save would overwrite a checkpoint that already exists; nothing was written."""


class FormatError(CheckpointError):
    """The manifest cannot be decoded or uses a format this version cannot read.

    Attributes:
        file: The offending file, when known.
    """

    def __init__(self, message: str, *, file: str | None = None) -> None:
        super().__init__(message)
        self.file = file


class CorruptionError(FormatError):
    """Stored bytes do not match their checksum, or the files differ from what the manifest says.

    Shorter than it says, no regular file, of another size than it records (:func:`aiockpt.verify`), or
    not holding all of a tensor.

    Attributes:
        key: The key path of the damaged tensor, when known (``None`` for a data file's size).
        file: The damaged file.
    """

    def __init__(self, message: str, *, file: str | None = None, key: str | None = None) -> None:
        super().__init__(message, file=file)
        self.key = key


class StateError(CheckpointError):
    """The state cannot be saved as given (unsupported object, bad key, refused pickle).

    Attributes:
        key: The key path of the culprit, when known.
    """

    def __init__(self, message: str, *, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key


class StateMismatchError(StateError):
    """The checkpoint and the load target disagree; nothing was loaded.

    Attributes:
        differences: One line per difference (missing key, unexpected key, shape or dtype mismatch).
        rank: In a distributed job, the (global) rank whose state differs; ``None`` otherwise.
    """

    def __init__(self, differences: Sequence[str], *, rank: int | None = None) -> None:
        self.differences = list(differences)
        self.rank = rank
        lines = "\n  ".join(self.differences)
        where = "" if rank is None else f" on rank {rank}"
        super().__init__(
            f"checkpoint and state{where} differ in {len(self.differences)} place(s):\n  {lines}"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        # ``BaseException.__reduce__`` rebuilds as ``cls(*self.args)``, that is from the message, which
        # this constructor would split into one difference per character (and lose the rank). Rebuild
        # from the differences instead; ``__dict__`` (rank, notes, attributes set later) follows as state.
        return (_rebuild_mismatch, (type(self), self.differences, self.rank), self.__dict__)


def _rebuild_mismatch(
    cls: type[StateMismatchError], differences: Sequence[str], rank: int | None
) -> StateMismatchError:
    """Rebuild a pickled or copied :class:`StateMismatchError` (module level, so pickle can name it)."""
    return cls(differences, rank=rank)


class StateMismatchWarning(UserWarning):
    """Emitted by ``load(..., strict=False)`` for every part of the target that was not loaded."""


class StorageError(CheckpointError):
    """The operating system refused an operation on checkpoint storage.

    Attributes:
        path: The file or directory involved.
    """

    def __init__(self, message: str, *, path: str | None = None) -> None:
        super().__init__(message)
        self.path = path


class BusyError(CheckpointError):
    """``on_busy="error"`` and the Checkpointer already has ``max_inflight`` saves in flight."""


class SaveSkippedError(BusyError):
    """The save was skipped (``on_busy="skip"``) because ``max_inflight`` saves were in flight."""


class CheckpointCancelledError(CheckpointError):
    """The save behind an awaited handle was cancelled before it committed."""


class DistributedError(CheckpointError):
    """A checkpoint collective failed on one or more ranks, or timed out.

    Attributes:
        ranks: The ranks that failed or did not answer.
    """

    def __init__(self, message: str, *, ranks: Sequence[int] = ()) -> None:
        super().__init__(message)
        self.ranks = tuple(ranks)
