"""The on-disk format contract: golden checkpoints, the envelope, raw aligned data, no pickle."""

from __future__ import annotations

import sys
from pathlib import Path

import crc32c
import msgspec
import pytest
import torch

import aiockpt
from aiockpt._body import decode_body, encode_body
from aiockpt._codec import SLICE
from aiockpt._format import (
    ENCODER,
    ENVELOPE_DECODER,
    FORMAT_VERSION,
    MANIFEST_NAME,
    Envelope,
    Manifest,
)
from aiockpt._load._manifest import decode_manifest

GOLDEN = Path(__file__).parent / "golden"
sys.path.insert(0, str(GOLDEN))
from golden_state import golden_state  # noqa: E402


def _same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and a.reshape(-1).view(torch.uint8).tolist() == b.reshape(-1).view(torch.uint8).tolist()
        )
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b


@pytest.mark.parametrize("version", sorted(int(p.name[1:]) for p in GOLDEN.glob("v*")))
async def test_golden_checkpoints_still_load(version: int) -> None:
    tree = await aiockpt.read(GOLDEN / f"v{version}")
    assert _same(tree, golden_state())
    assert tree["tied"] is tree["model"]["weight"]  # type: ignore[index]


async def test_the_format_3_golden_holds_the_state_of_each_rank() -> None:
    # Rank 0's is golden_state() (read above); rank 1 saved other values, and a key rank 0 lacks.
    expected = golden_state() | {"scalar": torch.tensor(8), "step": 43, "loader": {"position": 7}}
    expected["optim"]["param_groups"][0]["betas"] = (0.9, 0.99)  # type: ignore[index]
    assert ENVELOPE_DECODER.decode((GOLDEN / "v3" / MANIFEST_NAME).read_bytes()).format_version == 3
    assert _same(await aiockpt.read(GOLDEN / "v3", rank=1), expected)


def test_golden_of_the_current_version_exists() -> None:
    assert (GOLDEN / f"v{FORMAT_VERSION}" / MANIFEST_NAME).is_file(), "run tests/golden/make_golden.py"


def _manifest(path: Path) -> Manifest:
    env: Envelope = ENVELOPE_DECODER.decode((path / MANIFEST_NAME).read_bytes())
    return decode_body(env.body, env.format_version)


def _rewrite_envelope(path: Path, **changes: object) -> None:
    file = path / MANIFEST_NAME
    env = ENVELOPE_DECODER.decode(file.read_bytes())
    file.write_bytes(ENCODER.encode(msgspec.structs.replace(env, **changes)))


async def _saved(tmp_path: Path) -> Path:
    path = tmp_path / "ckpt"
    await aiockpt.save({"w": torch.arange(10.0)}, path)
    return path


async def test_newer_format_version_is_refused_by_name(tmp_path: Path) -> None:
    path = await _saved(tmp_path)
    # A newer manifest's body says its version too (the envelope alone saying so is damage).
    body = msgspec.msgpack.decode(ENVELOPE_DECODER.decode((path / MANIFEST_NAME).read_bytes()).body)
    newer = ENCODER.encode({**body, "format_version": FORMAT_VERSION + 1})
    _rewrite_envelope(path, format_version=FORMAT_VERSION + 1, body=newer, body_crc32c=crc32c.crc32c(newer))
    with pytest.raises(aiockpt.FormatError, match="upgrade aiockpt") as info:
        await aiockpt.read(path)
    assert info.value.file == str(path / MANIFEST_NAME)


