"""Foreign sources (DCP, safetensors, Hugging Face directories, torch.save) and ``aiockpt.convert``.

Every source is written by the real library (``dcp.save``, ``safetensors.torch.save_file``,
``torch.save``) and every conversion is checked by reading its output back with that library.
"""

from __future__ import annotations

import json
import os
import pickle
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import assert_tree_equal, random_tensor, raw_bytes, snapshot
from safetensors.torch import load_file, save_file

import aiockpt

DTYPES = [torch.bfloat16, torch.float32, torch.int64, torch.bool, torch.float16, torch.uint8]


def _tensors(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = {str(d).removeprefix("torch."): random_tensor(d, (3, 5), gen) for d in DTYPES}
    out["scalar"] = random_tensor(torch.float32, (), gen)
    return out


def _model(seed: int) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU(), torch.nn.Linear(6, 3))


def _trained(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = _model(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    for i in range(2):
        model(torch.full((2, 4), float(i))).square().sum().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _dcp_save(state: dict[str, Any], path: Path) -> None:
    from torch.distributed.checkpoint import state_dict_saver as dcp

    with warnings.catch_warnings():  # "saving in a single process": exactly what this test wants
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, checkpoint_id=path)


def _dcp_load(state: dict[str, Any], path: Path) -> None:
    from torch.distributed.checkpoint import state_dict_loader as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, checkpoint_id=path)


def assert_same_tensors(actual: object, expected: dict[str, torch.Tensor]) -> None:
    """Bit-exact equality of flat name -> tensor dicts, in any order (safetensors sorts by dtype)."""
    assert isinstance(actual, dict)
    assert set(actual) == set(expected)
    assert_tree_equal({k: actual[k] for k in expected}, expected)


