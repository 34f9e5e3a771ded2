"""The save's collective protocol (``_save/_protocol.py``) on its own: what it decides from what ranks send.

The collectives themselves are exercised on real ranks in test_distributed.py; here a stand-in world
returns the messages another rank would have sent, to reach a state that real ranks reach by timing only.
"""

from __future__ import annotations

import asyncio
from typing import cast

import pytest

import aiockpt
from aiockpt._format import ENCODER
from aiockpt._save._protocol import Exchanges, Status
from aiockpt._world import World


class _OtherSave:
    """A world of two whose rank 1 is in another save (or exchange) than this one: what saves started in
    different orders on two ranks meet. (The check itself, not the collectives: a unit of the protocol.)"""

    rank, size = 0, 2

    def __init__(self, save: str, step: str) -> None:
        self.other = ENCODER.encode(Status(ok=True, save=save, step=step))

    async def all_gather(self, payload: bytes, *, what: str) -> list[bytes]:
        return [payload, self.other]


@pytest.mark.parametrize(("save", "step"), [("step-00000002", "plan"), ("step-00000001", "vote")])
async def test_an_exchange_that_meets_another_save_fails_on_every_rank(save: str, step: str) -> None:
    """Two saves in flight on one group, begun in different orders on the two ranks: one save's plan
    met the other's, and a checkpoint could be committed from mixed plans."""
    exchanges = Exchanges(cast("World", _OtherSave(save, step)), save="step-00000001")
    with pytest.raises(aiockpt.DistributedError, match="met another save in its 'plan' exchange") as info:
        await exchanges.exchange("plan", Status(ok=True))
    assert info.value.ranks == (1,)
    assert exchanges.settled  # no further exchange of this save: it would meet the other save again
    await exchanges.abort("failed")  # a no-op now


class _Peer:
    """A world of two whose rank 1 sends ``digest`` in ``plan`` and succeeds (or fails, in ``fail_in``)."""

    rank, size = 0, 2

    def __init__(self, digest: int, fail_in: str = "") -> None:
        self.digest = digest
        self.fail_in = fail_in
        self.steps: list[str] = []

    async def all_gather(self, payload: bytes, *, what: str) -> list[bytes]:
        step = what.removeprefix("save/")
        self.steps.append(step)
        ok = step != self.fail_in
        digest = self.digest if step == "plan" else 0
        other = Status(ok=ok, error="" if ok else "boom", save="s", step=step, digest=digest)
        return [payload, ENCODER.encode(other)]


@pytest.mark.parametrize(("digest", "steps"), [(7, ["plan", "vote"]), (8, ["plan", "trees", "vote"])])
async def test_trees_are_exchanged_only_where_digests_differ(digest: int, steps: list[str]) -> None:
    peer = _Peer(digest)
    exchanges = Exchanges(cast("World", peer), save="s")
    await exchanges.exchange("plan", Status(ok=True, digest=7))
    if exchanges.next_step == "trees":
        await exchanges.exchange("trees", Status(ok=True))
    assert exchanges.next_step == "vote"
    await exchanges.exchange("vote", Status(ok=True))
    assert peer.steps == steps


@pytest.mark.parametrize(("digest", "steps"), [(7, ["plan", "vote", "outcome"]), (8, ["plan", "trees"])])
async def test_a_rank_failing_after_plan_takes_part_in_what_remains(digest: int, steps: list[str]) -> None:
    """After ``plan``, a failing rank goes through the exchanges its peers go through: ``trees`` where
    digests differed (a failure there ends the save for everyone), else ``vote`` and ``outcome``."""
    peer = _Peer(digest)
    exchanges = Exchanges(cast("World", peer), save="s")
    await exchanges.exchange("plan", Status(ok=True, digest=7))
    await exchanges.abort("failed")
    assert peer.steps == steps
    assert exchanges.settled


async def test_a_failure_in_trees_ends_the_protocol() -> None:
    peer = _Peer(8, fail_in="trees")
    exchanges = Exchanges(cast("World", peer), save="s")
    await exchanges.exchange("plan", Status(ok=True, digest=7))
    statuses = await exchanges.exchange("trees", Status(ok=True))
    with pytest.raises(aiockpt.DistributedError, match="aborted in 'trees'"):
        exchanges.check("trees", statuses)
    await exchanges.abort("failed")  # nothing more to take part in
    assert peer.steps == ["plan", "trees"]


async def test_saves_over_one_group_exchange_one_at_a_time_in_the_order_begun() -> None:
    """Two saves over one group in flight (two Checkpointers of one process group): their exchanges went
    in the order each one's stages ended, which differs between ranks, and one save's vote met the
    other's on another rank. A save that ends before its turn does not hold up those after it."""
    peer = _Peer(7)
    world = cast("World", peer)
    first, failed, third = (Exchanges(world, save="s") for _ in range(3))
    later = asyncio.ensure_future(third.exchange("plan", Status(ok=True, digest=7)))
    await asyncio.sleep(0.05)
    assert not later.done()
    assert peer.steps == []
    await first.exchange("plan", Status(ok=True, digest=7))
    await first.exchange("vote", Status(ok=True))
    failed.close()  # (it failed in its stage, before any exchange)
    await asyncio.sleep(0.05)
    assert not later.done()
    first.close()
    await asyncio.wait_for(later, 5)
    third.close()
    assert peer.steps == ["plan", "vote", "plan"]
