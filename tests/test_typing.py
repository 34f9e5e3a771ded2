"""The public annotations take the programs the docs show, and resolve at run time.

mypy checks this file (``tests/`` is in its ``files``): each test is a correct program that the older
annotations rejected, run here as well so it stays a real one.
"""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

import aiockpt
import aiockpt.sync
from aiockpt import Checkpointer


class _Bar:
    """A progress bar as tqdm's users write one: its methods return something."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, int]] = []

    def update(self, n: int) -> bool | None:  # tqdm.update's signature
        return None

    def report(self, done: int, total: int) -> bool:
        self.seen.append((done, total))
        return done == total


async def test_load_returns_its_target_with_the_target_type(tmp_path: Path) -> None:
    """``load`` took ``MutableMapping[str, object]`` (invariant) and returned it: a ``dict[str, Linear]``
    was refused, and README's ``state = await aiockpt.load(state, path)`` could not be assigned back."""
    model = nn.Linear(2, 2)
    optim = torch.optim.AdamW(model.parameters())
    state = {"model": model, "optim": optim, "step": 1}
    await aiockpt.save(state, tmp_path / "ckpt")
    state = await aiockpt.load(state, tmp_path / "ckpt")  # as in README
    assert state["step"] == 1

    target = {"model": model}  # dict[str, Linear]
    await aiockpt.save(target, tmp_path / "model")
    loaded = await aiockpt.load(target, tmp_path / "model")
    weight: torch.Tensor = loaded["model"].weight  # the Linear's own type, kept
    assert weight is model.weight
    async with Checkpointer(tmp_path / "run") as ckpt:
        await ckpt.save(target, step=1)
        step: int | None = await ckpt.load(target)
        assert step == 1


def test_sync_load_returns_its_target_with_the_target_type(tmp_path: Path) -> None:
    weights: dict[str, torch.Tensor] = {"w": torch.zeros(3)}
    aiockpt.sync.save(weights, tmp_path / "w")  # accepted already (Mapping is covariant)
    loaded = aiockpt.sync.load(weights, tmp_path / "w")
    loaded["w"].add_(1)  # a Tensor, not an object
    assert loaded is weights
    with aiockpt.sync.Checkpointer(tmp_path / "run") as ckpt:
        ckpt.save(weights, step=1)
        assert ckpt.load(weights) == 1


async def test_metadata_takes_any_mapping_of_its_values(tmp_path: Path) -> None:
    """``metadata=`` was an invariant ``dict[str, str | int | float | bool | None]``: a
    ``dict[str, float]`` of metrics was refused."""
    metrics: dict[str, float] = {"loss": 0.5, "lr": 1e-3}
    state = {"w": torch.zeros(1)}
    await aiockpt.save(state, tmp_path / "a", metadata=metrics)
    handle = await aiockpt.save(state, tmp_path / "b", metadata=metrics, async_op=True)
    await handle
    async with Checkpointer(tmp_path / "run") as ckpt:
        await ckpt.save(state, step=1, metadata=metrics)
        assert (await ckpt.metadata(1)).user_metadata == metrics
    assert (await aiockpt.read_metadata(tmp_path / "a")).user_metadata == metrics


def test_sync_metadata_takes_any_mapping_of_its_values(tmp_path: Path) -> None:
    metrics: dict[str, float] = {"loss": 0.5, "lr": 1e-3}
    state = {"w": torch.zeros(1)}
    aiockpt.sync.save(state, tmp_path / "a", metadata=metrics)
    with aiockpt.sync.Checkpointer(tmp_path / "run") as ckpt:
        ckpt.save(state, step=1, metadata=metrics)
        assert ckpt.metadata(1).user_metadata == metrics
    assert aiockpt.sync.read_metadata(tmp_path / "a").user_metadata == metrics


async def test_progress_callbacks_may_return_something(tmp_path: Path) -> None:
    """``progress`` was ``Callable[[int, int], None]``: a method returning a bool, or a lambda around
    tqdm's ``update``, was refused."""
    bar = _Bar()
    await aiockpt.save({"w": torch.ones(4)}, tmp_path / "src")
    await aiockpt.verify(tmp_path / "src", progress=bar.report)
    await aiockpt.convert(tmp_path / "src", tmp_path / "a.pt", to="torch", progress=bar.report)
    assert bar.seen[-1][0] == bar.seen[-1][1]


def test_sync_progress_callbacks_may_return_something(tmp_path: Path) -> None:
    bar = _Bar()
    aiockpt.sync.save({"w": torch.ones(4)}, tmp_path / "src")
    aiockpt.sync.verify(tmp_path / "src", progress=bar.report)
    aiockpt.sync.verify(tmp_path / "src", progress=lambda done, total: bar.update(done))
    aiockpt.sync.convert(tmp_path / "src", tmp_path / "b.pt", to="torch", progress=bar.report)
    assert bar.seen[-1][0] == bar.seen[-1][1]


def _public_callables() -> dict[str, Callable[..., object]]:
    found: dict[str, Callable[..., object]] = {}
    for module, names in ((aiockpt, aiockpt.__all__), (aiockpt.sync, aiockpt.sync.__all__)):
        for name in names:
            obj = getattr(module, name)
            if inspect.isclass(obj) and issubclass(obj, BaseException):
                continue
            if inspect.isclass(obj):
                for attr, member in vars(obj).items():
                    if callable(member) and (attr == "__init__" or not attr.startswith("_")):
                        found[f"{module.__name__}.{name}.{attr}"] = member
            elif callable(obj) and typing.get_origin(obj) is None:  # (not an alias: OnBusy)
                found[f"{module.__name__}.{name}"] = obj
    return found


def test_get_type_hints_resolves_every_public_annotation() -> None:
    """``ProcessGroup`` was imported for type checkers only: ``typing.get_type_hints`` (as used by
    typeguard, pydantic, cattrs and the like) raised NameError on ``save`` and ``Checkpointer``."""
    callables = _public_callables()
    assert "aiockpt.save" in callables
    assert "aiockpt.sync.Checkpointer.__init__" in callables
    failed = {}
    for name, fn in callables.items():
        try:
            typing.get_type_hints(fn)
        except Exception as exc:
            failed[name] = f"{type(exc).__name__}: {exc}"
    assert failed == {}