@pytest.mark.parametrize("version", range(1, FORMAT_VERSION + 1))
async def test_a_body_without_its_format_version_is_refused_as_such(tmp_path: Path, version: int) -> None:
    """The field took the newest version as its default: under an older envelope the manifest was called
    damaged ("envelope says format version 1, the manifest 3", which it never said; exit 1), and under
    the newest one accepted."""
    path = await _saved(tmp_path)
    body = msgspec.msgpack.decode(ENVELOPE_DECODER.decode((path / MANIFEST_NAME).read_bytes()).body)
    del body["format_version"]
    without = ENCODER.encode(body)
    _rewrite_envelope(path, format_version=version, body=without, body_crc32c=crc32c.crc32c(without))
    with pytest.raises(aiockpt.FormatError, match="missing required field `format_version`") as info:
        await aiockpt.read(path)
    assert info.value.file == str(path / MANIFEST_NAME)


async def test_foreign_magic_is_refused(tmp_path: Path) -> None:
    path = await _saved(tmp_path)
    _rewrite_envelope(path, magic="other")
    # (a CorruptionError: the body's checksum matches, so the magic of an aiockpt manifest was hit)
    with pytest.raises(aiockpt.CorruptionError, match="not an aiockpt manifest"):
        await aiockpt.read(path)


