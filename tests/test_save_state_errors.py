"""Errors from the state itself at save: a failing ``state_dict()``, an uninitialized lazy parameter.

Each is a ``StateError`` naming the key, and the save publishes nothing."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from pathlib import Path

import pytest
import torch
from conftest import tmp_entries

import aiockpt
from aiockpt import StateError

pytestmark = pytest.mark.timeout(60)


class _Interrupt(BaseException):
    """A BaseException that is not an Exception, as KeyboardInterrupt and SystemExit are."""


async def _save(state: Mapping[str, object], path: Path, async_op: bool) -> None:
    """Save ``state`` to ``path`` and wait until it is durable, staged first if ``async_op``."""
    if async_op:
        await (await aiockpt.save(state, path, async_op=True))
    else:
        await aiockpt.save(state, path)


class _Raises:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc

    def state_dict(self) -> Mapping[str, object]:
        raise self.exc

    def load_state_dict(self, state_dict: Mapping[str, object], /) -> None:
        pass


@pytest.mark.parametrize("async_op", [False, True], ids=["sync", "staged"])
async def test_a_failing_state_dict_is_a_state_error_naming_the_key(tmp_path: Path, async_op: bool) -> None:
    path = tmp_path / "ckpt"
    cause = ValueError("boom")
    state = {"w": torch.ones(3), "model": {"sub": _Raises(cause)}}
    with pytest.raises(
        StateError, match=r"state_dict\(\) of .*_Raises at key 'model/sub' failed: boom"
    ) as info:
        await _save(state, path, async_op)
    assert info.value.key == "model/sub"
    assert info.value.__cause__ is cause
    assert not path.exists()
    assert tmp_entries(tmp_path) == []


async def test_a_base_exception_from_state_dict_passes_as_it_is(tmp_path: Path) -> None:
    with pytest.raises(_Interrupt, match="stop"):
        await aiockpt.save({"model": _Raises(_Interrupt("stop"))}, tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()
    assert tmp_entries(tmp_path) == []


@pytest.mark.parametrize("async_op", [False, True], ids=["sync", "staged"])
async def test_a_cancelled_error_from_state_dict_reaches_the_caller_as_it_is(
    tmp_path: Path, async_op: bool
) -> None:
    """A ``CancelledError`` raised by a Stateful (one that awaited something cancelled), nothing cancelled.

    The task a public call runs its work in ended with it, which its task group swallowed: the caller
    got an ``IndexError`` from the empty list of results instead.
    """
    cause = asyncio.CancelledError("from state_dict")
    async with aiockpt.Checkpointer(tmp_path / "root") as ckpt:
        with pytest.raises(asyncio.CancelledError, match="from state_dict"):
            await ckpt.save({"w": torch.ones(3), "bad": _Raises(cause)}, step=1, async_op=async_op)
        await ckpt.save({"w": torch.ones(3)}, step=2, async_op=async_op)
        await ckpt.wait()
        assert ckpt.steps() == [2]
    assert tmp_entries(tmp_path / "root") == []


@pytest.mark.parametrize("async_op", [False, True], ids=["sync", "staged"])
async def test_an_uninitialized_lazy_parameter_is_a_state_error_naming_the_key(
    tmp_path: Path, async_op: bool
) -> None:
    path = tmp_path / "ckpt"
    state = {"model": {"head": torch.nn.LazyLinear(3)}}
    with pytest.raises(StateError, match=r"'model/head/weight'.*uninitialized lazy.*forward pass") as info:
        await _save(state, path, async_op)
    assert info.value.key == "model/head/weight"
    assert not path.exists()
    assert tmp_entries(tmp_path) == []


@pytest.mark.parametrize(
    "lazy",
    [
        torch.nn.UninitializedParameter(),
        torch.nn.UninitializedBuffer(),
        torch.nn.LazyLinear(3, device="meta").weight,  # lazy first: not "a meta tensor has no data"
    ],
    ids=["parameter", "buffer", "meta"],
)
async def test_lazy_tensors_given_directly_are_refused_as_uninitialized(
    tmp_path: Path, lazy: torch.Tensor
) -> None:
    with pytest.raises(StateError, match=r"'opt/0/buf'.*uninitialized lazy") as info:
        await aiockpt.save({"opt": {0: {"buf": lazy}}}, tmp_path / "ckpt")
    assert info.value.key == "opt/0/buf"


async def test_a_lazy_module_saves_once_materialized(tmp_path: Path) -> None:
    head = torch.nn.LazyLinear(3)
    head(torch.ones(2, 5))
    await aiockpt.save({"model": {"head": head}}, tmp_path / "ckpt")
    tree = await aiockpt.read(tmp_path / "ckpt")
    model = tree["model"]
    assert isinstance(model, dict)
    assert torch.equal(model["head"]["weight"], head.weight.detach())
