"""Round trips through save -> read / load, bit-exact, for synchronous and staged (async_op) saves."""

from __future__ import annotations

import math
import os
import struct
import sys
from pathlib import Path
from typing import cast

import crc32c
import pytest
import torch
from conftest import (
    assert_tree_equal,
    at,
    dir_tree,
    dtype_params,
    exists,
    file_size,
    get_dtype,
    layouts,
    listdir,
    make_model,
    make_optimizer,
    make_scheduler,
    random_tensor,
    raw_bytes,
    snapshot,
    tensor_at,
    tensors_in,
    train_step,
    zero_tensor,
)

import aiockpt
from aiockpt import SaveState
from aiockpt._fs import start_writeback
from aiockpt._load import read_manifest
from aiockpt._save import _write

pytestmark = pytest.mark.timeout(60)

ASYNC = pytest.mark.parametrize("async_op", [False, True], ids=["sync_save", "async_save"])
PHASES = {"stage", "local_plan", "global_plan", "write", "finish"}


async def save(state: dict[str, object], path: Path, *, async_op: bool) -> aiockpt.Metadata:
    """Save through either path and return the durable checkpoint's metadata."""
    if async_op:
        handle = await aiockpt.save(state, path, async_op=True)
        assert isinstance(handle, aiockpt.SaveHandle)
        meta = await handle
        assert handle.done()
        assert handle.state is SaveState.COMMITTED
    else:
        meta = await aiockpt.save(state, path)
    assert isinstance(meta, aiockpt.Metadata)
    return meta


def dtype_state(dtype: torch.dtype, seed: int = 0) -> dict[str, object]:
    gen = torch.Generator().manual_seed(seed)
    return layouts(lambda shape: random_tensor(dtype, shape, gen))


# --- Every dtype, every layout ----------------------------------------------------------------------------


# complex32 warns "ComplexHalf support is experimental" whenever one is created (by us or by the library).
@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental:UserWarning")
@pytest.mark.parametrize("name", dtype_params())
@ASYNC
async def test_dtype_roundtrip_read(name: str, async_op: bool, ckpt_path: Path) -> None:
    dtype = get_dtype(name)
    state = dtype_state(dtype)
    expected = snapshot(state)
    await save(state, ckpt_path, async_op=async_op)
    got = await aiockpt.read(ckpt_path)
    assert_tree_equal(got, expected)
    assert all(t.device.type == "cpu" for t in tensors_in(got))


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental:UserWarning")
@pytest.mark.parametrize("name", dtype_params())
@ASYNC
async def test_dtype_roundtrip_load_in_place(name: str, async_op: bool, ckpt_path: Path) -> None:
    dtype = get_dtype(name)
    state = dtype_state(dtype)
    expected = snapshot(state)
    await save(state, ckpt_path, async_op=async_op)

    # The target has the same (non-contiguous) layouts, on storages of zeros.
    target = layouts(lambda shape: zero_tensor(dtype, shape))
    before = list(tensors_in(target))
    result = await aiockpt.load(target, ckpt_path)
    assert result is target
    assert_tree_equal(target, expected)
    after = list(tensors_in(target))
    # Filled in place: the very same tensor objects, on the same memory.
    assert len(after) == len(before)
    assert all(a is b for a, b in zip(after, before, strict=True))


