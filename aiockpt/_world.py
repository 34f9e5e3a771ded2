"""The group of processes that takes part in a checkpoint, and its one collective.

Every stage talks to its peers only through :class:`World.all_gather`, with payloads already encoded as
msgspec bytes. A single process is a world of one (:class:`LocalWorld`), so single-process saves run the
very code path of distributed ones; :class:`aiockpt._dist.DistWorld` implements the same protocol over a
private gloo group of a ``torch.distributed`` job.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


class World(Protocol):
    """Collectives of a checkpoint group. Every rank calls them in the same order."""

    @property
    def rank(self) -> int:
        """This process's rank in the group; rank 0 coordinates."""
        ...

    @property
    def size(self) -> int:
        """Number of ranks."""
        ...

    async def all_gather(self, payload: bytes, *, what: str) -> list[bytes]:
        """Every rank gets every rank's ``payload``, in rank order.

        Args:
            payload: This rank's bytes.
            what: A name for the collective, used in error messages.

        Raises:
            DistributedError: The collective failed or timed out.
        """
        ...


def check_group(group: object) -> None:
    """Refuse a ``process_group`` argument that is not a group this process belongs to.

    Raises:
        CheckpointError: It is not a ``ProcessGroup`` (or ``None``), or this process is not a member:
            ``dist.new_group`` gives non-members a placeholder, which failed later with an AttributeError.
    """
    if group is None:
        return
    import torch.distributed as dist

    from ._errors import CheckpointError

    if group is dist.GroupMember.NON_GROUP_MEMBER:
        rank = dist.get_rank() if dist.is_initialized() else "?"
        raise CheckpointError(
            f"this process (global rank {rank}) is not a member of the process_group it was given: only the "
            "group's members save or load with it"
        )
    if not isinstance(group, dist.ProcessGroup):
        raise CheckpointError(
            f"process_group must be a torch.distributed.ProcessGroup or None, not {group!r}"
        )


async def resolve_world(group: ProcessGroup | None, timeout: float) -> World:
    """The checkpoint world of ``group``.

    Its private gloo group when ``torch.distributed`` is in use (created on first use, a collective call,
    in a worker thread), else this process alone.

    Raises:
        CheckpointError: ``group`` is not a group of this process's (see :func:`check_group`).
    """
    from ._dist import world_for
    from ._threads import run_sync

    check_group(group)
    world = await run_sync(lambda: world_for(group, timeout=timeout))
    return LocalWorld() if world is None else world


def part_of(group: ProcessGroup | None) -> tuple[int, int] | None:
    """``(rank, world size)`` of this process for a collective-free save, or ``None`` outside a job.

    Raises:
        CheckpointError: ``group`` is not a group of this process's (see :func:`check_group`).
    """
    import torch.distributed as dist

    check_group(group)
    if group is None and not (dist.is_available() and dist.is_initialized()):
        return None
    return dist.get_rank(group), dist.get_world_size(group)


class LocalWorld:
    """A world of one process: the collective returns at once."""

    rank = 0
    size = 1

    async def all_gather(self, payload: bytes, *, what: str) -> list[bytes]:
        """Return ``[payload]``."""
        return [payload]
