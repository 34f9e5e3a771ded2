"""A managed directory of checkpoints: numbered steps, in-flight limits, retention, resume."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import re
import uuid
import warnings
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterable, Mapping, MutableMapping, Sequence
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeGuard, TypeVar, overload

import anyio

from ._dist import DEFAULT_TIMEOUT
from ._errors import (
    BusyError,
    CheckpointCancelledError,
    CheckpointError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    CorruptionError,
    SaveSkippedError,
    StorageError,
)
from ._format import MANIFEST_NAME, Key, part_dir_name
from ._fs import (
    TMP_PREFIX,
    IrregularFileError,
    collect_garbage,
    flocked,
    fsync_dir,
    not_a_directory,
    read_regular,
    remove_tree,
    replace_durable,
)
from ._handle import Metadata, SaveHandle, SaveState
from ._insulate import insulated, warn_at_caller
from ._load import check_target, exists, is_checkpoint, run_load, run_metadata, run_read
from ._memory import StagingPool
from ._options import IOConfig, check_flags, check_timeout, io_config
from ._runner import start_background, start_soon
from ._save import SaveRequest, metadata_of, run_reserve, run_save
from ._save._protocol import abort_unbegun, unbegun
from ._storage import Location, S3Options, S3Path, resolve
from ._threads import run_sync
from ._world import LocalWorld, World, part_of, resolve_world

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
else:
    try:  # at run time too, so that typing.get_type_hints() resolves the annotations that name it
        from torch.distributed import ProcessGroup
    except ImportError:  # a torch built without distributed support: no group to pass
        ProcessGroup = object

OnBusy = Literal["wait", "skip", "error"]
"""What a save does while ``max_inflight`` saves are in flight (``Checkpointer(on_busy=...)``): ``"wait"``
for a slot, ``"skip"`` itself (its handle says so), or raise :class:`BusyError` (``"error"``)."""
T = TypeVar("T")

LATEST = "latest"
# Held (see flocked) by the ranks of a collective-free job while they update `latest`; a stable name that
# neither marks temp data nor a step, so garbage collection and listings leave it alone.
LATEST_LOCK = ".latest.lock"
_LOAD_ATTEMPTS = 3
STEP_RE = re.compile(r"step-([0-9]+)")


def step_dir_name(step: int) -> str:
    """``100`` -> ``step-00000100``."""
    return f"step-{step:08d}"


def step_of(name: str) -> int | None:
    """The step whose directory is called ``name``, or ``None`` if it is not a step's name.

    Only the name :func:`step_dir_name` gives counts: ``step-5`` beside ``step-00000005`` (a copy made by
    hand), or digits other than ASCII ones, would list one step twice, or a step that was never saved.
    """
    m = STEP_RE.fullmatch(name)
    if m is None:
        return None
    step = int(m.group(1))
    return step if name == step_dir_name(step) else None


def latest_of(root: Path) -> int | None:
    """The step that ``root``'s ``latest`` names, or ``None`` (no ``latest``, or not a step's name). Blocking.

    A FIFO, socket or device named ``latest`` names no step (read, a FIFO would wait for a writer): a
    writer replaces it as it does a missing one.

    Raises:
        OSError: ``latest`` exists but cannot be read.
    """
    try:
        raw = read_regular(root / LATEST)
    except (FileNotFoundError, IrregularFileError):
        return None
    return _latest_step(raw)


def collect_temp(root: Path, *, dry_run: bool = False) -> list[Path]:
    """Remove the temp data of ``root``, and of its step directories, whose writer is gone. Blocking.

    A collective-free save makes its part's temp dir inside the step directory, beside the part it
    becomes, so a rank killed mid-save leaves it there rather than in ``root``. Each step directory
    without a manifest of its own is listed once and cleaned as ``root`` is (see
    :func:`collect_garbage`): a temp entry goes only once its owner lock is free, never while its save
    runs. A collective save's temp dir is in ``root`` and is renamed whole into place, so a step
    directory with a manifest holds none and is not listed. A step directory emptied so stays: a rank
    may be about to make its temp dir in it.

    Args:
        root: The Checkpointer root.
        dry_run: Remove nothing; only say what would be removed.

    Returns:
        The paths removed (or that would be), those directly in ``root`` first.

    Raises:
        OSError: A directory cannot be listed, or an entry cannot be removed.
    """
    removed = collect_garbage(root, dry_run=dry_run)
    try:
        with os.scandir(root) as it:
            steps = [e.path for e in it if step_of(e.name) is not None and e.is_dir(follow_symlinks=False)]
    except FileNotFoundError:
        return removed
    for step in sorted(steps):
        if not os.path.isfile(os.path.join(step, MANIFEST_NAME)):
            try:
                removed += collect_garbage(Path(step), dry_run=dry_run)  # (one gone meanwhile: nothing)
            except PermissionError:
                continue  # a step directory this process may not read: scan_steps names it
    return removed


def _collect_if_allowed(root: Path) -> None:
    """:func:`collect_temp` on ``root``, unless this process may not write there. Blocking.

    A reader with no right to write the root (an RL actor following a learner, a read-only mount) has
    nothing to collect: the writer's next open does it.

    Raises:
        OSError: Listing or removing failed otherwise.
    """
    try:
        collect_temp(root)
    except OSError as exc:
        if exc.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise


def _latest_bytes(step: int) -> bytes:
    """What ``latest`` holds when it names ``step``: the step directory's name and a newline."""
    return (step_dir_name(step) + "\n").encode()


def _latest_step(raw: bytes) -> int | None:
    """The step that ``latest``'s bytes ``raw`` name (see :func:`_latest_bytes`), or ``None``."""
    return step_of(raw.decode(errors="replace").strip())


def _moves_latest(current: int | None, step: int) -> bool | None:
    """Whether ``latest``, naming ``current``, is to name ``step`` (``latest`` only moves forward).

    ``None`` (``current`` is newer): only if ``current`` is no longer committed (removed by hand), which the
    caller checks, on a local root or an object store.
    """
    if current == step:
        return False
    if current is None or current < step:
        return True
    return None


def _latest_turn(root: Path, locked: bool) -> contextlib.AbstractContextManager[None]:
    """The writers' turn at ``latest`` (an ``flock``; see :func:`publish_newer`), or none where unlocked."""
    return flocked(root / LATEST_LOCK) if locked else contextlib.nullcontext()