async def test_special_float_bit_patterns(ckpt_path: Path) -> None:
    def f32(*bits: int) -> torch.Tensor:
        return torch.tensor(list(bits), dtype=torch.int64).to(torch.int32).view(torch.float32)

    def f64(*bits: int) -> torch.Tensor:
        return torch.tensor([struct.unpack("<q", struct.pack("<Q", b))[0] for b in bits]).view(torch.float64)

    def f16(*bits: int) -> torch.Tensor:
        return torch.tensor(list(bits), dtype=torch.int32).to(torch.int16).view(torch.float16)

    def bf16(*bits: int) -> torch.Tensor:
        return torch.tensor(list(bits), dtype=torch.int32).to(torch.int16).view(torch.bfloat16)

    state: dict[str, object] = {
        # quiet NaN with payload, signalling NaN, negative NaN, +inf, -inf, -0.0, smallest denormal
        "f32": f32(0x7FC00001, 0x7F800001, -0x00400000, 0x7F800000, -0x00800000, -(2**31), 1),
        "f64": f64(
            0x7FF8000000000123, 0x7FF0000000000001, 0xFFF8000000000000, 0x7FF0000000000000, 1 << 63, 1
        ),
        "f16": f16(0x7E01, 0x7C01, -0x0200, 0x7C00, -0x0400, -0x8000, 1),
        "bf16": bf16(0x7FC1, 0x7F81, -0x0040, 0x7F80, -0x0080, -0x8000, 1),
        "c64": torch.complex(f32(0x7FC00001, 0x7F800000), f32(-(2**31), 0x7F800001)),
    }
    expected = snapshot(state)
    await save(state, ckpt_path, async_op=False)
    assert_tree_equal(await aiockpt.read(ckpt_path), expected)
    target: dict[str, object] = {
        k: torch.zeros_like(v) for k, v in state.items() if isinstance(v, torch.Tensor)
    }
    await aiockpt.load(target, ckpt_path)
    assert_tree_equal(target, expected)


@ASYNC
async def test_lazy_views_are_saved_resolved(async_op: bool, ckpt_path: Path) -> None:
    gen = torch.Generator().manual_seed(3)
    base = torch.randn(4, 3, generator=gen)
    c = torch.randn(5, dtype=torch.complex64, generator=gen)
    state: dict[str, object] = {
        "conj": c.conj(),  # lazy conjugate bit
        "conj_t": torch.randn(2, 3, dtype=torch.complex128, generator=gen).conj().t(),
        "expanded": base[0].expand(6, 3),  # stride 0
        "unsqueezed": base[:, None, 1],
        "offset_view": base[3:, 1:],
    }
    expected = snapshot(state)
    assert torch.equal(tensor_at(expected, "conj"), c.conj())
    await save(state, ckpt_path, async_op=async_op)
    got = await aiockpt.read(ckpt_path)
    assert_tree_equal(got, expected)
    assert torch.equal(tensor_at(got, "conj"), c.conj())


# --- Tied tensors ---------------------------------------------------------------------------------------


@ASYNC
async def test_tied_tensors_are_saved_once_and_restored_tied(async_op: bool, ckpt_path: Path) -> None:
    t = torch.arange(1000, dtype=torch.float32)
    u = torch.ones(3, dtype=torch.int64)
    state: dict[str, object] = {"a": t, "b": t, "nested": {"c": t, "list": [u, t]}, "u": u}
    meta = await save(state, ckpt_path, async_op=async_op)
    assert meta.num_tensors == 2
    assert meta.nbytes == 1000 * 4 + 3 * 8

    got = await aiockpt.read(ckpt_path)
    assert_tree_equal(got, snapshot(state))
    a, b = tensor_at(got, "a"), tensor_at(got, "b")
    assert a.data_ptr() == b.data_ptr()
    assert tensor_at(got, "nested", "c").data_ptr() == a.data_ptr()
    assert tensor_at(got, "nested", "list", 1).data_ptr() == a.data_ptr()
    assert tensor_at(got, "nested", "list", 0).data_ptr() == tensor_at(got, "u").data_ptr()
    a.add_(1)  # really one storage: writes through one key show through the other
    assert torch.equal(b, t + 1)


