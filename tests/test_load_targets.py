"""Targets a load cannot fill in place, and optimizer state that does not fit: differences, found first.

A strict load refuses them in its one ``StateMismatchError`` before any byte is written; ``strict=False``
leaves them out and names them in its warning. Also: an unpickling failure names its key.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import cast

import pytest
import torch
from conftest import tensor_at

import aiockpt
from aiockpt import StateMismatchError, StateMismatchWarning

pytestmark = pytest.mark.timeout(60)


def keys_of(error: StateMismatchError) -> list[str]:
    return sorted(d.split(":")[0] for d in error.differences)


# --- Meta tensors ---------------------------------------------------------------------------------------


def meta_target() -> dict[str, object]:
    with torch.device("meta"):
        module = torch.nn.Linear(2, 2)
    return {"a": torch.empty(4, device="meta"), "m": module, "c": torch.zeros(3)}


async def save_for_meta(path: Path) -> None:
    await aiockpt.save({"a": torch.arange(4.0), "m": torch.nn.Linear(2, 2), "c": torch.ones(3)}, path)


async def test_a_strict_load_refuses_meta_tensors_naming_each(ckpt_path: Path) -> None:
    await save_for_meta(ckpt_path)
    target = meta_target()
    with pytest.raises(StateMismatchError) as info:
        await aiockpt.load(target, ckpt_path)
    assert keys_of(info.value) == ["a", "m/bias", "m/weight"], info.value.differences
    assert all("meta device" in d for d in info.value.differences), info.value.differences
    assert torch.equal(tensor_at(target, "c"), torch.zeros(3))  # nothing was loaded


async def test_a_non_strict_load_leaves_meta_tensors_out_and_says_so(ckpt_path: Path) -> None:
    await save_for_meta(ckpt_path)
    target = meta_target()
    with pytest.warns(StateMismatchWarning) as record:  # (and no other warning: they are errors here)
        await aiockpt.load(target, ckpt_path, strict=False)
    text = " ".join(str(w.message) for w in record)
    for key in ("a:", "m/weight:", "m/bias:"):
        assert key in text, (key, text)
    assert torch.equal(tensor_at(target, "c"), torch.ones(3))
    module = target["m"]
    assert isinstance(module, torch.nn.Linear)
    assert module.weight.is_meta
    assert tensor_at(target, "a").is_meta


async def test_a_materialized_module_loads(ckpt_path: Path) -> None:
    """The way out the message names: ``to_empty`` gives the module memory, which the load fills."""
    saved = torch.nn.Linear(2, 2)
    await aiockpt.save({"m": saved}, ckpt_path)
    with torch.device("meta"):
        module = torch.nn.Linear(2, 2)
    module.to_empty(device="cpu")
    await aiockpt.load({"m": module}, ckpt_path)
    assert torch.equal(module.weight, saved.weight)


# --- Tensors whose elements share memory ----------------------------------------------------------------


async def test_an_expanded_target_is_refused_before_anything_is_written(ckpt_path: Path) -> None:
    await aiockpt.save({"a": torch.arange(1000.0), "b": torch.arange(3.0)}, ckpt_path)
    target: dict[str, object] = {"a": torch.zeros(1000), "b": torch.zeros(1).expand(3)}
    with pytest.raises(StateMismatchError) as info:
        await aiockpt.load(target, ckpt_path)
    assert keys_of(info.value) == ["b"], info.value.differences
    assert "share memory" in info.value.differences[0]
    assert not tensor_at(target, "a").any()  # nothing was loaded


async def test_a_non_strict_load_leaves_an_expanded_target_out(ckpt_path: Path) -> None:
    await aiockpt.save({"a": torch.arange(1000.0), "b": torch.arange(6.0).reshape(2, 3)}, ckpt_path)
    target: dict[str, object] = {"a": torch.zeros(1000), "b": torch.zeros(2, 1).expand(2, 3)}
    with pytest.warns(StateMismatchWarning, match=r"not loaded: b: .*share memory"):
        await aiockpt.load(target, ckpt_path, strict=False)
    assert torch.equal(tensor_at(target, "a"), torch.arange(1000.0))
    assert not tensor_at(target, "b").any()


async def test_strided_targets_whose_elements_are_apart_still_load(ckpt_path: Path) -> None:
    """Only a stride of 0 over more than one element is refused: views, size-1 dimensions load."""
    saved = {
        "t": torch.arange(6.0).reshape(2, 3),
        "s": torch.arange(4.0),
        "one": torch.arange(6.0).reshape(1, 2, 3),
    }
    await aiockpt.save(saved, ckpt_path)
    base = torch.zeros(8)
    target: dict[str, object] = {
        "t": torch.zeros(3, 2).t(),  # transposed: not contiguous
        "s": base[::2],  # every other element
        "one": torch.zeros(6).as_strided((1, 2, 3), (0, 1, 2)),  # transposed, stride 0 over one element
    }
    await aiockpt.load(target, ckpt_path)
    for key, value in saved.items():
        assert torch.equal(tensor_at(target, key), value), key
    assert torch.equal(base[1::2], torch.zeros(4))


# --- Statefuls that take what they are given -------------------------------------------------------------


class _History:
    """A Stateful whose state grows: a list of past values (an early-stopping tracker, say)."""

    def __init__(self, values: list[float] | None = None) -> None:
        self.values = values or []

    def state_dict(self) -> dict[str, object]:
        return {"history": list(self.values)}

    def load_state_dict(self, state_dict: dict[str, object]) -> None:
        self.values = list(cast("list[float]", state_dict["history"]))


async def test_a_statefuls_list_of_another_length_is_the_checkpoints(ckpt_path: Path) -> None:
    """As ``load_state_dict(sd)`` takes it: the lengths differing was a difference, and (``strict=False``)
    the object kept its own list."""
    await aiockpt.save({"es": _History([0.9, 0.7, 0.8])}, ckpt_path)
    for target in (_History(), _History([1.0])):
        await aiockpt.load({"es": target}, ckpt_path)
        assert target.values == [0.9, 0.7, 0.8]


class _Replay:
    """A Stateful holding a tensor whose length grows (a replay buffer): its load_state_dict replaces it."""

    def __init__(self, rows: int) -> None:
        self.obs = torch.zeros(rows, 2)

    def state_dict(self) -> dict[str, object]:
        return {"obs": self.obs}

    def load_state_dict(self, state_dict: dict[str, object]) -> None:
        self.obs = cast("torch.Tensor", state_dict["obs"])


async def test_a_statefuls_tensor_of_another_shape_is_the_checkpoints(ckpt_path: Path) -> None:
    """It was a difference (the target's tensor filled in place must fit), where torch.load hands it over."""
    saved = _Replay(5)
    saved.obs += torch.arange(5.0)[:, None]
    await aiockpt.save({"buffer": saved}, ckpt_path)
    for target in (_Replay(0), _Replay(7)):
        await aiockpt.load({"buffer": target}, ckpt_path)  # strict
        assert torch.equal(target.obs, saved.obs)
    fits = _Replay(5)
    own = fits.obs
    await aiockpt.load({"buffer": fits}, ckpt_path)
    assert fits.obs is own  # (one that fits is still filled in place)
    assert torch.equal(own, saved.obs)


class _Scaled(torch.nn.Module):
    """A module whose extra state is opaque to torch: a serialized blob, empty before first use."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(2, 2)
        self.history: list[float] = []

    def get_extra_state(self) -> object:
        if not self.history:
            return {"blob": torch.empty(0, dtype=torch.uint8), "history": []}
        return {"blob": torch.tensor(self.history).view(torch.uint8), "history": list(self.history)}

    def set_extra_state(self, state: object) -> None:
        blob = cast("dict[str, torch.Tensor]", state)["blob"]
        self.history = blob.view(torch.float32).tolist()
        assert self.history == cast("dict[str, list[float]]", state)["history"]


async def test_a_modules_extra_state_is_handed_over_as_saved(ckpt_path: Path) -> None:
    """torch hands set_extra_state what get_extra_state gave, whatever its shape; aiockpt matched it against
    the target's current extra state (a blob of another length, a list of another length: a difference)."""
    saved = _Scaled()
    saved.history = [0.5, 0.25, 0.125]
    await aiockpt.save({"m": saved}, ckpt_path)
    target = _Scaled()
    await aiockpt.load({"m": target}, ckpt_path)  # strict
    assert target.history == [0.5, 0.25, 0.125]
    assert torch.equal(target.lin.weight, saved.lin.weight)


def _adam_stepped(params_with_grad: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 2))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    x = model[0](torch.randn(4, 3))
    (model[1](x) if params_with_grad == 4 else x).sum().backward()
    opt.step()
    return model, opt


