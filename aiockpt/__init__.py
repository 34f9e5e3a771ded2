"""aiockpt: an asyncio-native checkpoint runtime for PyTorch.

Saves run as a pipeline of coroutines (stage -> local plan -> global plan -> write -> finish) whose
blocking work runs in threads, so the event loop keeps ticking; ``async_op=True`` returns as soon as the
state is staged. Checkpoints commit atomically and are verified on load.
"""

from __future__ import annotations

from . import sync
from ._api import load as load
from ._api import read as read
from ._api import read_metadata as read_metadata
from ._api import save as save
from ._checkpointer import Checkpointer as Checkpointer
from ._checkpointer import OnBusy as OnBusy
from ._errors import BusyError as BusyError
from ._errors import CheckpointCancelledError as CheckpointCancelledError
from ._errors import CheckpointError as CheckpointError
from ._errors import CheckpointExistsError as CheckpointExistsError
from ._errors import CheckpointNotFoundError as CheckpointNotFoundError
from ._errors import CorruptionError as CorruptionError
from ._errors import DistributedError as DistributedError
from ._errors import FormatError as FormatError
from ._errors import SaveSkippedError as SaveSkippedError
from ._errors import StateError as StateError
from ._errors import StateMismatchError as StateMismatchError
from ._errors import StateMismatchWarning as StateMismatchWarning
from ._errors import StorageError as StorageError
from ._format import FORMAT_VERSION as FORMAT_VERSION
from ._format import FileInfo as FileInfo
from ._handle import Metadata as Metadata
from ._handle import SaveHandle as SaveHandle
from ._handle import SaveMetrics as SaveMetrics
from ._handle import SaveState as SaveState
from ._interop._convert import convert as convert
from ._options import IOConfig as IOConfig
from ._preemption import Preemption as Preemption
from ._storage import S3Options as S3Options
from ._tree import Stateful as Stateful
from ._verify import VerifyReport as VerifyReport
from ._verify import verify as verify
from ._version import __version__ as __version__

__all__ = [
    "FORMAT_VERSION",
    "BusyError",
    "CheckpointCancelledError",
    "CheckpointError",
    "CheckpointExistsError",
    "CheckpointNotFoundError",
    "Checkpointer",
    "CorruptionError",
    "DistributedError",
    "FileInfo",
    "FormatError",
    "IOConfig",
    "Metadata",
    "OnBusy",
    "Preemption",
    "S3Options",
    "SaveHandle",
    "SaveMetrics",
    "SaveSkippedError",
    "SaveState",
    "StateError",
    "StateMismatchError",
    "StateMismatchWarning",
    "Stateful",
    "StorageError",
    "VerifyReport",
    "__version__",
    "convert",
    "load",
    "read",
    "read_metadata",
    "save",
    "sync",
    "verify",
]

# Tracebacks and reprs say aiockpt.X, not aiockpt._module.X.
for _name in __all__:
    _obj = globals().get(_name)
    if isinstance(_obj, type) and _obj.__module__.startswith("aiockpt._"):
        _obj.__module__ = __name__
del _name, _obj
