"""Load semantics: into fresh objects, strict by default, partial with strict=False, in place."""

from __future__ import annotations

import math
import os
from itertools import pairwise
from pathlib import Path
from typing import Any, cast

import anyio.to_thread
import crc32c
import msgspec
import pytest
import torch
from conftest import (
    assert_tree_equal,
    flip_byte,
    make_model,
    make_optimizer,
    make_scheduler,
    snapshot,
    tensor_at,
    tensors_in,
    train_step,
)

import aiockpt
import aiockpt._load
from aiockpt import StateMismatchError, StateMismatchWarning
from aiockpt._format import MANIFEST_NAME
from aiockpt._load._manifest import decode_manifest
from aiockpt._save._finish import encode_manifest

pytestmark = pytest.mark.timeout(60)


def mismatch_state() -> dict[str, object]:
    return {
        "same": torch.arange(6, dtype=torch.float32),
        "shape": torch.ones(2, 2),
        "dtype": torch.ones(4, dtype=torch.float32),
        "only_in_ckpt": torch.ones(1),
        "nested": {"x": torch.full((3,), 7.0), "gone": torch.zeros(2)},
    }


def mismatch_target() -> dict[str, object]:
    return {
        "same": torch.zeros(6),
        "shape": torch.zeros(3, 3),  # shape differs
        "dtype": torch.zeros(4, dtype=torch.int64),  # dtype differs
        "only_in_target": torch.zeros(1),  # missing from the checkpoint
        "nested": {"x": torch.zeros(3), "extra": torch.zeros(1)},  # "gone" unexpected, "extra" missing
    }


MISMATCHED_KEYS = ("shape", "dtype", "only_in_ckpt", "only_in_target", "nested/gone", "nested/extra")


# --- Resume into freshly built objects ------------------------------------------------------------------


async def test_resume_into_fresh_model_and_never_stepped_optimizer(ckpt_path: Path) -> None:
    model = make_model(0)
    opt = make_optimizer(model)
    sched = make_scheduler(opt)
    for i in range(3):
        train_step(model, opt, sched, i)
    state: dict[str, object] = {"model": model, "optim": opt, "sched": sched, "step": 3}
    await aiockpt.save(state, ckpt_path)

    model2 = make_model(1)  # different initial weights
    opt2 = make_optimizer(model2)
    sched2 = make_scheduler(opt2)
    assert opt2.state_dict()["state"] == {}  # never stepped: no per-parameter state to load into
    assert not torch.equal(next(model2.parameters()), next(model.parameters()))
    state2: dict[str, object] = {"model": model2, "optim": opt2, "sched": sched2, "step": 0}
    result = await aiockpt.load(state2, ckpt_path)

    assert result is state2
    assert state2["model"] is model2
    assert state2["optim"] is opt2
    assert state2["sched"] is sched2
    assert state2["step"] == 3
    assert_tree_equal(model2.state_dict(), model.state_dict())
    assert_tree_equal(opt2.state_dict(), opt.state_dict())
    assert_tree_equal(sched2.state_dict(), sched.state_dict())
    # The optimizer state is live: it steps exactly like the original.
    for i in range(3, 5):
        train_step(model, opt, sched, i)
        train_step(model2, opt2, sched2, i)
    assert_tree_equal(model2.state_dict(), model.state_dict())
    assert_tree_equal(opt2.state_dict(), opt.state_dict())
    assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]


async def test_an_older_torchs_optimizer_groups_keep_the_new_settings(ckpt_path: Path) -> None:
    """An older torch's param groups lack settings added since; torch's load_state_dict takes them."""
    model = make_model(0)
    opt = make_optimizer(model)  # AdamW, lr=0.01, weight_decay=0.1
    train_step(model, opt, None, 0)
    old = opt.state_dict()
    new_settings = ("decoupled_weight_decay", "fused", "capturable", "differentiable")
    old["param_groups"] = [{k: v for k, v in g.items() if k not in new_settings} for g in old["param_groups"]]
    await aiockpt.save({"optim": old}, ckpt_path)

    opt2 = torch.optim.AdamW(make_model(1).parameters(), lr=0.5)
    await aiockpt.load({"optim": opt2}, ckpt_path)  # strict: no difference reported
    group = opt2.param_groups[0]
    assert (group["lr"], group["weight_decay"]) == (0.01, 0.1)  # the checkpoint's
    assert group["decoupled_weight_decay"] is True  # AdamW's own, not Adam's default of False
    assert_tree_equal(opt2.state_dict()["state"], opt.state_dict()["state"])

    # A group without its parameters or a hyperparameter (the group of another optimizer) is still a
    # difference, and so are missing keys elsewhere.
    broken = {"state": old["state"], "param_groups": [{"lr": 0.01}]}
    await aiockpt.save({"optim": broken}, ckpt_path.with_name("broken"))
    with pytest.raises(StateMismatchError, match="param_groups/0/params: missing key") as info:
        await aiockpt.load(
            {"optim": torch.optim.AdamW(make_model(1).parameters())}, ckpt_path.with_name("broken")
        )
    assert "param_groups/0/betas: missing key" in str(info.value)
    assert "param_groups/0/fused" not in str(info.value)
    plain = torch.optim.AdamW(make_model(1).parameters()).state_dict()  # not the optimizer: strict
    with pytest.raises(StateMismatchError, match="param_groups/0/fused: missing key"):
        await aiockpt.load({"optim": plain}, ckpt_path)


async def test_an_older_torchs_lr_scheduler_loads_strictly(ckpt_path: Path) -> None:
    """An older torch's scheduler state lacks ``_is_initial`` and has ``verbose``; torch takes both."""
    opt = make_optimizer(make_model(0))
    sched = make_scheduler(opt)  # StepLR
    for _ in range(3):
        opt.step()
        sched.step()
    old = {k: v for k, v in sched.state_dict().items() if k != "_is_initial"} | {"verbose": False}
    await aiockpt.save({"sched": old}, ckpt_path)

    sched2 = make_scheduler(make_optimizer(make_model(1)))
    await aiockpt.load({"sched": sched2}, ckpt_path)
    assert (sched2.last_epoch, sched2.get_last_lr()) == (3, sched.get_last_lr())
    by_torch = make_scheduler(make_optimizer(make_model(1)))
    by_torch.load_state_dict(old)
    assert sched2.state_dict() == by_torch.state_dict()  # its own `_is_initial` kept, as torch keeps it

    del old["last_epoch"]  # any other key it lacks is still missing, for any scheduler
    await aiockpt.save({"sched": old}, ckpt_path.with_name("no-epoch"))
    with pytest.raises(StateMismatchError, match="sched/last_epoch: missing key"):
        await aiockpt.load(
            {"sched": make_scheduler(make_optimizer(make_model(1)))}, ckpt_path.with_name("no-epoch")
        )


