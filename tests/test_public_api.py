"""The public surface is explicit: ``__all__`` is complete and honest, names read ``aiockpt.X``."""

from __future__ import annotations

import inspect

import aiockpt
from aiockpt import sync


def test_all_names_exist_and_nothing_public_is_missing() -> None:
    assert all(hasattr(aiockpt, name) for name in aiockpt.__all__)
    public = {
        name
        for name, obj in vars(aiockpt).items()
        if not name.startswith("_") and not inspect.ismodule(obj) and name != "annotations"
    }
    assert public <= set(aiockpt.__all__), public - set(aiockpt.__all__)
    assert "sync" in aiockpt.__all__


def test_classes_report_the_public_module() -> None:
    for name in aiockpt.__all__:
        obj = getattr(aiockpt, name)
        if inspect.isclass(obj):
            assert obj.__module__ == "aiockpt", name


def test_every_error_is_a_checkpoint_error_and_never_a_base_exception_only() -> None:
    errors = [getattr(aiockpt, n) for n in aiockpt.__all__ if n.endswith("Error")]
    assert len(errors) >= 10
    for cls in errors:
        assert issubclass(cls, aiockpt.CheckpointError)
        assert issubclass(cls, Exception)


def test_sync_facade_surface() -> None:
    names = {"Checkpointer", "SyncSaveHandle", "convert", "load", "read", "read_metadata", "save", "verify"}
    assert set(sync.__all__) == names
    assert all(hasattr(sync, n) for n in sync.__all__)