async def test_an_optimizer_loads_state_as_its_load_state_dict_does(ckpt_path: Path) -> None:
    """Into a stepped optimizer: its state for parameters the checkpoint has none for is dropped (it was
    "missing key"), and a float ``step`` (older torch) is taken where the target's is a tensor."""
    _, saved = _adam_stepped(2)  # the second layer got no gradient: no state for it
    for state in saved.state.values():
        state["step"] = float(state["step"])
    await aiockpt.save({"opt": saved}, ckpt_path)
    _, target = _adam_stepped(4)
    _, reference = _adam_stepped(4)
    reference.load_state_dict(saved.state_dict())
    await aiockpt.load({"opt": target}, ckpt_path)
    got, want = target.state_dict(), reference.state_dict()
    assert got["param_groups"] == want["param_groups"]
    assert sorted(got["state"]) == sorted(want["state"]) == [0, 1]
    for pid, entries in want["state"].items():
        for name, value in entries.items():
            assert torch.equal(got["state"][pid][name], value), (pid, name)


async def test_small_state_a_load_creates_sits_in_a_slab_of_its_size(ckpt_path: Path) -> None:
    """A fresh optimizer's few KiB of state, created by the load, were cut from a 16 MiB slab, which
    ``torch.save(opt.state_dict())`` then wrote whole."""
    model, saved = _adam_stepped(4)
    await aiockpt.save({"opt": saved}, ckpt_path)
    target = torch.optim.Adam(model.parameters(), lr=0.1)
    await aiockpt.load({"opt": target}, ckpt_path)
    storages = {s["exp_avg"].untyped_storage().nbytes() for s in target.state.values()}
    assert max(storages) <= 64 << 10, storages


