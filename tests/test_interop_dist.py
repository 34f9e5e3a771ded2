"""Interop on real ``torch.distributed`` ranks (gloo on 127.0.0.1, spawned processes).

- A DCP checkpoint saved by 2 ranks holding DTensor shards reads back whole in one process, and loads
  into plain tensors and into DTensors of other placements.
- ``torch.distributed.checkpoint.state_dict`` (``get_state_dict``/``set_state_dict``) of an FSDP2 model
  and its optimizer saves and loads with aiockpt: resuming into a fresh model and optimizer continues
  bit-exactly, and ``read()`` gives a plain single-process model its full tensors.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, cast

import pytest
import torch
from conftest import assert_tree_equal, random_tensor

import aiockpt

from distributed_util import run_world

pytestmark = pytest.mark.dist


def _full() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        "rows": random_tensor(torch.float32, (7, 6), gen),  # 7 rows over 2 ranks: uneven shards
        "cols": random_tensor(torch.bfloat16, (4, 9), gen),
        "ids": random_tensor(torch.int64, (5, 3), gen),
        "mask": random_tensor(torch.bool, (6,), gen),
        "plain": random_tensor(torch.float32, (3, 3), gen),
    }


async def _dcp_save_sharded(rank: int, world: int, path: str) -> None:
    from torch.distributed.checkpoint.state_dict_saver import save
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    full = _full()
    state = {
        "rows": distribute_tensor(full["rows"], mesh, [Shard(0)]),
        "cols": distribute_tensor(full["cols"], mesh, [Shard(1)]),
        "ids": distribute_tensor(full["ids"], mesh, [Shard(0)]),
        "mask": distribute_tensor(full["mask"], mesh, [Shard(0)]),
        "plain": full["plain"],  # replicated: DCP writes it once
        "step": 9,
    }
    save(state, checkpoint_id=path)


async def _load_resharded(rank: int, world: int, path: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    full = _full()
    placements = {"rows": Shard(1), "cols": Shard(0), "ids": Replicate(), "mask": Shard(0), "plain": Shard(0)}
    target: dict[str, Any] = {
        k: distribute_tensor(torch.zeros_like(full[k]), mesh, [p]) for k, p in placements.items()
    }
    target["step"] = 0
    await aiockpt.load(target, path)
    out: dict[str, Any] = {k: target[k].full_tensor() for k in placements}
    out["step"] = target["step"]
    return out


def test_dcp_saved_by_two_ranks_as_dtensor_shards(tmp_path: Path) -> None:
    path = str(tmp_path / "dcp")
    run_world(_dcp_save_sharded, 2, tmp_path, path)
    expected: dict[str, Any] = {**_full(), "step": 9}

    async def single_process() -> None:
        tree = await aiockpt.read(path)
        assert_tree_equal(tree, expected)
        target: dict[str, Any] = {k: torch.zeros_like(v) for k, v in _full().items()}
        target["step"] = 0
        await aiockpt.load(target, path)
        assert_tree_equal(target, expected)

    asyncio.run(single_process())
    for result in run_world(_load_resharded, 2, tmp_path, path):
        assert_tree_equal(result, expected)


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 18), torch.nn.ReLU(), torch.nn.Linear(18, 7))


def _fsdp(world: int, seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = _model(seed)
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    torch.manual_seed(seed)
    model(torch.randn(4, 8)).square().sum().backward()
    opt.step()
    opt.zero_grad()


def _gathered(sd: dict[str, Any]) -> dict[str, Any]:
    """Full tensors of a state dict of DTensors (collective)."""
    return {
        k: (v.full_tensor() if hasattr(v, "full_tensor") else v.clone()) if isinstance(v, torch.Tensor) else v
        for k, v in sd.items()
    }


async def _fsdp2_state_dict_helpers(rank: int, world: int, path: str) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, opt = _fsdp(world, seed=0)
    for i in range(2):
        _train(model, opt, seed=i)
    msd, osd = get_state_dict(model, opt)
    await aiockpt.save({"model": msd, "optim": osd, "step": 2}, path)
    saved = _gathered(msd)

    fresh_model, fresh_opt = _fsdp(world, seed=1)
    # get_state_dict creates the state of an optimizer that never stepped (zeros), for the load to fill.
    fresh_msd, fresh_osd = get_state_dict(fresh_model, fresh_opt)
    state: dict[str, Any] = {"model": fresh_msd, "optim": fresh_osd, "step": 0}
    await aiockpt.load(state, path)
    set_state_dict(fresh_model, fresh_opt, model_state_dict=fresh_msd, optim_state_dict=fresh_osd)
    assert state["step"] == 2

    _train(model, opt, seed=7)
    _train(fresh_model, fresh_opt, seed=7)
    after, resumed = get_state_dict(model, opt), get_state_dict(fresh_model, fresh_opt)
    want = cast("dict[str, Any]", after[1]["state"])
    got = cast("dict[str, Any]", resumed[1]["state"])
    return {
        "saved": saved,
        "model": (_gathered(after[0]), _gathered(resumed[0])),
        "optim": {k: (_gathered(want[k]), _gathered(got[k])) for k in want},
    }


def test_fsdp2_get_state_dict_round_trip_and_plain_read(tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    results = run_world(_fsdp2_state_dict_helpers, 2, tmp_path, path)
    for r in results:
        expected, resumed = r["model"]
        assert_tree_equal(resumed, expected)  # one more step after the resume: bit-identical
        assert len(r["optim"]) == 4
        for key, (want, got) in r["optim"].items():
            assert_tree_equal(got, want, key)

    async def into_plain_model() -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        tree = await aiockpt.read(path)
        assert_tree_equal(tree["model"], results[0]["saved"])
        plain = _model(3)
        opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
        set_state_dict(plain, opt, model_state_dict=tree["model"], optim_state_dict=tree["optim"])  # type: ignore[arg-type]
        assert_tree_equal(plain.state_dict(), results[0]["saved"])
        assert sorted(opt.state_dict()["state"]) == [0, 1, 2, 3]

    asyncio.run(into_plain_model())


async def _load_safetensors_into_fsdp2(rank: int, world: int, path: str) -> dict[str, torch.Tensor]:
    model, _ = _fsdp(world, seed=1)
    await aiockpt.load(model.state_dict(), path)  # each rank reads only the rows of its shards
    return _gathered(model.state_dict())


def test_safetensors_weights_into_an_fsdp2_model(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    weights = {k: v.contiguous() for k, v in _model(0).state_dict().items()}
    save_file(weights, tmp_path / "model.safetensors")
    for result in run_world(_load_safetensors_into_fsdp2, 2, tmp_path, str(tmp_path / "model.safetensors")):
        assert_tree_equal(result, weights)