def publish_newer(
    root: Path, step: int, doomed: Iterable[int], *, locked: bool = True
) -> tuple[list[Path], OSError | None]:
    """Point ``latest`` at ``step`` unless it names a newer committed step; then trash ``doomed``. Blocking.

    Every writer of a root updates ``latest`` when it commits a step, from its own index (``step`` is its
    newest): the ranks of a collective-free job, and Checkpointers of one root in several processes. One
    late with an older step must not undo a newer one: ``latest`` only moves forward, to a step that is
    committed now; a ``latest`` naming a step that is no longer committed (removed by hand) is replaced.
    Retention runs after that, and ``doomed`` is older than ``step``: the step ``latest`` names is never
    trashed.

    ``locked``: the writers take turns under an ``flock`` on :data:`LATEST_LOCK`, so ``latest`` is read
    and replaced by one at a time. The ranks of a collective-free job, which complete steps at the same
    time, do; other roots have one writer as a rule, and no lock file (two writers committing at the same
    moment may then leave ``latest`` on the older of their steps; loads scan the steps, not ``latest``).

    Retention does not depend on ``latest``: where it cannot be read or replaced (a full disk, a
    directory in its place) the steps are trashed all the same, and the failure is returned, not raised
    (on a full disk, a retention that waited for ``latest`` would never free the room for one).

    Returns:
        The trees of the steps trashed, for the caller to remove (see :func:`trash_steps`), and why
        ``latest`` could not be read or replaced (``None``: it was, or needed no change).

    Raises:
        OSError: The lock or a step directory cannot be read or written.
    """
    with _latest_turn(root, locked):
        failed: OSError | None = None
        try:
            current = latest_of(root)
            moves = _moves_latest(current, step)
            if moves is None and current is not None:
                moves = not is_checkpoint(root / step_dir_name(current))
            if moves and is_checkpoint(root / step_dir_name(step)):
                replace_durable(root / LATEST, _latest_bytes(step))
        except OSError as exc:
            failed = exc
        trashed, trash_failed = _trash(root, doomed)
        return list(trashed.values()), failed or trash_failed


def repair_latest(root: Path, steps: Sequence[int], *, locked: bool = False) -> None:
    """Point a missing or dangling ``latest`` at the newest of ``steps`` (committed ones). Blocking.

    A writer killed between its commit and its update of ``latest`` leaves committed steps that no
    ``latest`` names, or one naming a step that is gone. The next open by a writer mends it. A ``latest``
    naming a committed step, older or not, is left alone: a writer of the root in another process may
    be about to move it forward, and moving it here could then move it back. Where it cannot be read or
    replaced (a reader with no right to write the root, a full disk), it stays as it is: it is a hint,
    and loads scan the steps. ``locked``: as :func:`publish_newer`'s.
    """
    if not steps:
        return
    with contextlib.suppress(OSError), _latest_turn(root, locked):
        current = latest_of(root)
        if current is None or not is_checkpoint(root / step_dir_name(current)):
            replace_durable(root / LATEST, _latest_bytes(steps[-1]))


def _listed_steps(root: Path) -> list[int]:
    """:func:`scan_steps`, its failure a :class:`StorageError` naming ``root``. Blocking."""
    try:
        return scan_steps(root)
    except OSError as exc:
        raise StorageError(
            f"cannot list checkpoint root {root}: {exc.strerror or exc}", path=str(root)
        ) from exc


def scan_steps(root: Path) -> list[int]:
    """The committed steps under ``root``, oldest first. Blocking.

    A step directory that cannot be read (no permission, an I/O error) is left out with a
    ``RuntimeWarning`` naming it: the steps around it stay usable (a load resumes from the newest one
    that can be read).

    Raises:
        OSError: ``root`` itself cannot be listed.
    """
    steps = []
    with os.scandir(root) as it:
        for entry in it:
            step = step_of(entry.name)
            if step is None:
                continue
            try:
                if entry.is_dir() and is_checkpoint(Path(entry.path)):
                    steps.append(step)
            except FileNotFoundError:
                continue  # (deleted meanwhile)
            except OSError as exc:
                warnings.warn(
                    f"step {step} in {root} is left out: cannot read {entry.path}: {exc.strerror or exc}",
                    RuntimeWarning,
                    stacklevel=2,
                )
    return sorted(steps)


async def _scan_objects(root: S3Path, *, collect: bool) -> list[int]:
    """The committed steps under an S3 ``root``; with ``collect``, delete abandoned uncommitted ones.

    A step prefix without a manifest holds saves in progress (here or in another process) and abandoned
    ones: only the objects of abandoned saves are deleted (see ``_storage._s3_lease``).
    """
    from ._storage._s3_lease import children, clear

    steps = []
    for name, found in (await children(root)).items():
        step = step_of(name)
        if step is not None and found.committed:
            steps.append(step)
        elif step is not None and collect:
            await clear(root / name, strict=False)
    return sorted(steps)


def doomed_steps(
    steps: Sequence[int], *, keep_last: int | None, keep_every: int | None, protect: Iterable[int] = ()
) -> list[int]:
    """The steps that retention deletes from the committed ``steps`` (oldest first). Pure.

    Retention keeps the newest ``keep_last`` steps (all of them when it is ``None``), every step divisible
    by ``keep_every``, and the ``protect``ed ones (being loaded); so the newest step is never deleted.
    """
    if keep_last is None or len(steps) <= keep_last:
        return []
    keep = set(steps[-keep_last:]) | set(protect)
    if keep_every:
        keep |= {s for s in steps if s % keep_every == 0}
    return [s for s in steps if s not in keep]


def trash_steps(root: Path, steps: Iterable[int]) -> dict[int, Path]:
    """Take the checkpoints of ``steps`` under ``root`` out of it; return those that were there. Blocking.

    Each is renamed to a temp name (what it is now called is returned by step), which deletes it
    atomically for readers; the root is fsynced once. Removing the renamed trees is the caller's
    (:func:`remove_tree`); one left behind, by a crash say, is temp data that the next garbage
    collection removes.
    """
    trashed, failed = _trash(root, steps)
    if failed is not None:
        raise failed
    return trashed


def _trash(root: Path, steps: Iterable[int]) -> tuple[dict[int, Path], OSError | None]:
    """:func:`trash_steps`, returning its failure instead of raising it, with the steps trashed before it.

    A step renamed away is gone for every reader whatever follows (the root's fsync failing, another
    rename): its tree is the caller's to remove, and its step is out of the index.
    """
    trashed: dict[int, Path] = {}
    try:
        for s in steps:
            trash = root / f"{TMP_PREFIX}del-{step_dir_name(s)}-{uuid.uuid4().hex[:8]}"
            with contextlib.suppress(FileNotFoundError):
                os.rename(root / step_dir_name(s), trash)
                trashed[s] = trash
        if trashed:
            fsync_dir(root)
    except OSError as exc:
        return trashed, exc
    return trashed, None


