"""The collective protocol of one save: three or four all-gathers that every rank takes part in.

    plan     after staging     every rank's local plan (rank 0's also names the temp directory) and a
                               digest of its state's structure and small values
    trees    only when digests differ: every rank's tree and tensor signatures (per-rank state)
    vote     after writing     every rank's checksums, or why it failed
    outcome  after the commit  rank 0 says whether the checkpoint was published

Saves over one checkpoint group (two Checkpointers on one process group, say) take their exchanges one
save at a time, in the order the saves began on this rank (see :class:`_Turns`): so on every rank, when
each began its saves in the same order. Each save is named in its exchanges by its full path, so ranks
that meet in different saves (begun in other orders, or to other paths) fail instead of mixing them.

Whether ``trees`` takes place follows from the statuses of ``plan``, which every rank sees alike, so every
rank skips it or takes part in it. A rank that fails or is cancelled still takes part in every remaining
exchange, with a failed status (shielded from cancellation), so no rank waits for it until a timeout and
every rank learns the save was aborted. A failure reported in ``plan`` or ``trees`` (nothing is written
yet) ends the protocol there for everyone.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import weakref
from functools import partial

import anyio
import msgspec

from .._errors import CheckpointError, DistributedError
from .._format import ENCODER
from .._threads import run_sync
from .._world import World

STEPS = ("plan", "trees", "vote", "outcome")
# A failure reported in one of these ends the protocol: no rank has written anything yet.
_ENDING = frozenset({"plan", "trees"})


class Status(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """One rank's contribution to an exchange."""

    ok: bool
    error: str = ""
    # Decoded as a view into the message (a local plan of 10^4 tensors is a megabyte: a copy on the
    # event loop's thread would stall it).
    payload: memoryview = msgspec.field(default_factory=lambda: memoryview(b""))
    tmp: str = ""
    # Which save and which exchange of it this is, filled in by ``Exchanges``: ranks that met in
    # different ones (saves started in different orders on different ranks) fail instead of mixing them.
    save: str = ""
    step: str = ""
    # ``plan`` only: a digest of this rank's tree and tensor signatures (see ``_save._ranks``), or 0 in a
    # world of one. Equal on every rank (SPMD state), ``trees`` is skipped.
    digest: int = 0
    # ``outcome`` only, from the coordinator that did not publish: the ranks that failed (itself, or
    # those that failed the vote), which every rank's error names.
    culprits: tuple[int, ...] = ()


_STATUS = msgspec.msgpack.Decoder(Status)
# Payloads up to this size are encoded on the event loop's thread: a thread hop costs more.
_INLINE_PAYLOAD = 64 << 10


def describe(exc: BaseException) -> str:
    """A one-line description of why a rank failed, for its peers."""
    if isinstance(exc, (asyncio.CancelledError, KeyboardInterrupt)) or type(exc).__name__ == "Cancelled":
        return "cancelled"
    return f"{type(exc).__name__}: {exc}"


