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


async def resolve_world(group: ProcessGroup | None, timeout: float) -> World:
    """The checkpoint world of ``group``.

    Its private gloo group when ``torch.distributed`` is in use (created on first use, a collective call,
    in a worker thread), else this process alone.
    """
    from ._dist import world_for
    from ._threads import run_sync

    world = await run_sync(lambda: world_for(group, timeout=timeout))
    return LocalWorld() if world is None else world


def part_of(group: ProcessGroup | None) -> tuple[int, int] | None:
    """``(rank, world size)`` of this process for a collective-free save, or ``None`` outside a job."""
    import torch.distributed as dist

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
