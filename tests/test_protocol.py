"""The save's collective protocol (``_save/_protocol.py``) on its own: what it decides from what ranks send.

The collectives themselves are exercised on real ranks in test_distributed.py; here a stand-in world
returns the messages another rank would have sent, to reach a state that real ranks reach by timing only.
"""

from __future__ import annotations

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