async def test_an_optimizer_of_named_parameters_keeps_its_param_names(ckpt_path: Path) -> None:
    model, saved = _adam_stepped(4)  # built from parameters(): its groups have no param_names
    await aiockpt.save({"opt": saved}, ckpt_path)
    target = torch.optim.Adam(model.named_parameters(), lr=0.1)
    await aiockpt.load({"opt": target}, ckpt_path)
    assert target.param_groups[0]["param_names"] == [n for n, _ in model.named_parameters()]
    assert len(target.state) == 4


# --- Inference tensors ----------------------------------------------------------------------------------


@pytest.mark.parametrize("source", ["aiockpt", "torch.save"])
async def test_inference_tensors_load_in_place_strided_or_not(source: str, tmp_path: Path) -> None:
    """Tensors made under ``torch.inference_mode()`` (an actor's serving weights) take a load.

    Outside inference mode torch refuses any in-place write to them: the copies into targets that are
    not read straight into (a transposed view, a foreign checkpoint's decoded chunks) raised a bare
    ``RuntimeError`` once the others had been written.
    """
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    t, v = torch.randn(3, 4), torch.randn(5)
    saved = {"t": t, "v": v, "m": model.state_dict()}
    path = tmp_path / "ckpt"
    if source == "aiockpt":
        await aiockpt.save(saved, path)
    else:
        path = tmp_path / "state.pt"
        torch.save(saved, path)
    with torch.inference_mode():
        transposed = torch.zeros(4, 3).t()
        plain = torch.zeros(5)
        module = torch.nn.Linear(4, 3)
    target: dict[str, object] = {"t": transposed, "v": plain, "m": module}
    await aiockpt.load(target, path)
    assert target["t"] is transposed
    assert transposed.is_inference()
    assert torch.equal(transposed, t)
    assert torch.equal(plain, v)
    assert torch.equal(module.weight, model.weight)
    assert torch.equal(module.bias, model.bias)


async def test_parameters_loaded_through_a_copy_stay_autograd_leaves(ckpt_path: Path) -> None:
    """The copies run in inference mode; a parameter filled so is a normal leaf, and counts the write."""
    await aiockpt.save({"w": torch.arange(12.0).reshape(4, 3)}, ckpt_path)
    weight = torch.nn.Parameter(torch.zeros(3, 4))
    target: dict[str, object] = {"w": weight.t()}  # transposed: filled by a copy, not read into
    version = weight._version
    await aiockpt.load(target, ckpt_path)
    assert torch.equal(weight.t(), torch.arange(12.0).reshape(4, 3))
    assert not weight.is_inference()
    assert weight._version > version
    (weight * 2).sum().backward()  # type: ignore[no-untyped-call]
    assert weight.grad is not None
    assert torch.equal(weight.grad, torch.full((3, 4), 2.0))


