"""Operating-system calls that fail where a save or a load least expects it (fault injection).

Each test makes one ``os`` function fail once (the technique of a fault-injection harness: the real call
is made where the kernel would have made it, a close frees its descriptor, then the error is raised) and
checks what the caller sees: past the commit point a ``RuntimeWarning`` and a committed save; before it,
or on a read, a ``StorageError`` naming the file (errno kept in the cause), with every descriptor closed.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from conftest import assert_tree_equal, listdir, read_text, tmp_entries

import aiockpt
from aiockpt._fs import OwnerLock

pytestmark = pytest.mark.timeout(60)

DATA = "data-r00000.bin"
O_DIRECT: int = getattr(os, "O_DIRECT", 0)


def state(value: float = 1.0) -> dict[str, object]:
    return {"w": torch.full((300_000,), value), "b": torch.arange(5), "step": int(value)}


def target_of(fd: int) -> str:
    """What descriptor ``fd`` is open on (its ``/proc/self/fd`` link), or ``""`` where it is not open."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return ""


def eio() -> OSError:
    return OSError(errno.EIO, os.strerror(errno.EIO))


def failing_close(
    monkeypatch: pytest.MonkeyPatch, on: Callable[[str], bool], times: int = 1
) -> list[tuple[int, str]]:
    """Make the first ``times`` closes of a descriptor whose target satisfies ``on`` report ``EIO``.

    The descriptor is closed first, as Linux does where a close reports an error. Returns every close
    call made meanwhile: (descriptor, its target then).
    """
    real = os.close
    calls: list[tuple[int, str]] = []
    left = [times]

    def close(fd: int) -> None:
        target = target_of(fd)
        calls.append((fd, target))
        real(fd)
        if left[0] and on(target):
            left[0] -= 1
            raise eio()

    monkeypatch.setattr(os, "close", close)
    return calls


# --- past the commit point: a warning, and a save that committed


async def test_a_failed_fsync_of_the_root_after_the_rename_is_a_warning_and_the_step_committed(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = os.fsync
    armed = [False]

    def fsync(fd: int) -> None:
        if armed[0] and target_of(fd) == str(root):
            armed[0] = False
            raise eio()
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    async with aiockpt.Checkpointer(root, keep_last=2) as ckpt:
        await ckpt.save(state(1), step=1)
        await ckpt.save(state(2), step=2)
        armed[0] = True
        with pytest.warns(
            RuntimeWarning, match=r"fsyncing .* after the rename that committed it failed"
        ) as w:
            meta = await ckpt.save(state(3), step=3)
        assert str(root) in str(w[0].message)
        assert os.strerror(errno.EIO) in str(w[0].message)
        assert not armed[0]
        assert meta.step == 3
        # The Checkpointer's after-commit work ran: index, `latest` and retention.
        assert ckpt.steps() == [2, 3]
        assert read_text(root / "latest").strip() == "step-00000003"
        assert [n for n in listdir(root) if n.startswith("step-")] == ["step-00000002", "step-00000003"]
        assert_tree_equal(await aiockpt.read(root / "step-00000003"), state(3))


async def test_a_failed_fsync_of_the_parent_in_a_one_shot_save_is_a_warning(
    ckpt_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = os.fsync

    def fsync(fd: int) -> None:
        if target_of(fd) == str(ckpt_path.parent):
            raise eio()
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.warns(RuntimeWarning, match=f"saved {ckpt_path}, but fsyncing {ckpt_path.parent}"):
        await aiockpt.save(state(), ckpt_path)
    monkeypatch.undo()
    assert_tree_equal(await aiockpt.read(ckpt_path), state())


@pytest.mark.parametrize("call", ["unlink", "close"])
async def test_a_failed_release_of_the_owner_lock_after_the_commit_is_a_warning(
    call: str, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The lock's descriptor is closed once: a second close could close a file opened meanwhile."""
    closes: list[tuple[int, str]] = []
    async with aiockpt.Checkpointer(root, keep_last=2) as ckpt:
        await ckpt.save(state(1), step=1)
        if call == "close":
            # The lock file is unlinked first, then its descriptor closed: "(deleted)" by then.
            closes = failing_close(monkeypatch, lambda t: f"{root}/" in t and t.endswith("(deleted)"))
        else:
            real_unlink = os.unlink
            fired = [False]

            def unlink(path: str | os.PathLike[str], *args: object, **kwargs: object) -> None:
                if os.fspath(path).endswith(".lock") and not fired[0]:
                    fired[0] = True
                    raise OSError(errno.EIO, os.strerror(errno.EIO), os.fspath(path))
                real_unlink(path, *args, **kwargs)  # type: ignore[arg-type]

            monkeypatch.setattr(os, "unlink", unlink)
        with pytest.warns(RuntimeWarning, match=r"saved .*step-00000002, but releasing its temp dir's lock"):
            meta = await ckpt.save(state(2), step=2)
        monkeypatch.undo()
        assert meta.step == 2
        assert ckpt.steps() == [1, 2]
        assert read_text(root / "latest").strip() == "step-00000002"
    if call == "close":
        assert len([t for _, t in closes if t.endswith("(deleted)")]) == 1
        assert "" not in [t for _, t in closes], closes  # no descriptor closed again once gone
    # A lock file left behind (its unlink failed) has no owner: the next open collects it.
    async with aiockpt.Checkpointer(root) as ckpt:
        assert ckpt.steps() == [1, 2]
    assert tmp_entries(root) == []


def test_owner_lock_release_is_once_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    lock = OwnerLock(tmp_path / ".tmp-x-0123456789ab.lock")
    closes = failing_close(monkeypatch, lambda t: True)
    with pytest.raises(OSError, match=os.strerror(errno.EIO)):
        lock.release()
    lock.release()  # the descriptor is gone: its number is not closed again
    assert len(closes) == 1
    assert not (tmp_path / ".tmp-x-0123456789ab.lock").exists()
