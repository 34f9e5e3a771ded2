"""Blocking file-system primitives. Every function here blocks: call them only from worker threads.

The commit protocol relies on three of them: :func:`fsync_dir` (a rename is durable only once its parent
directory is fsynced), :func:`rename_noreplace` (publishing never overwrites a checkpoint) and
:class:`OwnerLock` (in-progress temp data is garbage-collected only once its writer is gone).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
import shutil
import time
import uuid
from pathlib import Path

TMP_PREFIX = ".tmp-"
LOCK_SUFFIX = ".lock"

_AT_FDCWD = -100
_RENAME_NOREPLACE = 1


def _load_renameat2() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_renameat2 = _load_renameat2()


def absolute(path: str | os.PathLike[str]) -> Path:
    """``path`` made absolute against the working directory (a ``getcwd``, which never waits on a disk)."""
    return Path(os.path.abspath(path))


def rename_noreplace(src: Path, dst: Path) -> None:
    """Atomically rename ``src`` to ``dst``, failing if ``dst`` exists.

    Uses ``renameat2(RENAME_NOREPLACE)`` where the kernel and file system offer it; elsewhere it checks
    first, which leaves a window only against a concurrent writer of the same name.

    Raises:
        FileExistsError: ``dst`` exists.
        OSError: The rename failed.
    """
    if _renameat2 is not None:
        rc = _renameat2(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), _RENAME_NOREPLACE)
        if rc == 0:
            return
        err = ctypes.get_errno()
        if err not in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
            raise OSError(err, os.strerror(err), str(dst))
    if dst.exists():
        raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(dst))
    os.rename(src, dst)


def fsync_dir(path: Path) -> None:
    """Make the entries of directory ``path`` (creations, renames, removals) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durable(path: Path, data: bytes) -> None:
    """Write ``data`` to a new file ``path`` and fsync it (the directory entry is the caller's)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_durable(path: Path, data: bytes) -> None:
    """Atomically replace file ``path`` with ``data``: temp file, fsync, rename, fsync the directory."""
    tmp = path.with_name(f"{TMP_PREFIX}{path.name}-{uuid.uuid4().hex}")
    try:
        write_durable(tmp, data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)


def remove_tree(path: Path) -> None:
    """Remove a directory tree or file; entries that vanish meanwhile (another collector) are fine."""
    if not (path.is_dir() and not path.is_symlink()):
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        return
    for _ in range(3):  # a concurrent collector may remove entries under our feet: start over
        try:
            shutil.rmtree(path)
            return
        except FileNotFoundError:
            if not os.path.lexists(path):
                return
    shutil.rmtree(path)


class OwnerLock:
    """An ``flock`` held by a live writer on ``<temp dir>.lock`` for as long as the temp dir exists.

    The lock file is created under a private name, locked, then renamed into place, so nobody can ever
    see it unlocked while its owner lives. The kernel drops the lock when the owner dies, which is how
    :func:`collect_garbage` tells abandoned temp data from a save in progress in another process.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        private = path.with_name(f"{path.name}.{uuid.uuid4().hex}")
        self._fd = os.open(private, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.rename(private, path)
        except BaseException:
            os.close(self._fd)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(private)
            raise

    def release(self) -> None:
        """Remove the lock file, then drop the lock."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        os.close(self._fd)


def owner_alive(lock_path: Path) -> bool:
    """Whether a live process holds the ``flock`` on ``lock_path`` (a temp dir's owner lock)."""
    try:
        fd = os.open(lock_path, os.O_RDWR)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def collect_garbage(root: Path, *, stale_after: float = 60.0, dry_run: bool = False) -> list[Path]:
    """Remove temp data in ``root`` whose writer is gone (crashed saves, interrupted deletions).

    A temp directory goes once its owner lock is free (or it never had one: deletions in progress are
    idempotent). Loose temp files (lock files, half-written ``latest``) go once unlocked and older than
    ``stale_after`` seconds, which leaves a live writer time to rename them into place.

    Args:
        root: The directory to clean.
        stale_after: Age in seconds after which an unlocked loose temp file is garbage.
        dry_run: Remove nothing; only say what would be removed.

    Returns:
        The paths removed (or that would be).
    """
    removed: list[Path] = []
    try:
        entries = [e for e in root.iterdir() if e.name.startswith(TMP_PREFIX)]
    except FileNotFoundError:
        return removed
    now = time.time()
    for entry in entries:
        try:
            is_dir = entry.is_dir()
            age = now - entry.lstat().st_mtime
        except FileNotFoundError:
            continue
        lock = entry.with_name(entry.name + LOCK_SUFFIX)
        if is_dir:
            if owner_alive(lock):
                continue
        elif age < stale_after or owner_alive(entry):
            continue
        removed.append(entry)
        if dry_run:
            continue
        remove_tree(entry)
        if is_dir:  # its lock was just found free: it goes with the directory
            with contextlib.suppress(FileNotFoundError):
                lock.unlink()
    if dry_run:  # a directory's lock goes with it, as above
        dirs = {p.name + LOCK_SUFFIX for p in removed}
        removed = [p for p in removed if p.name not in dirs]
    return removed