async def test_tied_module_weights_restored_tied(ckpt_path: Path) -> None:
    def tied_model(seed: int) -> tuple[torch.nn.Sequential, torch.nn.Embedding, torch.nn.Linear]:
        torch.manual_seed(seed)
        emb, head = torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10, bias=False)
        head.weight = emb.weight  # weight tying, as in language models
        return torch.nn.Sequential(emb, head), emb, head

    model, emb, _ = tied_model(0)
    await aiockpt.save({"model": model}, ckpt_path)
    got = await aiockpt.read(ckpt_path)
    assert_tree_equal(at(got, "model"), model.state_dict())
    assert tensor_at(got, "model", "0.weight").data_ptr() == tensor_at(got, "model", "1.weight").data_ptr()

    fresh, fresh_emb, fresh_head = tied_model(1)
    assert not torch.equal(fresh_emb.weight, emb.weight)
    await aiockpt.load({"model": fresh}, ckpt_path)
    assert torch.equal(fresh_emb.weight, emb.weight)
    assert fresh_head.weight is fresh_emb.weight


async def test_tied_checkpoint_loads_into_separate_targets(ckpt_path: Path) -> None:
    t = torch.arange(12.0).reshape(3, 4)
    await aiockpt.save({"a": t, "b": t}, ckpt_path)
    target: dict[str, object] = {"a": torch.zeros(3, 4), "b": torch.zeros(4, 3).t()}
    await aiockpt.load(target, ckpt_path)
    assert torch.equal(tensor_at(target, "a"), t)
    assert torch.equal(tensor_at(target, "b"), t)


@ASYNC
@pytest.mark.parametrize("numel", [6, 20_000], ids=["small", "large"])
async def test_lazy_conjugate_and_negative_views_are_not_tied_to_their_base(
    numel: int, async_op: bool, ckpt_path: Path
) -> None:
    # A view that shares its base's memory, dtype, shape and strides but reads differently (a lazy conj or
    # neg bit) is another tensor: tying it to the base would restore the base's values in its place.
    gen = torch.Generator().manual_seed(4)
    z = torch.randn(numel, dtype=torch.complex64, generator=gen)
    x = torch.randn(numel, generator=gen)
    state: dict[str, object] = {
        "z": z,
        "z_conj": z.conj(),
        "im": z.imag,
        "neg_im": z.conj().imag,  # a lazy negative view of z.imag's memory
        "x": x,
        "neg_x": torch._neg_view(x),
    }
    expected = snapshot(state)
    meta = await save(state, ckpt_path, async_op=async_op)
    assert meta.num_tensors == 6
    got = await aiockpt.read(ckpt_path)
    assert_tree_equal(got, expected)
    assert torch.equal(tensor_at(got, "z_conj"), z.conj().resolve_conj())
    assert torch.equal(tensor_at(got, "neg_x"), -x)

    target: dict[str, object] = {k: torch.zeros_like(tensor_at(expected, k)) for k in state}
    await aiockpt.load(target, ckpt_path)
    assert_tree_equal(target, expected)


@ASYNC
async def test_a_tensor_stays_tied_when_a_lazy_view_of_its_bytes_came_first(
    async_op: bool, ckpt_path: Path
) -> None:
    """Only the first reading of some bytes was remembered for ties: after ``z.conj()``, two occurrences
    of ``z`` itself were stored twice and came back as two tensors."""
    gen = torch.Generator().manual_seed(6)
    z = torch.randn(64, dtype=torch.complex64, generator=gen)
    x = torch.randn(64, generator=gen)
    state: dict[str, object] = {
        "z_conj": z.conj(),
        "z": z,
        "z_again": z,
        "z_conj_again": z.conj(),
        "neg_x": torch._neg_view(x),
        "x": x,
        "x_again": x,
    }
    meta = await save(state, ckpt_path, async_op=async_op)
    assert meta.num_tensors == 4
    got = await aiockpt.read(ckpt_path)
    assert got["z"] is got["z_again"]
    assert got["z_conj"] is got["z_conj_again"]
    assert got["x"] is got["x_again"]
    assert torch.equal(tensor_at(got, "z_conj"), z.conj().resolve_conj())
    assert torch.equal(tensor_at(got, "z"), z)
    assert torch.equal(tensor_at(got, "neg_x"), -x)
    assert torch.equal(tensor_at(got, "x"), x)