# --- Layouts other than strided -------------------------------------------------------------------------


def sparse_targets() -> dict[str, Callable[[], torch.Tensor]]:
    makers: dict[str, Callable[[], torch.Tensor]] = {
        "sparse_coo": lambda: torch.zeros(4, 4).to_sparse(),
        "sparse_csr": lambda: torch.zeros(4, 4).to_sparse_csr(),
        "sparse_bsr": lambda: torch.zeros(4, 4).to_sparse_bsr((2, 2)),
    }
    if torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]
        makers["_mkldnn"] = lambda: torch.zeros(4, 4).to_mkldnn()
    return makers


@pytest.mark.filterwarnings("ignore:Sparse (CSR|BSR) tensor support is in beta:UserWarning")
@pytest.mark.parametrize("layout", sorted(sparse_targets()))
@pytest.mark.parametrize("strict", [True, False])
async def test_a_target_of_another_layout_is_a_difference(ckpt_path: Path, layout: str, strict: bool) -> None:
    await aiockpt.save({"a": torch.eye(4), "b": torch.ones(2)}, ckpt_path)
    target: dict[str, object] = {"a": sparse_targets()[layout](), "b": torch.zeros(2)}
    if strict:
        with pytest.raises(StateMismatchError) as info:
            await aiockpt.load(target, ckpt_path)
        assert keys_of(info.value) == ["a"], info.value.differences
        assert f"layout {layout}" in info.value.differences[0]
        assert not tensor_at(target, "b").any()
    else:
        with pytest.warns(StateMismatchWarning, match=rf"not loaded: a: .*layout {layout}"):
            await aiockpt.load(target, ckpt_path, strict=False)
        assert torch.equal(tensor_at(target, "b"), torch.ones(2))


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage:UserWarning")
@pytest.mark.parametrize("layout", [torch.strided, torch.jagged], ids=["strided", "jagged"])
async def test_a_nested_target_is_a_difference(ckpt_path: Path, layout: torch.layout) -> None:
    """A nested tensor of strided layout has no shape to compare: it is a difference all the same."""
    await aiockpt.save({"a": torch.zeros(2, 3), "b": torch.ones(2)}, ckpt_path)
    nested = torch.nested.nested_tensor([torch.zeros(3), torch.zeros(3)], layout=layout)
    with pytest.raises(StateMismatchError, match=r"a: the target is a nested tensor float32, the checkpoint"):
        await aiockpt.load({"a": nested, "b": torch.zeros(2)}, ckpt_path)
    target: dict[str, object] = {"a": nested, "b": torch.zeros(2)}
    with pytest.warns(StateMismatchWarning, match=r"not loaded: a: the target is a nested tensor"):
        await aiockpt.load(target, ckpt_path, strict=False)
    assert torch.equal(tensor_at(target, "b"), torch.ones(2))


class WithSparseBuffer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(2, 2)
        self.register_buffer("mask", torch.zeros(2, 2).to_sparse())


async def test_a_module_with_a_sparse_buffer_loads_the_rest(ckpt_path: Path) -> None:
    saved = torch.nn.Linear(2, 2)
    await aiockpt.save(
        {"m": {"lin.weight": saved.weight, "lin.bias": saved.bias, "mask": torch.eye(2)}}, ckpt_path
    )
    module = WithSparseBuffer()
    with pytest.warns(StateMismatchWarning, match=r"m/mask: .*layout sparse_coo"):
        await aiockpt.load({"m": module}, ckpt_path, strict=False)
    assert torch.equal(module.lin.weight, saved.weight)


# --- A never-stepped optimizer over parameters of other shapes ------------------------------------------