async def test_an_older_torchs_nested_schedulers_load_strictly(ckpt_path: Path) -> None:
    """SequentialLR saves its schedulers' states within its own: they lack ``_is_initial`` alike."""

    def sequential(model: torch.nn.Module) -> torch.optim.lr_scheduler.SequentialLR:
        opt = make_optimizer(model)
        first = torch.optim.lr_scheduler.LinearLR(opt, total_iters=2)
        return torch.optim.lr_scheduler.SequentialLR(opt, [first, make_scheduler(opt)], milestones=[2])

    sched = sequential(make_model(0))
    for _ in range(3):
        sched.optimizer.step()
        sched.step()
    old = sched.state_dict()
    old["_schedulers"] = [{k: v for k, v in sd.items() if k != "_is_initial"} for sd in old["_schedulers"]]
    await aiockpt.save({"sched": old}, ckpt_path)
    sched2 = sequential(make_model(1))
    await aiockpt.load({"sched": sched2}, ckpt_path)
    assert (sched2.last_epoch, sched2.get_last_lr()) == (3, sched.get_last_lr())


async def test_a_sequential_scheduler_over_a_tensor_lr_resumes_strictly(ckpt_path: Path) -> None:
    """Its _last_lr tensors are its first child's when built, its current child's once past a milestone.

    Loaded in place, the fresh target tied the first child's tensor to its own where the checkpoint ties
    the second's: a difference. Read fresh and handed over, as torch.load gives them, training goes on
    exactly as it would have.
    """

    Run = tuple[torch.nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.SequentialLR]

    def build(seed: int) -> Run:
        model = make_model(seed)
        opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(0.01))
        first = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.5, total_iters=2)
        second = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.9)
        return model, opt, torch.optim.lr_scheduler.SequentialLR(opt, [first, second], milestones=[2])

    def train(run: Run, steps: range) -> None:
        for i in steps:
            train_step(*run, i)

    trained = build(0)
    train(trained, range(3))
    await aiockpt.save(dict(zip(("model", "opt", "sched"), trained, strict=True)), ckpt_path)
    resumed = build(1)
    sched = resumed[2]
    assert sched._last_lr[0] is sched._schedulers[0]._last_lr[0]  # (what made the difference)
    await aiockpt.load(dict(zip(("model", "opt", "sched"), resumed, strict=True)), ckpt_path)
    assert sched._last_lr[0] is sched._schedulers[1]._last_lr[0]  # tied as saved
    assert resumed[1].param_groups[0]["lr"] is not sched._last_lr[0]  # the optimizer keeps its own

    train(trained, range(3, 6))
    train(resumed, range(3, 6))
    assert_tree_equal(resumed[0].state_dict(), trained[0].state_dict())
    assert_tree_equal(resumed[1].state_dict(), trained[1].state_dict())
    assert sched.get_last_lr() == trained[2].get_last_lr()


def _wrap(model: torch.nn.Module, how: str) -> torch.nn.Module:
    if how == "both":
        model = torch.nn.DataParallel(model)
    if how in ("compiled", "both"):
        compiled = torch.compile(model, backend="eager")  # (compiles lazily: never run here)
        assert isinstance(compiled, torch.nn.Module)  # an OptimizedModule: names under "_orig_mod."
        return compiled
    if how == "data_parallel":
        return torch.nn.DataParallel(model)  # names under "module." (as DistributedDataParallel's)
    return model


@pytest.mark.parametrize(
    ("saved", "loaded"),
    [("compiled", "plain"), ("plain", "compiled"), ("data_parallel", "compiled"), ("both", "plain")],
)
async def test_a_wrapped_models_state_loads_into_the_model_wrapped_otherwise(
    ckpt_path: Path, saved: str, loaded: str
) -> None:
    """A compiled learner's weights load into a plain actor model (and so on): only wrappers differ."""
    model = make_model(0)
    wrapped = _wrap(model, saved)
    assert (saved == "plain") == ("0.weight" in wrapped.state_dict())
    await aiockpt.save({"model": wrapped}, ckpt_path)

    model2 = make_model(1)
    target = _wrap(model2, loaded)
    await aiockpt.load({"model": target}, ckpt_path)  # strict: no difference
    assert_tree_equal(model2.state_dict(), model.state_dict())
    # Fresh reads show the names as saved.
    names = cast("dict[str, object]", (await aiockpt.read(ckpt_path))["model"])
    assert any(k.startswith(("_orig_mod.", "module.")) for k in names) == (saved != "plain")


async def test_names_that_differ_beyond_wrappers_are_still_differences(ckpt_path: Path) -> None:
    await aiockpt.save({"model": _wrap(make_model(0), "compiled")}, ckpt_path)
    longer = make_model(1)
    longer.add_module("extra", torch.nn.Linear(2, 2))
    with pytest.raises(StateMismatchError) as info:
        await aiockpt.load({"model": longer}, ckpt_path)
    assert info.value.differences == [
        "model/extra.weight: missing key (in the target, not in the checkpoint)",
        "model/extra.bias: missing key (in the target, not in the checkpoint)",
    ]
    shorter = torch.nn.Sequential(torch.nn.Linear(4, 8))
    with pytest.raises(StateMismatchError, match=r"model/_orig_mod\.4\.weight: unexpected key"):
        await aiockpt.load({"model": _wrap(shorter, "data_parallel")}, ckpt_path)


async def test_read_metadata_gives_what_the_save_returned_and_the_user_metadata(ckpt_path: Path) -> None:
    values: dict[str, str | int | float | bool | None] = {"loss": 0.25, "git": "abc123", "best": True}
    saved = await aiockpt.save({"model": make_model(0), "step": 3}, ckpt_path, metadata=values)
    assert saved.user_metadata == values
    meta = await aiockpt.read_metadata(ckpt_path)
    assert meta.user_metadata == values
    # Everything the manifest says is as the save returned it; how the save ran is not stored.
    expected = msgspec.structs.replace(saved, timings={}, written_bytes=0, direct_bytes=0)
    assert meta == expected
    assert await anyio.to_thread.run_sync(aiockpt.sync.read_metadata, ckpt_path) == expected

    with pytest.raises(aiockpt.CheckpointNotFoundError):
        await aiockpt.read_metadata(ckpt_path.with_name("nothing"))
    safetensors = pytest.importorskip("safetensors.torch")
    foreign = ckpt_path.with_name("w.safetensors")
    safetensors.save_file({"w": torch.ones(2)}, str(foreign))
    with pytest.raises(aiockpt.FormatError, match="safetensors checkpoint, which has no aiockpt metadata"):
        await aiockpt.read_metadata(foreign)