@ASYNC
@pytest.mark.parametrize("rows", [8, 50, 400], ids=["2400B", "15000B", "120000B"])
async def test_non_contiguous_one_byte_dtypes_without_copy_kernels_roundtrip(
    rows: int, async_op: bool, ckpt_path: Path
) -> None:
    # torch has no copy_ (nor contiguous) for a non-contiguous float4_e2m1fn_x2 tensor of a few KiB or more.
    if not hasattr(torch, "float4_e2m1fn_x2"):
        pytest.skip("this torch has no float4_e2m1fn_x2")
    gen = torch.Generator().manual_seed(rows)
    raw = torch.randint(0, 256, (rows, 300), dtype=torch.uint8, generator=gen)
    state: dict[str, object] = {"w": raw.view(torch.float4_e2m1fn_x2).t()}
    await save(state, ckpt_path, async_op=async_op)
    got = tensor_at(await aiockpt.read(ckpt_path), "w")
    assert got.dtype == torch.float4_e2m1fn_x2
    assert got.shape == (300, rows)
    assert torch.equal(got.view(torch.uint8), raw.t())


# --- Statefuls and Python values ------------------------------------------------------------------------


def trained(
    seed: int = 0, steps: int = 3
) -> tuple[torch.nn.Sequential, torch.optim.AdamW, torch.optim.lr_scheduler.StepLR]:
    model = make_model(seed)
    opt = make_optimizer(model)
    sched = make_scheduler(opt)
    for i in range(steps):
        train_step(model, opt, sched, i)
    return model, opt, sched


@ASYNC
async def test_training_state_roundtrip(async_op: bool, ckpt_path: Path) -> None:
    model, opt, sched = trained()
    state: dict[str, object] = {
        "model": model,
        "optim": opt,
        "sched": sched,
        "rng": torch.get_rng_state(),
        "step": 3,
    }
    expected = snapshot(state)
    meta = await save(state, ckpt_path, async_op=async_op)
    got = await aiockpt.read(ckpt_path)
    assert_tree_equal(got, expected)
    # Optimizer state is keyed by parameter index (ints), and stays so.
    optim_state = at(got, "optim", "state")
    assert isinstance(optim_state, dict)
    assert list(optim_state) == list(range(len(list(model.parameters()))))
    # The BatchNorm step counter is an int64 0-d tensor.
    counter = tensor_at(got, "model", "2.num_batches_tracked")
    assert counter.dtype == torch.int64
    assert counter.shape == ()
    assert int(counter) == 3
    unique = {t.data_ptr(): t for t in tensors_in(state)}
    assert meta.num_tensors == len(unique)
    assert meta.nbytes == sum(t.numel() * t.element_size() for t in unique.values())


async def test_rng_state_restores_the_stream(ckpt_path: Path) -> None:
    torch.manual_seed(1234)
    torch.rand(7)
    await aiockpt.save({"rng": torch.get_rng_state()}, ckpt_path)
    expected = torch.rand(5)
    torch.manual_seed(999)
    got = await aiockpt.read(ckpt_path)
    torch.set_rng_state(tensor_at(got, "rng"))
    assert torch.equal(torch.rand(5), expected)


# Values that must round trip without pickle.
PLAIN_VALUES: dict[str, object] = {
    "str": "héllo wörld ✓",
    "empty_str": "",
    "int": 42,
    "neg": -7,
    "zero": 0,
    "int64_max": 2**63 - 1,
    "int64_min": -(2**63),
    "float": 0.1,
    "neg_zero": -0.0,
    "nan": math.nan,
    "inf": math.inf,
    "ninf": -math.inf,
    "tiny": 5e-324,
    "true": True,
    "false": False,
    "none": None,
    "bytes": b"\x00\xff binary \x80",
    "empty_bytes": b"",
}


