"""Distributed saves and loads on real ``torch.distributed`` ranks (gloo on 127.0.0.1, spawned processes).

Every test here spawns its worlds with ``distributed_util.run_world``; no collective is mocked. Faults are
injected inside a rank (a write that raises, a process that kills itself) and the other ranks must see a
``DistributedError`` within the collective timeout, with nothing published.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, cast

import pytest
import torch
import torch.distributed as dist

import aiockpt
from aiockpt._fs import TMP_PREFIX

from distributed_util import run_world

pytestmark = pytest.mark.dist


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    # Row counts that no world size of 2-4 divides evenly: uneven shards everywhere.
    return torch.nn.Sequential(torch.nn.Linear(8, 18), torch.nn.ReLU(), torch.nn.Linear(18, 7))


def _fsdp(world: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = _model()
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _full(sd: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Full tensors of a model or optimizer state (collective for DTensors)."""
    out = {}
    for key, value in sd.items():
        if isinstance(value, dict):
            out.update({f"{key}/{k}": v for k, v in _full(value).items()})
        elif isinstance(value, torch.Tensor):
            full = value.full_tensor() if hasattr(value, "full_tensor") else value
            out[key] = full.detach().clone()
    return out


async def _save_sharded(rank: int, world: int, path: str) -> dict[str, torch.Tensor]:
    model, opt = _fsdp(world)
    torch.manual_seed(1)
    for _ in range(2):
        model(torch.randn(4, 8)).square().sum().backward()
        opt.step()
        opt.zero_grad()
    meta = await aiockpt.save({"model": model, "optim": opt, "world": world}, path)
    assert meta.world_size == world
    return {**_full(model.state_dict()), **_full(opt.state_dict()["state"])}


async def _load_sharded(rank: int, world: int, paths: list[str]) -> list[dict[str, torch.Tensor]]:
    results = []
    for path in paths:
        model, opt = _fsdp(world)  # fresh: the optimizer has never stepped and holds no state
        state: dict[str, object] = {"model": model, "optim": opt, "world": 0}
        await aiockpt.load(state, path)
        assert state["world"] != 0
        results.append({**_full(model.state_dict()), **_full(opt.state_dict()["state"])})
        # The loaded optimizer state is sharded like the parameters, so training goes on.
        model(torch.randn(2, 8)).sum().backward()
        opt.step()
    return results


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], what: str) -> None:
    assert a.keys() == b.keys(), what
    for key in a:
        assert torch.equal(a[key], b[key]), f"{what}: {key}"


def test_save_with_n_load_with_m(tmp_path: Path) -> None:
    sizes = [1, 2, 3, 4]
    paths = [str(tmp_path / f"ckpt-{n}") for n in sizes]
    reference = {}
    for n, path in zip(sizes, paths, strict=True):
        ranks = run_world(_save_sharded, n, tmp_path, path)
        reference[n] = ranks[0]
        for other in ranks[1:]:
            _assert_same(other, ranks[0], f"ranks of world {n} disagree")
    for m in sizes:
        loaded = run_world(_load_sharded, m, tmp_path, paths)
        for rank_result in loaded:
            for n, got in zip(sizes, rank_result, strict=True):
                _assert_same(got, reference[n], f"saved with {n} ranks, loaded with {m}")