def stepped(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    opt.zero_grad()


async def save_adamw(path: Path) -> None:
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    stepped(model, opt)
    await aiockpt.save({"optim": opt}, path)


async def test_a_fresh_optimizer_refuses_state_of_other_shapes(ckpt_path: Path) -> None:
    await save_adamw(ckpt_path)
    opt = torch.optim.AdamW(torch.nn.Linear(4, 8).parameters())  # never stepped, other shapes
    with pytest.raises(StateMismatchError) as info:
        await aiockpt.load({"optim": opt}, ckpt_path)
    assert keys_of(info.value) == [
        "optim/state/0/exp_avg",
        "optim/state/0/exp_avg_sq",
        "optim/state/1/exp_avg",
        "optim/state/1/exp_avg_sq",
    ], info.value.differences
    assert "float32[8, 4]" in info.value.differences[0]
    assert opt.state_dict()["state"] == {}


async def test_a_fresh_optimizer_leaves_misfit_state_out_non_strict(ckpt_path: Path) -> None:
    """Only the parameters whose state fits get it; the others start anew, and the next step works."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    opt = torch.optim.AdamW(model.parameters())
    stepped(model, opt)
    await aiockpt.save({"optim": opt}, ckpt_path)

    model2 = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 6))  # the last layer resized
    opt2 = torch.optim.AdamW(model2.parameters())
    with pytest.warns(StateMismatchWarning, match=r"optim/state/2/exp_avg: .*optim/state/3/exp_avg"):
        await aiockpt.load({"optim": opt2}, ckpt_path, strict=False)
    state = opt2.state_dict()["state"]
    assert sorted(state) == [0, 1]
    assert torch.equal(state[0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
    model2(torch.randn(2, 4)).sum().backward()
    opt2.step()  # the resized layer's state starts anew


async def test_a_stepped_optimizer_refuses_state_of_other_shapes_too(ckpt_path: Path) -> None:
    await save_adamw(ckpt_path)
    model = torch.nn.Linear(4, 8)
    opt = torch.optim.AdamW(model.parameters())
    stepped(model, opt)
    with pytest.raises(StateMismatchError, match=r"optim/state/0/exp_avg:"):
        await aiockpt.load({"optim": opt}, ckpt_path)


def lbfgs_closure(model: torch.nn.Module, opt: torch.optim.Optimizer) -> Callable[[], torch.Tensor]:
    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = model(torch.ones(2, 4)).pow(2).sum()
        loss.backward()
        return cast("torch.Tensor", loss)

    return closure


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda ps: torch.optim.LBFGS(ps), id="LBFGS"),  # flat vectors of every parameter
        pytest.param(lambda ps: torch.optim.Adafactor(ps), id="Adafactor"),  # factored second moments
        pytest.param(lambda ps: torch.optim.Adam(ps, amsgrad=True), id="Adam-amsgrad"),
        pytest.param(lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), id="SGD-momentum"),
        pytest.param(lambda ps: torch.optim.ASGD(ps), id="ASGD"),  # scalar eta and mu
        pytest.param(lambda ps: torch.optim.Rprop(ps), id="Rprop"),
    ],
)
async def test_a_fresh_optimizer_takes_state_of_matching_parameters(
    ckpt_path: Path, make: Callable[[object], torch.optim.Optimizer]
) -> None:
    """State of shapes other than its parameter's (scalars, flat or factored) is not refused."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.LayerNorm(4), torch.nn.Linear(4, 3))  # a 1-d parameter first
    opt = make(model.parameters())
    if isinstance(opt, torch.optim.LBFGS):
        opt.step(lbfgs_closure(model, opt))  # type: ignore[no-untyped-call]
    else:
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
    await aiockpt.save({"optim": opt}, ckpt_path)

    model2 = torch.nn.Sequential(torch.nn.LayerNorm(4), torch.nn.Linear(4, 3))
    opt2 = make(model2.parameters())
    await aiockpt.load({"optim": opt2}, ckpt_path)  # strict
    assert sorted(opt2.state_dict()["state"]) == sorted(opt.state_dict()["state"])


class ProjectingAdam(torch.optim.Optimizer):
    """An optimizer of another library whose ``exp_avg`` is not of its parameter's shape (as GaLore's)."""

    def __init__(self, params: object) -> None:
        super().__init__(params, {"lr": 0.1})  # type: ignore[arg-type]

    def step(self, closure: object = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p]["exp_avg"] = torch.zeros(2, p.shape[-1])


async def test_other_optimizers_state_is_not_judged_by_name(ckpt_path: Path) -> None:
    opt = ProjectingAdam(torch.nn.Linear(4, 4, bias=False).parameters())
    opt.step()
    await aiockpt.save({"optim": opt}, ckpt_path)
    opt2 = ProjectingAdam(torch.nn.Linear(4, 4, bias=False).parameters())
    await aiockpt.load({"optim": opt2}, ckpt_path)  # strict: exp_avg [2, 4] for a [4, 4] parameter is fine
    assert opt2.state_dict()["state"][0]["exp_avg"].shape == (2, 4)


# --- Unpickling failures name their key -----------------------------------------------------------------


class Gone:
    pass


async def test_an_unpickling_failure_names_its_key(ckpt_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    await aiockpt.save({"nested": {"g": Gone()}}, ckpt_path, allow_pickle=True)
    monkeypatch.delattr(sys.modules[__name__], "Gone")
    with pytest.raises(aiockpt.StateError, match=r"cannot unpickle .*Gone at key 'nested/g'") as info:
        await aiockpt.read(ckpt_path, allow_pickle=True)
    assert info.value.key == "nested/g"


class _Gain(torch.nn.Module):
    """A module whose state-dict format changed: version 1 stored log(scale), version 2 stores scale and
    migrates older state dicts when loaded (as torch documents ``_version`` for)."""

    _version = 2

    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(3))

    def _load_from_state_dict(  # type: ignore[no-untyped-def]
        self, state_dict, prefix, local_metadata, strict, missing, unexpected, errors
    ) -> None:
        version = local_metadata.get("version")
        if (version is None or version < 2) and prefix + "scale" in state_dict:
            state_dict[prefix + "scale"] = state_dict[prefix + "scale"].exp()
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing, unexpected, errors)