@ASYNC
async def test_plain_values_roundtrip(async_op: bool, ckpt_path: Path) -> None:
    state: dict[str, object] = dict(PLAIN_VALUES)
    state["containers"] = {
        "tuple": (1, "two", 3.0, None),
        "nested_tuple": ((1, 2), [3, (4,)], ()),
        "list": [1, [2, [3, []]], {"k": (b"v",)}],
        "empty_dict": {},
        "empty_list": [],
        "int_keys": {0: "zero", 1: "one", -5: "neg"},
        "mixed_keys": {0: "int zero", "0": "str zero"},
        "tensor_in_tuple": (torch.arange(3), "x"),
    }
    expected = snapshot(state)
    await save(state, ckpt_path, async_op=async_op)
    got = await aiockpt.read(ckpt_path)
    assert_tree_equal(got, expected)
    assert type(at(got, "containers", "tuple")) is tuple
    assert type(at(got, "containers", "nested_tuple", 1, 1)) is tuple
    assert at(got, "true") is True
    assert at(got, "none") is None


async def test_state_without_tensors(ckpt_path: Path) -> None:
    state: dict[str, object] = {"epoch": 3, "name": "run"}
    meta = await aiockpt.save(state, ckpt_path)
    assert meta.num_tensors == 0
    assert meta.nbytes == 0
    assert_tree_equal(await aiockpt.read(ckpt_path), state)


async def test_unusual_keys_roundtrip_and_stay_inside(tmp_path: Path) -> None:
    keys = [
        "a/b",
        ".",
        "..",
        "../../escape",
        "/abs",
        "~",
        "",
        " ",
        "a\\b",
        "nul\x00byte",
        "new\nline",
        "日本語",
        "emoji 🎉",
        "$HOME",
        "C:\\windows",
        "a" * 300,
    ]
    state: dict[str, object] = {k: torch.full((2,), float(i)) for i, k in enumerate(keys)}
    state["a"] = {"b": torch.full((2,), -1.0), "..": {"/": torch.full((2,), -2.0)}}  # "a"/"b" vs "a/b"
    before_parent = listdir(tmp_path.parent)
    before = dir_tree(tmp_path)
    path = tmp_path / "sub" / "ckpt"
    await aiockpt.save(state, path)
    new = {"sub", "sub/ckpt", "sub/ckpt/manifest.msgpack", "sub/ckpt/data-r00000.bin"}
    assert dir_tree(tmp_path) - before == new
    assert listdir(tmp_path.parent) == before_parent
    assert not exists(Path("/abs"))
    assert not exists(Path.cwd() / "escape")
    got = await aiockpt.read(path)
    assert_tree_equal(got, snapshot(state))


# --- Staged (async_op=True) saves -------------------------------------------------------------------------


async def test_async_save_snapshots_state_at_staging(ckpt_path: Path) -> None:
    model, opt, _ = trained()
    gen = torch.Generator().manual_seed(5)
    big = torch.randn(1 << 21, generator=gen)  # 8 MiB: still being written when we mutate it
    cfg: dict[str, object] = {"lr": 0.5, "tags": ["a", "b"]}
    state: dict[str, object] = {
        "model": model,
        "optim": opt,
        "big": big,
        "ints": torch.arange(100, dtype=torch.int64),
        "flags": torch.zeros(10, dtype=torch.bool),
        "view": big[10:20],
        "cfg": cfg,
    }
    expected = snapshot(state)
    handle = await aiockpt.save(state, ckpt_path, async_op=True)
    assert handle.state in (SaveState.STAGED, SaveState.WRITING, SaveState.COMMITTED)
    # Mutate everything before yielding to the event loop even once.
    with torch.no_grad():
        for t in tensors_in(state):
            if t.dtype == torch.bool:
                t.fill_(True)
            else:
                t.add_(1)
    cfg["lr"] = 99.0
    tags = cfg["tags"]
    assert isinstance(tags, list)
    tags.append("c")
    cfg["new"] = 1
    meta = await handle
    assert handle.state is SaveState.COMMITTED
    assert meta.num_tensors >= 5
    got = await aiockpt.read(ckpt_path)
    assert_tree_equal(got, expected)


