"""The ``torch.distributed`` bridge: a private gloo group and a dedicated collective thread.

Checkpoint collectives never share a process group with training: each parent group (the default one,
or the ``process_group`` a user passes) gets its own gloo group, created once, so checkpoint traffic
never interleaves with NCCL or other collectives and works for CPU bytes. Collectives are blocking
calls; they run one at a time on a single thread per group, in call order, so the event loop never
blocks and every rank issues them in the same order. Payloads are msgspec bytes, never pickle.

A collective that fails or times out (a dead or stuck rank) raises :class:`DistributedError`, and the
group is marked broken: later checkpoint collectives on it fail at once instead of hanging. To name the
culprit, each rank marks its arrival at every collective in the job's key-value store (the one
``init_process_group`` rendezvoused through) before entering it; when a collective fails, the ranks whose
mark is missing are the ones that never reached it (dead, hung, or diverged).
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import PrefixStore, ProcessGroupGloo, Store

from ._errors import DistributedError
from ._memory import byte_view

DEFAULT_TIMEOUT = 300.0


class DistWorld:
    """A checkpoint group over ``torch.distributed``; see the module docstring.

    Args:
        group: The parent process group (``None``: the default group).
        timeout: Seconds each checkpoint collective may take before it fails.
    """

    def __init__(self, group: dist.ProcessGroup | None = None, *, timeout: float = DEFAULT_TIMEOUT) -> None:
        """Create the group (a collective call of every member, and of no other rank).

        Raises:
            DistributedError: Creating it failed or timed out (a member never came).
        """
        parent = dist.group.WORLD if group is None else group
        assert parent is not None  # (world_for makes none without an initialised default group)
        self.parent = parent
        ranks = dist.get_process_group_ranks(parent)
        self.rank = dist.get_rank(parent)
        self.size = len(ranks)
        # Named after the parent (a name its members share) and how many such groups this process made:
        # not with dist.new_group, whose name for a group of some ranks only (use_local_synchronization)
        # counts every group the calling process belongs to, which differs between members that belong
        # to different other groups (a sub-group save after one over another sub-group): they waited for
        # each other under different names until the timeout.
        self.name = _next_name(parent, timeout)
        try:
            store = PrefixStore(f"aiockpt/groups/{self.name}/", _default_store())
            self._pg = ProcessGroupGloo(store, self.rank, self.size, timedelta(seconds=timeout))
        except RuntimeError as exc:  # a rank that never came (a store timeout, say)
            members = "every rank of the default group" if group is None else f"ranks {ranks}"
            raise DistributedError(
                f"cannot create aiockpt's checkpoint group over {members}: {exc} (a rank that never opened "
                "its Checkpointer or made its first save?)",
                ranks=[],
            ) from exc
        self.timeout = timeout
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="aiockpt-collectives")
        self._broken: str | None = None
        self._lock = threading.Lock()
        self._arrivals = _arrival_store(self.name)
        self._seq = 0  # collectives begun; identical on every rank since they run in the same order

    def __repr__(self) -> str:
        return f"<DistWorld rank={self.rank} size={self.size}>"

    async def all_gather(self, payload: bytes, *, what: str) -> list[bytes]:
        """Every rank gets every rank's ``payload`` (see :class:`aiockpt._world.World`).

        Cancelling the awaiting task does not stop the collective (a blocking call cannot be
        interrupted); the next collective simply queues behind it, which keeps the order of collectives
        identical on every rank.

        Raises:
            DistributedError: The collective failed or timed out, or an earlier one did.
        """
        future = self.submit(payload, what=what)
        return await asyncio.wrap_future(future)

    def submit(self, payload: bytes, *, what: str) -> Future[list[bytes]]:
        """Queue the collective on the group's thread; the future resolves to every rank's payload."""
        return self._executor.submit(self._all_gather, payload, what)

    def _all_gather(self, payload: bytes, what: str) -> list[bytes]:
        if self._broken is not None:
            raise DistributedError(
                f"checkpoint collective {what!r} refused on rank {self.rank}: the checkpoint group broke "
                f"earlier ({self._broken})"
            )
        seq, self._seq = self._seq, self._seq + 1
        self._mark(seq)
        try:
            gathered = _all_gather_bytes(payload, self._pg, self.size)
        except Exception as exc:
            self._broken = f"{what}: {exc}"
            absent = self._absent(seq)
            if absent is None:
                culprits = (
                    "which rank failed is unknown (the job's store cannot be reached: the rank that hosts "
                    "it may have died)"
                )
            elif absent:
                culprits = f"rank(s) {', '.join(map(str, absent))} never reached it (dead, hung or diverged)"
            else:
                culprits = "every rank reached it, so one died or hung inside it"
            raise DistributedError(
                f"checkpoint collective {what!r} failed on rank {self.rank} of {self.size} "
                f"(timeout {self.timeout:g} s): {culprits}: {exc}",
                ranks=absent or [],
            ) from exc
        if seq:
            # Every rank has reached `seq`, so none can still ask about `seq - 1`.
            self._unmark(seq - 1)
        return gathered

    def _key(self, seq: int, rank: int) -> str:
        return f"{seq}/{rank}"

    def _mark(self, seq: int) -> None:
        if self._arrivals is None:
            return
        try:
            self._arrivals.set(self._key(seq, self.rank), "1")
        except Exception:  # best effort: a store that is gone only costs the diagnosis
            self._arrivals = None

    def _unmark(self, seq: int) -> None:
        if self._arrivals is None:
            return
        try:
            self._arrivals.delete_key(self._key(seq, self.rank))
        except Exception:
            self._arrivals = None

    def _absent(self, seq: int) -> list[int] | None:
        """The ranks that never marked their arrival at collective ``seq`` (``None`` if unknown)."""
        if self._arrivals is None:
            return None
        try:
            return [r for r in range(self.size) if not self._arrivals.check([self._key(seq, r)])]
        except Exception:  # the store lived on a rank that died (torchrun's rank 0): culprits unknown
            return None

    def close(self) -> None:
        """Stop the collective thread (the gloo group lives as long as the process group does)."""
        self._executor.shutdown(wait=False, cancel_futures=True)


def _all_gather_bytes(payload: bytes, group: ProcessGroupGloo, size: int) -> list[bytes]:
    pg: Any = group  # (torch's stubs give Backend none of the collectives it has)
    n = torch.tensor([len(payload)], dtype=torch.int64)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(size)]
    pg.allgather([sizes], [n]).wait()
    lengths = [int(s.item()) for s in sizes]
    width = max(max(lengths), 1)
    mine = torch.zeros(width, dtype=torch.uint8)
    if payload:
        byte_view(mine)[: len(payload)] = payload
    outs = [torch.empty(width, dtype=torch.uint8) for _ in range(size)]
    pg.allgather([outs], [mine]).wait()
    return [bytes(byte_view(o)[:length]) for o, length in zip(outs, lengths, strict=True)]


def _default_store() -> Store:
    """The store of the job's default group, which every group's rendezvous goes through."""
    return dist.distributed_c10d._get_default_store()


def _arrival_store(name: str) -> Store | None:
    """A namespace of the job's store for the arrival marks of the group ``name``'s collectives.

    The name is the same on every member and unique in the job (see :func:`_next_name`), so marks of
    different groups (or of a group created again with another timeout) never mix.
    """
    try:
        store = _default_store()
    except Exception:  # best effort: without a store, collectives work and culprits go unnamed
        return None
    return PrefixStore(f"aiockpt/arrivals/{name}/", store)


# Checkpoint groups made in this process, by parent group name and timeout (see _next_name).
_made: dict[tuple[str, float], int] = {}


def _next_name(parent: dist.ProcessGroup, timeout: float) -> str:
    """The name of a new checkpoint group over ``parent``: the same on every member, and unused before.

    The parent's name is shared by its members (they rendezvoused under it) and unique among the job's
    groups; the members create the checkpoint groups of a parent in the same order (SPMD), so they count
    alike. Counted per timeout, as each timeout gets a group of its own (see :data:`_worlds`), and again
    after the parent was replaced (a default group destroyed and initialised again).
    """
    key = (parent.group_name, timeout)
    made = _made.get(key, 0)
    _made[key] = made + 1
    return f"{parent.group_name}/{timeout!r}/{made}"


# Checkpoint groups by their parent group's ``id`` and their timeout. Each entry keeps its parent alive
# (``DistWorld.parent``), so the id cannot be reused by another group while the entry stands; an entry
# whose parent is no longer the group asked for (the default group destroyed and initialised again,
# in-process restarts do) is replaced, never used: its gloo group belongs to the old world. A gloo
# group's timeout is fixed when it is made, so each timeout asked for gets its own, made once: a job
# that alternated two (a Checkpointer's and aiockpt.save's default) made a group at every switch, each
# holding its sockets for good.
_worlds: dict[tuple[int, float], DistWorld] = {}
_worlds_lock = threading.Lock()


def world_for(group: dist.ProcessGroup | None, *, timeout: float = DEFAULT_TIMEOUT) -> DistWorld | None:
    """The checkpoint group of ``group``, created on first use (a collective call).

    ``None`` means the default group as it is now: after ``destroy_process_group`` and a new
    ``init_process_group`` it is a new group, with a checkpoint group of its own.

    Returns:
        ``None`` when ``torch.distributed`` is not initialised and no group is given (a single process).
    """
    if group is None and not (dist.is_available() and dist.is_initialized()):
        return None
    parent = dist.group.WORLD if group is None else group
    key = (id(parent), timeout)
    with _worlds_lock:
        world = _worlds.get(key)
        if world is None or world.parent is not parent:
            world = _worlds[key] = DistWorld(group, timeout=timeout)
        return world
