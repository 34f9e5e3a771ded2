"""Blocking file-system primitives. Every function here blocks: call them only from worker threads.

The commit protocol relies on three of them: :func:`fsync_dir` (a rename is durable only once its parent
directory is fsynced), :func:`rename_noreplace` (publishing never overwrites a checkpoint) and
:class:`OwnerLock` (in-progress temp data is garbage-collected only once its writer is gone). Processes
that update one file in turns hold :func:`flocked`.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
import re
import shutil
import stat
import sys
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path

TMP_PREFIX = ".tmp-"
LOCK_SUFFIX = ".lock"
# The longest file name, in bytes, on Linux's file systems (ext4, XFS, btrfs, tmpfs: NAME_MAX).
NAME_MAX = 255
# What a temp directory's name leaves room for: its owner lock's suffix and, where the lock cannot be
# made unnamed, the ``.<32 hex>`` of the private name it is made under first (see _create_locked).
_LOCK_ROOM = len(LOCK_SUFFIX) + 1 + 32

_AT_FDCWD = -100
_RENAME_NOREPLACE = 1


def libc_function(
    name: str, argtypes: list[type] | None, restype: type = ctypes.c_int
) -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    """The C library's function ``name`` (its ``errno`` kept for ``ctypes.get_errno``), or ``None``.

    ``argtypes`` ``None`` leaves the arguments unchecked (variadic calls such as ``syscall``).
    """
    try:
        fn = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError):
        return None
    fn.argtypes = argtypes
    fn.restype = restype
    return fn


_renameat2 = libc_function(
    "renameat2", [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
)
_linkat = libc_function(
    "linkat", [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_int]
)
_sync_file_range = libc_function(
    "sync_file_range", [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
)
_SYNC_FILE_RANGE_WRITE = 2
# Pieces per writev call: below IOV_MAX (1024 on Linux).
_WRITEV_MAX = 512
_AT_EMPTY_PATH = 0x1000
# Refusals that mean "this way of naming an unnamed file is not open to us here", not a real failure.
_CANNOT_LINK = (errno.EPERM, errno.EACCES, errno.ENOENT, errno.EXDEV, errno.EOPNOTSUPP, errno.EINVAL)


# aiockpt's own temp names: ``.tmp-<name>-<hex>`` (a save's or a conversion's directory, 12 hex digits; a
# deletion's, 8; a file replaced durably, 32), each with its owner lock (``.lock``, or under its private
# name ``.lock.<32 hex>`` until renamed). Other ``.tmp-`` names in a root are another program's.
_TEMP_RE = re.compile(r"\.tmp-.+-(?:[0-9a-f]{8}|[0-9a-f]{12}|[0-9a-f]{32})(?:\.lock(?:\.[0-9a-f]{32})?)?")


def is_temp(name: str) -> bool:
    """Whether ``name`` is one of aiockpt's temp names (see :func:`collect_garbage`)."""
    return _TEMP_RE.fullmatch(name) is not None


def temp_name(name: str, unique: str) -> str:
    """The name ``.tmp-<name>-<unique>`` of temp data for ``name``, ``name`` cut short where it must be.

    Cut (at a character) so that the temp name, and its owner lock's names, fit in :data:`NAME_MAX`
    bytes: a name that fits itself may be saved to. The prefix and ``unique`` (hex digits, see
    :func:`is_temp`) mark temp data for :func:`collect_garbage` and keep temp names apart; the name is
    there for people.
    """
    room = NAME_MAX - _LOCK_ROOM - len(TMP_PREFIX) - 1 - len(unique)
    cut = name[:room]  # every character takes a byte or more
    while len(os.fsencode(cut)) > room:
        cut = cut[:-1]
    return f"{TMP_PREFIX}{cut}-{unique}"


def absolute(path: str | os.PathLike[str]) -> Path:
    """``path`` made absolute against the working directory (a ``getcwd``, which never waits on a disk)."""
    return Path(os.path.abspath(path))


def not_a_directory(path: Path) -> Path | None:
    """The nearest of ``path`` and its ancestors that exists, where it is not a directory; else ``None``.

    That is what keeps ``path.mkdir(parents=True)`` from making ``path``, which ``mkdir`` reports as
    ``FileExistsError`` or ``NotADirectoryError`` of the path it was asked for, not of the file in the way.
    ``None`` too where nothing of ``path`` exists.
    """
    for candidate in (path, *path.parents):
        if os.path.lexists(candidate):
            return None if candidate.is_dir() else candidate
    return None


def irregular(mode: int) -> str | None:
    """What a file of ``st_mode`` ``mode`` is where it is no regular file, for messages; ``None`` where it is.

    ``"a directory"``, else ``"not a regular file"`` (a FIFO, a socket, a device).
    """
    if stat.S_ISREG(mode):
        return None
    return "a directory" if stat.S_ISDIR(mode) else "not a regular file"


class IrregularFileError(OSError):
    """:func:`open_regular` found a FIFO, a socket or a device where it wanted a regular file (``EINVAL``)."""