async def test_async_save_keeps_the_shapes_and_dtypes_tensors_had_when_staged(ckpt_path: Path) -> None:
    """The local plan was made after the save returned, from the caller's tensors: one transposed or
    given another dtype in place then reached the manifest with its new shape or dtype, and a resized
    one left a checkpoint whose every read failed its checksums."""
    state: dict[str, object] = {
        "t": torch.arange(12.0).reshape(3, 4),
        "shrunk": torch.arange(12.0),
        "grown": torch.arange(6.0),
        "retyped": torch.ones(4),
        "unsqueezed": torch.arange(6.0).reshape(2, 3),
        "other": torch.full((12,), 7.0),
    }
    expected = snapshot(state)
    handle = await aiockpt.save(state, ckpt_path, async_op=True)
    tensors = cast("dict[str, torch.Tensor]", state)
    tensors["t"].t_()
    tensors["shrunk"].resize_(4)
    tensors["grown"].resize_(600)
    tensors["retyped"].data = tensors["retyped"].data.view(torch.int32)
    tensors["unsqueezed"].unsqueeze_(0)
    await handle
    assert_tree_equal(await aiockpt.read(ckpt_path), expected)
    report = await aiockpt.verify(ckpt_path)
    assert report.ok, report


async def test_async_handle_and_metadata(ckpt_path: Path) -> None:
    state: dict[str, object] = {"w": torch.randn(1 << 18), "b": torch.zeros(3, dtype=torch.float16)}
    handle = await aiockpt.save(state, ckpt_path, async_op=True)
    assert handle.state is not SaveState.STAGING
    assert handle.done() == (handle.state in (SaveState.COMMITTED, SaveState.FAILED))
    meta = await handle
    assert handle.done()
    assert handle.state is SaveState.COMMITTED
    assert (await handle) == meta  # awaiting again gives the same result
    assert meta.path == str(ckpt_path)
    assert meta.step is None
    assert meta.world_size == 1
    assert meta.num_tensors == 2
    assert meta.nbytes == (1 << 18) * 4 + 3 * 2
    assert set(meta.timings) >= PHASES
    assert all(v >= 0 for v in meta.timings.values())
    files = {f.name: f.nbytes for f in meta.files}
    assert files == {"data-r00000.bin": file_size(ckpt_path / "data-r00000.bin")}
    assert set(handle.metrics.seconds) >= PHASES
    assert listdir(ckpt_path) == ["data-r00000.bin", "manifest.msgpack"]


async def test_sync_save_returns_durable_metadata(ckpt_path: Path) -> None:
    w = torch.randn(100)
    state: dict[str, object] = {"w": w}
    meta = await aiockpt.save(state, ckpt_path)
    assert isinstance(meta, aiockpt.Metadata)
    assert exists(ckpt_path / "manifest.msgpack")
    assert meta.nbytes == 400
    assert set(meta.timings) >= PHASES
    assert torch.equal(raw_bytes(tensor_at(await aiockpt.read(ckpt_path), "w")), raw_bytes(w))


async def test_several_async_saves_in_flight(tmp_path: Path) -> None:
    states = [{"x": torch.full((1000,), float(i))} for i in range(4)]
    handles = [await aiockpt.save(dict(s), tmp_path / f"c{i}", async_op=True) for i, s in enumerate(states)]
    for s in states:
        s["x"].zero_()
    metas = [await h for h in handles]
    assert [m.path for m in metas] == [str(tmp_path / f"c{i}") for i in range(4)]
    for i in range(4):
        got = await aiockpt.read(tmp_path / f"c{i}")
        assert torch.equal(tensor_at(got, "x"), torch.full((1000,), float(i)))