def _remove_trees(trees: Iterable[Path]) -> None:
    for tree in trees:
        remove_tree(tree)


def delete_steps(root: Path, steps: Iterable[int]) -> list[int]:
    """Delete the checkpoints of ``steps`` under ``root``; return those that were there. Blocking.

    See :func:`trash_steps`.
    """
    trashed = trash_steps(root, steps)
    _remove_trees(trashed.values())
    return list(trashed)


def _steps_text(steps: Sequence[int], most: int = 6) -> str:
    """``[3, 6, 9, 10]``; a long list shortened to its ends: ``[1, 2, 3, ..., 7, 8, 9] (9 steps)``."""
    if len(steps) <= most:
        return str(list(steps))
    half = most // 2
    head, tail = ", ".join(map(str, steps[:half])), ", ".join(map(str, steps[-half:]))
    return f"[{head}, ..., {tail}] ({len(steps)} steps)"


def _is_int(value: object) -> TypeGuard[int]:
    """Whether ``value`` is an int proper: ``True`` is an int to Python, but as a count it is a mistake."""
    return isinstance(value, int) and not isinstance(value, bool)


def _check_arguments(
    *,
    keep_last: object,
    keep_every: object,
    max_inflight: object,
    on_busy: object,
    allow_pickle: object,
    io: object,
    staging_budget: object,
    collective_timeout: object,
    use_collectives: object,
    s3: object,
) -> None:
    """Refuse the :class:`Checkpointer` arguments of a wrong type or out of range, naming the argument.

    Eagerly, in the constructor: a float ``keep_last`` (from a YAML config, say) would otherwise only
    fail at each commit's pruning (a slice index), and a float ``max_inflight`` at open.

    Raises:
        CheckpointError: An argument has a wrong type or is out of range; the message names it and its
            value.
    """

    def refuse(name: str, expected: str, value: object) -> CheckpointError:
        return CheckpointError(f"{name} must be {expected}, not {value!r}")

    for name, count in (("keep_last", keep_last), ("keep_every", keep_every)):
        if count is not None and not (_is_int(count) and count >= 1):
            raise refuse(name, "an int of at least 1 or None", count)
    if not (_is_int(max_inflight) and max_inflight >= 1):
        raise refuse("max_inflight", "an int of at least 1", max_inflight)
    if not isinstance(on_busy, str) or on_busy not in ("wait", "skip", "error"):
        raise refuse("on_busy", "'wait', 'skip' or 'error'", on_busy)
    check_flags(allow_pickle=allow_pickle, use_collectives=use_collectives)
    if io is not None and not isinstance(io, IOConfig):
        raise refuse("io", "an aiockpt.IOConfig or None", io)
    if staging_budget is not None and not (_is_int(staging_budget) and staging_budget >= 0):
        raise refuse("staging_budget", "a byte count (an int of at least 0) or None", staging_budget)
    check_timeout(collective_timeout)
    if s3 is not None and not isinstance(s3, S3Options):
        raise refuse("s3", "an aiockpt.S3Options or None", s3)


def _check_step(step: object) -> None:
    """Refuse a step that is not an int from 0 to 2**63 - 1 (a bool is not one).

    Raises:
        CheckpointError: It is not; the message names it.
    """
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step < 2**63:
        raise CheckpointError(f"step must be a non-negative int (below 2**63), not {step!r}")


