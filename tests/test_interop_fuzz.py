"""Damaged and forged foreign checkpoints: each gives a clear CheckpointError, never a raw exception.

Regressions found by fuzzing safetensors files, ``torch.save`` files and DCP directories (byte flips,
forged headers and metadata, malicious pickles). Each case builds its source with the real library, then
damages it the way the fuzzer did.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import struct
import warnings
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

import aiockpt


def _dcp_save(state: dict[str, Any], path: Path) -> None:
    from torch.distributed.checkpoint import state_dict_saver as dcp

    with warnings.catch_warnings():  # "saving in a single process": exactly what these tests want
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, checkpoint_id=path)


def _forge(path: Path, edit: Any) -> None:
    """Rewrite ``path/.metadata`` with ``edit(metadata)`` applied (a forged, well-formed pickle)."""
    file = path / ".metadata"
    md = pickle.loads(file.read_bytes())
    edit(md)
    file.write_bytes(pickle.dumps(md))


def _transposed_state() -> dict[str, Any]:
    # A transposed tensor is saved as its storage with strides (1, 4): DCP's blob is decoded with
    # torch.load, not read in place. The others are plain records, read in place.
    return {
        "t": torch.arange(12, dtype=torch.float32).reshape(3, 4).t(),
        "b": torch.tensor([True, False, True]),
        "w": torch.arange(6, dtype=torch.float32).reshape(2, 3),
    }


# --- safetensors -----------------------------------------------------------------------------------------


async def test_safetensors_header_nested_too_deep_is_corruption(tmp_path: Path) -> None:
    raw = b"[" * 100_000 + b"]" * 100_000  # json.loads raised RecursionError
    file = tmp_path / "m.safetensors"
    file.write_bytes(struct.pack("<Q", len(raw)) + raw)
    with pytest.raises(aiockpt.CorruptionError, match="damaged safetensors header") as info:
        await aiockpt.read(file)
    assert info.value.file == str(file)


async def test_hf_index_nested_too_deep_or_naming_nul_is_a_format_error(tmp_path: Path) -> None:
    directory = tmp_path / "hf"
    directory.mkdir()
    save_file({"a": torch.ones(2)}, str(directory / "model-00001-of-00001.safetensors"))
    index = directory / "model.safetensors.index.json"
    index.write_bytes(b"[" * 100_000 + b"]" * 100_000)  # RecursionError
    with pytest.raises(aiockpt.FormatError, match="cannot read"):
        await aiockpt.read(directory)
    index.write_text(json.dumps({"weight_map": {"a": "model\u0000.safetensors"}}))  # ValueError from open()
    with pytest.raises(aiockpt.FormatError, match="outside the directory") as info:
        await aiockpt.read(directory)
    assert info.value.file == str(index)


# --- DCP metadata ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("what", "edit"),
    [
        # A chunk box past the shape: the decoded chunk was copied where it overlapped, the rest was
        # never written and read() returned uninitialized memory.
        (
            "outside the shape",
            lambda md: setattr(md.state_dict_metadata["t"].chunks[0], "offsets", torch.Size([1, 0])),
        ),
        # Chunk boxes of another rank than the tensor: ValueError from zip(strict=True).
        (
            "outside the shape",
            lambda md: setattr(md.state_dict_metadata["t"].chunks[0], "sizes", torch.Size([4])),
        ),
        # A negative dimension: ZeroDivisionError / RuntimeError from the slab allocator.
        ("shape", lambda md: setattr(md.state_dict_metadata["w"], "size", torch.Size([-5, 3]))),
        # A quantized dtype: an internal assert of torch while allocating.
        ("does not read", lambda md: setattr(md.state_dict_metadata["w"].properties, "dtype", torch.quint8)),
    ],
)
async def test_dcp_forged_tensor_metadata_is_refused_by_key(tmp_path: Path, what: str, edit: Any) -> None:
    _dcp_save(_transposed_state(), tmp_path / "d")
    _forge(tmp_path / "d", edit)
    with pytest.raises(aiockpt.FormatError, match=what) as info:
        await aiockpt.read(tmp_path / "d")
    assert info.value.file == str(tmp_path / "d" / ".metadata")


async def test_dcp_planner_path_nested_thousands_deep_stays_flat(tmp_path: Path) -> None:
    # planner_data says where each name sat in the saved state; 5000 levels: RecursionError in tree_of.
    _dcp_save({"a": torch.ones(2)}, tmp_path / "d")
    _forge(tmp_path / "d", lambda md: setattr(md, "planner_data", {"a": ("k",) * 5000}))
    tree = await aiockpt.read(tmp_path / "d")
    assert list(tree) == ["a"]
    assert torch.equal(tree["a"], torch.ones(2))  # type: ignore[arg-type]


async def test_dcp_decoded_tensor_with_a_hole_is_refused(tmp_path: Path) -> None:
    # The global shape grows by a row that no chunk holds: read() left it uninitialized, without error.
    _dcp_save(_transposed_state(), tmp_path / "d")
    _forge(tmp_path / "d", lambda md: setattr(md.state_dict_metadata["t"], "size", torch.Size([5, 3])))
    with pytest.raises(aiockpt.CorruptionError, match=r"does not hold all of key 't'.*\[4:5, 0:3\]") as info:
        await aiockpt.read(tmp_path / "d")
    assert info.value.key == "t"


async def test_dcp_huge_shape_is_refused_before_memory_is_taken(tmp_path: Path) -> None:
    # 2^40 rows: torch.empty failed with a RuntimeError ("can't allocate memory"), or took the memory.
    _dcp_save(_transposed_state(), tmp_path / "d")
    _forge(tmp_path / "d", lambda md: setattr(md.state_dict_metadata["w"], "size", torch.Size([2**40, 3])))
    with pytest.raises(aiockpt.CorruptionError, match="does not hold all of key 'w'"):
        await aiockpt.read(tmp_path / "d")


@pytest.mark.parametrize(
    ("field", "value", "error"),
    [
        ("length", 10**12, aiockpt.CorruptionError),  # MemoryError: f.read(length) before any check
        ("length", 2**63, aiockpt.FormatError),  # OverflowError
        ("offset", 2**63, aiockpt.FormatError),  # ValueError from seek()
    ],
)
async def test_dcp_storage_location_past_any_file_is_refused(
    tmp_path: Path, field: str, value: int, error: type[Exception]
) -> None:
    from torch.distributed.checkpoint.metadata import MetadataIndex

    _dcp_save(_transposed_state(), tmp_path / "d")
    _forge(tmp_path / "d", lambda md: setattr(md.storage_data[MetadataIndex("t", (0, 0))], field, value))
    with pytest.raises(error, match="'t'"):
        await aiockpt.read(tmp_path / "d")
    target: dict[str, object] = {k: torch.zeros_like(v) for k, v in _transposed_state().items()}
    with pytest.raises(error, match="'t'"):
        await aiockpt.load(target, tmp_path / "d")


async def test_dcp_plain_chunk_of_another_dtype_is_not_reinterpreted(tmp_path: Path) -> None:
    # The metadata says int8, the blob holds a bool tensor of the same byte count: its raw record was read
    # as int8 without a word, where the decoded path reports the mismatch.
    _dcp_save(_transposed_state(), tmp_path / "d")
    _forge(tmp_path / "d", lambda md: setattr(md.state_dict_metadata["b"].properties, "dtype", torch.int8))
    with pytest.raises(
        aiockpt.CorruptionError, match=r"key 'b' .* is bool\[3\], the metadata says int8\[3\]"
    ):
        await aiockpt.read(tmp_path / "d")


# --- torch.save files --------------------------------------------------------------------------------------


async def test_torch_save_with_a_compressed_record_reads_its_true_values(tmp_path: Path) -> None:
    # torch.load(mmap=True) maps a deflated record's compressed bytes as the tensor's: wrong values.
    expected = {"w": torch.arange(64, dtype=torch.float32), "n": torch.zeros(8, dtype=torch.int64)}
    plain = io.BytesIO()
    torch.save(expected, plain)
    file = tmp_path / "m.pt"
    with zipfile.ZipFile(plain) as src, zipfile.ZipFile(file, "w") as dst:
        for info in src.infolist():
            kind = zipfile.ZIP_DEFLATED if "/data/" in info.filename else zipfile.ZIP_STORED
            dst.writestr(zipfile.ZipInfo(info.filename), src.read(info), compress_type=kind)
    tree = await aiockpt.read(file)
    assert torch.equal(tree["w"], expected["w"])  # type: ignore[arg-type]
    assert torch.equal(tree["n"], expected["n"])  # type: ignore[arg-type]


# --- malicious pickles never run -------------------------------------------------------------------------


def _global(module: str, name: str) -> bytes:
    """Protocol 4's STACK_GLOBAL of ``module`` and ``name`` (which may be dotted: an attribute chain)."""
    return b"".join(b"\x8c" + bytes([len(s)]) + s.encode() for s in (module, name)) + b"\x93"