class Opaque:
    """An object ``torch.load(weights_only=True)`` refuses."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Opaque) and other.value == self.value

    def __hash__(self) -> int:
        return self.value


class PicklesOnce:
    """Pickles fine; the copy it unpickles into refuses to be pickled again (a writer failing midway)."""

    def __init__(self) -> None:
        self.copy = False

    def __getstate__(self) -> dict[str, bool]:
        if self.copy:
            raise RuntimeError("this copy cannot be pickled")
        return {"copy": True}

    def __setstate__(self, state: dict[str, bool]) -> None:
        self.copy = state["copy"]


# --- DCP ------------------------------------------------------------------------------------------------


def _dcp_state(seed: int) -> dict[str, Any]:
    model, opt = _trained(seed)
    return {
        "model": model.state_dict(),
        "optim": opt.state_dict(),
        "tensors": _tensors(seed),
        "step": 7,
        "name": "run-a",
        "pair": (1, "x"),
        "mixed": [torch.arange(3), {"lr": 0.5}],
    }


async def test_read_dcp_rebuilds_the_saved_structure(tmp_path: Path) -> None:
    state = _dcp_state(0)
    _dcp_save(state, tmp_path / "d")
    tree = await aiockpt.read(tmp_path / "d")
    expected = snapshot(state)
    assert isinstance(expected, dict)
    # DCP stores every mapping key as a str: the optimizer's per-parameter state comes back keyed "0", "1".
    expected["optim"]["state"] = {str(k): v for k, v in expected["optim"]["state"].items()}
    assert_tree_equal(tree, expected)


async def test_load_dcp_in_place_into_fresh_objects(tmp_path: Path) -> None:
    model, opt = _trained(0)
    _dcp_save({"model": model, "optim": opt, "tensors": _tensors(0), "step": 7}, tmp_path / "d")
    fresh_model = _model(1)
    fresh_opt = torch.optim.AdamW(fresh_model.parameters(), lr=0.5)  # never stepped: no state yet
    target: dict[str, Any] = {
        "model": fresh_model,
        "optim": fresh_opt,
        "tensors": {k: torch.zeros_like(v) for k, v in _tensors(0).items()},
        "step": 0,
    }
    first = fresh_model[0]
    assert isinstance(first, torch.nn.Linear)
    memory = first.weight.data_ptr()
    await aiockpt.load(target, tmp_path / "d")
    assert first.weight.data_ptr() == memory
    assert_tree_equal(fresh_model.state_dict(), model.state_dict())
    assert_tree_equal(fresh_opt.state_dict(), opt.state_dict())
    assert_tree_equal(target["tensors"], _tensors(0))
    assert target["step"] == 7


async def test_load_dcp_matches_what_dcp_itself_loads(tmp_path: Path) -> None:
    state = _dcp_state(3)
    _dcp_save(state, tmp_path / "d")
    ours = snapshot(_dcp_state(4))
    theirs = snapshot(_dcp_state(4))
    assert isinstance(ours, dict)
    assert isinstance(theirs, dict)
    await aiockpt.load(ours, tmp_path / "d")
    _dcp_load(theirs, tmp_path / "d")
    assert_tree_equal(ours, theirs)


async def test_dcp_plain_chunks_are_read_in_place_and_others_decoded(tmp_path: Path) -> None:
    from aiockpt._interop._dcp import DcpSource

    gen = torch.Generator().manual_seed(5)
    state = {
        "plain": random_tensor(torch.bfloat16, (6, 5), gen),
        "channels_last": random_tensor(torch.float32, (2, 3, 4, 5), gen).to(
            memory_format=torch.channels_last
        ),
        "empty": torch.zeros(0, 3),
        "scalar": random_tensor(torch.int64, (), gen),
    }
    _dcp_save(state, tmp_path / "d")
    source = DcpSource(tmp_path / "d", allow_pickle=False)
    index = {e.path[0]: i for i, e in enumerate(source.manifest.tensors)}
    assert source.decoded == {index["channels_last"]}  # its storage is not in row-major order
    for name in ("plain", "scalar"):
        (chunk,) = source.manifest.tensors[index[name]].chunks
        stored = (tmp_path / "d" / chunk.file).read_bytes()[chunk.offset : chunk.offset + chunk.nbytes]
        assert stored == raw_bytes(state[name]).numpy().tobytes()  # the chunk points at the raw record
    assert_tree_equal(await aiockpt.read(tmp_path / "d"), state)
    target: dict[str, object] = {k: torch.empty_like(v) for k, v in state.items()}
    await aiockpt.load(target, tmp_path / "d")
    assert_tree_equal(target, state)


async def test_dcp_lazy_conjugate_and_negative_views_keep_their_values(tmp_path: Path) -> None:
    # DCP stores a lazy conj()/_neg_view() as its un-applied storage plus metadata {'conj': True} /
    # {'neg': True} for torch.load to apply: the raw record alone holds the wrong values.
    z = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)
    x = torch.tensor([1.0, 2.0, 3.0])
    _dcp_save({"conj": z.conj(), "neg": x._neg_view(), "plain": x}, tmp_path / "d")
    expected = {"conj": z.conj().resolve_conj(), "neg": -x, "plain": x}
    assert_tree_equal(await aiockpt.read(tmp_path / "d"), expected)
    target: dict[str, object] = {k: torch.zeros_like(v) for k, v in expected.items()}
    await aiockpt.load(target, tmp_path / "d")
    assert_tree_equal(target, expected)


async def test_dcp_strict_mismatch_lists_every_difference(tmp_path: Path) -> None:
    _dcp_save({"a": torch.zeros(2, 3), "b": torch.zeros(4), "c": torch.zeros(2), "extra": 1}, tmp_path / "d")
    target: dict[str, Any] = {
        "a": torch.ones(3, 2),
        "b": torch.ones(4, dtype=torch.int64),
        "c": torch.ones(2),
        "gone": torch.ones(1),
    }
    with pytest.raises(aiockpt.StateMismatchError) as info:
        await aiockpt.load(target, tmp_path / "d")
    text = "\n".join(info.value.differences)
    assert len(info.value.differences) == 4, text
    for needle in ("a: the target", "b: the target", "extra: unexpected key", "gone: missing key"):
        assert needle in text
    assert torch.equal(target["c"], torch.ones(2))  # nothing was loaded

    with pytest.warns(aiockpt.StateMismatchWarning, match="gone"):
        await aiockpt.load(target, tmp_path / "d", strict=False)
    assert torch.equal(target["c"], torch.zeros(2))
    assert torch.equal(target["a"], torch.ones(3, 2))


async def test_malicious_dcp_metadata_is_refused_without_running_it(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self) -> tuple[Any, ...]:
            return (os.system, (f"touch {marker}",))

    _dcp_save({"a": torch.ones(2)}, tmp_path / "d")
    (tmp_path / "d" / ".metadata").write_bytes(pickle.dumps(Exploit()))
    with pytest.raises(aiockpt.FormatError, match=r"posix\.system|os\.system") as info:
        await aiockpt.read(tmp_path / "d")
    assert "allow_pickle" in str(info.value)
    with pytest.raises(aiockpt.FormatError):
        await aiockpt.load({"a": torch.zeros(2)}, tmp_path / "d")
    assert not marker.exists()


async def test_dcp_metadata_smuggling_a_call_inside_real_metadata_is_refused(tmp_path: Path) -> None:
    _dcp_save({"a": torch.ones(2)}, tmp_path / "d")
    file = tmp_path / "d" / ".metadata"
    md = pickle.loads(file.read_bytes())
    md.planner_data = {"a": Opaque(1)}  # a class DCP metadata never holds
    file.write_bytes(pickle.dumps(md))
    with pytest.raises(aiockpt.FormatError, match="Opaque"):
        await aiockpt.read(tmp_path / "d")
    tree = await aiockpt.read(tmp_path / "d", allow_pickle=True)  # the user vouches for it
    assert torch.equal(tree["a"], torch.ones(2))  # type: ignore[arg-type]


async def test_malicious_dcp_tensor_blob_is_refused_without_running_it(tmp_path: Path) -> None:
    import io
    import zipfile

    from torch.distributed.checkpoint.metadata import MetadataIndex

    marker = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self) -> tuple[Any, ...]:
            return (os.system, (f"touch {marker}",))

    _dcp_save({"a": torch.ones(2)}, tmp_path / "d")
    blob = io.BytesIO()
    with zipfile.ZipFile(blob, "w") as zf:  # a torch.save archive whose data.pkl calls os.system
        zf.writestr("archive/data.pkl", pickle.dumps(Exploit(), protocol=2))
        zf.writestr("archive/byteorder", "little")
    (data,) = (tmp_path / "d").glob("*.distcp")
    offset = data.stat().st_size
    data.write_bytes(data.read_bytes() + blob.getvalue())
    file = tmp_path / "d" / ".metadata"
    md = pickle.loads(file.read_bytes())
    info = md.storage_data[MetadataIndex("a", (0,))]
    info.offset, info.length = offset, len(blob.getvalue())
    file.write_bytes(pickle.dumps(md))
    with pytest.raises(aiockpt.CorruptionError, match="cannot decode 'a'"):
        await aiockpt.read(tmp_path / "d")
    assert not marker.exists()


async def test_dcp_pickled_object_needs_allow_pickle_and_names_the_key(tmp_path: Path) -> None:
    _dcp_save({"a": torch.ones(2), "obj": Opaque(5)}, tmp_path / "d")
    with pytest.raises(aiockpt.StateError, match=r"'obj'.*allow_pickle"):
        await aiockpt.read(tmp_path / "d")
    tree = await aiockpt.read(tmp_path / "d", allow_pickle=True)
    assert tree["obj"] == Opaque(5)
    # A load whose target does not ask for the object never decodes it.
    target: dict[str, Any] = {"a": torch.zeros(2)}
    with pytest.warns(aiockpt.StateMismatchWarning, match="obj"):
        await aiockpt.load(target, tmp_path / "d", strict=False)
    assert torch.equal(target["a"], torch.ones(2))


def _explode() -> None:
    raise ValueError("this object cannot be rebuilt here")


class Exploding:
    """Pickles fine; unpickling it raises (as a class this process cannot import does)."""

    def __reduce__(self) -> tuple[object, tuple[()]]:
        return (_explode, ())


async def test_dcp_object_that_cannot_be_unpickled_is_a_state_error_naming_the_key(tmp_path: Path) -> None:
    """It escaped as the raw exception of the unpickling (and the command line printed a traceback)."""
    _dcp_save({"a": torch.ones(2), "obj": Exploding()}, tmp_path / "d")
    with pytest.raises(aiockpt.StateError, match=r"cannot unpickle 'obj' in .*\.distcp: this object") as info:
        await aiockpt.read(tmp_path / "d", allow_pickle=True)
    assert info.value.key == "obj"
    assert isinstance(info.value.__cause__, ValueError)


async def test_convert_to_safetensors_refuses_the_name_of_its_metadata(tmp_path: Path) -> None:
    """A tensor named ``__metadata__`` overwrote the header's metadata: an invalid file, the tensor lost."""
    src = tmp_path / "src"
    await aiockpt.save({"__metadata__": torch.ones(2), "w": torch.zeros(2)}, src)
    with pytest.raises(aiockpt.StateError, match="reserves the name '__metadata__'") as info:
        await aiockpt.convert(src, tmp_path / "m.safetensors", to="safetensors")
    assert info.value.key == "__metadata__"
    assert not (tmp_path / "m.safetensors").exists()