class _Turns:
    """Which save over one checkpoint group may take its exchanges: one at a time, in the order begun.

    Two saves over one group in flight at once (two Checkpointers of one process group, each with an
    ``async_op=True`` save) took their exchanges in whatever order their stages ended, which differs
    from rank to rank: one save's vote met the other's. Each save takes a ticket when it begins; its
    first exchange waits until every save of an earlier ticket is done with its exchanges. Staging and
    planning still overlap. Thread-safe, and for saves of any event loop (the blocking facade's too).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._next = 0  # the next ticket
        self._serving = 0  # the ticket whose save may exchange now
        self._finished: set[int] = set()  # tickets done out of order (a save that failed while waiting)
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []

    def take(self) -> int:
        with self._lock:
            ticket, self._next = self._next, self._next + 1
            return ticket

    async def wait(self, ticket: int) -> None:
        """Return once the saves of every earlier ticket are finished."""
        loop = asyncio.get_running_loop()
        while True:
            with self._lock:
                if self._serving == ticket:
                    return
                turn: asyncio.Future[None] = loop.create_future()
                self._waiters.append((loop, turn))
            await turn

    def finish(self, ticket: int) -> None:
        """The save of ``ticket`` is done with its exchanges (or will take none)."""
        with self._lock:
            self._finished.add(ticket)
            while self._serving in self._finished:
                self._finished.remove(self._serving)
                self._serving += 1
            waiters, self._waiters = self._waiters, []
        for loop, turn in waiters:
            with contextlib.suppress(RuntimeError):  # (a loop closed meanwhile: its save is gone)
                loop.call_soon_threadsafe(_wake, turn)


def _wake(turn: asyncio.Future[None]) -> None:
    if not turn.done():
        turn.set_result(None)


_turns: weakref.WeakKeyDictionary[World, _Turns] = weakref.WeakKeyDictionary()
_turns_lock = threading.Lock()


def _turns_of(world: World) -> _Turns:
    with _turns_lock:
        turns = _turns.get(world)
        if turns is None:
            turns = _turns[world] = _Turns()
        return turns


class Exchanges:
    """The state of one save's protocol on this rank.

    Made when the save begins (it takes the save's turn, see :class:`_Turns`); :meth:`close` must follow,
    once the save is over.
    """

    def __init__(self, world: World, save: str = "") -> None:
        self.world = world
        self.save = save  # the same on every rank for one save (its full path)
        self.done = 0  # exchanges begun
        self.settled = False  # every rank knows the outcome; no exchange remains
        self._pending: asyncio.Task[list[bytes]] | None = None
        self._pending_step = ""
        self._turns = _turns_of(world) if world.size > 1 else None
        self._ticket = self._turns.take() if self._turns is not None else -1
        self._turn = self._turns is None  # whether this save may exchange

    def close(self) -> None:
        """Let the next save over this group exchange (this one takes no further exchange)."""
        if self._turns is not None and self._ticket >= 0:
            self._turns.finish(self._ticket)
            self._ticket = -1

    @property
    def next_step(self) -> str:
        """The exchange this rank takes part in next (``""`` once every one took place)."""
        return STEPS[self.done] if self.done < len(STEPS) else ""

    def _after(self, step: str, statuses: list[Status]) -> None:
        """Skip ``trees`` where ``plan`` showed every rank's digest alike (every rank decides the same)."""
        if step == "plan" and all(s.ok for s in statuses) and len({s.digest for s in statuses}) == 1:
            self.done += 1

    async def exchange(self, step: str, status: Status) -> list[Status]:
        """Run the next exchange; return every rank's status.

        The exchange runs in its own task, shielded: if the caller is cancelled meanwhile, it goes on, and
        :meth:`abort` later reads its result to know which exchanges remain.
        """
        assert STEPS[self.done] == step, f"exchange {step!r} out of order"
        if not self._turn:
            assert self._turns is not None
            await self._turns.wait(self._ticket)
            self._turn = True
        status = msgspec.structs.replace(status, save=self.save, step=step)
        # A large payload is copied into the message in a thread. Cancelled meanwhile, this rank has not
        # begun the exchange yet.
        if len(status.payload) > _INLINE_PAYLOAD:
            message = await run_sync(partial(ENCODER.encode, status))
        else:
            message = ENCODER.encode(status)
        self.done += 1  # counted before awaiting: once begun, an exchange is in flight on every rank
        self._pending_step = step
        self._pending = asyncio.ensure_future(self.world.all_gather(message, what=f"save/{step}"))
        raw = await asyncio.shield(self._pending)
        self._pending = None
        statuses = [_STATUS.decode(r) for r in raw]
        self._check_in_step(step, statuses)
        self._after(step, statuses)
        return statuses

    def _check_in_step(self, step: str, statuses: list[Status]) -> None:
        """Raise unless every rank was in this save's ``step`` exchange.

        Every rank sees the same statuses, so all of them raise here, and none takes part in a further
        exchange of this save (which would only meet another save's again).

        Raises:
            DistributedError: Naming the ranks that were in another save or exchange.
        """
        elsewhere = {r: s for r, s in enumerate(statuses) if (s.save, s.step) != (self.save, step)}
        if not elsewhere:
            return
        self.settled = True
        where = "; ".join(f"rank {r} in {s.step!r} of {s.save!r}" for r, s in sorted(elsewhere.items()))
        raise DistributedError(
            f"the save of {self.save!r} met another save in its {step!r} exchange ({where}): every rank of "
            "a process group saves to the same path (one directory they share), and begins its saves in "
            "the same order",
            ranks=sorted(elsewhere),
        )

    async def _finish_pending(self) -> bool:
        """Wait for an exchange the caller was cancelled out of; return whether no exchange follows it."""
        if self._pending is None:
            return False
        raw = await self._pending
        self._pending = None
        statuses = [_STATUS.decode(r) for r in raw]
        if self._pending_step in _ENDING and not all(s.ok for s in statuses):
            return True
        self._after(self._pending_step, statuses)
        return self.done == len(STEPS)

    def check(self, step: str, statuses: list[Status]) -> None:
        """Raise if any rank failed in ``step``; after ``plan`` that also settles the protocol.

        Raises:
            DistributedError: Naming every failed rank and why.
        """
        failed = {r: s.error for r, s in enumerate(statuses) if not s.ok}
        if not failed:
            return
        if step in _ENDING:
            self.settled = True
        reasons = "; ".join(f"rank {r}: {e}" for r, e in sorted(failed.items()))
        raise DistributedError(f"the save was aborted in {step!r} ({reasons})", ranks=sorted(failed))

    async def abort(self, reason: str) -> None:
        """Take part in every remaining exchange as a failed rank. Call shielded from cancellation."""
        if self.settled or self.world.size == 1:
            return
        failed = Status(ok=False, error=reason)
        try:
            if await self._finish_pending():
                return
            while self.done < len(STEPS):
                step = STEPS[self.done]
                await self.exchange(step, failed)
                if step in _ENDING:
                    return  # everyone saw the failure there and stops
        except CheckpointError:
            pass  # the group itself broke; the peers get their own DistributedError
        finally:
            self.settled = True


def unbegun(world: World, save: str) -> Exchanges | None:
    """The exchanges of a save to ``save`` that ended before they began (``None`` in a world of one).

    The other ranks' saves wait in its first exchange (``plan``): told nothing, they would wait there
    until the collective timeout breaks the checkpoint group for good (a rank whose own checks refused
    the save, or whose call was cancelled before its protocol began); or, where this rank saved again
    at once, meet its next save there, and the ranks would stay one save apart. Made now, they take the
    save's turn before any later save of this rank; :func:`abort_unbegun` then takes part in them.
    """
    return Exchanges(world, save=save) if world.size > 1 else None


async def abort_unbegun(exchanges: Exchanges, exc: BaseException) -> None:
    """Take part in ``exchanges`` (:func:`unbegun`'s) as a failed rank, ``exc`` the reason; then close them.

    Waits for the saves over the group that began before (their turns), shielded from cancellation.
    Raises nothing: a group that broke meanwhile gives the other ranks errors of their own.
    """
    try:
        with anyio.CancelScope(shield=True):
            await exchanges.abort(describe(exc))
    except Exception:  # (abort itself passes on no CheckpointError)
        pass
    finally:
        exchanges.close()
