"""File-system helpers: durability (fsync) for the baselines and cold page cache for the loaders."""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

_SYNC_FILE_RANGE_WRITE = 2


def _libc_sync_file_range() -> Callable[[int, int, int, int], int] | None:
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):  # not Linux
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_sync_file_range = _libc_sync_file_range()


def start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Have the kernel start writing a range of ``fd``'s dirty pages to the device, without waiting.

    The same call as ``aiockpt._fs.start_writeback``, kept apart: the suite runs without aiockpt too.
    """
    if _sync_file_range is not None:
        _sync_file_range(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)


def fsync_path(path: Path) -> None:
    """Fsync one file or directory."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """Fsync every file under ``root``, then every directory bottom-up, ``root`` itself and its parent.

    Gives the baselines (torch.save, safetensors, DCP) the same durability aiockpt promises: data and the
    directory entries naming it are on stable storage when the timed call returns.
    """
    if root.is_file():
        fsync_path(root)
        fsync_path(root.parent)
        return
    dirs: list[Path] = []
    for here, _, files in os.walk(root):
        dirs.append(Path(here))
        for name in files:
            fsync_path(Path(here, name))
    for d in reversed(dirs):
        fsync_path(d)
    fsync_path(root.parent)


def drop_cache(root: Path) -> int:
    """Flush dirty data (``os.sync``) and evict every file under ``root`` from the page cache.

    Uses ``posix_fadvise(POSIX_FADV_DONTNEED)``, which drops clean pages; ``os.sync`` first makes sure none
    are dirty. Needs no privileges, unlike ``/proc/sys/vm/drop_caches``.

    Returns:
        The number of bytes in the files evicted.
    """
    os.sync()
    paths = [root] if root.is_file() else [Path(h, n) for h, _, files in os.walk(root) for n in files]
    total = 0
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            total += os.fstat(fd).st_size
        finally:
            os.close(fd)
    return total


def remove(path: Path) -> None:
    """Remove a file or directory tree if it exists."""
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


def tree_bytes(root: Path) -> int:
    """Total size of the files under ``root`` (or of ``root`` itself when it is a file)."""
    if root.is_file():
        return root.stat().st_size
    return sum(Path(h, n).stat().st_size for h, _, files in os.walk(root) for n in files)


@contextlib.contextmanager
def scratch_dir(root: str | os.PathLike[str], name: str) -> Iterator[Path]:
    """A new, empty directory ``root/name`` (absolute) for one benchmark, removed when the block ends."""
    path = Path(root).absolute() / name
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
