"""Foreign formats: DCP optimizer state through ``convert`` and ``load``, damaged ``torch.save`` files, header
keys, load targets with cycles, deep nesting or keys that join to one name.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Literal

import pytest
import torch
from safetensors.torch import save_file

import aiockpt
from aiockpt._interop._names import restore_optimizer_ids

# --- DCP optimizer state survives convert --------------------------------------------------------------


def _model() -> torch.nn.Sequential:
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def _trained(seed: int = 0) -> tuple[torch.nn.Sequential, torch.optim.AdamW]:
    torch.manual_seed(seed)
    model = _model()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        optim.zero_grad()
        model(torch.randn(3, 4)).sum().backward()
        optim.step()
    return model, optim


def _dcp_save(state: dict[str, object], path: Path) -> None:
    from torch.distributed.checkpoint import state_dict_saver as dcp

    with warnings.catch_warnings():  # dcp.save warns that it saves in a single process: the intent
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, checkpoint_id=str(path))


def _step(model: torch.nn.Module, optim: torch.optim.Optimizer) -> None:
    optim.zero_grad()
    model(torch.arange(12.0).reshape(3, 4) / 10).sum().backward()
    optim.step()


def _assert_resumed(
    model: torch.nn.Module,
    optim: torch.optim.Optimizer,
    ref: torch.nn.Module,
    ref_optim: torch.optim.Optimizer,
) -> None:
    params, ref_params = list(model.parameters()), list(ref.parameters())
    assert all(p in optim.state for p in params), "the optimizer state is not keyed by its parameters"
    assert list(optim.state_dict()["state"]) == list(range(len(params)))
    for p, q in zip(params, ref_params, strict=True):
        assert torch.equal(p, q)
        for name in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(optim.state[p][name], ref_optim.state[q][name]), name
    # One more step on both: bit-identical (a fresh optimizer state would step differently).
    _step(model, optim)
    _step(ref, ref_optim)
    for p, q in zip(params, ref_params, strict=True):
        assert torch.equal(p, q)


@pytest.mark.parametrize(("to", "name"), [("aiockpt", "converted"), ("torch", "converted.pt")])
async def test_dcp_optimizer_state_converted_loads_into_a_fresh_optimizer(
    tmp_path: Path, to: str, name: str
) -> None:
    model, optim = _trained()
    _dcp_save({"model": model.state_dict(), "optim": optim.state_dict(), "step": 7}, tmp_path / "dcp")
    dst = tmp_path / name
    await aiockpt.convert(tmp_path / "dcp", dst, to=to)  # type: ignore[arg-type]

    tree = await aiockpt.read(dst)
    optim_tree = tree["optim"]
    assert isinstance(optim_tree, dict)
    assert list(optim_tree["state"]) == [0, 1, 2, 3]  # as the optimizer saved them, not DCP's "0", "1"...
    assert optim_tree["param_groups"][0]["params"] == [0, 1, 2, 3]

    fresh = _model()
    fresh_optim = torch.optim.AdamW(fresh.parameters(), lr=1e-2)  # never stepped: no state yet
    state: dict[str, object] = {"model": fresh, "optim": fresh_optim, "step": 0}
    await aiockpt.load(state, dst)  # strict
    assert state["step"] == 7
    _assert_resumed(fresh, fresh_optim, model, optim)


async def test_str_keyed_optimizer_state_loads_keyed_by_parameters(tmp_path: Path) -> None:
    """A tree that kept DCP's str keys (``dcp_to_torch_save``, earlier conversions) loads by parameter."""
    model, optim = _trained()
    _dcp_save({"model": model.state_dict(), "optim": optim.state_dict()}, tmp_path / "dcp")
    tree = await aiockpt.read(tmp_path / "dcp")  # str keys, as documented
    assert list(tree["optim"]["state"]) == ["0", "1", "2", "3"]  # type: ignore[index]
    torch.save(tree, tmp_path / "str-keys.pt")
    await aiockpt.save({str(k): v for k, v in tree.items()}, tmp_path / "str-keys")
    for src in ("str-keys.pt", "str-keys"):
        fresh = _model()
        fresh_optim = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
        await aiockpt.load({"model": fresh, "optim": fresh_optim}, tmp_path / src)
        _assert_resumed(fresh, fresh_optim, *_trained())
        # Into an optimizer that stepped already (int keys in place): the same.
        stepped, stepped_optim = _trained(seed=1)
        await aiockpt.load({"model": stepped, "optim": stepped_optim}, tmp_path / src)
        _assert_resumed(stepped, stepped_optim, *_trained())