async def test_manifest_body_damage_is_detected(tmp_path: Path) -> None:
    path = await _saved(tmp_path)
    env = ENVELOPE_DECODER.decode((path / MANIFEST_NAME).read_bytes())
    body = bytearray(env.body)
    body[len(body) // 2] ^= 0x01
    _rewrite_envelope(path, body=bytes(body))
    with pytest.raises(aiockpt.CorruptionError, match="checksum") as info:
        await aiockpt.read(path)
    assert info.value.file == str(path / MANIFEST_NAME)


async def test_data_is_raw_little_endian_at_aligned_offsets(tmp_path: Path) -> None:
    big = torch.arange(64 * 1024, dtype=torch.int32)  # 256 KiB: page aligned
    small = torch.tensor([1.5, -2.0], dtype=torch.float64)  # packed at 64-byte alignment
    path = tmp_path / "ckpt"
    await aiockpt.save({"small": small, "big": big, "small2": small + 1}, path)
    manifest = _manifest(path)
    assert manifest.format_version == 2  # (no per-rank state: see test_ranks.py for version 3)
    data = {f.name: (path / f.name).read_bytes() for f in manifest.files}
    expected = {"small": small, "big": big, "small2": small + 1}
    for entry in manifest.tensors:
        (chunk,) = entry.chunks
        raw = data[chunk.file][chunk.offset : chunk.offset + chunk.nbytes]
        tensor = expected[str(entry.path[0])]
        assert raw == bytes(tensor.view(torch.uint8).tolist())
        assert chunk.offset % (4096 if chunk.nbytes >= 64 * 1024 else 64) == 0
    assert b"\x80\x04" not in (path / MANIFEST_NAME).read_bytes()  # no pickle protocol header


async def test_user_metadata_and_origin_are_recorded(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    model = torch.nn.Linear(2, 2)
    await aiockpt.save({"model": model}, path, metadata={"run": "abc", "epoch": 3})
    manifest = _manifest(path)
    assert manifest.user_metadata == {"run": "abc", "epoch": 3}
    (node,) = manifest.tree.values
    assert isinstance(node, aiockpt._format.DictNode)
    assert node.origin == "torch.nn.modules.linear.Linear"


def test_the_format_1_golden_decoded_in_slices_equals_the_one_shot_decode() -> None:
    env = ENVELOPE_DECODER.decode((GOLDEN / "v1" / MANIFEST_NAME).read_bytes())
    assert env.format_version == 1
    assert decode_body(env.body, 1) == msgspec.msgpack.decode(env.body, type=Manifest)


async def test_large_fields_are_stored_in_slices_and_decode_back(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    # More entries than one slice, nested containers, and a plain value.
    state = {"m": {f"t{i}": torch.full((2,), float(i)) for i in range(1300)}, "n": 3}
    await aiockpt.save(state, path)
    env = ENVELOPE_DECODER.decode((path / MANIFEST_NAME).read_bytes())
    outline = msgspec.msgpack.decode(env.body)
    # Both large fields are arrays of bin values of at most one slice each: no decode call walks more.
    for field, count in (("tensors", 1300), ("tree", 1 + 1 + 1300 + 1)):
        blobs = outline[field]
        assert all(isinstance(b, bytes) for b in blobs)
        sizes = [len(msgspec.msgpack.decode(b)) for b in blobs]
        assert sum(sizes) == count
        assert max(sizes) == SLICE
    manifest = decode_manifest((path / MANIFEST_NAME).read_bytes(), "m")
    assert decode_body(encode_body(manifest), FORMAT_VERSION) == manifest
    assert [aiockpt._tree.render(t.path) for t in manifest.tensors[:2]] == ["m/t0", "m/t1"]
    tree = await aiockpt.read(path)
    assert tree["n"] == 3
    assert torch.equal(tree["m"]["t1299"], torch.full((2,), 1299.0))  # type: ignore[index]


@pytest.mark.parametrize("count", [1, 1300])
async def test_the_manifest_file_is_msgspecs_encoding_of_its_envelope(tmp_path: Path, count: int) -> None:
    # The file is written in pieces (the body's blobs are not joined); the bytes must be exactly what one
    # encode of the envelope gives, for a body under 64 KiB (bin16 header) and over it (bin32).
    path = tmp_path / "ckpt"
    await aiockpt.save({"m": {f"t{i}": torch.full((2,), float(i)) for i in range(count)}}, path)
    raw = (path / MANIFEST_NAME).read_bytes()
    env = ENVELOPE_DECODER.decode(raw)
    assert (len(env.body) > 0xFFFF) == (count > 1)
    assert env.body_crc32c == crc32c.crc32c(env.body)
    assert raw == ENCODER.encode(env)
    assert bytes(env.body) == encode_body(decode_manifest(raw, "m"))


@pytest.mark.parametrize("name", ["float3_e1m1", "float"], ids=["unknown", "alias"])
async def test_a_dtype_this_torch_lacks_is_named_by_read_and_load(tmp_path: Path, name: str) -> None:
    # A checkpoint from a newer torch may hold a dtype this one lacks: read must not hand back None. An
    # alias of float32, which no save writes, was read as float32, yet no float32 target loaded it.
    path = tmp_path / "ckpt"
    await aiockpt.save({"a": torch.ones(3), "b": {"c": torch.ones(2)}}, path)
    manifest = _manifest(path)
    entries = [
        msgspec.structs.replace(e, dtype=name) if aiockpt._tree.render(e.path) == "b/c" else e
        for e in manifest.tensors
    ]
    body = encode_body(msgspec.structs.replace(manifest, tensors=tuple(entries)))
    _rewrite_envelope(path, body=body, body_crc32c=crc32c.crc32c(body))
    with pytest.raises(aiockpt.FormatError, match=rf"b/c: dtype {name} is unknown to this torch"):
        await aiockpt.read(path)
    target: dict[str, object] = {"a": torch.zeros(3), "b": {"c": torch.zeros(2)}}
    with pytest.raises(aiockpt.StateMismatchError, match=rf"b/c: the target is .*the checkpoint {name}"):
        await aiockpt.load(target, path)
    assert torch.equal(target["a"], torch.zeros(3))  # type: ignore[arg-type]


async def test_a_malformed_tensor_entry_is_named(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    await aiockpt.save({f"t{i}": torch.zeros(2) for i in range(700)}, path)
    manifest = _manifest(path)
    entries: list[object] = list(manifest.tensors)
    entries[600] = {"not": "an entry"}
    body = encode_body(msgspec.structs.replace(manifest, tensors=tuple(entries)))
    _rewrite_envelope(path, body=body, body_crc32c=crc32c.crc32c(body))
    with pytest.raises(aiockpt.FormatError, match=r"cannot be decoded.*tensor entry 600"):
        await aiockpt.read(path)