async def test_a_versioned_module_is_handed_its_state_dict_versions(tmp_path: Path) -> None:
    """The dict handed to load_state_dict had no ``_metadata``, so a module that migrates older state
    dicts took the checkpoint's current values for an old format's (scale came back as exp(scale))."""
    linear, gain = torch.nn.Linear(2, 2), _Gain()
    with torch.no_grad():
        gain.scale.copy_(torch.tensor([1.0, 2.0, 3.0]))
    await aiockpt.save({"model": torch.nn.Sequential(linear, gain)}, tmp_path / "c")
    fresh_linear, fresh_gain = torch.nn.Linear(2, 2), _Gain()
    await aiockpt.load({"model": torch.nn.Sequential(fresh_linear, fresh_gain)}, tmp_path / "c")
    assert torch.equal(fresh_gain.scale, gain.scale)
    assert torch.equal(fresh_linear.weight, linear.weight)


@pytest.mark.parametrize("strict", [True, False])
@pytest.mark.parametrize("groups", ["fewer groups", "fewer params"])
async def test_an_optimizer_whose_param_groups_differ_is_refused_before_anything_is_read(
    tmp_path: Path, strict: bool, groups: str
) -> None:
    """torch's load_state_dict refuses param groups of another number (or size), but only once the load
    had filled the optimizer's moments, and the model, in place: a StateError left both half loaded."""

    def build(split: bool) -> tuple[torch.nn.Module, torch.nn.Linear, torch.optim.Optimizer]:
        first, second = torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)
        model = torch.nn.Sequential(first, second)
        params = [{"params": first.parameters()}, {"params": second.parameters()}]
        if not split:
            params = [{"params": model.parameters()}] if groups == "fewer groups" else params[:1]
        optim = torch.optim.Adam(params, lr=0.1)
        model(torch.randn(3, 4)).sum().backward()
        optim.step()
        return model, first, optim

    model, first, optim = build(split=True)
    await aiockpt.save({"model": model, "optim": optim}, tmp_path / "c")
    target, target_first, target_optim = build(split=False)
    before_w = target_first.weight.detach().clone()
    before_m = target_optim.state[target_first.weight]["exp_avg"].clone()
    if strict:
        with pytest.raises(StateMismatchError, match=r"optim/param_groups: .*the checkpoint") as info:
            await aiockpt.load({"model": target, "optim": target_optim}, tmp_path / "c")
        assert keys_of(info.value) == ["optim/param_groups"]
        assert torch.equal(target_first.weight, before_w)  # nothing was loaded
    else:
        with pytest.warns(StateMismatchWarning, match="optim/param_groups"):
            await aiockpt.load({"model": target, "optim": target_optim}, tmp_path / "c", strict=False)
        assert torch.equal(target_first.weight, first.weight)  # what matches is loaded
    assert torch.equal(target_optim.state[target_first.weight]["exp_avg"], before_m)  # the optimizer is not