def test_optimizer_ids_are_restored_only_where_unambiguous() -> None:
    groups = [{"lr": 0.1, "params": [0, 1]}]
    tree: dict[object, object] = {
        "optim": {"state": {"0": {"a": 1}, "1": {"a": 2}}, "param_groups": groups},
        "nested": [{"state": {"1": 5}, "param_groups": [{"params": [1]}]}],
        # Not an optimizer's ids: a key no group lists, a non-canonical number, names (get_state_dict).
        "extra": {"state": {"0": 1, "2": 2}, "param_groups": [{"params": [0, 1]}]},
        "padded": {"state": {"00": 1}, "param_groups": [{"params": [0]}]},
        "named": {"state": {"w": 1}, "param_groups": [{"params": ["w"]}]},
        "str_ids": {"state": {"0": 1}, "param_groups": [{"params": ["0"]}]},
        "plain": {"state": {"0": 1}},
    }
    assert restore_optimizer_ids(tree) == 2  # type: ignore[arg-type]
    assert tree["optim"] == {"state": {0: {"a": 1}, 1: {"a": 2}}, "param_groups": groups}
    assert tree["nested"] == [{"state": {1: 5}, "param_groups": [{"params": [1]}]}]
    assert list(tree["extra"]["state"]) == ["0", "2"]  # type: ignore[index]
    assert list(tree["padded"]["state"]) == ["00"]  # type: ignore[index]
    assert list(tree["named"]["state"]) == ["w"]  # type: ignore[index]
    assert list(tree["str_ids"]["state"]) == ["0"]  # type: ignore[index]
    assert list(tree["plain"]["state"]) == ["0"]  # type: ignore[index]


async def test_convert_keeps_str_keys_of_an_aiockpt_source(tmp_path: Path) -> None:
    """Only DCP lost the ints: an aiockpt source's str keys are what its saver chose."""
    tree = {"optim": {"state": {"0": torch.ones(1)}, "param_groups": [{"params": [0]}]}}
    await aiockpt.save(tree, tmp_path / "src")
    await aiockpt.convert(tmp_path / "src", tmp_path / "out.pt", to="torch")
    assert list(torch.load(tmp_path / "out.pt")["optim"]["state"]) == ["0"]


# --- A damaged torch.save file is damage ---------------------------------------------------------------