class Checkpointer:
    """Checkpoints of one training run or service under ``root``, one directory per step.

    Use it as ``async with Checkpointer(root) as ckpt:``. Opening it removes temp data abandoned by
    crashed saves (never that of saves still running in other processes). Closing it waits for saves in
    flight (or cancels them, see :meth:`aclose`) and frees the staging buffers.

    Args:
        root: The directory holding ``step-NNNNNNNN`` checkpoints and the ``latest`` pointer, or an
            ``s3://bucket/prefix`` URL of an S3-compatible object store (``aiockpt[s3]``).
        keep_last: Keep only the newest ``keep_last`` committed steps (``None``: keep all). The newest by
            number, whatever the order they were saved in: a step saved below them (a new run counting
            from 1 again in the root of an old one) is deleted as soon as its save commits it, with a
            :class:`RuntimeWarning` saying so.
        keep_every: Also keep every step divisible by ``keep_every``, permanently.
        max_inflight: Saves allowed in flight at once (staging, writing or committing); 1 in a
            distributed job with collectives.
        on_busy: What a save does while ``max_inflight`` saves are in flight: ``"wait"`` for a slot,
            ``"skip"`` itself (the handle says so), or raise :class:`BusyError` (``"error"``).
        allow_pickle: Pickle (and unpickle) objects of other types instead of refusing them.
        io: I/O tuning.
        staging_budget: Most bytes of host memory for staging buffers, in use or kept for reuse, at
            once (``None``: no limit). A save that does not fit waits for memory (``on_busy="wait"``) or
            raises :class:`BusyError`; one larger than the whole budget always raises.
        process_group: Save collectively over this ``torch.distributed`` group (default: the default
            group when ``torch.distributed`` is initialised). Every rank opens a Checkpointer on the same
            root and calls ``save`` with the same steps; rank 0 publishes, updates ``latest`` and prunes.
            Loads need no collective: each rank reads the chunks its state needs.
        collective_timeout: Seconds each checkpoint collective may take before the save fails with
            :class:`DistributedError`.
        use_collectives: With ``False`` in a distributed job, every rank saves its own part of each step
            without any collective (see :func:`aiockpt.save`); a step counts as committed once all parts
            are published, and the rank that completes it updates ``latest`` (never to an older step
            than it names) and prunes.
        s3: Object-store settings for an ``s3://`` root (default: from the AWS environment variables).

    Raises:
        CheckpointError: An argument has a wrong type (``keep_last=2.5``) or is out of range (the
            message names it), or ``root`` is empty. Also, once opened in a distributed job with
            collectives: ``on_busy`` is not ``"wait"`` (each rank would decide on its own whether to
            skip, and the others would wait for it), or ``max_inflight`` is more than 1 (two saves in
            flight could reach their collectives in different orders on different ranks).
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        keep_last: int | None = None,
        keep_every: int | None = None,
        max_inflight: int = 1,
        on_busy: OnBusy = "wait",
        allow_pickle: bool = False,
        io: IOConfig | None = None,
        staging_budget: int | None = None,
        process_group: ProcessGroup | None = None,
        collective_timeout: float = DEFAULT_TIMEOUT,
        use_collectives: bool = True,
        s3: S3Options | None = None,
    ) -> None:
        _check_arguments(
            keep_last=keep_last,
            keep_every=keep_every,
            max_inflight=max_inflight,
            on_busy=on_busy,
            allow_pickle=allow_pickle,
            io=io,
            staging_budget=staging_budget,
            collective_timeout=collective_timeout,
            use_collectives=use_collectives,
            s3=s3,
        )
        self.root = resolve(root, s3)
        self.keep_last = keep_last
        self.keep_every = keep_every
        self.max_inflight = max_inflight
        self.on_busy: OnBusy = on_busy
        self.allow_pickle = allow_pickle
        self.io = io_config(io)
        self._pool = StagingPool(staging_budget, wait=on_busy == "wait", own_pinned=True)
        self._steps: list[int] = []
        self._inflight: dict[int, SaveHandle] = {}
        # One per save this rank ended before it began, set once the rank has taken part in the save's
        # exchanges as a failed rank (see _abort_unbegun); wait() waits for them.
        self._aborting: set[anyio.Event] = set()
        self._loading: dict[int, int] = {}
        self._slots: anyio.Semaphore | None = None
        self._commit_lock: anyio.Lock | None = None
        self._opened = False
        self._opening: anyio.Event | None = None  # set when the open in progress ends (either way)
        self._closing = False  # aclose() began: no new save starts
        self._closed = False
        self._group = process_group
        self._timeout = collective_timeout
        self._world: World = LocalWorld()
        self._use_collectives = use_collectives
        self._part: tuple[int, int] | None = None
        # Set once the steps retention last took out of the root are removed (see _remove_later).
        self._removed: anyio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # the event loop it serves (see _check_loop)

    def __repr__(self) -> str:
        # Shortened: a run that keeps every step has thousands (a log line of 29 KB for 5000).
        return f"<Checkpointer root={str(self.root)!r} steps={_steps_text(self._steps)}>"

    async def __aenter__(self) -> Checkpointer:
        await self.open()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    # --- Directory state --------------------------------------------------------------------------------

    @insulated
    async def open(self) -> None:
        """Create ``root`` if needed, collect abandoned temp data and index the committed steps.

        Raises:
            CheckpointError: The Checkpointer is closed.
            StorageError: ``root`` cannot be made or listed; where it or an ancestor is a file, not a
                directory, the message and ``path`` name that file.
        """
        self._check_loop()
        # Concurrent first calls (saves gathered before any ``async with``) wait for one open: each
        # opening its own would give each save a semaphore of its own, and max_inflight would not hold.
        while not self._opened:
            if self._closed:
                raise CheckpointError(f"the Checkpointer of {self.root} is closed")
            if self._opening is not None:
                await self._opening.wait()  # and try again if that open failed
                continue
            self._opening = anyio.Event()
            try:
                await self._open()
            finally:
                opening, self._opening = self._opening, None
                opening.set()
        if self._closed:
            raise CheckpointError(f"the Checkpointer of {self.root} is closed")

    def _check_loop(self) -> None:
        """Serve the running event loop, refusing it while another one that this Checkpointer served runs.

        Its semaphore, lock and events wake a waiter through the loop it waits on: shared by two loops
        at once (two threads), a release in one never woke a waiter of the other, which hung. One loop
        after another (a second ``asyncio.run``) is fine.

        Raises:
            CheckpointError: Another event loop, still running, has used this Checkpointer.
        """
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # (another async library: nothing to check)
            return
        if loop is self._loop:
            return
        if self._loop is not None and self._loop.is_running():
            raise CheckpointError(
                f"the Checkpointer of {self.root} is in use by another event loop, which still runs: a "
                "Checkpointer serves one event loop at a time (make one per loop)"
            )
        self._loop = loop

    async def _open(self) -> None:
        if self._use_collectives:
            self._world = await resolve_world(self._group, self._timeout)
        else:
            self._part = part_of(self._group)
        if self._world.size > 1 and self.on_busy != "wait":
            raise CheckpointError(
                f"on_busy={self.on_busy!r} needs every rank to decide alike; distributed jobs use 'wait'"
            )
        if self._world.size > 1 and self.max_inflight > 1:
            # Each rank runs its saves' collectives in its own call order: two saves in flight would
            # reach them in different orders on different ranks (one's plan meeting the other's vote).
            raise CheckpointError(
                f"max_inflight={self.max_inflight} needs saves to reach their collectives in one order on "
                "every rank; distributed jobs save one at a time (max_inflight=1)"
            )
        coordinator = self._world.rank == 0
        collective_free = self._part is not None
        root = self.root

        def prepare(root: Path) -> list[int]:
            try:
                root.mkdir(parents=True, exist_ok=True)
                if not coordinator:  # the other ranks would race it
                    return scan_steps(root)
                _collect_if_allowed(root)
                steps = scan_steps(root)
                repair_latest(root, steps, locked=collective_free)
                return steps
            except (FileExistsError, NotADirectoryError) as exc:
                blocked = not_a_directory(root)
                if blocked is None:  # (the file in the way went meanwhile)
                    raise StorageError(
                        f"cannot open checkpoint root {root}: {exc.strerror or exc}", path=str(root)
                    ) from exc
                what = "it is not a directory" if blocked == root else f"{blocked} is not a directory"
                raise StorageError(f"cannot open checkpoint root {root}: {what}", path=str(blocked)) from exc
            except OSError as exc:
                where = str(root) if exc.filename is None else os.fsdecode(exc.filename)
                within = "" if where == str(root) else f" ({where})"
                raise StorageError(
                    f"cannot open checkpoint root {root}: {exc.strerror or exc}{within}", path=where
                ) from exc

        if isinstance(root, S3Path):
            self._steps = await _scan_objects(root, collect=coordinator)
        else:
            self._steps = await run_sync(partial(prepare, root))
        self._slots = anyio.Semaphore(self.max_inflight)
        self._commit_lock = anyio.Lock()
        self._opened = True

    @insulated
    async def refresh(self) -> list[int]:
        """Re-read the committed steps from disk (they may have been written by another process).

        Raises:
            StorageError: ``root`` cannot be listed (it was removed, say).
        """
        await self.open()
        root = self.root
        assert self._commit_lock is not None
        # Under the commit lock: a listing taken before a save of this Checkpointer commits must not
        # replace the index after that save added its step (`latest` and retention would go by it).
        async with self._commit_lock:
            if isinstance(root, S3Path):
                self._steps = await _scan_objects(root, collect=False)
            else:
                self._steps = await run_sync(partial(_listed_steps, root))
        return list(self._steps)

    def steps(self) -> list[int]:
        """Committed steps, oldest first, as of the last save, load, open or :meth:`refresh`."""
        return list(self._steps)

    def latest_step(self) -> int | None:
        """The newest committed step (see :meth:`steps`), or ``None``."""
        return self._steps[-1] if self._steps else None

    def path_of(self, step: int) -> Location:
        """The directory (or object prefix) of ``step``'s checkpoint.

        Raises:
            CheckpointError: ``step`` is not a non-negative int.
        """
        _check_step(step)
        return self.root / step_dir_name(step)

    # --- Saving -----------------------------------------------------------------------------------------

    @overload
    async def save(
        self,
        state: Mapping[str, object],
        *,
        step: int,
        async_op: Literal[False] = ...,
        metadata: Mapping[str, str | int | float | bool | None] | None = ...,
    ) -> Metadata: ...

    @overload
    async def save(
        self,
        state: Mapping[str, object],
        *,
        step: int,
        async_op: Literal[True],
        metadata: Mapping[str, str | int | float | bool | None] | None = ...,
    ) -> SaveHandle: ...

    @overload
    async def save(
        self,
        state: Mapping[str, object],
        *,
        step: int,
        async_op: bool,
        metadata: Mapping[str, str | int | float | bool | None] | None = ...,
    ) -> Metadata | SaveHandle: ...

    @insulated
    async def save(
        self,
        state: Mapping[str, object],
        *,
        step: int,
        async_op: bool = False,
        metadata: Mapping[str, str | int | float | bool | None] | None = None,
    ) -> Metadata | SaveHandle:
        """Save ``state`` as checkpoint ``step``.

        With ``async_op=True`` this returns once the state is staged (the caller may mutate it), with a
        :class:`SaveHandle` to await for durability. Otherwise it returns once the checkpoint is durable.
        After the commit, ``latest`` is updated and retention applied.

        Raises:
            CheckpointExistsError: ``step`` is committed or being saved already.
            BusyError: ``on_busy="error"`` and ``max_inflight`` saves are in flight.
            SaveSkippedError: ``on_busy="skip"``, the Checkpointer is busy and ``async_op`` is false (with
                ``async_op=True`` the returned handle is skipped instead).
            StateError: The state or ``metadata`` holds something that cannot be saved (names the key),
                or ``metadata`` is not a dict.
            StorageError: Writing failed; earlier checkpoints are untouched.
            CheckpointError: ``async_op`` is not a bool, or ``step`` is not an int of at least 0.
        """
        await self.open()
        if self._closing:
            raise CheckpointError(f"the Checkpointer of {self.root} is closing")
        _check_step(step)
        check_flags(async_op=async_op)
        path = self.path_of(step)
        save_path = path if self._part is None else path / part_dir_name(*self._part)
        try:
            user_metadata = metadata_of(metadata)
            # Distributed: rank 0 checks the target inside the save's collective protocol, so that every
            # rank takes the same decision; here only a step in flight on this rank is refused early.
            if (self._world.size == 1 and step in self._steps) or step in self._inflight:
                raise CheckpointExistsError(f"step {step} already exists (or is being saved) at {path}")
        except CheckpointError as exc:
            await self._abort_unbegun(save_path, exc)
            raise
        slots = self._slots
        assert slots is not None
        if slots.value == 0 and self.on_busy != "wait":
            busy = f"{self.max_inflight} save(s) in flight in {self.root}"
            if self.on_busy == "error":
                raise BusyError(f"cannot save step {step}: {busy}")
            if async_op:
                return SaveHandle._skipped(path=str(path), step=step)
            raise SaveSkippedError(f"skipped the save of step {step}: {busy}")
        # In flight from here, before the first await: a save of the same step made while this one waits
        # for a slot is refused above, and aclose() waits for (or cancels) this one too.
        handle = SaveHandle(path=str(path), step=step)
        self._inflight[step] = handle
        newest = self._steps[-1] if self._steps else None  # committed before this save began
        try:
            with handle._cancellable() as waiting, handle.metrics.waiting():
                await slots.acquire()
        except BaseException as exc:
            self._abandon(handle)
            await self._abort_unbegun(save_path, exc)
            raise
        if waiting.cancelled_caught:  # aclose(cancel=True) while it waited
            self._abandon(handle)
            cancelled = CheckpointCancelledError(f"the save of step {step} was cancelled before it began")
            await self._abort_unbegun(save_path, cancelled)
            raise cancelled
        req = SaveRequest(
            state=state,
            path=save_path,
            part=self._part,
            step=step,
            copy=async_op,
            allow_pickle=self.allow_pickle,
            user_metadata=user_metadata,
            io=self.io,
            settle=self._removals_done,
        )

        ran = False  # the body began: from then on, it gives the slot back itself

        async def body(report: Callable[[SaveState], None]) -> Metadata:
            nonlocal ran
            ran = True
            try:
                meta = await run_save(
                    req, world=self._world, pool=self._pool, metrics=handle.metrics, report=report
                )
                with anyio.CancelScope(shield=True):  # committed: the bookkeeping must follow
                    await self._after_commit(step, newest)
                return meta
            finally:
                self._forget(handle)
                slots.release()

        try:
            if async_op:
                return await start_background(handle, body)
            await handle._drive(body)
        except BaseException as exc:
            if not ran:  # failed before the body began: give the slot back here
                slots.release()
                self._abandon(handle)
                await self._abort_unbegun(save_path, exc)
            raise
        return await handle

    async def _abort_unbegun(self, save: Location, exc: BaseException) -> None:
        """Have the other ranks learn that this rank's save to ``save`` ended before its protocol began.

        Told nothing, their saves would wait for it in their first exchange (see ``unbegun``). This rank
        takes part in the save's exchanges as a failed rank (``exc`` the reason), which ends the save on
        every rank, in the background: there it waits for the saves over the group ahead of it (the one
        in flight, whose slot this one was waiting for), and the caller's error or cancellation is not
        held up. :meth:`wait` and :meth:`aclose` wait for it.
        """
        exchanges = unbegun(self._world, str(save))
        if exchanges is None:
            return
        done = anyio.Event()
        self._aborting.add(done)

        async def take_part() -> None:
            try:
                await abort_unbegun(exchanges, exc)
            finally:
                self._aborting.discard(done)
                done.set()

        with anyio.CancelScope(shield=True):  # (called while the caller's cancellation propagates too)
            await start_soon(take_part)

    def _forget(self, handle: SaveHandle) -> None:
        """Take ``handle`` out of the saves in flight (if a later save of its step has not replaced it)."""
        assert handle.step is not None
        if self._inflight.get(handle.step) is handle:
            del self._inflight[handle.step]

    def _abandon(self, handle: SaveHandle) -> None:
        """End ``handle``, whose save never ran, as cancelled (whoever waits for it, aclose say, goes on)."""
        self._forget(handle)
        handle._finish(SaveState.CANCELLED)

    @insulated
    async def reserve(self, state: Mapping[str, object]) -> int:
        """Allocate now the staging memory that ``save(state, async_op=True)`` will copy into, and keep it.

        A Checkpointer's first ``async_op=True`` save allocates its staging buffer, and new memory is
        slow to fill: the first write to each page faults (on a VM twice), and page-locking it for the
        copies from a GPU takes longer still (2.1 GiB: 1.3 s on an H100 machine). Call this once the
        state exists, before the training loop say, to pay that there: the buffer is kept as if a save
        had given it back (counted in ``staging_budget``), and the next save of this state, or of a
        smaller one, copies into it. Nothing is allocated when a kept buffer already fits.

        Returns:
            The bytes such a save stages (0 when it copies nothing).

        Raises:
            StateError: The state holds something that cannot be saved (names the key).
            BusyError: ``staging_budget`` cannot hold the buffer (ever, or now with ``on_busy`` other
                than ``"wait"``).
            CheckpointError: The Checkpointer is closed (or closing).
        """
        await self.open()
        if self._closing:
            raise CheckpointError(f"the Checkpointer of {self.root} is closing")
        return await run_reserve(state, pool=self._pool, allow_pickle=self.allow_pickle, io=self.io)

    async def _after_commit(self, step: int, newest: int | None = None) -> None:
        """Index the committed ``step``, update ``latest`` and prune.

        ``newest`` is the newest step committed when the save began: it tells the save of a step older
        than those already there from two saves in flight that committed out of order.
        """
        path = self.path_of(step)
        if (
            self._part is not None
            and isinstance(path, Path)
            and not await run_sync(lambda: is_checkpoint(path))
        ):
            return  # collective-free: the rank that publishes the last part completes the step
        # Saves may commit concurrently (max_inflight > 1): one at a time updates `latest` and prunes,
        # each from the index as it is when its turn comes. The step joins the index under the lock
        # too, so that a refresh listing the root meanwhile cannot drop it again (see refresh).
        assert self._commit_lock is not None
        async with self._commit_lock:
            self._steps = sorted({*self._steps, step})
            try:
                await self._publish_and_prune()
            except Exception as exc:
                # The step is committed and stays so: `latest` is written again, and what retention
                # left is pruned, after the next commit (or collected by the next open).
                warn_at_caller(
                    f"step {step} is committed in {self.root}, but updating `latest` or pruning older "
                    f"steps failed: {exc}",
                    RuntimeWarning,
                )
                return
            if step not in self._steps and newest is not None and step < newest:
                # Retention took out the step just committed: deliberate (it keeps the newest steps,
                # whatever order they came in), but the save returns normally and loads go on finding
                # the newer steps, so say so, where the step was older than one committed before its
                # save began (a run counting from 1 again). Saves of one run in order of steps get
                # here only when two in flight commit out of order (a large step 1 after a small step
                # 2), which is no mistake: no word then.
                warn_at_caller(
                    f"step {step} was deleted from {self.root} at once, by retention, right after its "
                    f"save committed it: retention ({self._retention_text()}) keeps steps "
                    f"{_steps_text(self._steps)}, and step {step} is older. A run that numbers its steps "
                    "from the start again needs a root of its own",
                    RuntimeWarning,
                )

    def _retention_text(self) -> str:
        """``keep_last=2, keep_every=100``, the retention settings, for messages."""
        text = f"keep_last={self.keep_last}"
        return text if self.keep_every is None else f"{text}, keep_every={self.keep_every}"

    async def _publish_and_prune(self) -> None:
        steps = list(self._steps)
        doomed = self._doomed(steps)
        if self._world.rank != 0:  # rank 0 publishes and prunes; the others only follow in their index
            self._steps = [s for s in self._steps if s not in doomed]
            return
        root = self.root
        if isinstance(root, S3Path):
            from ._storage._s3 import committed, get, put, remove

            failed: Exception | None = None
            try:
                # Forward only, as publish_newer: another writer of this root may have committed a newer
                # step than this index knows. (Read, then put: a put between the two may still be undone;
                # an object store offers no compare-and-swap here.)
                raw = await get(root, LATEST)
                current = None if raw is None else _latest_step(raw)
                moves = _moves_latest(current, steps[-1])
                if moves is None and current is not None:
                    moves = not await committed(root / step_dir_name(current))
                if moves:
                    await put(root, LATEST, _latest_bytes(steps[-1]), create=False)
            except StorageError as exc:  # retention goes on without it (see publish_newer)
                failed = exc
            for s in doomed:
                # The manifest goes first: the step stops being a checkpoint at once, and a crash
                # mid-way leaves an uncommitted prefix that a later open collects.
                await remove(root / step_dir_name(s))
            self._steps = [s for s in self._steps if s not in doomed]
            if failed is not None:
                raise failed
            return

        # `latest` only moves forward: another writer of this root (a Checkpointer in another process,
        # or every rank completing a collective-free step) may have committed a step newer than this
        # index knows, and a save of an older one committing after it must not name its own.
        collective_free = self._part is not None
        trash, failed = await run_sync(
            partial(publish_newer, root, steps[-1], doomed, locked=collective_free)
        )
        self._steps = [s for s in self._steps if s not in doomed]
        if trash:
            await self._remove_later(trash)
        if failed is not None:
            raise failed

    async def _remove_later(self, trash: list[Path]) -> None:
        """Remove the trees of steps retention took out of the root (renamed away), in the background.

        A save's handle does not wait for it: unlinking a large file can take long (2 GiB: 0.24-0.28 s
        on this project's ext4, mounted with ``discard``; longer on network file systems), and the step
        is already gone for every reader. The next save waits for it before it writes (it may need the
        space), as :meth:`wait` and :meth:`aclose` do. A tree left behind (a failure, the loop ending) is
        temp data that the next open collects.
        """
        before, done = self._removed, anyio.Event()
        self._removed = done

        async def remove() -> None:
            try:
                if before is not None:
                    await before.wait()  # one removal at a time: the device is the bottleneck
                await run_sync(partial(_remove_trees, trash))
            except Exception as exc:
                warnings.warn(
                    f"removing steps that retention deleted from {self.root} failed (the next open "
                    f"collects what is left): {exc}",
                    RuntimeWarning,
                    stacklevel=1,
                )
            finally:
                done.set()

        await start_soon(remove)

    async def _removals_done(self) -> None:
        """Wait until the steps retention deleted are removed (see :meth:`_remove_later`)."""
        if self._removed is not None:
            await self._removed.wait()

    def _doomed(self, steps: list[int]) -> list[int]:
        return doomed_steps(
            steps, keep_last=self.keep_last, keep_every=self.keep_every, protect=self._loading
        )

    # --- Loading ----------------------------------------------------------------------------------------

    async def _resolve(self, step: int | None) -> int | None:
        if step is not None:
            _check_step(step)  # (True is no step 1, nor "1" step 1)
        await self.refresh()
        if step is None:
            return self.latest_step()
        if step not in self._steps:
            raise CheckpointNotFoundError(f"step {step} is not a committed checkpoint in {self.root}")
        return step

    @insulated
    async def load(
        self, state: MutableMapping[str, Any], *, step: int | None = None, strict: bool = True
    ) -> int | None:
        """Load checkpoint ``step`` (default: the latest committed one) into ``state`` in place.

        If another process's retention deletes the latest step while it is being loaded, the load fails
        before touching ``state`` (every data file is opened before the first byte lands) and is retried
        with the new latest step.

        Per-rank state (values that the ranks of a distributed save held differently under one key,
        such as each rank's RNG state) is loaded as this rank saved it, its rank in this Checkpointer's
        group (with ``use_collectives=False``, the rank of its parts): a key that only other ranks saved
        is missing from the checkpoint for this rank (a strict load reports it).

        Returns:
            The step loaded, or ``None`` when there is no committed checkpoint (``state`` is untouched).

        Raises:
            CheckpointNotFoundError: ``step`` is not committed, or was deleted (by another process's
                retention) while being loaded; ``state`` is untouched then.
            CorruptionError: Stored bytes fail verification (names the key and file).
            StateMismatchError: ``strict`` and the target differs; nothing was loaded.
            StateError: This rank has no item of a list or tuple saved per rank (a checkpoint of a
                smaller world); names the key. Or ``state`` is not a mutable mapping (nothing was read).
                Or a Stateful's ``load_state_dict`` raised, leaving ``state`` as :func:`aiockpt.load`
                says.
            CheckpointError: ``step`` is neither ``None`` nor an int of at least 0.
        """
        check_flags(strict=strict)
        check_target(state)

        async def run(path: Location) -> None:
            await run_load(
                state, path, strict=strict, allow_pickle=self.allow_pickle, io=self.io, rank=self._rank
            )

        done = await self._with_step(step, run)
        return None if done is None else done[0]

    @property
    def _rank(self) -> int:
        """This process's rank in the world of its saves, whose per-rank state its loads read (once open).

        That of its group, or with ``use_collectives=False`` the rank its parts are saved as; 0 alone.
        """
        return self._world.rank if self._part is None else self._part[0]

    async def _with_step(
        self, step: int | None, run: Callable[[Location], Awaitable[T]]
    ) -> tuple[int, T] | None:
        """``run(path)`` on checkpoint ``step`` (``None``: the latest); the step and what ``run`` returned.

        ``None`` when ``step`` is ``None`` and nothing is committed. While ``run`` goes on, this
        Checkpointer's own retention leaves the step alone; another process's may delete it. ``run``
        opens every data file before it hands out a byte, so a step that vanished under it made it fail
        (the files or the manifest missing) without effect: with ``step`` ``None`` it is run again on the
        new latest step, up to ``_LOAD_ATTEMPTS`` times.

        Raises:
            CheckpointNotFoundError: ``step`` is not committed, or vanished under ``run`` (each time).
        """
        for attempt in range(_LOAD_ATTEMPTS):
            chosen = await self._resolve(step)
            if chosen is None:
                return None
            path = self.path_of(chosen)
            self._loading[chosen] = self._loading.get(chosen, 0) + 1
            try:
                return chosen, await run(path)
            except (CheckpointNotFoundError, CorruptionError) as exc:
                # Another process's retention may delete a step while we start reading it (a missing
                # data file reads as corruption): only a step that is still there is really damaged.
                if await exists(path):
                    raise
                if step is not None or attempt == _LOAD_ATTEMPTS - 1:
                    raise CheckpointNotFoundError(
                        f"step {chosen} was deleted from {self.root} while loading it (retention by "
                        "another process?); nothing was loaded"
                    ) from exc
            finally:
                self._loading[chosen] -= 1
                if not self._loading[chosen]:
                    del self._loading[chosen]
        raise AssertionError("unreachable")

    async def watch(self, *, poll_interval: float = 1.0, coalesce: bool = True) -> AsyncGenerator[int, None]:
        """Yield steps as they are committed, by this process or any other (a learner), forever.

        The directory is polled (a listing every ``poll_interval`` seconds, in a worker thread) rather
        than watched with inotify: polling works the same on local disks, NFS and other shared file
        systems where change notifications are missing or unreliable, and needs no dependency. Steps
        committed before the watch starts are not yielded; it starts with the first iteration (the
        first ``anext``), as an async generator's code does, not when ``watch()`` is called. So an actor
        should load the newest step itself once it has begun iterating, or after the first step yielded.

        Each step is yielded once, when a listing first shows it: also a step committed after a newer
        one (two saves in flight, several writers), which a comparison with the newest step yielded
        would miss. A root that vanished (removed to start a run afresh) is waited for: its steps are
        yielded once it is back. A local root made afresh (another directory under the same path, seen
        missing or not) holds new checkpoints, whatever their numbers: its steps count as new; so do the
        steps of a root whose newest step is older than the newest seen before (a run begun afresh in
        the same directory, or in one that got the old one's inode number). (An S3 root has no identity:
        a step number saved again there, after the old one's deletion, is yielded only if some listing
        saw it missing in between, or the newest step went back.)

        Args:
            poll_interval: Seconds between listings.
            coalesce: When several steps appeared between two listings, yield only the newest, and only
                when it is the newest committed step (what an actor that hot-loads weights wants); with
                ``False``, yield each, oldest first.

        Raises:
            StorageError: ``root`` cannot be listed (but for its being missing, which is waited out).
            CheckpointError: ``poll_interval`` is not a positive number of seconds, or ``coalesce`` is not
                a bool (at the first step).
        """
        if not (isinstance(poll_interval, (int, float)) and poll_interval > 0):  # (0 or nan: a busy loop)
            raise CheckpointError(f"poll_interval must be positive seconds, not {poll_interval!r}")
        check_flags(coalesce=coalesce)
        # Every step of the last listing: a step is new when it is not among them. (Forgetting the steps
        # that retention removed keeps this as small as the root; a step of that number saved again
        # later, in a root made afresh say, is a new checkpoint and is yielded.)
        # A root missing at the start (being made afresh) has no steps yet: all it will have are new.
        first = await self._listing()
        known, root = (set(first[0]), first[1]) if first is not None else (set(), None)
        while True:
            await anyio.sleep(poll_interval)
            found = await self._listing()
            if found is None:  # the root is gone: what comes back in its place holds new checkpoints
                known, root = set(), None
                continue
            listed, identity = found
            # Another directory (a run begun afresh) holds new steps; so does a root whose newest step is
            # older than the newest known (retention never deletes the newest): the same path, removed
            # and made again between two listings, whose directory got the old one's inode number.
            if identity != root or (listed and known and listed[-1] < max(known)):
                known, root = set(), identity
            fresh = [s for s in listed if s not in known]
            known = set(listed)
            if coalesce:
                fresh = fresh[-1:] if fresh and fresh[-1] == listed[-1] else []
            for s in fresh:
                yield s

    async def _listing(self) -> tuple[list[int], tuple[int, int] | None] | None:
        """The committed steps (see :meth:`refresh`) and the root's identity; ``None`` while it is missing.

        The identity of a local root is its directory's device and inode, taken before the listing: a
        root removed and made again is another directory. An S3 root has none (``None``).

        Raises:
            StorageError: ``root`` cannot be listed for another reason.
        """
        root = self.root
        identity: tuple[int, int] | None = None
        try:
            if isinstance(root, Path):
                with contextlib.suppress(OSError):  # (but its absence: the listing says what is wrong)
                    st = await run_sync(partial(os.stat, root))
                    identity = (st.st_dev, st.st_ino)
            return await self.refresh(), identity
        except StorageError as exc:
            if not isinstance(exc.__cause__, FileNotFoundError):
                raise
            return None

    @insulated
    async def read(self, step: int | None = None) -> dict[Key, object]:
        """Read checkpoint ``step`` (default: the latest) as a fresh tree of CPU tensors.

        Like :meth:`load`, a read of the latest step that another process's retention deletes under it
        is retried with the new latest step. Per-rank state is this rank's, as :meth:`load` reads it: a
        key that only other ranks saved is absent.

        Raises:
            CheckpointNotFoundError: ``step`` is not committed, or there is no checkpoint at all, or it
                was deleted (by another process's retention) while being read.
            CorruptionError: Stored bytes fail verification (names the key and file).
            StateError: This rank has no item of a list or tuple saved per rank (a checkpoint of a
                smaller world); names the key.
            CheckpointError: ``step`` is neither ``None`` nor an int of at least 0.
        """

        async def run(path: Location) -> dict[Key, object]:
            return await run_read(path, allow_pickle=self.allow_pickle, io=self.io, rank=self._rank)

        done = await self._with_step(step, run)
        if done is None:
            raise CheckpointNotFoundError(f"no committed checkpoint in {self.root}")
        return done[1]

    @insulated
    async def metadata(self, step: int | None = None) -> Metadata:
        """The :class:`Metadata` of checkpoint ``step`` (default: the latest), from its manifest alone.

        Its ``user_metadata`` is the ``metadata=`` the step was saved with: to choose a step by a value
        saved with it (an evaluation loss, say) without loading any. See :func:`aiockpt.read_metadata`.

        Raises:
            CheckpointNotFoundError: ``step`` is not committed, or there is no checkpoint at all.
            CorruptionError: The manifest's checksum does not match (names the file).
            CheckpointError: ``step`` is neither ``None`` nor an int of at least 0.
        """
        done = await self._with_step(step, run_metadata)
        if done is None:
            raise CheckpointNotFoundError(f"no committed checkpoint in {self.root}")
        return done[1]

    # --- Closing ----------------------------------------------------------------------------------------

    @insulated
    async def wait(self) -> None:
        """Wait until every save in flight has ended (whatever its outcome).

        Also until the steps retention deleted are removed from the disk (which goes on in the background,
        after the save that deleted them has returned).

        Raises:
            CheckpointError: Another event loop, still running, uses this Checkpointer.
        """
        self._check_loop()
        while self._inflight or self._aborting or (self._removed is not None and not self._removed.is_set()):
            if not self._inflight and self._aborting:
                await next(iter(self._aborting)).wait()
                continue
            if not self._inflight:
                assert self._removed is not None
                await self._removed.wait()
                continue
            handle = next(iter(self._inflight.values()))
            with contextlib.suppress(Exception):  # its outcome is its caller's (``await handle``)
                await handle
            self._forget(handle)  # if it ended without reaching its own clean-up

    @insulated
    async def aclose(self, *, cancel: bool = False) -> None:
        """Wait for the saves in flight (or cancel them with ``cancel=True``), then free staging buffers.

        Saves called before still run (or, with ``cancel=True``, are cancelled, also those still waiting
        for an in-flight slot); a save called once closing has begun raises :class:`CheckpointError`.

        Raises:
            CheckpointError: Another event loop, still running, uses this Checkpointer, or ``cancel`` is not
                a bool (also once closed).
        """
        check_flags(cancel=cancel)
        if self._closed:
            return
        self._check_loop()
        self._closing = True
        try:
            if cancel:
                for handle in list(self._inflight.values()):
                    handle.cancel()
            with anyio.CancelScope(shield=True):
                await self.wait()
        finally:
            self._closed = True
            with anyio.CancelScope(shield=True):
                await run_sync(self._pool.close)