@pytest.mark.parametrize("with_large", [False, True], ids=["one-block-each", "mixed"])
async def test_checksums_of_thousands_of_tensors_are_each_their_own(
    with_large: bool, ckpt_path: Path
) -> None:
    # More tensors than one slice of checksum bookkeeping (2,048); with a tensor of several blocks, the
    # other way of grouping a write's checksums.
    state: dict[str, object] = {f"t{i:05d}": torch.full((3,), float(i)) for i in range(5000)}
    if with_large:
        state["large"] = torch.arange(3 * 4096, dtype=torch.float32)  # 48 KiB: 12 blocks of 4 KiB
    io = aiockpt.IOConfig(checksum_block=4096)
    await aiockpt.save(state, ckpt_path, io=io)
    manifest = read_manifest(ckpt_path)
    assert manifest.checksum_block == 4096
    for entry in manifest.tensors:
        t = tensor_at(state, *entry.path)
        (chunk,) = entry.chunks
        raw = bytes(raw_bytes(t).tolist())
        want = tuple(crc32c.crc32c(raw[i : i + 4096]) for i in range(0, len(raw), 4096))
        assert chunk.checksums == want, entry.path
    assert_tree_equal(await aiockpt.read(ckpt_path), state)


async def test_checksums_of_small_and_large_blocks_in_one_save(ckpt_path: Path) -> None:
    # Runs of many small blocks and of large ones, and a tensor (9 MiB) of several default 4 MiB blocks.
    state: dict[str, object] = {f"t{i:04d}": torch.full((5,), float(i)) for i in range(3000)}
    state["one_mib"] = torch.arange(256 * 1024, dtype=torch.float32)
    state["nine_mib"] = torch.arange(9 * 256 * 1024, dtype=torch.int32)
    await aiockpt.save(state, ckpt_path)
    manifest = read_manifest(ckpt_path)
    block = manifest.checksum_block
    assert block == 4 << 20
    for entry in manifest.tensors:
        (chunk,) = entry.chunks
        raw = bytes(raw_bytes(tensor_at(state, *entry.path)).numpy().tobytes())
        want = tuple(crc32c.crc32c(raw[i : i + block]) for i in range(0, len(raw), block))
        assert chunk.checksums == want, entry.path
    assert_tree_equal(await aiockpt.read(ckpt_path), state)


async def test_writers_start_the_writeback_of_what_they_wrote(
    ckpt_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every 16 MiB a writer has written through the page cache, it asks the kernel to start writing them
    # to the device (direct writes are on the device when their call returns).
    calls: list[tuple[int, int, bool]] = []

    def spy(fd: int, offset: int, nbytes: int) -> bool:
        taken = start_writeback(fd, offset, nbytes)
        calls.append((offset, nbytes, taken))
        return taken

    monkeypatch.setattr(_write, "start_writeback", spy)
    state = {"big": torch.arange(40 << 18, dtype=torch.float32)}  # 40 MiB: 10 blocks of 4 MiB
    await aiockpt.save(state, ckpt_path, io=aiockpt.IOConfig(threads=1, direct_writes=False))
    (chunk,) = read_manifest(ckpt_path).tensors[0].chunks
    # Two requests, for the first 16 MiB and the next 16 MiB of the tensor's bytes; the rest is the fsync's.
    mib16 = 16 << 20
    assert [(off, n) for off, n, _ in calls] == [(chunk.offset, mib16), (chunk.offset + mib16, mib16)]
    if sys.platform == "linux":
        assert all(taken for _, _, taken in calls)
    assert_tree_equal(await aiockpt.read(ckpt_path), state)


def test_start_writeback_is_a_hint_that_says_whether_it_was_taken(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"x" * 65536)
    fd = os.open(path, os.O_RDWR)
    try:
        assert start_writeback(fd, 0, 65536) is (sys.platform == "linux")
    finally:
        os.close(fd)
    read_end, write_end = os.pipe()
    try:
        assert start_writeback(read_end, 0, 4096) is False  # a pipe has no pages to write back
    finally:
        os.close(read_end)
        os.close(write_end)