async def test_a_checkpoint_deleted_while_it_is_read_is_not_found_not_corrupt(
    ckpt_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another process's retention renames a step away once its manifest was read: its data files go
    missing, which used to be reported as damage (CorruptionError), though nothing was damaged."""
    await aiockpt.save({"w": torch.ones(1 << 16)}, ckpt_path)
    real = aiockpt._load.read_into  # type: ignore[attr-defined]
    away = ckpt_path.with_name("deleted")
    how = "deleted"

    async def meanwhile(directory: Path, *args: Any, **kwargs: Any) -> Any:
        if how == "deleted":
            directory.rename(away)  # as retention does, before it removes the tree
        else:
            (directory / "data-r00000.bin").unlink()  # the checkpoint stays: damaged
        return await real(directory, *args, **kwargs)

    monkeypatch.setattr(aiockpt._load, "read_into", meanwhile)
    w = torch.zeros(1 << 16)
    target: dict[str, object] = {"w": w}
    with pytest.raises(aiockpt.CheckpointNotFoundError, match="was deleted while it was read") as info:
        await aiockpt.load(target, ckpt_path)
    assert isinstance(info.value.__cause__, aiockpt.CorruptionError)
    assert not w.any()  # nothing was loaded
    away.rename(ckpt_path)
    with pytest.raises(aiockpt.CheckpointNotFoundError, match="was deleted while it was read"):
        await aiockpt.read(ckpt_path, io=aiockpt.IOConfig(map_reads=False))
    away.rename(ckpt_path)
    how = "damaged"  # where the checkpoint is still there, missing data is damage, as before
    with pytest.raises(aiockpt.CorruptionError, match="data file is missing"):
        await aiockpt.load(target, ckpt_path)


@pytest.mark.parametrize("map_reads", [True, False])
async def test_a_data_file_that_cannot_be_looked_up_is_no_missing_file(
    ckpt_path: Path, map_reads: bool
) -> None:
    """A fresh read said "data file is missing" for a file whose stat failed for another reason (here a
    symlink loop; EACCES and EIO alike), where a load names the real error."""
    await aiockpt.save({"w": torch.ones(1 << 16)}, ckpt_path)
    data = ckpt_path / "data-r00000.bin"
    data.unlink()
    data.symlink_to(data.name)  # a loop: ELOOP
    with pytest.raises(aiockpt.StorageError, match="Too many levels of symbolic links") as info:
        await aiockpt.read(ckpt_path, io=aiockpt.IOConfig(map_reads=map_reads))
    assert info.value.path == str(data)


async def test_module_tensors_are_loaded_in_place(ckpt_path: Path) -> None:
    model = make_model(0)
    await aiockpt.save({"model": model}, ckpt_path)
    model2 = make_model(1)
    params = dict(model2.named_parameters())
    ptrs = {name: p.data_ptr() for name, p in params.items()}
    await aiockpt.load({"model": model2}, ckpt_path)
    for name, p in model2.named_parameters():
        assert p is params[name]  # the same Parameter objects (an optimizer holding them keeps working)
        assert p.data_ptr() == ptrs[name]
    assert_tree_equal(model2.state_dict(), model.state_dict())


class _ReadsAKey(torch.nn.Module):
    """Derives an attribute from the state dict it loads (a vocabulary size, say)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(10, 4)
        self.vocab = 0

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        self.vocab = state_dict["emb.weight"].shape[0]
        return super().load_state_dict(state_dict, strict, assign)


class _NoStrict(torch.nn.Module):
    """Overrides ``load_state_dict(state_dict)`` only, as ``aiockpt.Stateful`` declares it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(2, 2)

    def load_state_dict(self, state_dict: Any) -> Any:  # type: ignore[override]
        return super().load_state_dict(state_dict)


class _AlwaysStrict(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(2, 2)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        return super().load_state_dict(state_dict, strict=True)


@pytest.mark.parametrize("cls", [_ReadsAKey, _NoStrict, _AlwaysStrict])
async def test_a_module_that_loads_its_own_way_gets_its_whole_state_dict(
    cls: type[torch.nn.Module], ckpt_path: Path
) -> None:
    """Its ``load_state_dict`` got the state dict without the tensors read in place, and ``strict=False``:
    the first raised a KeyError, the second a TypeError, the third "Missing key(s)"."""
    torch.manual_seed(0)
    saved = cls()
    await aiockpt.save({"model": saved}, ckpt_path)
    model = cls()
    params = {name: p.data_ptr() for name, p in model.named_parameters()}
    await aiockpt.load({"model": model}, ckpt_path)
    assert_tree_equal(model.state_dict(), saved.state_dict())
    assert {name: p.data_ptr() for name, p in model.named_parameters()} == params  # still in place
    if isinstance(model, _ReadsAKey):
        assert model.vocab == 10


async def test_load_into_parameters_that_require_grad(ckpt_path: Path) -> None:
    w = torch.randn(3, 4)
    await aiockpt.save({"w": w}, ckpt_path)
    p = torch.nn.Parameter(torch.zeros(3, 4))
    state: dict[str, object] = {"w": p}
    await aiockpt.load(state, ckpt_path)
    assert state["w"] is p
    assert p.requires_grad
    assert torch.equal(p.detach(), w)


async def test_load_into_views_writes_through_to_the_base(ckpt_path: Path) -> None:
    saved = torch.arange(20.0).reshape(4, 5)
    saved_state: dict[str, object] = {
        "t": saved.t().contiguous(),
        "row": saved[1].clone(),
        "corner": saved[:2, :2],
    }
    await aiockpt.save(saved_state, ckpt_path)
    base = torch.zeros(4, 5)
    other = torch.zeros(3, 5)
    state: dict[str, object] = {"t": base.t(), "row": other[1], "corner": torch.zeros(4, 4)[::2, ::2]}
    await aiockpt.load(state, ckpt_path)
    assert torch.equal(base, saved)
    assert torch.equal(other[1], saved[1])
    assert torch.equal(other[0], torch.zeros(5))
    assert torch.equal(other[2], torch.zeros(5))
    assert torch.equal(tensor_at(state, "corner"), saved[:2, :2])


async def test_nested_containers_load_in_place(ckpt_path: Path) -> None:
    saved: dict[str, object] = {
        "nested": {"a": torch.ones(2), "lst": [torch.full((2,), 2.0), 5], "tup": (torch.full((1,), 3.0),)},
        "cfg": {"lr": 0.25, "name": "new", "sizes": [1, 2]},
    }
    await aiockpt.save(saved, ckpt_path)
    a, l0, t0 = torch.zeros(2), torch.zeros(2), torch.zeros(1)
    state: dict[str, object] = {
        "nested": {"a": a, "lst": [l0, 0], "tup": (t0,)},
        "cfg": {"lr": 1.0, "name": "old", "sizes": [0, 0]},
    }
    await aiockpt.load(state, ckpt_path)
    assert_tree_equal(state, saved)
    # Tensors are filled in place, wherever they sit.
    assert tensor_at(state, "nested", "a") is a
    assert tensor_at(state, "nested", "lst", 0) is l0
    assert tensor_at(state, "nested", "tup", 0) is t0
    assert torch.equal(a, torch.ones(2))
    assert torch.equal(t0, torch.full((1,), 3.0))


async def test_plain_values_are_replaced_in_the_mapping(ckpt_path: Path) -> None:
    await aiockpt.save({"epoch": 7, "name": "run-7", "best": 0.5, "done": True, "extra": None}, ckpt_path)
    state: dict[str, object] = {"epoch": 0, "name": "", "best": math.inf, "done": False, "extra": None}
    result = await aiockpt.load(state, ckpt_path)
    assert result is state
    assert state == {"epoch": 7, "name": "run-7", "best": 0.5, "done": True, "extra": None}


async def test_load_returns_the_state_object(ckpt_path: Path) -> None:
    await aiockpt.save({"x": torch.ones(1)}, ckpt_path)
    state: dict[str, object] = {"x": torch.zeros(1)}
    assert await aiockpt.load(state, ckpt_path) is state


async def test_read_then_load_give_the_same_values(ckpt_path: Path) -> None:
    model = make_model(0)
    await aiockpt.save({"model": model}, ckpt_path)
    fresh = make_model(3)
    await aiockpt.load({"model": fresh}, ckpt_path)
    got = await aiockpt.read(ckpt_path)
    assert_tree_equal(got["model"], fresh.state_dict())


# --- Strict (default) -----------------------------------------------------------------------------------


async def test_strict_load_reports_every_difference_at_once(ckpt_path: Path) -> None:
    await aiockpt.save(mismatch_state(), ckpt_path)
    target = mismatch_target()
    before = snapshot(target)
    objects = {k: id(v) for k, v in target.items()}
    with pytest.raises(StateMismatchError) as info:
        await aiockpt.load(target, ckpt_path)
    err = info.value
    assert isinstance(err, aiockpt.StateError)
    assert isinstance(err, aiockpt.CheckpointError)
    assert len(err.differences) == len(MISMATCHED_KEYS), err.differences
    for key in MISMATCHED_KEYS:
        assert sum(key in d.split(":")[0] for d in err.differences) >= 1, (key, err.differences)
        assert key in str(err)
    assert "same" not in " ".join(d.split(":")[0] for d in err.differences)
    # Nothing in the target was touched.
    assert_tree_equal(target, before)
    assert {k: id(v) for k, v in target.items()} == objects


async def test_strict_is_the_default_and_explicit(ckpt_path: Path) -> None:
    await aiockpt.save({"a": torch.ones(2)}, ckpt_path)
    target: dict[str, object] = {"a": torch.zeros(2), "b": torch.zeros(2)}
    with pytest.raises(StateMismatchError, match="b"):
        await aiockpt.load(target, ckpt_path)
    with pytest.raises(StateMismatchError, match="b"):
        await aiockpt.load(target, ckpt_path, strict=True)
    assert torch.equal(tensor_at(target, "a"), torch.zeros(2))


async def test_strict_load_of_a_different_architecture_changes_nothing(ckpt_path: Path) -> None:
    torch.manual_seed(0)
    await aiockpt.save({"model": torch.nn.Linear(4, 3)}, ckpt_path)
    other = torch.nn.Linear(4, 5)
    before = snapshot(other)
    with pytest.raises(StateMismatchError) as info:
        await aiockpt.load({"model": other}, ckpt_path)
    text = str(info.value)
    assert "model/weight" in text
    assert "model/bias" in text
    assert len(info.value.differences) == 2
    assert_tree_equal(other.state_dict(), before)


async def test_a_manifest_that_repeats_a_key_cannot_hide_a_missing_one(tmp_path: Path) -> None:
    # The matcher counts the target's keys it found instead of building a set of the checkpoint's: a
    # forged tree with "a" twice and no "b" has as many keys as the target. Such a tree is refused as
    # the manifest is read (no save writes a key twice), so nothing is loaded.
    path = tmp_path / "ckpt"
    await aiockpt.save({"a": torch.ones(2), "b": torch.ones(2)}, path)
    file = path / MANIFEST_NAME
    manifest = decode_manifest(file.read_bytes(), str(file))
    forged = msgspec.structs.replace(manifest, tree=msgspec.structs.replace(manifest.tree, keys=("a", "a")))
    file.write_bytes(b"".join(encode_manifest(forged)[0]))
    target: dict[str, object] = {"a": torch.zeros(2), "b": torch.zeros(2)}
    with pytest.raises(aiockpt.FormatError, match="lists key 'a' twice"):
        await aiockpt.load(target, path)
    assert torch.equal(tensor_at(target, "a"), torch.zeros(2))
    assert torch.equal(tensor_at(target, "b"), torch.zeros(2))


async def test_strict_load_reports_unexpected_module_keys(ckpt_path: Path) -> None:
    torch.manual_seed(0)
    bigger = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    await aiockpt.save({"model": bigger}, ckpt_path)
    smaller = torch.nn.Sequential(torch.nn.Linear(2, 2))
    before = snapshot(smaller)
    with pytest.raises(StateMismatchError) as info:
        await aiockpt.load({"model": smaller}, ckpt_path)
    assert sorted(d.split(":")[0] for d in info.value.differences) == ["model/1.bias", "model/1.weight"]
    assert_tree_equal(smaller.state_dict(), before)


async def test_strict_load_reports_container_mismatches(ckpt_path: Path) -> None:
    saved: dict[str, object] = {"lst": [torch.ones(1), torch.ones(1)], "val": torch.ones(2), "d": {"k": 1}}
    await aiockpt.save(saved, ckpt_path)
    target: dict[str, object] = {"lst": [torch.zeros(1)], "val": {"k": torch.zeros(2)}, "d": torch.zeros(1)}
    before = snapshot(target)
    with pytest.raises(StateMismatchError) as info:
        await aiockpt.load(target, ckpt_path)
    keys = sorted(d.split(":")[0] for d in info.value.differences)
    assert keys == ["d", "lst", "val"], info.value.differences
    assert_tree_equal(target, before)


# --- Non-strict -----------------------------------------------------------------------------------------


async def test_non_strict_loads_what_matches_and_warns_about_the_rest(ckpt_path: Path) -> None:
    await aiockpt.save(mismatch_state(), ckpt_path)
    target = mismatch_target()
    with pytest.warns(StateMismatchWarning) as record:
        result = await aiockpt.load(target, ckpt_path, strict=False)
    assert result is target
    text = " ".join(str(w.message) for w in record)
    for key in MISMATCHED_KEYS:
        assert key in text, (key, text)
    assert torch.equal(tensor_at(target, "same"), torch.arange(6, dtype=torch.float32))
    assert torch.equal(tensor_at(target, "nested", "x"), torch.full((3,), 7.0))
    # What did not match is left alone, and entries the checkpoint lacks stay in the target.
    nested = target["nested"]
    assert isinstance(nested, dict)
    assert "extra" in nested, f"strict=False dropped the target's own entry nested/extra: {list(nested)}"
    assert torch.equal(tensor_at(target, "shape"), torch.zeros(3, 3))
    assert torch.equal(tensor_at(target, "dtype"), torch.zeros(4, dtype=torch.int64))
    assert torch.equal(tensor_at(target, "only_in_target"), torch.zeros(1))
    assert torch.equal(tensor_at(target, "nested", "extra"), torch.zeros(1))


async def test_non_strict_without_differences_does_not_warn(ckpt_path: Path) -> None:
    await aiockpt.save({"a": torch.ones(2)}, ckpt_path)
    target: dict[str, object] = {"a": torch.zeros(2)}
    await aiockpt.load(target, ckpt_path, strict=False)  # warnings are errors in this suite
    assert torch.equal(tensor_at(target, "a"), torch.ones(2))


async def test_non_strict_partial_module_load(ckpt_path: Path) -> None:
    torch.manual_seed(0)
    saved = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 3))
    await aiockpt.save({"model": saved}, ckpt_path)
    torch.manual_seed(1)
    target = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 4))  # head resized
    head_before = snapshot(target[1])
    with pytest.warns(StateMismatchWarning, match=r"model/1\.weight"):
        await aiockpt.load({"model": target}, ckpt_path, strict=False)
    assert_tree_equal(target[0].state_dict(), saved[0].state_dict())
    assert_tree_equal(target[1].state_dict(), head_before)


# --- Tensors of every kind load in place ----------------------------------------------------------------


async def test_load_keeps_tensor_identity_everywhere(ckpt_path: Path) -> None:
    gen = torch.Generator().manual_seed(0)
    saved: dict[str, object] = {
        "a": torch.randn(3, generator=gen),
        "b": [torch.randn(2, 2, generator=gen)],
        "c": {"d": torch.randint(0, 9, (4,), generator=gen)},
    }
    await aiockpt.save(saved, ckpt_path)
    target: dict[str, object] = {
        "a": torch.zeros(3),
        "b": [torch.zeros(2, 2)],
        "c": {"d": torch.zeros(4).long()},
    }
    before = list(tensors_in(target))
    await aiockpt.load(target, ckpt_path)
    after = list(tensors_in(target))
    assert all(x is y for x, y in zip(before, after, strict=True))
    assert_tree_equal(target, saved)


# --- Fresh tensors and read-ahead -----------------------------------------------------------------------


async def test_read_builds_separate_contiguous_tensors_of_every_shape(ckpt_path: Path) -> None:
    # Small tensors are cut from shared slabs; each must still be a contiguous tensor of its own bytes.
    state: dict[str, object] = {
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 4),
        "vec": torch.arange(5, dtype=torch.int16),
        "mat": torch.randn(3, 7),
        "cube": torch.randn(2, 3, 5).to(torch.bfloat16),
        "vec2": torch.arange(9, dtype=torch.int16),
        "large": torch.randn(128, 256),  # 128 KiB: memory of its own
    }
    await aiockpt.save(state, ckpt_path)
    got = await aiockpt.read(ckpt_path)
    assert_tree_equal(got, state)
    for key, t in got.items():
        assert isinstance(t, torch.Tensor)
        assert t.is_contiguous(), key
        assert t.stride() == torch.empty(t.shape).stride(), key
    before = {k: t.clone() for k, t in got.items() if isinstance(t, torch.Tensor)}
    tensor_at(got, "vec").fill_(-1)
    tensor_at(got, "mat").fill_(-1)
    for key in ("scalar", "vec2", "cube", "large"):
        assert torch.equal(tensor_at(got, key), before[key]), f"writing to neighbours changed {key}"


async def test_read_cuts_many_tensors_of_one_shape_apart(ckpt_path: Path) -> None:
    # 1200 of one shape take several batches of one view call each; 300 of 60 KiB fill more than one
    # slab. Ties and tensors inside lists come back as they were saved.
    state: dict[str, object] = {f"s{i}": torch.full((3, 5), float(i)) for i in range(1200)}
    state |= {f"w{i}": torch.full((15360,), float(i)) for i in range(300)}
    state["odd"] = [torch.arange(7, dtype=torch.int16), (torch.tensor(True),)]
    state["tied"] = state["s7"]
    await aiockpt.save(state, ckpt_path)
    got = await aiockpt.read(ckpt_path)
    assert_tree_equal(got, state)
    assert got["tied"] is got["s7"]
    unique = {id(t): t for t in tensors_in(got)}.values()
    spans = sorted((t.data_ptr(), t.data_ptr() + t.nbytes) for t in unique)
    assert all(end <= start for (_, end), (start, _) in pairwise(spans)), "overlap"
    assert all(start % 64 == 0 for start, _ in spans)
    assert all(t.is_contiguous() and t.stride() == torch.empty(t.shape).stride() for t in unique)
    tensor_at(got, "s3").fill_(-1)
    assert torch.equal(tensor_at(got, "s4"), state["s4"])  # type: ignore[arg-type]
    assert torch.equal(tensor_at(got, "s2"), state["s2"])  # type: ignore[arg-type]


async def test_in_place_load_into_tensors_that_share_nothing_but_shape(ckpt_path: Path) -> None:
    state = {f"t{i}": torch.full((4, 3), float(i)) for i in range(50)}
    await aiockpt.save(state, ckpt_path)
    target: dict[str, object] = {k: torch.zeros(4, 3) for k in state}
    ptrs = {k: tensor_at(target, k).data_ptr() for k in target}
    await aiockpt.load(target, ckpt_path)
    assert_tree_equal(target, state)
    assert {k: tensor_at(target, k).data_ptr() for k in target} == ptrs


# --- Targets whose keys share memory, leaves that require grad, lazy parameters ------------------------


class _Tied(torch.nn.Module):
    def __init__(self, n: int, *, tie: bool) -> None:
        super().__init__()
        self.emb = torch.nn.Linear(n, n, bias=False)
        self.head = torch.nn.Linear(n, n, bias=False)
        if tie:
            self.head.weight = self.emb.weight


IO_CASES = {
    "default": aiockpt.IOConfig(),
    "buffered": aiockpt.IOConfig(direct_reads=False),
    "buffered-no-checkers": aiockpt.IOConfig(direct_reads=False, checkers=False),
    "direct": aiockpt.IOConfig(direct_reads=True),
}


@pytest.mark.parametrize("io", IO_CASES.values(), ids=IO_CASES.keys())
@pytest.mark.parametrize("n", [100, 512], ids=["40KiB", "1MiB"])
async def test_tied_target_loads_keys_stored_apart_with_equal_values(
    ckpt_path: Path, io: aiockpt.IOConfig, n: int
) -> None:
    # The target ties head.weight to emb.weight; the checkpoint holds them apart, of equal values. Read in
    # place, the second key's bytes overwrote the first's before its checksum was verified there: a false
    # CorruptionError.
    torch.manual_seed(0)
    src = _Tied(n, tie=False)
    src.head.weight = torch.nn.Parameter(src.emb.weight.detach().clone())
    await aiockpt.save({"model": src}, ckpt_path)
    dst = _Tied(n, tie=True)
    await aiockpt.load({"model": dst}, ckpt_path, io=io)
    assert dst.head.weight is dst.emb.weight
    assert torch.equal(dst.emb.weight, src.emb.weight)


@pytest.mark.parametrize("io", IO_CASES.values(), ids=IO_CASES.keys())
@pytest.mark.parametrize("n", [100, 512], ids=["40KiB", "1MiB"])
async def test_tied_target_refuses_keys_stored_apart_with_other_values(
    ckpt_path: Path, io: aiockpt.IOConfig, n: int
) -> None:
    # The same, of other values (a model that ties its head loading one that does not): one memory cannot
    # hold both, and the one loaded first was overwritten without a word, as load_state_dict does.
    torch.manual_seed(0)
    src = _Tied(n, tie=False)
    await aiockpt.save({"model": src}, ckpt_path)
    dst = _Tied(n, tie=True)
    before = dst.emb.weight.detach().clone()
    with pytest.raises(aiockpt.StateMismatchError) as info:
        await aiockpt.load({"model": dst}, ckpt_path, io=io)
    assert info.value.differences == [
        "model/head.weight: the target ties it to model/emb.weight (one memory), the checkpoint holds the "
        "two apart, with other values"
    ]
    assert torch.equal(dst.emb.weight, before)  # nothing written
    # strict=False loads the key met first, and reports the other as not loaded.
    with pytest.warns(aiockpt.StateMismatchWarning, match="model/head.weight: the target ties it"):
        await aiockpt.load({"model": dst}, ckpt_path, io=io, strict=False)
    assert dst.head.weight is dst.emb.weight
    assert torch.equal(dst.emb.weight, src.emb.weight)


async def test_tied_plain_tensors_refuse_other_values_and_take_equal_ones(ckpt_path: Path) -> None:
    await aiockpt.save({"a": torch.ones(4), "b": torch.zeros(4), "c": torch.ones(4)}, ckpt_path)
    w, v = torch.empty(4), torch.empty(4)
    with pytest.raises(aiockpt.StateMismatchError, match="b: the target ties it to a"):
        await aiockpt.load({"a": w, "b": w, "c": v}, ckpt_path)
    await aiockpt.load({"a": w, "b": torch.empty(4), "c": w[:]}, ckpt_path)  # a view alike: equal values
    assert torch.equal(w, torch.ones(4))


@pytest.mark.parametrize("io", IO_CASES.values(), ids=IO_CASES.keys())
async def test_keys_of_overlapping_views_load_in_key_order(ckpt_path: Path, io: aiockpt.IOConfig) -> None:
    big = 1 << 18  # 1 MiB of float32: direct reads take it by default
    saved: dict[str, object] = {
        "all": torch.arange(big, dtype=torch.float32),
        "middle": torch.full((big // 2,), -1.0),
        "tail": torch.full((8,), 5.0),
    }
    await aiockpt.save(saved, ckpt_path)
    base = torch.zeros(big)
    state: dict[str, object] = {
        "all": base,
        "middle": base[big // 4 : big // 4 + big // 2],
        "tail": base[::2][-8:],  # not contiguous: read through a host buffer
    }
    await aiockpt.load(state, ckpt_path, io=io)
    expected = torch.arange(big, dtype=torch.float32)
    expected[big // 4 : big // 4 + big // 2] = -1.0
    expected[::2][-8:] = 5.0
    assert torch.equal(base, expected)


async def test_load_copies_into_parameters_that_require_grad(ckpt_path: Path) -> None:
    # Copies into place (non-contiguous targets, keys tied in the checkpoint) ran under autograd, which
    # refuses an in-place copy into a leaf that requires grad: a raw RuntimeError after part of the load.
    x = torch.randn(30, 20)
    await aiockpt.save({"emb": x, "head": x, "t": x, "other": torch.randn(100)}, ckpt_path)
    emb = torch.nn.Parameter(torch.zeros(30, 20))
    head = torch.nn.Parameter(torch.zeros(30, 20))
    t = torch.nn.Parameter(torch.zeros(20, 30))
    state: dict[str, object] = {"emb": emb, "head": head, "t": t.t(), "other": torch.zeros(100)}
    await aiockpt.load(state, ckpt_path)
    assert state["emb"] is emb
    assert state["head"] is head
    for p in (emb, head, t):
        assert p.requires_grad
        assert p.grad_fn is None
    assert torch.equal(emb.detach(), x)
    assert torch.equal(head.detach(), x)
    assert torch.equal(t.detach(), x.t())


async def test_strict_load_refuses_plain_values_where_the_target_holds_containers(ckpt_path: Path) -> None:
    await aiockpt.save({"opt": None, "lst": 3, "tup": b"raw", "w": torch.ones(3)}, ckpt_path)

    def target() -> dict[str, object]:
        return {"opt": {"m": torch.zeros(4)}, "lst": [torch.zeros(2)], "tup": (1, 2), "w": torch.zeros(3)}

    state = target()
    before = snapshot(state)
    with pytest.raises(StateMismatchError) as info:
        await aiockpt.load(state, ckpt_path)
    assert sorted(d.split(":")[0] for d in info.value.differences) == ["lst", "opt", "tup"]
    assert "the target holds a dict, the checkpoint a NoneType" in str(info.value)
    assert_tree_equal(state, before)
    state = target()
    opt, lst = state["opt"], state["lst"]
    with pytest.warns(StateMismatchWarning, match="opt: the target holds a dict"):
        await aiockpt.load(state, ckpt_path, strict=False)
    assert state["opt"] is opt
    assert state["lst"] is lst
    assert state["tup"] == (1, 2)
    assert_tree_equal(state["opt"], {"m": torch.zeros(4)})
    assert torch.equal(tensor_at(state, "w"), torch.ones(3))


@pytest.mark.filterwarnings("ignore:Lazy modules are a new feature:UserWarning")
async def test_lazy_parameters_are_materialized_as_load_state_dict_does(ckpt_path: Path) -> None:
    saved = torch.nn.LazyLinear(4)
    saved(torch.randn(2, 3))
    await aiockpt.save({"m": saved}, ckpt_path)
    lazy = torch.nn.LazyLinear(4)
    await aiockpt.load({"m": lazy}, ckpt_path)
    assert not any(torch.nn.parameter.is_lazy(p) for p in lazy.parameters())
    assert_tree_equal(lazy.state_dict(), saved.state_dict())
    # Outside a module nothing can materialize it: a difference naming the key, not a crash.
    state: dict[str, object] = {"m": {"weight": torch.nn.UninitializedParameter(), "bias": torch.zeros(4)}}
    with pytest.raises(StateMismatchError, match="m/weight: the target holds an uninitialized lazy"):
        await aiockpt.load(state, ckpt_path)


# --- Stored chunks that do not cover the target ---------------------------------------------------------


def _forge_chunks(path: Path, key: str, boxes: list[tuple[int, int]]) -> None:
    """Make the 1-d tensor ``key`` of the checkpoint at ``path`` stored as only the element ranges ``boxes``.

    Each range becomes a chunk of the same data file at its own bytes, with its checksum: every stored
    byte intact, as a save over a sub-group holding part of a DTensor writes them.
    """
    file = path / MANIFEST_NAME
    manifest = decode_manifest(file.read_bytes(), str(file))
    tensors = []
    for t in manifest.tensors:
        if t.path == (key,):
            (whole,) = t.chunks
            size = whole.nbytes // t.shape[0]
            data = (path / whole.file).read_bytes()
            chunks = []
            for lo, hi in boxes:
                start, n = whole.offset + lo * size, (hi - lo) * size
                crc = crc32c.crc32c(data[start : start + n])
                chunks.append(
                    msgspec.structs.replace(
                        whole, offsets=(lo,), sizes=(hi - lo,), offset=start, nbytes=n, checksums=(crc,)
                    )
                )
            t = msgspec.structs.replace(t, chunks=tuple(chunks))
        tensors.append(t)
    forged = msgspec.structs.replace(manifest, tensors=tuple(tensors))
    file.write_bytes(b"".join(encode_manifest(forged)[0]))


@pytest.mark.parametrize(("boxes", "hole"), [([(0, 4)], "[4:8]"), ([(0, 4), (6, 8)], "[4:6]"), ([], "[0:8]")])
async def test_chunks_that_miss_part_of_a_tensor_are_refused_naming_the_key(
    ckpt_path: Path, boxes: list[tuple[int, int]], hole: str
) -> None:
    # The stored chunks hold only part of "w": a load used to leave the rest of the target as it was,
    # and a read to return uninitialized memory there, silently.
    await aiockpt.save({"w": torch.arange(8.0), "v": torch.ones(3)}, ckpt_path)
    _forge_chunks(ckpt_path, "w", boxes)
    # Every stored byte is intact, but verify reports what a read refuses: the hole in "w".
    (problem,) = (await aiockpt.verify(ckpt_path)).problems
    assert (problem.key, problem.file) == ("w", str(ckpt_path))
    assert f"elements {hole}" in str(problem)
    target: dict[str, object] = {"w": torch.full((8,), -1.0), "v": torch.zeros(3)}
    with pytest.raises(aiockpt.CorruptionError, match=rf"key 'w' .*elements \{hole}") as info:
        await aiockpt.load(target, ckpt_path)
    assert info.value.key == "w"
    assert info.value.file == str(ckpt_path)
    # Refused while planning, before any byte is read.
    assert_tree_equal(target, {"w": torch.full((8,), -1.0), "v": torch.zeros(3)})
    with pytest.raises(aiockpt.CorruptionError, match=rf"key 'w' .*elements \{hole}"):
        await aiockpt.read(ckpt_path)


async def test_chunks_that_cover_a_tensor_together_load_it(ckpt_path: Path) -> None:
    await aiockpt.save({"w": torch.arange(8.0)}, ckpt_path)
    _forge_chunks(ckpt_path, "w", [(4, 8), (0, 3), (3, 4), (0, 3)])  # out of order, and a box twice
    target: dict[str, object] = {"w": torch.zeros(8)}
    await aiockpt.load(target, ckpt_path)
    assert torch.equal(tensor_at(target, "w"), torch.arange(8.0))
    assert torch.equal(tensor_at(await aiockpt.read(ckpt_path), "w"), torch.arange(8.0))


def test_uncovered_finds_holes_exactly_also_between_overlapping_boxes() -> None:
    from aiockpt._load._read import _uncovered

    dest_off, dest_size = (2, 0), (4, 6)  # rows 2..6, columns 0..6
    assert _uncovered(dest_off, dest_size, [((0, 0), (8, 6))]) is None
    assert _uncovered(dest_off, dest_size, [((0, 0), (4, 6)), ((4, 0), (4, 6))]) is None
    # Overlapping boxes whose elements outnumber the destination's and still leave a hole.
    overlapping = [((2, 0), (4, 4)), ((2, 0), (4, 3)), ((2, 5), (4, 1))]
    assert _uncovered(dest_off, dest_size, overlapping) == [(2, 6), (4, 5)]
    assert _uncovered(dest_off, dest_size, [((2, 0), (4, 6)), ((2, 1), (1, 1))]) is None
    assert _uncovered((), (), []) == []  # a 0-d tensor stored nowhere
    assert _uncovered((0,), (0,), []) is None  # nothing to cover


# --- Collective-free checkpoints: one world size's parts, and keys only one part holds --------------------


async def _save_part(step: Path, rank: int, world: int, state: dict[str, object]) -> Path:
    part = step / f"rank-{rank:05d}-of-{world:05d}"
    await aiockpt.save(state, part)
    return part


async def test_collective_free_parts_of_two_world_sizes_never_merge(tmp_path: Path) -> None:
    # A 3-rank job published the parts of ranks 0 and 2 (rank 1 died); a 2-rank job then publishes the
    # part of its rank 1. Together they name ranks 0, 1 and 2: that used to count as a complete 3-rank
    # checkpoint, read as a mix of both saves.
    from aiockpt._checkpointer import scan_steps
    from aiockpt._load import is_checkpoint, published_parts, read_manifest

    root = tmp_path / "root"
    step = root / "step-00000005"
    for rank in (0, 2):
        await _save_part(step, rank, 3, {"w": torch.full((6,), 1.0)})
    await _save_part(step, 1, 2, {"w": torch.full((6,), 2.0)})
    assert not is_checkpoint(step)
    assert scan_steps(root) == []
    assert published_parts(step) == (3, [step / "rank-00000-of-00003", step / "rank-00002-of-00003"])
    with pytest.raises(
        aiockpt.CheckpointNotFoundError, match=r"ranks \[1\] \(of 3\).*other world sizes \(1 of 2\)"
    ):
        read_manifest(step)
    with pytest.raises(aiockpt.CheckpointNotFoundError):
        await aiockpt.read(step)
    # The 2-rank job's rank 0 publishes too: its set is complete and is the checkpoint; the stale parts of
    # the failed 3-rank save are left out, whatever their ranks.
    await _save_part(step, 0, 2, {"w": torch.full((6,), 2.0)})
    assert is_checkpoint(step)
    assert scan_steps(root) == [5]
    manifest = read_manifest(step)
    assert manifest.world_size == 2
    assert {f.name.split("/")[0] for f in manifest.files} == {"rank-00000-of-00002", "rank-00001-of-00002"}
    assert torch.equal(tensor_at(await aiockpt.read(step), "w"), torch.full((6,), 2.0))
    target: dict[str, object] = {"w": torch.zeros(6)}
    await aiockpt.load(target, step)
    assert torch.equal(tensor_at(target, "w"), torch.full((6,), 2.0))
    async with aiockpt.Checkpointer(root) as ckpt:
        assert ckpt.steps() == [5]


async def test_collective_free_step_saved_twice_completely_reads_the_first_completed(tmp_path: Path) -> None:
    # A committed step keeps what it held when it was committed, as the no-replace publication of each
    # part promises: a second complete set of another world size (published later) is not read.
    from aiockpt._load import is_checkpoint, read_manifest

    step = tmp_path / "step-00000005"
    first = [await _save_part(step, r, 2, {"w": torch.full((4,), 1.0)}) for r in range(2)]
    later = [await _save_part(step, r, 3, {"w": torch.full((4,), 2.0)}) for r in range(3)]
    # Completion times as the manifests' write times say, set rather than waited for.
    for parts, ns in ((first, 1_000_000_000_000), (later, 2_000_000_000_000)):
        for part in parts:
            os.utime(part / MANIFEST_NAME, ns=(ns, ns))
    assert is_checkpoint(step)
    assert read_manifest(step).world_size == 2
    assert torch.equal(tensor_at(await aiockpt.read(step), "w"), torch.full((4,), 1.0))


async def test_collective_free_parts_with_per_rank_keys_give_each_rank_its_own(tmp_path: Path) -> None:
    # Keys that name the rank: the merge was rank 0's tree, so rank 1's key was unreachable (refused by
    # name since, silently missing before that).
    step = tmp_path / "step"
    g = torch.Generator().manual_seed(0)
    rng = [torch.randint(0, 255, (16,), dtype=torch.uint8, generator=g) for _ in range(2)]
    parts = [
        await _save_part(step, r, 2, {"w": torch.ones(3), "rng": {f"rank{r}": rng[r]}}) for r in range(2)
    ]
    assert torch.equal(tensor_at(await aiockpt.read(step), "rng", "rank0"), rng[0])
    assert torch.equal(tensor_at(await aiockpt.read(step, rank=1), "rng", "rank1"), rng[1])
    target: dict[str, object] = {"w": torch.zeros(3), "rng": {"rank1": torch.zeros(16, dtype=torch.uint8)}}
    await aiockpt.load(target, step, rank=1)
    assert torch.equal(tensor_at(target, "rng", "rank1"), rng[1])
    with pytest.raises(aiockpt.StateMismatchError, match="rng/rank1: missing key"):
        await aiockpt.load(target, step)  # (rank 0 outside a job: rank 1's key is not rank 0's)
    # Each part still reads on its own, by its directory.
    assert torch.equal(tensor_at(await aiockpt.read(parts[1]), "rng", "rank1"), rng[1])
    # Verification checks every part's bytes.
    report = await aiockpt.verify(step)
    assert report.ok
    assert report.num_tensors == 3
    rank1 = read_manifest_of(parts[1], "rng", "rank1")
    flip_byte(parts[1] / rank1[0], rank1[1])
    report = await aiockpt.verify(step)
    assert [(p.key, p.file) for p in report.problems] == [("rng/rank1", str(parts[1] / rank1[0]))]


async def test_collective_free_parts_with_per_rank_values_give_each_rank_its_own(tmp_path: Path) -> None:
    # Each part's RNG state under one key, and a position: rank 0's were read for every rank.
    step = tmp_path / "step"
    states = []
    for r in range(2):
        torch.manual_seed(r)
        states.append({"w": torch.ones(3), "rng": torch.get_rng_state(), "pos": 100 * r})
        await _save_part(step, r, 2, states[-1])
    for r in range(2):
        tree = await aiockpt.read(step, rank=r)
        assert torch.equal(tensor_at(tree, "rng"), states[r]["rng"])  # type: ignore[arg-type]
        assert tree["pos"] == 100 * r


def read_manifest_of(path: Path, *key: str) -> tuple[str, int]:
    """``(data file, byte offset)`` of the single chunk of tensor ``key`` in the checkpoint at ``path``."""
    from aiockpt._load import read_manifest

    (entry,) = [t for t in read_manifest(path).tensors if t.path == key]
    (chunk,) = entry.chunks
    return chunk.file, chunk.offset


@pytest.mark.parametrize(
    "rank1",
    [
        {"x": 1, "more": {"y": 2}},
        {"x": torch.ones(2)},
        {"x": 1, "l": [1, 2]},
        {"l": [1], "x": 5},
    ],
)
async def test_collective_free_parts_that_differ_are_each_their_ranks(
    tmp_path: Path, rank1: dict[str, object]
) -> None:
    # Keys rank 0 lacks, another kind of value, a longer list, another plain value: the merge was rank 0's
    # tree, refusing what it could not reach and reading rank 0's values for every rank.
    step = tmp_path / "step"
    await _save_part(step, 0, 2, {"x": 1, "l": [1]})
    await _save_part(step, 1, 2, rank1)
    assert await aiockpt.read(step) == {"x": 1, "l": [1]}
    got = await aiockpt.read(step, rank=1)
    assert got.keys() == rank1.keys()
    for key, value in rank1.items():
        same = torch.equal(got[key], value) if isinstance(value, torch.Tensor) else got[key] == value  # type: ignore[arg-type]
        assert same, key


async def test_collective_free_parts_refuse_a_dtensor_shard_under_keys_that_differ(tmp_path: Path) -> None:
    from aiockpt._format import Manifest, TensorEntry
    from aiockpt._load._manifest import decode_manifest
    from aiockpt._save._finish import encode_manifest

    step = tmp_path / "step"
    await _save_part(step, 0, 2, {"x": 1})
    part = await _save_part(step, 1, 2, {"x": 1, "mine": torch.ones(4)})

    def as_shard(m: Manifest) -> Manifest:  # rank 1's tensor made half of a DTensor of 8 elements
        (t,) = m.tensors
        (c,) = t.chunks
        chunk = msgspec.structs.replace(c, sizes=(4,), offsets=(4,))
        entry = TensorEntry(path=t.path, dtype=t.dtype, shape=(8,), chunks=(chunk,))
        return msgspec.structs.replace(m, tensors=(entry,))

    file = part / MANIFEST_NAME
    file.write_bytes(b"".join(encode_manifest(as_shard(decode_manifest(file.read_bytes(), str(file))))[0]))
    with pytest.raises(aiockpt.FormatError, match=r"rank 1 holds a DTensor at key 'mine'") as info:
        await aiockpt.read(step)
    assert info.value.file == str(step)
