"""Leases: which process owns the objects of an uncommitted save on S3, and whether it is gone.

A file system tells a live writer from a dead one by a lock the kernel drops when its holder dies (see
``_fs.OwnerLock``). An object store holds no locks, so a save holds a lease instead:

- The coordinator makes a token for the save (:func:`new_token`) that every object of the save carries
  in its name: ``data-rNNNNN-<token>.bin`` for each rank's data, ``lease-<token>.json`` for the lease.
  Racing saves of one prefix therefore never write, nor delete, each other's objects.
- It puts the lease before any rank uploads a byte, renews it every ``lease_timeout / 8`` while the save
  runs (a task of the save, cancelled with it), marks it ``committing`` just before the manifest put, and
  deletes it once the manifest is in place, or after the save's data when the save fails. A save's data
  objects therefore never exist without its lease until the save is over.
- The lease names its owner (:class:`Owner`): host name, boot id, PID namespace, PID and the process's
  start time, and the ``timeout`` it promises to renew within.

Another process counts a save as abandoned when:

- it has no lease: it is over (the lease goes only after its manifest, or after its own data);
- its owner ran in this host's PID namespace (same boot id, same namespace) and that process is gone (no
  such PID, a zombie, or a PID reused by a process that started at another time), unless the lease says
  it was committing: a manifest put still in flight when its process died may land afterwards, and must
  not find its data deleted. A new save of that prefix goes on beside such a save instead (their objects
  have different names, and the create-only manifest put lets one of them commit), and deletes its
  objects once its own manifest is in place, which the late one can then never replace;
- its lease was not renewed for the ``timeout`` it states.

Objects of no save's token (written by releases before leases) are abandoned once older than
``S3Options.stale_after``. A prefix that holds a manifest is committed: no judge collects anything in it
(stray objects of a losing save there go with the step, when retention deletes it), and only the save
that committed it deletes the objects of the dead committing saves it went on beside.

Ages are measured with the server's clock, never by comparing the local clock with LastModified: a probe
object put beside the prefix gives the server's time (its LastModified), which the local monotonic clock
then advances (re-probed every 10 minutes). The clock is read before the lease is fetched, so an age is
never overestimated; where a store keeps whole seconds (S3 does), an age comes out up to 2 s short.

A save may commit only while its lease cannot have expired: a renewal that ends more than
``lease_timeout / 2`` after the previous one was sent marks the lease lapsed, and the commit (whose first
step is a renewal) then fails instead. A collector waits the whole ``lease_timeout``, which leaves the
manifest put at least the other half, and the renewals go on while it runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import socket
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from functools import partial
from typing import TYPE_CHECKING, Annotated

import anyio
import msgspec

from .._errors import StorageError
from .._format import MANIFEST_NAME
from .._threads import run_sync
from .._version import __version__
from ._s3 import committed, delete, fetch, head, listing, put, store

if TYPE_CHECKING:
    from anyio.abc import TaskStatus
    from obstore import ObjectMeta

    from . import S3Path

_DATA = re.compile(r"data-r\d{5,}-(?P<token>[0-9a-f]+)\.bin")
_LEASE = re.compile(r"lease-(?P<token>[0-9a-f]+)\.json")
CLOCK_PREFIX = ".aiockpt-clock-"
_CLOCK_TTL = 600.0  # seconds a server clock reading is advanced by the local monotonic clock


def new_token() -> str:
    """A new save's token: 64 random bits, in hex."""
    return uuid.uuid4().hex[:16]


def lease_name(token: str) -> str:
    """The name of the lease object of the save of ``token``."""
    return f"lease-{token}.json"


class Owner(msgspec.Struct, frozen=True, kw_only=True):
    """The content of a lease object: the process that runs the save, and the terms of its lease.

    ``boot``, ``pid_ns`` and ``start`` are ``None`` where the host does not tell them (not Linux); such an
    owner is judged by its lease's age alone.
    """

    host: str
    boot: str | None = None
    pid_ns: str | None = None
    pid: Annotated[int, msgspec.Meta(gt=0)]
    start: int | None = None
    timeout: Annotated[float, msgspec.Meta(gt=0)]
    committing: bool = False
    version: str = ""