def open_readable(path: Path | str) -> int:
    """``path`` opened read-only without waiting for anything: a FIFO's plain ``open`` waits for a writer.

    That wait would hold a worker thread that no cancellation reaches, for as long as nobody writes. Opened
    with ``O_NONBLOCK``, any file opens at once; the flag, needed by the open only, is cleared again (some
    FUSE file systems would pass it on to reads). The caller checks what it opened (:func:`irregular` of
    its ``fstat``) before it reads: a FIFO that no writer holds open reads as empty.

    Raises:
        OSError: The open failed.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_regular(path: Path | str) -> int:
    """``path`` opened read-only (see :func:`open_readable`), where it is a regular file; else refused.

    Raises:
        IrregularFileError: ``path`` is a FIFO, a socket or a device ("not a regular file").
        OSError: ``path`` cannot be opened (``IsADirectoryError`` for a directory, as ``open``).
    """
    fd = open_readable(path)
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path))
        if not stat.S_ISREG(mode):
            raise IrregularFileError(errno.EINVAL, "not a regular file", str(path))
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_regular(path: Path) -> bytes:
    """All of the regular file ``path`` (a manifest, a pointer); anything else is refused without a wait.

    Raises:
        IrregularFileError: ``path`` is a FIFO, a socket or a device ("not a regular file").
        OSError: ``path`` cannot be opened or read (``IsADirectoryError`` for a directory, as ``open``).
    """
    with open(open_regular(path), "rb") as f:
        return f.read()


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


def start_writeback(fd: int, offset: int, nbytes: int) -> bool:
    """Have the kernel start writing ``fd``'s dirty pages in ``[offset, offset + nbytes)`` to the device.

    Without it, a large buffered write only reaches the device once the dirty pages pass the kernel's
    background threshold (10% of memory by default) or at the final fsync, so the device idles while
    the bytes are copied into the page cache. ``sync_file_range(SYNC_FILE_RANGE_WRITE)`` submits them
    without waiting for them; it neither reports nor consumes write errors, which the fsync that follows
    still does. A hint: Linux only, and nothing is done where the call is missing or refused.

    Returns:
        Whether the kernel took the request.
    """
    return _sync_file_range is not None and _sync_file_range(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE) == 0


_O_DIRECT: int = getattr(os, "O_DIRECT", 0)


def open_direct(path: Path, flags: int) -> int | None:
    """``path`` opened with ``flags | O_DIRECT``, or ``None`` where direct I/O is refused.

    Refused: a platform without ``O_DIRECT``, or a file system without direct I/O (``EINVAL``: tmpfs
    before Linux 6.6, some FUSE and network file systems).

    Raises:
        OSError: The open failed otherwise.
    """
    if not _O_DIRECT:
        return None
    try:
        return os.open(path, flags | _O_DIRECT)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        return None


def write_durable(path: Path, data: bytes | Sequence[bytes]) -> None:
    """Write ``data`` (or its pieces, back to back) to a new file ``path`` and fsync it.

    The directory entry is the caller's to fsync.
    """
    pieces = [memoryview(p) for p in ([data] if isinstance(data, bytes) else data) if len(p)]
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        first = 0
        while first < len(pieces):
            done = os.writev(fd, pieces[first : first + _WRITEV_MAX])
            # Drop what was written: whole pieces, then the head of a piece cut short.
            while done and done >= len(pieces[first]):
                done -= len(pieces[first])
                first += 1
            if done:
                pieces[first] = pieces[first][done:]
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
    for _ in range(3):  # entries made meanwhile (none are, in a doomed tree) would survive a pass
        if sys.version_info >= (3, 12):
            shutil.rmtree(path, onexc=_skip_vanished)
        else:
            shutil.rmtree(path, onerror=lambda function, name, info: _skip_vanished(function, name, info[1]))
        if not os.path.lexists(path):
            return
    shutil.rmtree(path)


def _skip_vanished(function: object, name: str, exc: BaseException) -> None:
    """``shutil.rmtree``'s error handler: an entry another collector removed first is not an error.

    Without it, ``rmtree`` stops at the first such entry, and two processes removing one large tree
    (a step of many ranks' files, renamed for deletion) would each keep failing on the other's work.
    """
    if not isinstance(exc, FileNotFoundError):
        raise exc


def _open_unnamed(directory: Path) -> int:
    """An unnamed file in ``directory`` (``O_TMPFILE``), or -1 where the platform or file system has none."""
    flag = getattr(os, "O_TMPFILE", 0)
    if not flag:
        return -1
    try:
        return os.open(directory, flag | os.O_RDWR, 0o644)
    except OSError as exc:
        # EOPNOTSUPP: the file system cannot; EISDIR/EINVAL: a kernel older than O_TMPFILE.
        if exc.errno in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
            return -1
        raise


def _name_unnamed(fd: int, path: Path) -> bool:
    """Give the ``O_TMPFILE`` file ``fd`` the name ``path`` (never replacing one); False if not allowed.

    ``linkat(fd, "", AT_EMPTY_PATH)`` needs CAP_DAC_READ_SEARCH on most kernels; linking its
    ``/proc/self/fd`` entry needs no privilege but is refused inside some sandboxes.

    Raises:
        OSError: The link failed for another reason (``path`` exists, the disk is full, ...).
    """
    if _linkat is not None:
        if _linkat(fd, b"", _AT_FDCWD, os.fsencode(path), _AT_EMPTY_PATH) == 0:
            return True
        err = ctypes.get_errno()
        if err not in _CANNOT_LINK:
            raise OSError(err, os.strerror(err), str(path))
    try:
        os.link(f"/proc/self/fd/{fd}", path, follow_symlinks=True)
    except OSError as exc:
        if exc.errno in _CANNOT_LINK:
            return False
        raise
    return True


def _create_locked(path: Path) -> tuple[int, bool]:
    """Create ``path`` with an ``flock`` held on it; return its descriptor and whether it was atomic.

    Atomic: the file is made unnamed, locked, then linked into place, so it never bears its name unlocked.
    Otherwise it is made under a private name beside ``path``, locked, then renamed into place. Either
    way an existing ``path`` is never replaced.

    Raises:
        FileExistsError: ``path`` exists.
        OSError: It could not be created.
    """
    fd = _open_unnamed(path.parent)
    if fd >= 0:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if _name_unnamed(fd, path):
                return fd, True
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)
    private = path.with_name(f"{path.name}.{uuid.uuid4().hex}")
    fd = os.open(private, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        rename_noreplace(private, path)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(private)
        raise
    return fd, False


class OwnerLock:
    """An ``flock`` held by a live writer on ``<temp dir>.lock`` for as long as the temp dir exists.

    The lock file never bears its name unlocked while its owner lives (see :func:`_create_locked`), so
    :func:`collect_garbage` may remove a free one at once. Where the file cannot be created unnamed, a
    crash before its rename leaves it under its private name, which goes once stale. The kernel drops the
    lock when the owner dies, which is how :func:`collect_garbage` tells abandoned temp data from a save
    in progress in another process.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd, self.atomic = _create_locked(path)

    def release(self) -> None:
        """Remove the lock file, then drop the lock. Once only: a second call does nothing.

        The lock is dropped even where the unlink fails (the file, unlocked, is then an orphan that
        :func:`collect_garbage` removes) or the close reports an error (Linux frees the descriptor all
        the same). The descriptor is let go of before it is closed: closing its number again would
        close whatever file the process opened under that number since.

        Raises:
            OSError: The lock file could not be removed, or closing its descriptor reported an error.
        """
        fd, self._fd = self._fd, -1
        if fd < 0:
            return
        try:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
        finally:
            os.close(fd)


@contextlib.contextmanager
def flocked(path: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on file ``path`` for the block, waiting for it while another holds it.

    The file is created if missing and never removed: a lock file that could vanish between one
    process's open and its ``flock`` would let a second process lock a new file of that name meanwhile.
    The kernel drops the lock when its holder dies. For short sections only (the wait is unbounded).

    Raises:
        OSError: ``path`` cannot be opened or created, or cannot be locked.
    """
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # drops the lock


def owner_alive(lock_path: Path) -> bool:
    """Whether a live process holds the ``flock`` on ``lock_path`` (a temp dir's owner lock).

    The owner holds it exclusively: a shared lock is refused while it lives. Asked so, the file need only
    be readable: a reader of the root (an RL actor) may have no right to write there, or the root may be
    mounted read-only, and two processes asking at once do not take each other for an owner. (On NFS,
    where ``flock`` is a byte-range lock, a shared one needs a descriptor open for reading only.)
    """
    try:
        fd = os.open(lock_path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def collect_garbage(root: Path, *, stale_after: float = 60.0, dry_run: bool = False) -> list[Path]:
    """Remove temp data in ``root`` whose writer is gone (crashed saves, interrupted deletions).

    A temp directory goes once its owner lock is free (or it never had one: deletions in progress are
    idempotent), and so does a lock file whose directory was never made. Other loose temp files (a
    half-written ``latest``, a lock file still under its private name) go once unlocked and older than
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
        # aiockpt's own alone: a root may hold another program's ``.tmp-`` data (a build cache, say).
        entries = [e for e in root.iterdir() if is_temp(e.name)]
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
        elif entry.name.endswith(LOCK_SUFFIX):
            # A lock file bears its final name only while its owner holds it (see OwnerLock): free, it is
            # an orphan of a writer that died before creating its temp dir, whatever its age.
            if owner_alive(entry):
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
    # A directory's lock goes with it, as above: listed under the directory only, whether the lock was
    # met first in the listing (and removed as a free lock) or after it (gone already), or not removed.
    dirs = {p.name + LOCK_SUFFIX for p in removed}
    return [p for p in removed if p.name not in dirs]