async def test_dcp_truncated_data_file_names_key_and_file(tmp_path: Path) -> None:
    _dcp_save({"a": torch.ones(100), "b": torch.ones(100)}, tmp_path / "d")
    (data,) = (tmp_path / "d").glob("*.distcp")
    os.truncate(data, data.stat().st_size // 2)
    with pytest.raises(aiockpt.CorruptionError, match="truncated") as info:
        await aiockpt.read(tmp_path / "d")
    assert info.value.file == str(data)
    assert info.value.key in ("a", "b")


# --- safetensors ----------------------------------------------------------------------------------------


async def test_read_safetensors_file_is_load_file(tmp_path: Path) -> None:
    tensors = {f"layer.{k}": v for k, v in _tensors(1).items()}
    save_file(tensors, tmp_path / "m.safetensors")
    tree = await aiockpt.read(tmp_path / "m.safetensors")
    assert_tree_equal(tree, load_file(tmp_path / "m.safetensors"))  # same order too
    assert_same_tensors(tree, tensors)


async def test_load_safetensors_by_joined_names(tmp_path: Path) -> None:
    model = _model(0)
    save_file({f"net.{k}": v for k, v in model.state_dict().items()}, tmp_path / "m.safetensors")
    fresh = _model(1)
    await aiockpt.load({"net": fresh}, tmp_path / "m.safetensors")
    assert_tree_equal(fresh.state_dict(), model.state_dict())
    # A plain state dict addresses the same tensors without the prefix.
    plain = _model(2)
    with pytest.raises(aiockpt.StateMismatchError, match=r"0\.weight: missing key"):
        await aiockpt.load(plain.state_dict(), tmp_path / "m.safetensors")


async def test_safetensors_strict_mismatch(tmp_path: Path) -> None:
    save_file({"a.w": torch.ones(2, 2), "a.b": torch.ones(2), "z": torch.ones(1)}, tmp_path / "m.safetensors")
    target: dict[str, Any] = {"a": {"w": torch.zeros(2, 3), "b": torch.zeros(2)}, "n": torch.zeros(1)}
    with pytest.raises(aiockpt.StateMismatchError) as info:
        await aiockpt.load(target, tmp_path / "m.safetensors")
    text = "\n".join(info.value.differences)
    assert len(info.value.differences) == 3, text
    assert "a/w: the target" in text
    assert "z: unexpected key" in text
    assert "n: missing key" in text
    with pytest.warns(aiockpt.StateMismatchWarning):
        await aiockpt.load(target, tmp_path / "m.safetensors", strict=False)
    assert torch.equal(target["a"]["b"], torch.ones(2))


async def test_hf_sharded_directory_written_by_hand(tmp_path: Path) -> None:
    model = _model(5)
    sd = {k: v.contiguous() for k, v in model.state_dict().items()}
    names = list(sd)
    directory = tmp_path / "hf"
    directory.mkdir()
    shards = {"model-00001-of-00002.safetensors": names[:2], "model-00002-of-00002.safetensors": names[2:]}
    for file, keys in shards.items():
        save_file({k: sd[k] for k in keys}, directory / file, metadata={"format": "pt"})
    index = {
        "metadata": {"total_size": sum(v.nbytes for v in sd.values())},
        "weight_map": {k: f for f, keys in shards.items() for k in keys},
    }
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    assert_same_tensors(await aiockpt.read(directory), sd)
    fresh = _model(6)
    await aiockpt.load(fresh.state_dict(), directory)
    assert_tree_equal(fresh.state_dict(), sd)


@pytest.mark.parametrize("cut", [4, 40, -8])
async def test_truncated_safetensors_is_a_clear_error(tmp_path: Path, cut: int) -> None:
    file = tmp_path / "m.safetensors"
    save_file({"a": torch.ones(64), "b": torch.ones(64)}, file)
    size = file.stat().st_size
    os.truncate(file, cut if cut > 0 else size + cut)
    with pytest.raises(aiockpt.CorruptionError, match="truncated") as info:
        await aiockpt.read(file)
    assert info.value.file == str(file)


# --- torch.save -----------------------------------------------------------------------------------------


async def test_torch_save_file_reads_and_loads_like_a_checkpoint(tmp_path: Path) -> None:
    model, opt = _trained(2)
    torch.save({"model": model.state_dict(), "optim": opt.state_dict(), "step": 3}, tmp_path / "c.pt")
    tree = await aiockpt.read(tmp_path / "c.pt")
    assert_tree_equal(tree, {"model": model.state_dict(), "optim": opt.state_dict(), "step": 3})
    fresh_model = _model(9)
    fresh_opt = torch.optim.AdamW(fresh_model.parameters(), lr=1.0)
    await aiockpt.load({"model": fresh_model, "optim": fresh_opt, "step": 0}, tmp_path / "c.pt")
    assert_tree_equal(fresh_opt.state_dict(), opt.state_dict())


async def test_torch_save_file_loads_into_parameters_and_tied_targets(tmp_path: Path) -> None:
    # Decoded chunks are copied into place outside autograd (a Parameter refuses a recorded in-place copy),
    # and keys tied in the target are filled after the others, in key order, as load_state_dict does.
    gen = torch.Generator().manual_seed(3)
    saved = {"w": torch.randn(30, 20, generator=gen), "v": torch.randn(50, generator=gen)}
    tied = {"emb": torch.randn(8, 8, generator=gen), "head": torch.randn(8, 8, generator=gen)}
    torch.save({**saved, **tied}, tmp_path / "c.pt")
    w = torch.nn.Parameter(torch.zeros(30, 20))
    shared = torch.nn.Parameter(torch.zeros(8, 8))
    target: dict[str, object] = {"w": w, "v": torch.zeros(50), "emb": shared, "head": shared}
    await aiockpt.load(target, tmp_path / "c.pt")
    assert target["w"] is w
    assert w.requires_grad
    assert w.grad_fn is None
    assert torch.equal(w.detach(), saved["w"])
    assert torch.equal(shared.detach(), tied["head"])  # the later key's values


async def test_torch_save_with_objects_needs_allow_pickle(tmp_path: Path) -> None:
    torch.save({"a": torch.ones(1), "obj": Opaque(3)}, tmp_path / "c.pt")
    with pytest.raises(aiockpt.StateError, match="allow_pickle"):
        await aiockpt.read(tmp_path / "c.pt")
    assert (await aiockpt.read(tmp_path / "c.pt", allow_pickle=True))["obj"] == Opaque(3)


async def test_torch_save_values_that_weights_only_loads_need_no_allow_pickle(tmp_path: Path) -> None:
    """An int beyond 64 bits is kept pickled, as in a native checkpoint: its pickle imports nothing.

    It was refused as "a pickled builtins.int; loading it can run code", where torch.load with
    weights_only=True (which the file is decoded with) builds it.
    """
    torch.save({"w": torch.ones(2), "tokens_seen": 2**70, "tags": {"a"}}, tmp_path / "c.pt")
    got = await aiockpt.read(tmp_path / "c.pt")
    assert got["tokens_seen"] == 2**70
    assert got["tags"] == {"a"}
    target: dict[str, object] = {"w": torch.zeros(2), "tokens_seen": 0, "tags": None}
    await aiockpt.load(target, tmp_path / "c.pt")
    assert target["tokens_seen"] == 2**70


# --- convert --------------------------------------------------------------------------------------------

_SUFFIX = {"aiockpt": "", "torch": ".pt", "dcp": "", "safetensors": ".safetensors", "hf": ""}


async def _convert(src: Path, fmt: str, dst: Path, **kw: Any) -> Path:
    to = "safetensors" if fmt == "hf" else fmt
    return await aiockpt.convert(src, dst, to=to, **kw)  # type: ignore[arg-type]


def _read_with_library(fmt: str, path: Path, template: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    if fmt == "torch":
        out = torch.load(path, weights_only=True)
        assert isinstance(out, dict)
        return out
    if fmt == "safetensors":
        return load_file(path)
    if fmt == "hf":
        if (path / "model.safetensors").exists():
            return load_file(path / "model.safetensors")
        index = json.loads((path / "model.safetensors.index.json").read_text())
        out = {}
        for file in sorted(set(index["weight_map"].values())):
            out.update(load_file(path / file))
        assert set(out) == set(index["weight_map"])
        assert index["metadata"]["total_size"] == sum(t.nbytes for t in out.values())
        return {k: out[k] for k in template}
    assert fmt == "dcp"
    target = {k: torch.empty_like(v) for k, v in template.items()}
    _dcp_load(target, path)
    return target


@pytest.mark.parametrize("via", ["aiockpt", "torch", "dcp", "safetensors", "hf"])
@pytest.mark.parametrize("start", ["torch", "dcp", "safetensors"])
async def test_convert_round_trips_bit_exact(tmp_path: Path, start: str, via: str) -> None:
    tensors = _tensors(11)
    src = tmp_path / f"src{_SUFFIX[start]}"
    if start == "torch":
        torch.save(tensors, src)
    elif start == "dcp":
        _dcp_save(dict(tensors), src)
    else:
        save_file(tensors, src)
    seen: list[tuple[int, int]] = []
    mid = await _convert(
        src,
        via,
        tmp_path / f"mid{_SUFFIX[via]}",
        max_shard_size=100,
        progress=lambda d, t: seen.append((d, t)),
    )
    assert mid == tmp_path / f"mid{_SUFFIX[via]}"
    total = sum(t.nbytes for t in tensors.values())
    assert seen[0] == (0, total)
    assert seen[-1] == (total, total)
    assert [d for d, _ in seen] == sorted(d for d, _ in seen)
    if via == "hf":  # 100-byte shards: several files and an index
        assert len(list(mid.glob("model-*-of-*.safetensors"))) > 1
    if via != "aiockpt":
        assert_same_tensors(_read_with_library(via, mid, tensors), tensors)
    back = await aiockpt.convert(mid, tmp_path / "back", to="aiockpt")
    assert_same_tensors(await aiockpt.read(back), tensors)


async def test_convert_to_torch_writes_only_the_tensors_bytes(tmp_path: Path) -> None:
    small = {"a": torch.ones(10), "b": torch.arange(5), "tied": [torch.zeros(3)] * 2}
    await aiockpt.save(small, tmp_path / "a")
    await aiockpt.convert(tmp_path / "a", tmp_path / "a.pt", to="torch")
    assert (tmp_path / "a.pt").stat().st_size < 10_000  # not the slabs read() carves small tensors from
    back = torch.load(tmp_path / "a.pt", weights_only=True)
    assert_tree_equal(back, small)
    assert back["tied"][0] is back["tied"][1]


@pytest.mark.parametrize("to", ["aiockpt", "torch", "dcp", "safetensors"])
async def test_convert_maps_the_source_only_for_writers_that_copy_tensor_bytes(
    tmp_path: Path, to: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch.save writes whole storages and DCP clones views: a mapped tensor's storage is its data file."""
    from aiockpt import _api

    src = tmp_path / "src"
    await aiockpt.save({"w": torch.randn(256, 256), "b": torch.randn(8)}, src)
    seen: list[bool] = []
    real = _api.read

    async def spy(path: Any, **kw: Any) -> Any:
        seen.append(kw["io"].map_reads)
        return await real(path, **kw)

    monkeypatch.setattr(_api, "read", spy)
    dst = await aiockpt.convert(src, tmp_path / f"dst{_SUFFIX[to]}", to=to)  # type: ignore[arg-type]
    assert seen == [to in ("aiockpt", "safetensors")]
    assert_tree_equal(await aiockpt.read(dst), await aiockpt.read(src))


async def test_convert_aiockpt_checkpoint_with_values_to_dcp_and_back(tmp_path: Path) -> None:
    model, opt = _trained(4)
    await aiockpt.save({"model": model, "optim": opt, "step": 12, "tag": "x"}, tmp_path / "a")
    await aiockpt.convert(tmp_path / "a", tmp_path / "d", to="dcp")
    fresh_model = _model(8)
    fresh_opt = torch.optim.AdamW(fresh_model.parameters())
    target: dict[str, Any] = {"model": fresh_model, "optim": fresh_opt, "step": 0, "tag": ""}
    await aiockpt.load(target, tmp_path / "d")
    assert_tree_equal(fresh_opt.state_dict(), opt.state_dict())
    assert_tree_equal(fresh_model.state_dict(), model.state_dict())
    assert (target["step"], target["tag"]) == (12, "x")


async def test_convert_to_safetensors_refuses_values_unless_dropped(tmp_path: Path) -> None:
    await aiockpt.save({"w": torch.ones(2), "step": 3, "cfg": {"name": "x", "sizes": [1, 2]}}, tmp_path / "a")
    with pytest.raises(aiockpt.StateError) as info:
        await aiockpt.convert(tmp_path / "a", tmp_path / "s.safetensors", to="safetensors")
    for key in ("'step'", "'cfg/name'", "'cfg/sizes'"):
        assert key in str(info.value)
    assert not (tmp_path / "s.safetensors").exists()
    await aiockpt.convert(tmp_path / "a", tmp_path / "s.safetensors", to="safetensors", drop_non_tensors=True)
    assert_tree_equal(load_file(tmp_path / "s.safetensors"), {"w": torch.ones(2)})


@pytest.mark.parametrize("to", ["aiockpt", "torch", "safetensors", "dcp"])
async def test_convert_never_overwrites(tmp_path: Path, to: str) -> None:
    torch.save({"w": torch.ones(2)}, tmp_path / "src.pt")
    (tmp_path / "dst").mkdir()
    (tmp_path / "dst" / "keep").write_text("mine")
    (tmp_path / "file.safetensors").write_text("mine")
    for dst in (tmp_path / "dst", tmp_path / "file.safetensors"):
        with pytest.raises(aiockpt.CheckpointExistsError, match="exists"):
            await aiockpt.convert(tmp_path / "src.pt", dst, to=to)  # type: ignore[arg-type]
    assert (tmp_path / "dst" / "keep").read_text() == "mine"
    assert (tmp_path / "file.safetensors").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dst", "file.safetensors", "src.pt"]


async def test_convert_refuses_a_dtype_safetensors_lacks(tmp_path: Path) -> None:
    await aiockpt.save({"w": torch.ones(2, dtype=torch.complex128)}, tmp_path / "a")
    with pytest.raises(aiockpt.StateError, match="complex128"):
        await aiockpt.convert(tmp_path / "a", tmp_path / "out", to="safetensors")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a"]


@pytest.mark.parametrize("to", ["torch", "dcp"])
async def test_convert_failing_midway_leaves_nothing_behind(tmp_path: Path, to: str) -> None:
    await aiockpt.save({"w": torch.ones(1000), "obj": PicklesOnce()}, tmp_path / "a", allow_pickle=True)
    with pytest.raises(aiockpt.StateError, match="cannot be pickled"):
        await aiockpt.convert(tmp_path / "a", tmp_path / "out", to=to, allow_pickle=True)  # type: ignore[arg-type]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a"]


async def test_legacy_torch_save_file(tmp_path: Path) -> None:
    tensors = _tensors(12)
    torch.save(tensors, tmp_path / "old.pt", _use_new_zipfile_serialization=False)
    assert_tree_equal(await aiockpt.read(tmp_path / "old.pt"), tensors)


async def test_hf_directory_of_one_file(tmp_path: Path) -> None:
    tensors = _tensors(13)
    torch.save(tensors, tmp_path / "src.pt")
    out = await aiockpt.convert(tmp_path / "src.pt", tmp_path / "hf", to="safetensors")
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]
    assert_same_tensors(load_file(out / "model.safetensors"), tensors)
    assert_same_tensors(await aiockpt.read(out), tensors)