_ENCODER = msgspec.json.Encoder()
_DECODER = msgspec.json.Decoder(Owner)


# --- Processes -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Host:
    """Where a process runs, as far as telling whether a PID is the same process goes."""

    boot: str | None
    pid_ns: str | None


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return f.read()
    except OSError:
        return None


def _state(stat: str | None) -> tuple[str, int] | None:
    """(state, start time in clock ticks after boot) from the text of ``/proc/<pid>/stat``, if it parses."""
    if stat is None:
        return None
    fields = stat.rpartition(")")[2].split()  # the command name, in parentheses, may hold anything
    try:
        return fields[0], int(fields[19])
    except (IndexError, ValueError):
        return None


def _this_host() -> _Host:
    """This host's boot id and this process's PID namespace (``None`` where unknown). Blocking.

    The namespace is known only where ``/proc`` is this namespace's own (it names this process by the PID
    ``os.getpid`` gives): a ``/proc`` of another namespace would show other processes under those PIDs.
    """
    boot = _read("/proc/sys/kernel/random/boot_id")
    stat = _read("/proc/self/stat")
    pid_ns: str | None = None
    if stat is not None and stat.split(" ", 1)[0] == str(os.getpid()):
        with contextlib.suppress(OSError):
            pid_ns = os.readlink("/proc/self/ns/pid")
    return _Host(boot.strip() if boot else None, pid_ns)


def owner(timeout: float) -> Owner:
    """This process as the owner of a lease of ``timeout`` seconds. Blocking."""
    here = _this_host()
    state = _state(_read("/proc/self/stat")) if here.pid_ns is not None else None
    return Owner(
        host=socket.gethostname(),
        boot=here.boot,
        pid_ns=here.pid_ns,
        pid=os.getpid(),
        start=None if state is None else state[1],
        timeout=timeout,
        version=__version__,
    )