def _exploits(marker: Path) -> list[bytes]:
    """Pickles that create ``marker`` when unpickled, spelled the ways an unpickler resolves a global."""
    cmd = f"touch {marker}".encode()
    call = b"\x8c" + bytes([len(cmd)]) + cmd + b"\x85R."  # (the command) as the one argument, REDUCE
    return [
        b"cos\nsystem\n(S'" + cmd + b"'\ntR.",  # GLOBAL + REDUCE
        b"(S'" + cmd + b"'\nios\nsystem\n.",  # INST
        b"\x80\x04" + _global("os", "system") + call,  # STACK_GLOBAL
        # Dotted names reaching os through modules the DCP unpickler allows names of.
        b"\x80\x04" + _global("torch.distributed.checkpoint.filesystem", "os.system") + call,
        b"\x80\x04" + _global("pathlib", "os.system") + call,
    ]


async def test_malicious_pickles_in_every_place_never_run(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    _dcp_save({"a": torch.ones(2)}, tmp_path / "d")
    plain = io.BytesIO()
    torch.save({"a": torch.ones(2)}, plain)
    with zipfile.ZipFile(plain) as zf:
        records = {info.filename: zf.read(info) for info in zf.infolist()}
    for i, exploit in enumerate(_exploits(marker)):
        (tmp_path / "d" / ".metadata").write_bytes(exploit)
        with pytest.raises(aiockpt.FormatError):
            await aiockpt.read(tmp_path / "d")
        file = tmp_path / f"m{i}.pt"  # a torch.save archive whose data.pkl is the exploit
        with zipfile.ZipFile(file, "w") as zf:
            for name, data in records.items():
                zf.writestr(name, exploit if name.endswith("data.pkl") else data)
        with pytest.raises(aiockpt.CheckpointError):
            await aiockpt.read(file)
        with pytest.raises(aiockpt.CheckpointError):
            await aiockpt.load({"a": torch.zeros(2)}, file)
    assert not marker.exists()
    assert not os.path.exists(marker)
