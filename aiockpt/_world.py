"""The group of processes that takes part in a checkpoint, and its collectives.

Every stage talks to its peers only through :class:`World`, with payloads already encoded as msgspec bytes.
A single process is a world of one (:class:`LocalWorld`), so single-process saves run the very code path
of distributed ones; the ``torch.distributed`` bridge implements the same protocol over a gloo group.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class World(Protocol):
    """Collectives of a checkpoint group. Every rank calls each collective in the same order."""

    @property
    def rank(self) -> int:
        """This process's rank in the group."""
        ...

    @property
    def size(self) -> int:
        """Number of ranks."""
        ...

    async def gather(self, payload: bytes) -> list[bytes] | None:
        """Send ``payload`` to the coordinator (rank 0); it gets every rank's, in rank order."""
        ...

    async def scatter(self, payloads: Sequence[bytes] | None) -> bytes:
        """The coordinator hands ``payloads[r]`` to rank ``r``; others pass ``None``."""
        ...

    async def broadcast(self, payload: bytes | None) -> bytes:
        """Every rank receives the coordinator's ``payload``."""
        ...


class LocalWorld:
    """A world of one process: every collective returns at once."""

    rank = 0
    size = 1

    async def gather(self, payload: bytes) -> list[bytes] | None:
        """Return ``[payload]``."""
        return [payload]

    async def scatter(self, payloads: Sequence[bytes] | None) -> bytes:
        """Return this rank's payload."""
        assert payloads is not None
        assert len(payloads) == 1
        return payloads[0]

    async def broadcast(self, payload: bytes | None) -> bytes:
        """Return ``payload``."""
        assert payload is not None
        return payload