async def test_read_of_a_sharded_checkpoint_gives_full_tensors(tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    (ref, *_) = run_world(_save_sharded, 3, tmp_path, path)
    tree = await aiockpt.read(path)
    model = tree["model"]
    assert isinstance(model, dict)
    for key, value in model.items():
        assert torch.equal(value, ref[key]), key
    # Plain loads into a single process work too, without torch.distributed.
    single = _model()
    with pytest.warns(aiockpt.StateMismatchWarning, match="optim/state"):
        await aiockpt.load({"model": single, "optim": {}, "world": 0}, path, strict=False)
    for key, value in single.state_dict().items():
        assert torch.equal(value, ref[key]), key


async def _save_dtensor_and_its_local_shard(rank: int, world: int, path: str) -> list[bool]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from aiockpt._tree import flatten

    dt = distribute_tensor(torch.arange(8.0), init_device_mesh("cpu", (world,)), [Shard(0)])
    state = {"dt": dt, "shard": dt.to_local()}  # the plain tensor shares the DTensor's local memory
    await aiockpt.save(state, path)
    return [box is None for box in flatten(state, allow_pickle=False).boxes]


async def test_a_plain_tensor_sharing_a_dtensors_shard_is_not_tied_to_it(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    # Two tensors on every rank: the DTensor's shard (with its box) and the plain tensor (without).
    assert run_world(_save_dtensor_and_its_local_shard, 2, tmp_path, str(path)) == [[False, True]] * 2
    tree = await aiockpt.read(path)
    assert torch.equal(tree["dt"], torch.arange(8.0))  # type: ignore[arg-type]
    # The plain tensor is replicated as far as the save knows: one rank's copy of it is written.
    shard = tree["shard"]
    assert isinstance(shard, torch.Tensor)
    assert shard.tolist() in ([0.0, 1.0, 2.0, 3.0], [4.0, 5.0, 6.0, 7.0])


async def _save_2d(rank: int, world: int, path: str) -> int:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    base = torch.arange(6 * 10, dtype=torch.float32).reshape(6, 10)
    state = {
        "both": distribute_tensor(base, mesh, [Shard(0), Shard(1)]),
        "rows": distribute_tensor(base * 2, mesh, [Shard(0), Replicate()]),
        "repl": distribute_tensor(base * 3, mesh, [Replicate(), Replicate()]),
        "plain": base * 4,  # a plain tensor on every rank: replicated, written once
        # Sharded over the tensor-parallel sub-mesh alone, alike in both data-parallel replicas: each
        # box was written once per replica.
        "tp_only": distribute_tensor(base * 5, mesh["tp"], [Shard(0)]),
    }
    meta = await aiockpt.save(state, path)
    return meta.nbytes


async def _load_2d_into_1d(rank: int, world: int, path: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    zeros = torch.zeros(6, 10)
    state: dict[str, object] = {
        "both": distribute_tensor(zeros, mesh, [Shard(1)]),
        "rows": distribute_tensor(zeros, mesh, [Shard(0)]),
        "repl": distribute_tensor(zeros, mesh, [Shard(1)]),
        "plain": torch.zeros(6, 10),
        "tp_only": distribute_tensor(zeros, mesh, [Shard(1)]),
    }
    await aiockpt.load(state, path)
    base = torch.arange(60, dtype=torch.float32).reshape(6, 10)
    for key, factor in (("both", 1), ("rows", 2), ("repl", 3), ("tp_only", 5)):
        full = state[key].full_tensor()  # type: ignore[attr-defined]
        assert torch.equal(full, base * factor), key
    assert torch.equal(state["plain"], base * 4)  # type: ignore[arg-type]


def test_2d_mesh_writes_unique_bytes_once_and_reshards(tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    nbytes = run_world(_save_2d, 4, tmp_path, path)
    unique = 5 * 6 * 10 * 4
    assert nbytes == [unique] * 4
    on_disk = sum(f.stat().st_size for f in Path(path).glob("data-*.bin"))
    assert unique <= on_disk < unique + 4 * 4096  # alignment padding only
    run_world(_load_2d_into_1d, 2, tmp_path, path)


async def _save_parts_a_load_would_refuse(rank: int, world: int, root: str, how: str) -> list[str]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    dt = distribute_tensor(torch.arange(10.0), mesh, [Shard(0)])
    if how == "dtensor_and_plain":  # the same values, a DTensor on rank 0 and a plain tensor on rank 1
        whole = dt.full_tensor()
        bad: object = dt if rank == 0 else whole
    else:  # shards of 6 and 4 elements, where torch's split is 5 and 5
        local = torch.arange(10.0)[:6] if rank == 0 else torch.arange(10.0)[6:]
        bad = DTensor.from_local(
            local, mesh, [Shard(0)], run_check=False, shape=torch.Size((10,)), stride=(1,)
        )
    async with aiockpt.Checkpointer(root, keep_last=1) as ckpt:
        await ckpt.save({"x": dt}, step=1)
        try:
            await ckpt.save({"x": bad}, step=2)
        except aiockpt.CheckpointError as exc:
            error = f"{type(exc).__name__}: {exc}"
        else:
            error = "saved"
        target = distribute_tensor(torch.zeros(10), mesh, [Shard(0)])
        await ckpt.load({"x": target})  # step 1, still there
        assert torch.equal(target.full_tensor(), torch.arange(10.0))
        return [error, str(ckpt.steps())]


@pytest.mark.parametrize("how", ["dtensor_and_plain", "own_shard_sizes"])
def test_parts_of_a_tensor_that_a_load_would_refuse_fail_the_save_on_every_rank(
    tmp_path: Path, how: str
) -> None:
    """Such saves were published (rank 0 said saved, retention deleted step 1, latest named step 2) and
    every load refused them: the ranks' boxes of 'x' overlapped."""
    root = tmp_path / "root"
    results = run_world(_save_parts_a_load_would_refuse, 2, tmp_path, str(root), how, timeout=90)
    for rank, (error, steps) in enumerate(results):
        assert steps == "[1]", (rank, error)
        assert error.startswith(("StateError", "DistributedError")), (rank, error)
    first = results[0][0]
    if how == "dtensor_and_plain":
        assert "ranks 0 and 1 hold overlapping parts of tensor 'x'" in first
        assert all(r[0].startswith("StateError") for r in results)  # every rank makes the same plan
    else:
        assert "DTensor at key 'x': its local shard is [6]" in first
    assert (root / "latest").read_text().strip() == "step-00000001"


async def _save_with_a_group_of_others(rank: int, world: int, root: str) -> list[str]:
    group = dist.new_group([1])  # (every rank makes it; rank 0 is not in it)
    errors = []
    if rank == 0:
        for call in (
            lambda: aiockpt.save({"w": torch.ones(2)}, f"{root}/one", process_group=group),
            lambda: aiockpt.save(
                {"w": torch.ones(2)}, f"{root}/two", process_group=group, use_collectives=False
            ),
            lambda: aiockpt.Checkpointer(f"{root}/ckpts", process_group=group).open(),
        ):
            try:
                await call()
            except aiockpt.CheckpointError as exc:
                errors.append(str(exc))
    return errors


def test_a_process_outside_the_group_it_passes_is_told_so(tmp_path: Path) -> None:
    """``dist.new_group`` gives a non-member a placeholder (an int), which failed with an AttributeError."""
    errors, _ = run_world(_save_with_a_group_of_others, 2, tmp_path, str(tmp_path), timeout=60)
    assert len(errors) == 3
    assert all("this process (global rank 0) is not a member of the process_group" in e for e in errors)
    assert not any((tmp_path / name).exists() for name in ("one", "two"))


async def _strict_load_with_an_extra_key_on_rank_1(rank: int, world: int, path: str) -> str:
    await aiockpt.save({"w": torch.ones(2)}, path)
    target: dict[str, object] = {"w": torch.zeros(2)}
    if rank == 1:
        target["extra"] = torch.zeros(1)
    try:
        await aiockpt.load(target, path)
    except aiockpt.StateMismatchError as exc:
        return f"{exc.rank}: {exc}"
    return "loaded"


def test_a_strict_load_names_the_rank_whose_state_differs(tmp_path: Path) -> None:
    """Each rank loads alone: the error named the key, not which rank's state it was missing from."""
    results = run_world(
        _strict_load_with_an_extra_key_on_rank_1, 2, tmp_path, str(tmp_path / "c"), timeout=60
    )
    assert results[0] == "loaded"
    assert results[1].startswith("1: checkpoint and state on rank 1 differ in 1 place(s)")
    assert "extra: missing key" in results[1]


async def _fail_in_write(rank: int, world: int, path: str, how: str) -> str:
    import aiockpt._save as save_pipeline

    real_write = vars(save_pipeline)["write"]

    async def faulty(*args: Any, **kwargs: Any) -> Any:
        if rank == 1:
            if how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise aiockpt.StorageError("injected: the disk of rank 1 failed")
        return await real_write(*args, **kwargs)

    vars(save_pipeline)["write"] = faulty  # fault injection inside this rank's process only
    state = {"w": torch.full((1000,), float(rank)), "shared": torch.ones(10)}
    try:
        await aiockpt.save(state, path, collective_timeout=15)
    except aiockpt.DistributedError as exc:
        return f"DistributedError ranks={list(exc.ranks)}: {exc}"
    except aiockpt.StorageError as exc:
        return f"StorageError: {exc}"
    return "saved"


def _no_trace(parent: Path) -> None:
    assert not (parent / "ckpt").exists()
    assert [p.name for p in parent.iterdir() if p.name.startswith(".tmp")] == []


def test_a_rank_that_raises_mid_write_aborts_every_rank(tmp_path: Path) -> None:
    parent = tmp_path / "out"
    results = run_world(_fail_in_write, 3, tmp_path, str(parent / "ckpt"), "raise")
    assert results[1].startswith("StorageError: injected")
    assert results[0].startswith("DistributedError ranks=[1]")
    assert "injected" in results[0]
    # Rank 2 learns of it from rank 0's outcome, which names the rank that failed (it named rank 0).
    assert results[2].startswith("DistributedError ranks=[1]: rank 0 did not publish"), results[2]
    assert "injected" in results[2]
    _no_trace(parent)


def test_a_rank_killed_mid_save_gives_an_error_not_a_hang(tmp_path: Path) -> None:
    parent = tmp_path / "out"
    results = run_world(_fail_in_write, 2, tmp_path, str(parent / "ckpt"), "kill", expect_failure={1})
    assert results[1] is None
    # Rank 0 names the dead rank: rank 1 never marked its arrival at the vote.
    assert results[0].startswith("DistributedError ranks=[1]"), results[0]
    assert "rank(s) 1 never reached it" in results[0]
    _no_trace(parent)


async def _die_in_write_on_rank_0(rank: int, world: int, root: str) -> list[str]:
    import aiockpt._save as save_pipeline

    outcomes = []
    async with aiockpt.Checkpointer(root, collective_timeout=15) as ck:
        await ck.save({"w": torch.full((1000,), float(rank))}, step=1)
        real_write = vars(save_pipeline)["write"]

        async def dying(*args: Any, **kwargs: Any) -> Any:
            if rank == 0:
                os._exit(3)  # (and the job's store with it)
            return await real_write(*args, **kwargs)

        vars(save_pipeline)["write"] = dying
        for step in (2, 3):
            try:
                await ck.save({"w": torch.full((1000,), float(rank))}, step=step)
                outcomes.append("saved")
            except aiockpt.DistributedError as exc:
                outcomes.append(f"ranks={list(exc.ranks)}: {exc}")
    return outcomes


def test_a_dead_rank_that_hosted_the_store_is_not_said_to_have_reached_the_collective(
    tmp_path: Path,
) -> None:
    """Rank 0 of torchrun hosts the job's store: dead, the marks of who arrived cannot be read.

    The error said "every rank reached it, so one died or hung inside it", of a collective rank 0 never
    reached; it says which rank failed is unknown.
    """
    results = run_world(
        _die_in_write_on_rank_0, 3, tmp_path, str(tmp_path / "c"), expect_failure={0}, tcp_store=True
    )
    for survivor in results[1:]:
        assert len(survivor) == 2, survivor
        assert "which rank failed is unknown (the job's store cannot be reached" in survivor[0], survivor
        assert "every rank reached it" not in survivor[0]
        assert survivor[0].startswith("ranks=[]")


async def _end_a_save_before_it_begins_on_rank_1(rank: int, world: int, root: str, how: str) -> list[str]:
    """Rank 1's save of step 2 ends before its protocol begins; then every rank saves steps 3 and 4."""
    outcomes = []
    state = {"w": torch.full((1 << 16,), float(rank))}
    async with aiockpt.Checkpointer(root, collective_timeout=30) as ck:
        first = await ck.save(state, step=1, async_op=True)
        try:
            if rank == 1 and how == "cancelled":  # while it waits for the slot the save of step 1 holds
                await asyncio.wait_for(ck.save(state, step=2, async_op=True), 0.001)
            elif rank == 1:
                await ck.save(state, step=2, metadata={"note": "bad\udcff"})
            else:
                await ck.save(state, step=2)
            outcomes.append("saved")
        except (aiockpt.CheckpointError, TimeoutError) as exc:
            outcomes.append(f"{type(exc).__name__} ranks={list(getattr(exc, 'ranks', []))}: {exc}")
        await first
        for step in (3, 4):
            await ck.save(state, step=step)
        outcomes.append(f"steps={ck.steps()}")
    return outcomes


@pytest.mark.parametrize("how", ["cancelled", "refused"])
def test_a_save_one_rank_ends_before_it_begins_fails_on_every_rank_and_the_next_saves_work(
    tmp_path: Path, how: str
) -> None:
    """The other ranks waited for it in the plan exchange until the collective timeout broke the group,
    or (rank 1 saving again at once) met its next save there, and every later save failed."""
    results = run_world(_end_a_save_before_it_begins_on_rank_1, 2, tmp_path, str(tmp_path / "c"), how)
    ending = "cancelled" if how == "cancelled" else "StateError: cannot save metadata key 'note'"
    assert results[0][0].startswith(
        f"DistributedError ranks=[1]: the save was aborted in 'plan' (rank 1: {ending}"
    )
    assert results[1][0].startswith("TimeoutError" if how == "cancelled" else "StateError")
    assert results[0][1] == results[1][1] == "steps=[1, 3, 4]"
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == [
        "latest",
        *(f"step-{s:08d}" for s in (1, 3, 4)),
    ]


async def _module_save_refused_on_rank_1(rank: int, world: int, parent: str) -> list[str]:
    outcomes = []
    state = {"w": torch.full((100,), float(rank))}
    for name, metadata in (("a", {"note": "bad\udcff" if rank == 1 else "fine"}), ("b", {"note": "fine"})):
        started = time.monotonic()
        try:
            await aiockpt.save(state, f"{parent}/{name}", metadata=metadata, collective_timeout=60)
            outcomes.append("saved")
        except aiockpt.CheckpointError as exc:
            outcomes.append(f"{type(exc).__name__} after {time.monotonic() - started:.0f} s: {exc}")
    return outcomes


def test_a_module_level_save_one_rank_refuses_fails_on_every_rank_at_once(tmp_path: Path) -> None:
    results = run_world(_module_save_refused_on_rank_1, 2, tmp_path, str(tmp_path))
    assert results[0][0].startswith("DistributedError after 0 s: the save was aborted in 'plan' (rank 1:")
    assert results[1][0].startswith("StateError after 0 s: cannot save metadata key 'note'")
    assert results[0][1] == results[1][1] == "saved"
    assert not (tmp_path / "a").exists()


async def _checkpointer_run(rank: int, world: int, root: str) -> tuple[list[int], int | None]:
    model, opt = _fsdp(world)
    state = {"model": model, "optim": opt}
    async with aiockpt.Checkpointer(root, keep_last=2) as ckpt:
        for step in (10, 20, 30):
            model(torch.randn(2, 8)).sum().backward()
            opt.step()
            handle = await ckpt.save(state, step=step, async_op=True)
            await handle
        expected = _full(model.state_dict())
        fresh_model, fresh_opt = _fsdp(world)
        loaded = await ckpt.load({"model": fresh_model, "optim": fresh_opt})
        _assert_same(_full(fresh_model.state_dict()), expected, f"rank {rank}")
        dist.barrier()
    # Two saves in flight would reach their collectives in different orders on different ranks.
    with pytest.raises(aiockpt.CheckpointError, match="max_inflight=2"):
        await aiockpt.Checkpointer(root, max_inflight=2).open()
    with pytest.raises(aiockpt.CheckpointError, match="on_busy='skip'"):
        await aiockpt.Checkpointer(root, on_busy="skip").open()
    # Per-rank state through a Checkpointer: each rank's own keys and values come back to it.
    async with aiockpt.Checkpointer(Path(root).parent / "per-rank") as other:
        await other.save({"w": torch.ones(2), "rng": {f"rank{rank}": torch.full((3,), rank)}}, step=1)
        target: dict[str, Any] = {
            "w": torch.zeros(2),
            "rng": {f"rank{rank}": torch.zeros(3, dtype=torch.long)},
        }
        await other.load(target)
        assert torch.equal(target["rng"][f"rank{rank}"], torch.full((3,), rank))
        assert list((await other.read())["rng"]) == [f"rank{rank}"]  # type: ignore[call-overload]
    return ckpt.steps(), loaded


def test_checkpointer_across_ranks(tmp_path: Path) -> None:
    root = tmp_path / "root"
    results = run_world(_checkpointer_run, 2, tmp_path, str(root))
    assert results == [([20, 30], 30), ([20, 30], 30)]
    assert (root / "latest").read_text().strip() == "step-00000030"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-00000020", "step-00000030"]


async def _save_across_a_new_default_group(rank: int, world: int, tmp: str) -> list[int]:
    """Save on the default group, then on a new default group of one (as after an in-process restart)."""
    sizes = [(await aiockpt.save({"x": torch.tensor([rank])}, Path(tmp) / "before")).world_size]
    dist.destroy_process_group()
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store-alone-{rank}", rank=0, world_size=1)
    try:
        # A checkpoint group left from the old world would exchange with the other process here.
        alone = await aiockpt.save({"x": torch.tensor([rank])}, Path(tmp) / f"alone-{rank}")
        sizes.append(alone.world_size)
    finally:
        dist.destroy_process_group()
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store-again", rank=rank, world_size=world)
    # And the default group made again for both: a checkpoint group of its own once more.
    sizes.append((await aiockpt.save({"x": torch.tensor([rank])}, Path(tmp) / "after")).world_size)
    return sizes


def test_a_new_default_group_gets_a_checkpoint_group_of_its_own(tmp_path: Path) -> None:
    assert run_world(_save_across_a_new_default_group, 2, tmp_path, str(tmp_path)) == [[2, 1, 2], [2, 1, 2]]
    loaded: dict[str, Any] = {"x": torch.tensor([-1])}
    aiockpt.sync.load(loaded, tmp_path / "alone-1")
    assert loaded["x"].item() == 1


async def _save_collective_free(rank: int, world: int, path: str, skip_rank: int) -> list[str]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    state = {
        "sharded": distribute_tensor(torch.arange(50.0).reshape(10, 5), mesh, [Shard(0)]),
        "replicated": torch.full((4,), 7.0),
        "rank": rank,
    }
    if rank != skip_rank:
        meta = await aiockpt.save(state, path, use_collectives=False)
        assert meta.world_size == world
    return sorted(p.name for p in Path(path).iterdir()) if Path(path).exists() else []


async def test_collective_free_saves_merge_on_load(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    listing = run_world(_save_collective_free, 2, tmp_path, str(path), -1)
    parts = ["rank-00000-of-00002", "rank-00001-of-00002"]
    assert sorted(p.name for p in path.iterdir()) == parts
    # Each rank wrote only its own part: while a rank lists the directory, the other may still be
    # writing its part, in a temp directory beside it (with its lock file), and nothing else.
    assert all(
        name in parts or any(name.startswith(f"{TMP_PREFIX}{part}-") for part in parts)
        for names in listing
        for name in names
    ), listing
    tree = await aiockpt.read(path)
    assert torch.equal(tree["sharded"], torch.arange(50.0).reshape(10, 5))  # type: ignore[arg-type]
    assert torch.equal(tree["replicated"], torch.full((4,), 7.0))  # type: ignore[arg-type]
    assert tree["rank"] == 0  # the structure and plain values are rank 0's


async def test_collective_free_checkpoint_with_a_missing_part_is_incomplete(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    run_world(_save_collective_free, 3, tmp_path, str(path), 1)
    with pytest.raises(aiockpt.CheckpointNotFoundError, match=r"ranks \[1\] \(of 3\)"):
        await aiockpt.read(path)


async def _checkpointer_collective_free(rank: int, world: int, root: str) -> list[int]:
    state = {"w": torch.full((8,), float(rank)), "step": 0}
    async with aiockpt.Checkpointer(root, keep_last=1, use_collectives=False) as ckpt:
        for step in (1, 2):
            state["step"] = step
            await ckpt.save(state, step=step)
        dist.barrier()  # every part of step 2 is published
        target: dict[str, object] = {"w": torch.zeros(8), "step": 0}
        assert await ckpt.load(target) == 2
        assert target["step"] == 2
        return await ckpt.refresh()


def test_checkpointer_without_collectives(tmp_path: Path) -> None:
    root = tmp_path / "root"
    assert run_world(_checkpointer_collective_free, 2, tmp_path, str(root)) == [[2], [2]]
    assert (root / "latest").read_text().strip() == "step-00000002"
    assert sorted(p.name for p in (root / "step-00000002").iterdir()) == [
        "rank-00000-of-00002",
        "rank-00001-of-00002",
    ]


async def _load_from_a_sub_group_save(rank: int, world: int, path: str) -> str:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    dt = distribute_tensor(torch.arange(8.0), mesh, [Shard(0)])
    group = dist.new_group([0])  # (every rank makes it)
    if rank == 0:
        await aiockpt.save({"dt": dt}, path, process_group=group)  # holds only rank 0's half
    dist.barrier()
    plain: dict[str, object] = {"dt": torch.full((8,), -1.0)}
    with pytest.raises(aiockpt.CorruptionError, match=r"key 'dt' .*elements \[4:8\]"):
        await aiockpt.load(plain, path)
    assert torch.equal(plain["dt"], torch.full((8,), -1.0))  # type: ignore[arg-type]
    # A rank whose shard the checkpoint holds loads it; the other is refused, naming its shard.
    target = distribute_tensor(torch.zeros(8), mesh, [Shard(0)])
    try:
        await aiockpt.load({"dt": target}, path)
    except aiockpt.CorruptionError as exc:
        return str(exc)
    assert torch.equal(target.to_local(), torch.arange(4.0))
    return "loaded"


def test_a_load_refuses_chunks_that_do_not_cover_its_target(tmp_path: Path) -> None:
    # A save over a sub-group that held half of a DTensor: loads used to leave the rest as it was.
    loaded, refused = run_world(_load_from_a_sub_group_save, 2, tmp_path, str(tmp_path / "ckpt"), timeout=60)
    assert loaded == "loaded"
    assert "key 'dt'" in refused
    assert "elements [4:8], wanted by this rank's shard [4:8]" in refused


async def _saves_over_overlapping_sub_groups(rank: int, world: int, root: str) -> list[str]:
    groups = {(0, 1): dist.new_group([0, 1]), (1, 2): dist.new_group([1, 2])}  # (every rank makes both)
    done = []
    for members, group in groups.items():
        if rank in members:
            name = "-".join(map(str, members))
            await aiockpt.save({"w": torch.full((4,), float(rank))}, f"{root}/{name}", process_group=group)
            done.append(name)
        dist.barrier()
    return done


def test_saves_over_sub_groups_that_share_a_rank(tmp_path: Path) -> None:
    """Rank 1 saves over [0, 1], then with rank 2 over [1, 2].

    aiockpt's checkpoint group was made with ``dist.new_group(use_local_synchronization=True)``, which
    names a group of some ranks by counting every group the calling process belongs to: after the first
    save rank 1 had made one more than rank 2, the two waited under different names, and the second save
    failed after its collective timeout on both.
    """
    done = run_world(_saves_over_overlapping_sub_groups, 3, tmp_path, str(tmp_path), timeout=90)
    assert done == [["0-1"], ["0-1", "1-2"], ["1-2"]]
    for name in ("0-1", "1-2"):
        assert (tmp_path / name / "manifest.msgpack").exists()


async def _load_tied_into_separate_dtensors(rank: int, world: int, path: str) -> list[str]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    full = torch.arange(24.0).reshape(6, 4)
    tied = distribute_tensor(full, mesh, [Shard(0)])
    await aiockpt.save({"emb": tied, "head": tied}, path)  # one tensor, saved once under two keys

    def dt(*placements: Any) -> torch.Tensor:
        return distribute_tensor(torch.zeros(6, 4), mesh, list(placements))

    shared = dt(Shard(0))
    targets: dict[str, dict[str, object]] = {
        "the same layout": {"emb": dt(Shard(0)), "head": dt(Shard(0))},
        "another layout": {"emb": dt(Shard(0)), "head": dt(Shard(1))},
        "replicated second": {"emb": dt(Shard(0)), "head": dt(Replicate())},
        "a plain second": {"emb": dt(Shard(1)), "head": torch.zeros(6, 4)},
        "one DTensor twice": {"emb": shared, "head": shared},
    }
    wrong = []
    for name, target in targets.items():
        await aiockpt.load(target, path)
        for key, value in target.items():
            assert isinstance(value, torch.Tensor)
            got = value.full_tensor() if hasattr(value, "full_tensor") else value
            if not torch.equal(got, full):
                wrong.append(f"{name}: {key} = {got.tolist()}")
    return wrong


def test_tied_checkpoint_keys_fill_every_separate_dtensor_target(tmp_path: Path) -> None:
    # The second DTensor target of a tensor saved once under two keys used to be skipped silently.
    assert run_world(_load_tied_into_separate_dtensors, 2, tmp_path, str(tmp_path / "ckpt"), timeout=60) == [
        [],
        [],
    ]


def _per_rank_state(rank: int) -> dict[str, Any]:
    """State of ``rank`` whose every key but "model", "big" and "same" differs between ranks."""
    torch.manual_seed(100 + rank)
    return {
        "model": torch.ones(100),
        "rng": torch.get_rng_state(),  # a different generator state on each rank
        "pos": rank * 100,  # a dataloader's position
        "dl": {f"dp_rank_{rank}": b"x" * (rank + 1)},  # keys that name the rank (torchtitan's dataloader)
        "buf": torch.arange(rank + 3),  # a shape per rank
        "big": torch.full((40_000,), 1.0),  # 160 KB, the same everywhere
        "same": 5,
    }


def _template(rank: int) -> dict[str, Any]:
    return {
        "model": torch.zeros(100),
        "rng": torch.zeros_like(torch.get_rng_state()),
        "pos": -1,
        "dl": {f"dp_rank_{rank}": b""},
        "buf": torch.zeros(rank + 3, dtype=torch.long),
        "big": torch.zeros(40_000),
        "same": 0,
    }


def _differences(expected: dict[str, Any], actual: Mapping[Any, object]) -> list[str]:
    wrong = []
    for key, want in expected.items():
        got = actual.get(key)
        same = (
            isinstance(got, torch.Tensor) and torch.equal(got, want)
            if isinstance(want, torch.Tensor)
            else got == want
        )
        if not same:
            wrong.append(key)
    return wrong


async def _save_and_load_per_rank(rank: int, world: int, path: str) -> list[str]:
    await aiockpt.save(_per_rank_state(rank), path)
    target = _template(rank)
    await aiockpt.load(target, path)  # strict: each rank finds exactly its own keys
    tree = await aiockpt.read(path)
    return _differences(_per_rank_state(rank), target) + _differences(_per_rank_state(rank), tree)


async def test_per_rank_state_comes_back_to_each_rank(tmp_path: Path) -> None:
    """Values that differ per rank (an RNG state, a position, keys naming the rank, a shape per rank)
    used to be saved as rank 0's, silently, or not at all (keys rank 0 lacked): each rank loaded rank 0's
    RNG state, and rank 1 could not load its dataloader state."""
    from aiockpt._format import RanksNode
    from aiockpt._load import read_manifest

    path = tmp_path / "ckpt"
    assert run_world(_save_and_load_per_rank, 3, tmp_path, str(path), timeout=90) == [[], [], []]
    manifest = read_manifest(path)
    assert manifest.format_version == 3
    tree = dict(zip(manifest.tree.keys, manifest.tree.values, strict=True))
    assert {k for k, v in tree.items() if isinstance(v, RanksNode)} == {"rng", "pos", "buf"}
    dl = tree["dl"]
    assert dl.keys == ("dp_rank_0", "dp_rank_1", "dp_rank_2")  # type: ignore[union-attr]
    assert [n.ranks for n in dl.values] == [(0,), (1,), (2,)]  # type: ignore[union-attr]
    # Shared tensors are written once; each rank wrote its own RNG state and buffer, in its own file.
    entries: dict[str, list[str]] = {}
    for t in manifest.tensors:
        entries.setdefault("/".join(map(str, t.path)), []).extend(c.file for c in t.chunks)
    assert entries == {
        "model": [entries["model"][0]],
        "big": [entries["big"][0]],
        "rng": ["data-r00000.bin", "data-r00001.bin", "data-r00002.bin"],
        "buf": ["data-r00000.bin", "data-r00001.bin", "data-r00002.bin"],
    }
    assert not (await aiockpt.verify(path)).problems
    # Outside a job, a read is rank 0's; ``rank=`` picks another's.
    assert _differences(_per_rank_state(0), await aiockpt.read(path)) == []
    assert _differences(_per_rank_state(2), await aiockpt.read(path, rank=2)) == []


async def _save_the_same_state(rank: int, world: int, path: str) -> None:
    await aiockpt.save({"w": torch.ones(10), "n": 3, "small": torch.arange(5)}, path)


def test_state_alike_on_every_rank_stays_in_format_2(tmp_path: Path) -> None:
    # No per-rank state: no tree exchange, and a manifest older aiockpt releases read.
    from aiockpt._load import read_manifest

    path = tmp_path / "ckpt"
    run_world(_save_the_same_state, 2, tmp_path, str(path), timeout=60)
    assert read_manifest(path).format_version == 2


async def _dtensor_under_per_rank_state(rank: int, world: int, path: str) -> str:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    dt = distribute_tensor(torch.arange(8.0), mesh, [Shard(0)])
    try:
        await aiockpt.save({"w": torch.ones(2), f"mine{rank}": {"dt": dt}}, path)
    except aiockpt.StateError as exc:
        return str(exc)
    return "saved"


def test_a_dtensor_under_per_rank_keys_is_refused_on_every_rank(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    results = run_world(_dtensor_under_per_rank_state, 2, tmp_path, str(path), timeout=60)
    assert all("holds a DTensor at key 'mine0/dt'" in r for r in results), results
    assert not path.exists()


async def _fail_before_trees(rank: int, world: int, path: str) -> str:
    import aiockpt._save._ranks as ranks

    real = ranks.encode_rank_tree

    def faulty(message: ranks.RankTree) -> bytes:
        if rank == 1:
            raise aiockpt.StorageError("injected: rank 1 failed before the trees exchange")
        return real(message)

    ranks.encode_rank_tree = faulty  # fault injection inside this rank's process only
    try:
        await aiockpt.save(
            {"w": torch.ones(4), "rng": torch.full((3,), float(rank))}, path, collective_timeout=15
        )
    except aiockpt.CheckpointError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "saved"


def test_a_rank_failing_before_the_trees_exchange_aborts_every_rank(tmp_path: Path) -> None:
    # Per-rank state adds an exchange; a rank failing there still takes part in it, so the others learn
    # at once (no timeout) and nothing is published.
    parent = tmp_path / "out"
    results = run_world(_fail_before_trees, 2, tmp_path, str(parent / "ckpt"), timeout=60)
    assert results[1].startswith("StorageError: injected")
    assert results[0].startswith("DistributedError: the save was aborted in 'trees' (rank 1: StorageError")
    _no_trace(parent)


async def _collective_free_per_rank(rank: int, world: int, path: str) -> list[str]:
    await aiockpt.save(_per_rank_state(rank), path, use_collectives=False)
    dist.barrier()  # (every part published)
    target = _template(rank)
    await aiockpt.load(target, path)
    return _differences(_per_rank_state(rank), target)


def test_collective_free_per_rank_state_comes_back_to_each_rank(tmp_path: Path) -> None:
    # Each part holds its rank's state: the merge was rank 0's tree (rank 1's RNG state read as rank
    # 0's, its own dataloader key refused).
    path = tmp_path / "ckpt"
    assert run_world(_collective_free_per_rank, 2, tmp_path, str(path), timeout=60) == [[], []]


async def _two_checkpointers_in_flight(rank: int, world: int, tmp: str) -> list[str]:
    """Two Checkpointers of one group, an async save in flight on each; rank 0 writes much for ``a`` and
    little for ``b``, rank 1 the other way round, so their writes end in opposite orders."""
    large, tiny = torch.arange(1 << 22, dtype=torch.float32), torch.arange(8, dtype=torch.float32)
    async with (
        aiockpt.Checkpointer(Path(tmp) / "a", collective_timeout=60) as a,
        aiockpt.Checkpointer(Path(tmp) / "b", collective_timeout=60) as b,
    ):
        first = await a.save({f"r{rank}": large if rank == 0 else tiny}, step=1, async_op=True)
        second = await b.save({f"r{rank}": tiny if rank == 0 else large}, step=1, async_op=True)
        return [(await first).path, (await second).path]


def test_two_checkpointers_of_one_group_save_at_once(tmp_path: Path) -> None:
    """Their exchanges met out of order on the two ranks (each save named by its directory's name only,
    ``step-00000001`` for both), and rank 0 committed checkpoints built from the other save's votes:
    reported as saved, then unreadable."""
    run_world(_two_checkpointers_in_flight, 2, tmp_path, str(tmp_path))
    for name, sizes in (("a", (1 << 22, 8)), ("b", (8, 1 << 22))):
        path = tmp_path / name / "step-00000001"
        for rank, numel in enumerate(sizes):
            tree = aiockpt.sync.read(path, rank=rank)
            assert torch.equal(
                cast("torch.Tensor", tree[f"r{rank}"]), torch.arange(numel, dtype=torch.float32)
            )


async def _save_to_a_path_of_its_own(rank: int, world: int, tmp: str) -> str:
    try:
        await aiockpt.save({"x": torch.ones(4)}, Path(tmp) / f"node{rank}" / "ckpt")
    except aiockpt.DistributedError as exc:
        return str(exc)
    return "saved"


def test_ranks_saving_to_other_paths_fail_alike_before_writing(tmp_path: Path) -> None:
    """Rank 0 committed its own path and returned, rank 1 (holding no bytes to write) failed with a raw
    FileNotFoundError reading a manifest from its own path."""
    results = run_world(_save_to_a_path_of_its_own, 2, tmp_path, str(tmp_path))
    for rank, message in enumerate(results):
        assert f"node{rank}/ckpt' met another save in its 'plan' exchange" in message, message
        assert f"node{1 - rank}/ckpt" in message
    assert not (tmp_path / "node0" / "ckpt").exists()
    assert [p.name for p in (tmp_path / "node0").iterdir()] == []  # no temp data either


async def _alternate_timeouts(rank: int, world: int, tmp: str) -> int:
    from aiockpt import _dist

    for i in range(4):
        async with aiockpt.Checkpointer(Path(tmp) / "root", collective_timeout=100) as ckpt:
            await ckpt.save({"x": torch.ones(2)}, step=i)
        await aiockpt.save({"x": torch.ones(2)}, Path(tmp) / f"plain-{i}")  # the default timeout
    return len(_dist._worlds)


def test_checkpoint_groups_of_two_timeouts_are_made_once_each(tmp_path: Path) -> None:
    """Each switch between two timeouts made a new gloo group, never destroyed: 5 sockets more a time."""
    assert run_world(_alternate_timeouts, 2, tmp_path, str(tmp_path)) == [2, 2]