@pytest.mark.parametrize("cut", [10, "half"])
async def test_truncated_torch_file_is_a_corruption_error(tmp_path: Path, cut: int | str) -> None:
    path = tmp_path / "x.pt"
    torch.save({"w": torch.randn(64, 64), "step": 5}, path)
    size = path.stat().st_size
    os.truncate(path, size // 2 if cut == "half" else size - int(cut))
    with pytest.raises(aiockpt.CorruptionError, match="damaged") as info:
        await aiockpt.read(path)
    assert info.value.file == str(path)
    with pytest.raises(aiockpt.CorruptionError) as info:
        await aiockpt.load({"w": torch.zeros(64, 64), "step": 0}, path)
    assert info.value.file == str(path)


async def test_truncated_legacy_torch_file_is_a_corruption_error(tmp_path: Path) -> None:
    path = tmp_path / "legacy.pt"
    torch.save({"w": torch.ones(4)}, path, _use_new_zipfile_serialization=False)
    os.truncate(path, path.stat().st_size - 5)
    with pytest.raises(aiockpt.CorruptionError, match="ends early") as info:
        await aiockpt.read(path)
    assert info.value.file == str(path)


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")  # (torch.load's, for protocols other than 2)
@pytest.mark.parametrize("protocol", [2, 3, 4, 5])
async def test_legacy_torch_files_of_every_pickle_protocol_are_read(tmp_path: Path, protocol: int) -> None:
    """Only protocol 2's magic number was recognised: torch.save(..., pickle_protocol=3, 4 or 5) files
    were "not an aiockpt checkpoint: it is not a directory"."""
    path = tmp_path / "legacy.pt"
    state = {"w": torch.arange(6.0).reshape(2, 3), "step": 7}
    torch.save(state, path, _use_new_zipfile_serialization=False, pickle_protocol=protocol)
    # torch.load(weights_only=True) knows no FRAME opcode (protocols 4 and 5 frame their pickles), so
    # those files need allow_pickle=True, as they need weights_only=False in torch.load.
    got = await aiockpt.read(path, allow_pickle=protocol >= 4)
    assert torch.equal(got["w"], state["w"])  # type: ignore[arg-type]
    assert got["step"] == 7


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
@pytest.mark.parametrize("protocol", [4, 5])
@pytest.mark.parametrize("zipped", [True, False], ids=["zip", "legacy"])
async def test_a_framed_pickle_is_refused_for_its_protocol_not_its_objects(
    tmp_path: Path, protocol: int, zipped: bool
) -> None:
    """A file of a tensor and an int pickled with protocol 4 or 5 was said to hold "objects that
    torch.load(weights_only=True) refuses (Unsupported operand 149; unpickling it can run code)"."""
    path = tmp_path / "framed.pt"
    torch.save(
        {"w": torch.ones(2), "step": 7}, path, _use_new_zipfile_serialization=zipped, pickle_protocol=protocol
    )
    with pytest.raises(aiockpt.StateError, match="pickled with protocol 4 or 5") as info:
        await aiockpt.read(path)
    assert "holds objects" not in str(info.value)


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
@pytest.mark.parametrize("protocol", [2, 3])
async def test_a_legacy_torch_file_cut_anywhere_is_damage(tmp_path: Path, protocol: int) -> None:
    """Cut in its pickles, it gave a FormatError ("index out of range", "unpack requires a buffer"), or a
    StateError that told the user to pass allow_pickle=True for a file that was merely truncated."""
    whole = tmp_path / "whole.pt"
    torch.save({"w": torch.ones(100)}, whole, _use_new_zipfile_serialization=False, pickle_protocol=protocol)
    data = whole.read_bytes()
    path = tmp_path / "cut.pt"
    seen: dict[int, str] = {}
    for n in range(30, len(data), 7):
        path.write_bytes(data[:n])
        for allow_pickle in (False, True):
            try:
                await aiockpt.read(path, allow_pickle=allow_pickle)
            except aiockpt.CheckpointError as exc:
                if not isinstance(exc, aiockpt.CorruptionError) or exc.file != str(path):
                    seen[n] = f"{type(exc).__name__}: {exc}"
            else:
                seen[n] = "read"
    assert seen == {}


async def test_a_truncated_dcp_metadata_file_is_damage(tmp_path: Path) -> None:
    """It was a FormatError ("is not readable DCP metadata: pickle data was truncated"), exit 2."""
    _dcp_save({"w": torch.ones(4)}, tmp_path / "d")
    metadata = tmp_path / "d" / ".metadata"
    os.truncate(metadata, metadata.stat().st_size // 2)
    with pytest.raises(aiockpt.CorruptionError, match="ends early") as info:
        await aiockpt.read(tmp_path / "d")
    assert info.value.file == str(metadata)


async def test_a_zip_that_is_no_torch_file_is_still_a_format_error(tmp_path: Path) -> None:
    import zipfile

    path = tmp_path / "x.pt"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("hello.txt", "not a torch.save archive")
    with pytest.raises(aiockpt.FormatError) as info:
        await aiockpt.read(path)
    assert not isinstance(info.value, aiockpt.CorruptionError)


async def test_an_aiockpt_copy_keeps_the_step_and_metadata_of_its_aiockpt_source(tmp_path: Path) -> None:
    """convert --to aiockpt dropped both: the copy had no step and no metadata (loss, epoch...)."""
    async with aiockpt.Checkpointer(tmp_path / "root") as ckpt:
        await ckpt.save({"w": torch.ones(3)}, step=1500, metadata={"loss": 0.25, "run": "a"})
    await aiockpt.convert(tmp_path / "root" / "step-00001500", tmp_path / "copy", to="aiockpt")
    meta = await aiockpt.read_metadata(tmp_path / "copy")
    assert meta.step == 1500
    assert meta.user_metadata == {"loss": 0.25, "run": "a"}
    torch.save({"w": torch.ones(3)}, tmp_path / "x.pt")  # a source with neither
    await aiockpt.convert(tmp_path / "x.pt", tmp_path / "from-torch", to="aiockpt")
    meta = await aiockpt.read_metadata(tmp_path / "from-torch")
    assert (meta.step, meta.user_metadata) == (None, {})


@pytest.mark.parametrize("to", ["torch", "aiockpt", "dcp"])
async def test_convert_counts_a_tied_tensor_once(
    tmp_path: Path, to: Literal["torch", "aiockpt", "dcp"]
) -> None:
    """Its bytes were counted once per key: the progress total, and the CLI's nbytes, were doubled."""
    w = torch.ones(256)
    await aiockpt.save({"embed": w, "lm_head": w}, tmp_path / "src")
    seen: list[tuple[int, int]] = []
    await aiockpt.convert(
        tmp_path / "src", tmp_path / "out", to=to, progress=lambda d, t: seen.append((d, t))
    )
    assert seen[0] == (0, w.nbytes)
    assert seen[-1] == (w.nbytes, w.nbytes)


@pytest.mark.parametrize("dst", ["out.safetensors", "hf"])
async def test_an_error_of_the_progress_callback_reaches_the_caller_as_it_is(
    tmp_path: Path, dst: str
) -> None:
    """Raised from a call made as safetensors tensors were written, it came back as a StateError blaming
    the source ("cannot write ... as safetensors: ...")."""

    class Stop(Exception):
        pass

    def progress(done: int, total: int) -> None:
        if done:
            raise Stop

    await aiockpt.save({f"w{i}": torch.ones(4096) for i in range(4)}, tmp_path / "src")
    with pytest.raises(Stop):
        await aiockpt.convert(tmp_path / "src", tmp_path / dst, to="safetensors", progress=progress)
    assert sorted(os.listdir(tmp_path)) == ["src"]


@pytest.mark.parametrize(
    ("state", "key"),
    [({"s": torch.eye(2).to_sparse()}, "s"), ({0: torch.ones(1)}, "0")],
    ids=["sparse", "int_key"],
)
async def test_a_torch_file_aiockpt_cannot_read_is_named(
    tmp_path: Path, state: object, key: str | None
) -> None:
    """The refusal named the key alone, in a save's words ("cannot save tensor at key 's'")."""
    path = tmp_path / "x.pt"
    torch.save(state, path)
    with pytest.raises(aiockpt.StateError, match=f"{path} holds what aiockpt cannot read") as info:
        await aiockpt.read(path)
    assert info.value.key == key


# --- convert into a path under a file ----------------------------------------------------------------


@pytest.mark.parametrize("to", ["torch", "aiockpt", "safetensors"])
@pytest.mark.parametrize("under", ["notadir", "notadir/sub"])
async def test_convert_under_a_file_names_the_file(tmp_path: Path, to: str, under: str) -> None:
    await aiockpt.save({"w": torch.ones(2)}, tmp_path / "src")
    (tmp_path / "notadir").write_text("hi")
    dst = tmp_path / under / "out.pt"
    with pytest.raises(aiockpt.StorageError, match="is not a directory") as info:
        await aiockpt.convert(tmp_path / "src", dst, to=to)  # type: ignore[arg-type]
    assert not isinstance(info.value, aiockpt.CheckpointExistsError)
    assert info.value.path == str(tmp_path / "notadir")
    assert f"{tmp_path / 'notadir'} is not a directory" in str(info.value)
    assert (tmp_path / "notadir").read_text() == "hi"
    assert sorted(os.listdir(tmp_path)) == ["notadir", "src"]


# --- safetensors header errors name the key ------------------------------------------------------------


def _edit_header(path: Path, edit: dict[str, object]) -> None:
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    header.update(edit)
    new = json.dumps(header).encode()
    new += b" " * (-len(new) % 8)
    path.write_bytes(len(new).to_bytes(8, "little") + new + raw[8 + n :])


@pytest.mark.parametrize(
    "entry",
    [
        {"dtype": "F32", "shape": [4], "data_offsets": [-4, 12]},
        {"dtype": "F32", "shape": [4], "data_offsets": ["a", "b"]},
        {"dtype": "F32", "shape": [-4], "data_offsets": [0, 16]},
        {"dtype": "F32", "shape": [4.0], "data_offsets": [0, 16]},
        {"dtype": 5, "shape": [4], "data_offsets": [0, 16]},
        5,
    ],
    ids=[
        "offsets_neg",
        "offsets_str",
        "shape_neg",
        "shape_float",
        "dtype_int",
        "not_object",
    ],
)
async def test_safetensors_header_errors_name_the_key(tmp_path: Path, entry: object) -> None:
    path = tmp_path / "x.safetensors"
    save_file({"a": torch.ones(4), "b": torch.zeros(2)}, str(path))
    _edit_header(path, {"a": entry})
    with pytest.raises(aiockpt.CorruptionError) as info:
        await aiockpt.read(path)
    assert info.value.key == "a"
    assert info.value.file == str(path)
    assert "'a'" in str(info.value)


async def test_a_safetensors_dtype_this_reader_does_not_know_is_a_format_error_naming_it(
    tmp_path: Path,
) -> None:
    # Damage, or a dtype a later safetensors added: a reader cannot tell, so not CorruptionError.
    path = tmp_path / "x.safetensors"
    save_file({"a": torch.ones(4)}, str(path))
    _edit_header(path, {"a": {"dtype": "F99", "shape": [4], "data_offsets": [0, 16]}})
    with pytest.raises(aiockpt.FormatError, match=r"'a' has dtype 'F99'.*or the header is damaged") as info:
        await aiockpt.read(path)
    assert not isinstance(info.value, aiockpt.CorruptionError)


# --- a foreign load walks any target a native load takes ---------------------------------------------


def _cyclic_dict() -> dict[str, object]:
    cfg: dict[str, object] = {}
    cfg["self"] = cfg
    return cfg


def _cyclic_list() -> list[object]:
    items: list[object] = [torch.zeros(1)]
    items.append(items)
    return items


def _deep(levels: int, leaf: object = 0) -> object:
    for _ in range(levels):
        leaf = {"k": leaf}
    return leaf


def _foreign(tmp_path: Path, kind: str, tensors: dict[str, torch.Tensor]) -> Path:
    if kind == "safetensors":
        save_file(tensors, str(tmp_path / "x.safetensors"))
        return tmp_path / "x.safetensors"
    nested: dict[str, object] = {}  # for DCP, the names' key paths: "a.b" is {"a": {"b": ...}}
    for name, t in tensors.items():
        *parents, last = name.split(".")
        cur = nested
        for k in parents:
            cur = cur.setdefault(k, {})  # type: ignore[assignment]
        cur[last] = t
    _dcp_save(nested, tmp_path / "dcp")
    return tmp_path / "dcp"


@pytest.mark.parametrize("kind", ["safetensors", "dcp"])
@pytest.mark.parametrize(
    "cfg", [_cyclic_dict, _cyclic_list, lambda: _deep(2000)], ids=["dict", "list", "deep"]
)
async def test_a_foreign_load_reports_a_cyclic_or_deep_target_key_missing_as_a_native_load(
    tmp_path: Path, kind: str, cfg: object
) -> None:
    """It recursed over the whole target: a RecursionError."""
    path = _foreign(tmp_path, kind, {"a.b": torch.ones(2)})
    assert callable(cfg)
    state: dict[str, object] = {"a": {"b": torch.zeros(2)}, "cfg": cfg()}
    with pytest.raises(aiockpt.StateMismatchError) as info:
        await aiockpt.load(state, path)
    assert info.value.differences == ["cfg: missing key (in the target, not in the checkpoint)"]
    with pytest.warns(aiockpt.StateMismatchWarning, match="cfg: missing key"):
        await aiockpt.load(state, path, strict=False)
    assert torch.equal(state["a"]["b"], torch.ones(2))  # type: ignore[index]


@pytest.mark.parametrize(
    ("kind", "differences"),
    [
        # DCP's key paths place the entry inside the cycle: the matcher walks the target alongside it.
        ("dcp", ["cfg/self/self: missing key", "cfg/self/x: unexpected key"]),
        ("safetensors", ["cfg/self.x: unexpected key", "cfg/self: missing key"]),
    ],
)
async def test_a_foreign_load_compares_a_cycle_the_source_has_entries_under(
    tmp_path: Path, kind: str, differences: list[str]
) -> None:
    path = _foreign(tmp_path, kind, {"cfg.self.x": torch.ones(2)})
    with pytest.raises(aiockpt.StateMismatchError) as info:
        await aiockpt.load({"cfg": _cyclic_dict()}, path)
    assert sorted(d.split(" (")[0] for d in info.value.differences) == differences


async def test_a_foreign_load_refuses_a_target_nested_too_deep_where_the_source_has_entries(
    tmp_path: Path,
) -> None:
    path = _foreign(tmp_path, "safetensors", {"k." * 150 + "w": torch.ones(2)})
    with pytest.raises(aiockpt.StateError, match="nests containers more than 100 levels deep") as info:
        await aiockpt.load({"k": _deep(149, {"w": torch.zeros(2)})}, path)
    assert info.value.key == "/".join(["k"] * 100)


# --- two target keys of one flat name -----------------------------------------------------------------


@pytest.mark.parametrize("kind", ["safetensors", "dcp"])
async def test_a_foreign_load_fills_one_of_two_target_keys_joined_to_one_name(
    tmp_path: Path, kind: str
) -> None:
    """Both were filled with the one tensor, silently, even with ``strict``."""
    path = _foreign(tmp_path, kind, {"a.b": torch.ones(2), "x.0": torch.full((2,), 7.0)})

    def target() -> dict[str, object]:
        return {
            "a.b": torch.zeros(2),
            "a": {"b": torch.zeros(2)},
            "x": {0: torch.zeros(2), "0": torch.zeros(2)},
        }

    with pytest.raises(aiockpt.StateMismatchError) as info:
        await aiockpt.load(target(), path)
    said = "\n".join(info.value.differences)
    assert "a/b: not loaded: it and 'a.b' are both named 'a.b' once joined with '.'" in said
    assert "x/'0': not loaded: it and 'x/0' are both named 'x.0' once joined with '.'" in said
    state = target()
    with pytest.warns(aiockpt.StateMismatchWarning, match="a/b: not loaded"):
        await aiockpt.load(state, path, strict=False)
    assert torch.equal(state["a.b"], torch.ones(2))  # type: ignore[arg-type]
    assert torch.equal(state["a"]["b"], torch.zeros(2))  # type: ignore[index]
    assert torch.equal(state["x"][0], torch.full((2,), 7.0))  # type: ignore[index]
    assert torch.equal(state["x"]["0"], torch.zeros(2))  # type: ignore[index]


# --- an optimizer's state lists from DCP stay lists ------------------------------------------------------


def _lbfgs(seed: int, steps: int) -> tuple[torch.nn.Linear, torch.optim.LBFGS, object]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(3, 1)
    optim = torch.optim.LBFGS(model.parameters(), history_size=3, max_iter=2)
    x, y = torch.arange(24.0).reshape(8, 3) / 10, torch.arange(8.0).reshape(8, 1) / 10

    def closure() -> torch.Tensor:
        optim.zero_grad()
        loss: torch.Tensor = ((model(x) - y) ** 2).mean()
        loss.backward()  # type: ignore[no-untyped-call]
        return loss

    for _ in range(steps):
        optim.step(closure)  # type: ignore[no-untyped-call]
    return model, optim, closure


@pytest.mark.parametrize("steps", [0, 1], ids=["fresh", "shorter_history"])
async def test_lbfgs_state_saved_by_dcp_resumes_bit_exact(tmp_path: Path, steps: int) -> None:
    """Its lists came back as int-keyed dicts (``old_dirs.append`` failed), or were refused if longer."""
    ref, ref_optim, ref_closure = _lbfgs(0, 3)
    _dcp_save({"model": ref, "optim": ref_optim}, tmp_path / "dcp")
    model, optim, closure = _lbfgs(1, steps)
    await aiockpt.load({"model": model, "optim": optim}, tmp_path / "dcp")
    state, ref_state = optim.state[model.weight], ref_optim.state[ref.weight]
    for name in ("old_dirs", "old_stps", "ro", "al"):
        assert type(state[name]) is list, name
        assert len(state[name]) == len(ref_state[name]), name
    for _ in range(3):
        loss, ref_loss = optim.step(closure), ref_optim.step(ref_closure)  # type: ignore[no-untyped-call]
        assert torch.equal(loss, ref_loss)
        assert torch.equal(model.weight, ref.weight)
        assert torch.equal(model.bias, ref.bias)