def gone(who: Owner, here: _Host) -> bool:
    """Whether ``who``'s process has certainly ended. Blocking.

    Only an owner in ``here``'s PID namespace can be looked up: a PID means nothing on another host, or in
    another container of this one. Where the process cannot be seen (another user's, under ``hidepid``),
    it is taken to run.
    """
    if who.boot is None or who.pid_ns is None or who.start is None:
        return False
    if who.boot != here.boot or who.pid_ns != here.pid_ns:
        return False
    try:
        os.kill(who.pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        pass  # (PermissionError: another user's process, which exists)
    found = _state(_read(f"/proc/{who.pid}/stat"))
    if found is None:
        return False
    state, start = found
    # A zombie has ended (its parent has yet to reap it); another start time is another process.
    return state in ("Z", "X") or start != who.start


# --- The server's clock ----------------------------------------------------------------------------------

# Per client: (a lower bound of the server's time at ``mono``, ``mono``), local monotonic seconds.
_clocks: dict[int, tuple[float, float]] = {}


def _grain(stamp: datetime) -> float:
    """The resolution of a store's timestamps, as far as ``stamp`` tells: S3 keeps whole seconds."""
    return 1.0 if stamp.microsecond == 0 else 0.0


async def server_now(path: S3Path) -> float:
    """A lower bound of the server's clock now (seconds since the epoch), for ages of objects near ``path``.

    Measured by putting a probe object beside ``path`` (``.aiockpt-clock-<hex>``, deleted at once):
    its LastModified is at most the server's time when the put returned, from which the local monotonic
    clock counts on.

    Raises:
        StorageError: The probe could not be put or read.
    """
    key = id(store(path))  # (clients are cached for the process: the id stays theirs)
    cached = _clocks.get(key)
    mono = time.monotonic()
    if cached is None or mono - cached[1] > _CLOCK_TTL:
        where = path.parent
        name = f"{CLOCK_PREFIX}{uuid.uuid4().hex}"
        try:
            await put(where, name, b"", create=False)
            returned = time.monotonic()
            meta = await head(where, name)
        finally:
            with anyio.CancelScope(shield=True), contextlib.suppress(StorageError):
                await delete(where, [(where / name).key])
        if meta is None:
            raise StorageError(f"the clock probe {where / name} vanished before it was read", path=str(where))
        cached = _clocks[key] = (meta["last_modified"].timestamp(), returned)
    server, at = cached
    return server + (time.monotonic() - at)


def age(stamp: datetime, now: float) -> float:
    """A lower bound of the age of a LastModified ``stamp``, given a lower bound of the server's time."""
    return now - stamp.timestamp() - _grain(stamp)


# --- Judging the objects under a prefix ------------------------------------------------------------------


@dataclass
class Objects:
    """The objects under one checkpoint prefix, sorted by the save that wrote them.

    Attributes:
        committed: The prefix holds a manifest.
        leases: Per save token, its lease object.
        data: Per save token, the keys of its data objects.
        other: Objects of no save's token: written by a release that took no lease, or unknown.
        nested: Objects under deeper prefixes (``step-00000001/manifest.msgpack``): no save writes
            there, so they belong to something else (a Checkpointer's root, checkpoints saved under it).
    """

    committed: bool = False
    leases: dict[str, ObjectMeta] = field(default_factory=dict)
    data: dict[str, list[str]] = field(default_factory=dict)
    other: list[ObjectMeta] = field(default_factory=list)
    nested: list[ObjectMeta] = field(default_factory=list)

    def add(self, name: str, meta: ObjectMeta) -> None:
        """Sort in the object ``meta``, called ``name`` under the prefix."""
        if "/" in name:
            self.nested.append(meta)
        elif name == MANIFEST_NAME:
            self.committed = True
        elif (m := _LEASE.fullmatch(name)) is not None:
            self.leases[m["token"]] = meta
        elif (m := _DATA.fullmatch(name)) is not None:
            self.data.setdefault(m["token"], []).append(meta["path"])
        else:
            self.other.append(meta)

    def empty(self) -> bool:
        """Whether the prefix holds nothing at all."""
        return not (self.committed or self.leases or self.data or self.other or self.nested)


async def objects(path: S3Path) -> Objects:
    """The objects under ``path``, sorted.

    Raises:
        StorageError: The listing failed.
    """
    found = Objects()
    base = len(path.key) + 1
    for meta in await listing(path):
        found.add(meta["path"][base:], meta)
    return found


async def children(root: S3Path) -> dict[str, Objects]:
    """The prefixes one level under ``root`` (by name), with their objects sorted.

    Raises:
        StorageError: The listing failed.
    """
    found: dict[str, Objects] = {}
    base = len(root.key) + 1
    for meta in await listing(root):
        name, slash, rest = meta["path"][base:].partition("/")
        if slash:  # (not an object right under the root: ``latest``, a clock probe)
            found.setdefault(name, Objects()).add(rest, meta)
    return found


@dataclass(frozen=True)
class Cleared:
    """What :func:`clear` found under a prefix.

    Attributes:
        committed: The prefix holds a checkpoint (nothing was deleted).
        live: Why each save that may still run there counts as live (nothing of it was deleted).
        beside: The keys (lease first) of each save whose process died while it committed: nothing of it
            was deleted, since its manifest put may still land and would then refer to them. A new save
            may go on beside it (the create-only manifest put lets one of the two commit), and deletes
            them once its own manifest is in place, which theirs can then never replace.
        removed: How many abandoned saves' objects were deleted.
        nested: The key of an object under a deeper prefix, if there is one: never deleted, and no place
            for a save (see :attr:`Objects.nested`).
    """

    committed: bool = False
    live: tuple[str, ...] = ()
    beside: tuple[tuple[str, ...], ...] = ()
    removed: int = 0
    nested: str | None = None


def _seconds(value: float) -> str:
    return f"{value:.0f} s" if value >= 10 else f"{value:.1f} s"


async def clear(path: S3Path, *, strict: bool) -> Cleared:
    """Delete the objects of the abandoned saves under the uncommitted prefix ``path``; say what is left.

    Never deletes anything under a committed prefix or one that holds deeper prefixes (see
    :attr:`Objects.nested`), nor any object of a save that may still run or whose manifest may still
    land (see the module docstring and :attr:`Cleared.beside`). With ``strict``,
    failing to read the server's clock is an error; without, saves whose age decides are then left alone
    (a client that may not write cannot put the probe).

    Raises:
        StorageError: A request failed.
    """
    found = await objects(path)
    if found.committed or found.empty():
        return Cleared(committed=found.committed)
    if found.nested:  # something else's prefix (a Checkpointer's root): nothing here is judged, or deleted
        return Cleared(nested=found.nested[0]["path"])
    now: float | None = None
    try:
        now = await server_now(path)
    except StorageError:
        if strict:
            raise
    # Listed again after the clock was read: every LastModified is then at least as recent as that reading.
    found = await objects(path)
    if found.committed:
        return Cleared(committed=True)
    dead: list[list[str]] = []  # per abandoned save: its keys, the lease first
    live: list[str] = []
    leases: dict[str, tuple[bytes, ObjectMeta]] = {}
    for token in found.leases:
        got = await fetch(path, lease_name(token))
        if got is not None:  # (gone since the listing: the save is over, as if it had none)
            leases[token] = got
    owners: dict[str, Owner | None] = {}
    for token, (raw, _) in leases.items():
        try:
            owners[token] = _DECODER.decode(raw)
        except msgspec.DecodeError:
            owners[token] = None  # not a lease this release can read: judged by stale_after
    here = await run_sync(_this_host)
    ended = await run_sync(lambda: {t for t, o in owners.items() if o is not None and gone(o, here)})
    beside: list[list[str]] = []
    for token in sorted(set(found.data) | set(found.leases)):
        keys = found.data.get(token, [])
        lease_key = (path / lease_name(token)).key
        who = owners.get(token)
        if token not in leases or (token in ended and who is not None and not who.committing):
            dead.append([lease_key, *keys])
            continue
        timeout = path.options.stale_after if who is None else who.timeout
        stamp = leases[token][1]["last_modified"]
        seen = None if now is None else age(stamp, now)
        if seen is not None and seen > timeout:
            dead.append([lease_key, *keys])
            continue
        if token in ended:  # (committing): its manifest put may land yet, but nothing else of it will
            beside.append([lease_key, *keys])
            continue
        whose = "an unreadable lease" if who is None else f"pid {who.pid} on host {who.host!r}"
        if who is not None and who.committing:
            whose += ", committing"
        when = "its age is unknown" if seen is None else f"renewed {_seconds(max(seen, 0.0))} ago"
        live.append(
            f"a save by {whose}: its lease {lease_key} was {when}, and it counts as abandoned "
            f"{_seconds(timeout)} after its last renewal or once its process is gone"
        )
    if found.other:
        newest = max((m["last_modified"] for m in found.other), key=lambda s: s.timestamp())
        seen = None if now is None else age(newest, now)
        if seen is not None and seen > path.options.stale_after:
            dead.append([m["path"] for m in found.other])
        else:
            when = "of unknown age" if seen is None else f"written {_seconds(max(seen, 0.0))} ago"
            live.append(
                f"objects without a lease, {when} (in progress elsewhere, or abandoned: they count as "
                f"abandoned once older than S3Options.stale_after={path.options.stale_after:g} s)"
            )
    if found.nested:  # (appeared since the first listing)
        return Cleared(nested=found.nested[0]["path"])
    done = Cleared(live=tuple(live), beside=tuple(tuple(keys) for keys in beside))
    if not dead:
        return done
    # A save whose lease went since the listing may have gone because it committed (the lease goes after
    # the manifest): the manifest is looked for after every judgement, so that it is found.
    if await committed(path):
        return Cleared(committed=True)
    for keys in dead:
        await remove_save(path, keys)
    return dataclasses.replace(done, removed=len(dead))


async def remove_save(path: S3Path, keys: Sequence[str]) -> None:
    """Delete the objects of one save under ``path``: ``keys``, its lease first.

    From the lease's deletion on the save has none, which every later judge takes as over.

    Raises:
        StorageError: A request failed.
    """
    await delete(path, keys[:1])
    await delete(path, keys[1:])


# --- Holding a lease -------------------------------------------------------------------------------------


class Lease:
    """The lease of one running save, held by its coordinator (see the module docstring).

    :meth:`take` puts it; :meth:`keep` (a task) renews it until :meth:`stop`; :meth:`committing` is the
    commit's first step; :meth:`drop` deletes it.

    Attributes:
        token: The save's token.
        timeout: Seconds the lease may go unrenewed before others count the save as abandoned.
        lapsed: A renewal ended more than ``timeout / 2`` after the previous one was sent: the server's copy
            may have looked expired meanwhile, and the save must not commit.
    """

    def __init__(self, path: S3Path, token: str) -> None:
        self.path = path
        self.token = token
        self.name = lease_name(token)
        self.timeout = path.options.lease_timeout
        self.lapsed = False
        self._owner: Owner | None = None
        self._sent: float | None = None  # monotonic time the last renewal that succeeded was sent
        self._lock = anyio.Lock()  # one put at a time: the last one that returned is the server's copy
        self._stopping = anyio.Event()
        self._nap: anyio.CancelScope | None = None
        self._ended: anyio.Event | None = None

    async def take(self) -> None:
        """Put the lease, create-only (the token is new).

        Raises:
            StorageError: The put failed.
        """
        self._owner = await run_sync(partial(owner, self.timeout))
        await self._renew(create=True)

    async def _renew(self, *, create: bool = False) -> None:
        assert self._owner is not None
        async with self._lock:
            sent = time.monotonic()
            try:
                await put(self.path, self.name, _ENCODER.encode(self._owner), create=create)
            except FileExistsError as exc:  # (64 random bits: never, in practice)
                raise StorageError(f"the lease {self.path / self.name} exists already") from exc
            # Until this put landed the server's copy was the previous one: it was at most this old.
            if self._sent is not None and time.monotonic() - self._sent > self.timeout / 2:
                self.lapsed = True
            self._sent = sent

    async def keep(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Renew the lease every ``timeout / 8`` until :meth:`stop`; run it with ``TaskGroup.start``.

        A failed renewal is not raised: the next one may succeed, and one too late marks the lease lapsed.
        """
        self._ended = anyio.Event()
        try:
            task_status.started()
            while not self._stopping.is_set():
                with anyio.CancelScope() as self._nap:
                    await anyio.sleep(self.timeout / 8)
                if self._stopping.is_set():
                    break
                # Shielded: a renewal in flight when the save is cancelled lands before stop() returns,
                # so that it cannot put the lease back after the save deleted it.
                with anyio.CancelScope(shield=True), contextlib.suppress(StorageError):
                    await self._renew()
        finally:
            self._ended.set()

    async def committing(self) -> None:
        """Mark the lease as committing: the last step before the manifest put.

        Raises:
            StorageError: The lease lapsed (another process may have deleted this save's objects
                meanwhile), or the put failed.
        """
        assert self._owner is not None
        self._owner = msgspec.structs.replace(self._owner, committing=True)
        await self._renew()
        if self.lapsed:
            raise StorageError(
                f"the lease {self.path / self.name} of this save went unrenewed for more than "
                f"lease_timeout / 2 = {_seconds(self.timeout / 2)}; not committing, since another process "
                "may have taken the save for abandoned and deleted its objects",
                path=str(self.path),
            )

    async def stop(self) -> None:
        """Stop the renewals; return once none is in flight. Call shielded."""
        self._stopping.set()
        if self._nap is not None:
            self._nap.cancel()
        if self._ended is not None:
            await self._ended.wait()

    async def drop(self) -> None:
        """Delete the lease object (after :meth:`stop`).

        Raises:
            StorageError: The request failed.
        """
        await delete(self.path, [(self.path / self.name).key])
