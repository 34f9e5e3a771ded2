"""Damaged and forged manifests: every reader refuses them with a CheckpointError naming the file.

A manifest's checksum only shows that its bytes are those its writer wrote: these tests forge it, so that
the decoded fields themselves are wrong (found by fuzzing the readers with mutated manifests). Each case
is refused before anything is allocated, recursed into or opened by a field of the manifest.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import random
from collections.abc import Callable
from pathlib import Path

import crc32c
import msgspec
import pytest
import torch
from conftest import evict

import aiockpt
from aiockpt._body import decode_body, encode_body
from aiockpt._cli._app import run as cli
from aiockpt._format import (
    ENCODER,
    ENVELOPE_DECODER,
    MANIFEST_NAME,
    MAX_READ_DEPTH,
    Chunk,
    DictNode,
    FileInfo,
    ListNode,
    Manifest,
    Node,
    TensorEntry,
    TensorNode,
    TupleNode,
    ValueNode,
)
from aiockpt._load._read import _uncovered


def _state() -> dict[str, object]:
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(4, 3, generator=gen)
    return {
        "w": w,
        "tied": w,
        "i": torch.arange(6, dtype=torch.int64).reshape(2, 3),
        "nested": {"a": [torch.ones(3, dtype=torch.bfloat16), 5], 7: (torch.zeros(2, dtype=torch.bool), 2.5)},
        "lr": 0.1,
    }


def _template() -> dict[str, object]:
    """A load target shaped like :func:`_state`, holding other values."""
    w = torch.zeros(4, 3)
    return {
        "w": w,
        "tied": w,
        "i": torch.zeros(2, 3, dtype=torch.int64),
        "nested": {"a": [torch.zeros(3, dtype=torch.bfloat16), 0], 7: (torch.ones(2, dtype=torch.bool), 0.0)},
        "lr": 0.0,
    }


def _manifest(path: Path) -> Manifest:
    env = ENVELOPE_DECODER.decode((path / MANIFEST_NAME).read_bytes())
    return decode_body(env.body, env.format_version)


def _forge(path: Path, manifest: Manifest, version: int = 2, body: bytes | None = None) -> None:
    """Write ``manifest`` (or ``body``) as ``path``'s, in format ``version``, with a checksum that matches."""
    if body is not None:
        pass
    elif version == 1:
        body = ENCODER.encode(msgspec.structs.replace(manifest, format_version=1))
    else:
        body = encode_body(manifest)
    env = {"magic": "aiockpt", "format_version": version, "body_crc32c": crc32c.crc32c(body), "body": body}
    (path / MANIFEST_NAME).write_bytes(msgspec.msgpack.encode(env))


def _cli(*args: str) -> tuple[int, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli(list(args))
    return rc, err.getvalue()


async def _run(op: str, path: Path) -> None:
    """Load (into a matching target), read or verify ``path``; a damage that verify reports is raised."""
    if op == "load":
        await aiockpt.load(_template(), path)
    elif op == "read":
        await aiockpt.read(path)
    else:
        report = await aiockpt.verify(path)
        if report.problems:
            raise report.problems[0]


async def _every_reader_refuses(path: Path, error: type[aiockpt.CheckpointError], *words: str) -> None:
    """load, read, verify and the CLI each refuse ``path`` with ``error`` (a message with ``words``)."""
    for op in ("load", "read", "verify"):
        with pytest.raises(error) as info:
            await _run(op, path)
        message = str(info.value)
        assert str(path) in message, (op, message)
        for word in words:
            assert word in message, (op, message)
    for command in ("inspect", "verify"):
        rc, err = await asyncio.to_thread(_cli, command, str(path))  # (the CLI runs an event loop of its own)
        assert rc in (1, 2), (command, rc, err)
        assert err.startswith("aiockpt: error:"), err


async def _saved(path: Path) -> Manifest:
    await aiockpt.save(_state(), path)
    return _manifest(path)


def _with_tensor(m: Manifest, entry: TensorEntry, **changes: object) -> Manifest:
    """``m`` with ``entry`` added under the root key its path names (and other fields ``changes``)."""
    tree = DictNode(
        keys=(*m.tree.keys, entry.path[0]), values=(*m.tree.values, TensorNode(index=len(m.tensors)))
    )
    return msgspec.structs.replace(m, tensors=(*m.tensors, entry), tree=tree, **changes)


def _entry(m: Manifest, name: str) -> int:
    return next(i for i, t in enumerate(m.tensors) if t.path == (name,))


def _with_entry(m: Manifest, name: str, **changes: object) -> Manifest:
    i = _entry(m, name)
    tensors = list(m.tensors)
    tensors[i] = msgspec.structs.replace(tensors[i], **changes)
    return msgspec.structs.replace(m, tensors=tuple(tensors))


def _with_chunk(m: Manifest, name: str, **changes: object) -> Manifest:
    chunk = m.tensors[_entry(m, name)].chunks[0]
    return _with_entry(m, name, chunks=(msgspec.structs.replace(chunk, **changes),))


def _with_tree_value(m: Manifest, key: str, node: Node) -> Manifest:
    values = tuple(node if k == key else v for k, v in zip(m.tree.keys, m.tree.values, strict=True))
    return msgspec.structs.replace(m, tree=DictNode(keys=m.tree.keys, values=values))


# Each: a forged change of a saved manifest, and a word the error names (the key, where there is one).
FORGED: dict[str, tuple[Callable[[Manifest], Manifest], str]] = {
    "tensor index past the entries": (
        lambda m: _with_tree_value(m, "w", TensorNode(index=len(m.tensors))),
        "w",
    ),
    "negative tensor index": (lambda m: _with_tree_value(m, "w", TensorNode(index=-1)), "w"),
    "chunk box of fewer dims": (lambda m: _with_chunk(m, "i", offsets=(0,), sizes=(2,)), "i"),
    "0-d shape of a 2-d chunk": (lambda m: _with_entry(m, "i", shape=()), "i"),
    "negative dim": (lambda m: _with_entry(m, "i", shape=(-2, 3)), "i"),
    "chunk box past the shape": (lambda m: _with_chunk(m, "i", offsets=(1, 0)), "i"),
    "huge shape": (lambda m: _with_entry(m, "i", shape=(2**31, 2**31)), "i"),
    "chunk byte count off by one": (lambda m: _with_chunk(m, "i", nbytes=47), "i"),
    "negative file offset": (lambda m: _with_chunk(m, "i", offset=-64), "i"),
    "no checksums": (lambda m: _with_chunk(m, "i", checksums=()), "i"),
    "one checksum too many": (lambda m: _with_chunk(m, "i", checksums=(0, 0)), "i"),
    "data file outside the checkpoint": (lambda m: _with_chunk(m, "i", file="../data-r00000.bin"), "i"),
    "absolute data file": (lambda m: _with_chunk(m, "i", file="/etc/passwd"), "i"),
    "quantized dtype": (lambda m: _with_entry(m, "i", dtype="qint8"), "i"),
    "checksum block of 0 bytes": (lambda m: msgspec.structs.replace(m, checksum_block=0), "checksum block"),
    "unknown checksum algorithm": (lambda m: msgspec.structs.replace(m, checksum_algorithm="md5"), "md5"),
    "world size 0": (lambda m: msgspec.structs.replace(m, world_size=0), "world size"),
    "infinite creation time": (
        lambda m: msgspec.structs.replace(m, created_at=float("inf")),
        "creation time",
    ),
    "data file of 2**64 bytes": (
        lambda m: msgspec.structs.replace(m, files=(FileInfo(name="data-r00000.bin", nbytes=2**64 - 1),)),
        "data file",
    ),
    "data file named ..": (
        lambda m: msgspec.structs.replace(m, files=(FileInfo(name="..", nbytes=0),)),
        "data file",
    ),
    # A read kept the last value of the key: the other was dropped without a word.
    "a key listed twice": (
        lambda m: msgspec.structs.replace(
            m, tree=DictNode(keys=(*m.tree.keys[:-1], m.tree.keys[0]), values=m.tree.values)
        ),
        "twice",
    ),
    # Chunks over the same bytes let a small checkpoint claim any size (see the amplification test).
    "two tensors over the same bytes": (
        lambda m: _with_chunk(m, "i", offset=m.tensors[_entry(m, "w")].chunks[0].offset),
        "chunks over the same bytes of data-r00000.bin",
    ),
}


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("case", sorted(FORGED))
async def test_forged_manifest_fields_are_format_errors_naming_file_and_key(
    case: str, version: int, ckpt_path: Path
) -> None:
    forge, word = FORGED[case]
    _forge(ckpt_path, forge(await _saved(ckpt_path)), version)
    await _every_reader_refuses(ckpt_path, aiockpt.FormatError, MANIFEST_NAME, word)


async def test_v1_dict_with_more_keys_than_values_is_a_format_error(ckpt_path: Path) -> None:
    m = await _saved(ckpt_path)
    tree = DictNode(keys=(*m.tree.keys, "extra"), values=m.tree.values)
    _forge(ckpt_path, msgspec.structs.replace(m, tree=tree), version=1)
    await _every_reader_refuses(ckpt_path, aiockpt.FormatError, MANIFEST_NAME, "keys")


def _deep(depth: int, kind: str) -> DictNode:
    node: Node = ValueNode(value=1)
    for _ in range(depth - 1):  # (the root dict is one level)
        if kind == "dict":
            node = DictNode(keys=("k",), values=(node,))
        else:
            node = ListNode(items=(node,)) if kind == "list" else TupleNode(items=(node,))
    return DictNode(keys=("root",), values=(node,))


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("kind", ["dict", "list", "tuple"])
async def test_a_manifest_nested_too_deep_is_a_format_error(kind: str, version: int, ckpt_path: Path) -> None:
    # (600 levels: a RecursionError in the load's matcher before, 1,000 in `aiockpt inspect` too.)
    m = await _saved(ckpt_path)
    for depth in (MAX_READ_DEPTH + 1, 600, 20_000):
        if version == 1:  # (encoded without recursion: msgspec refuses to encode 600 levels)
            _forge(ckpt_path, m, 1, body=_deep_v1_body(m, depth, kind))
        else:
            _forge(ckpt_path, msgspec.structs.replace(m, tree=_deep(depth, kind)), version)
        await _every_reader_refuses(ckpt_path, aiockpt.FormatError, MANIFEST_NAME, "deep")


def _deep_v1_body(m: Manifest, depth: int, kind: str) -> bytes:
    """The format-1 body of ``m`` with the tree of :func:`_deep`, encoded without recursion."""
    mark = msgspec.Raw(b"\xa4MARK")  # a msgpack str, cut out below
    items: tuple[Node, ...] = (mark,)  # type: ignore[assignment]
    node: Node = DictNode(keys=("k",), values=items)
    if kind != "dict":
        node = ListNode(items=items) if kind == "list" else TupleNode(items=items)
    head, tail = ENCODER.encode(node).split(b"\xa4MARK")
    inner = msgspec.Raw(head * (depth - 1) + ENCODER.encode(ValueNode(value=1)) + tail * (depth - 1))
    tree = DictNode(keys=("root",), values=(inner,))  # type: ignore[arg-type]
    return ENCODER.encode(msgspec.structs.replace(m, format_version=1, tree=tree))


@pytest.mark.parametrize("kind", ["dict", "list", "tuple"])
async def test_the_deepest_accepted_nesting_reads_and_loads(kind: str, ckpt_path: Path) -> None:
    # Checkpoints of releases before saves refused nesting deeper than 100 levels stay readable up to here.
    m = await _saved(ckpt_path)
    _forge(ckpt_path, msgspec.structs.replace(m, tree=_deep(MAX_READ_DEPTH, kind)))
    tree = await aiockpt.read(ckpt_path)
    node = tree["root"]
    for _ in range(MAX_READ_DEPTH - 1):
        node = node["k"] if kind == "dict" else node[0]  # type: ignore[index]
    assert node == 1
    rc, _ = await asyncio.to_thread(_cli, "inspect", str(ckpt_path))
    assert rc == 0


async def test_a_huge_tensor_whose_data_file_is_short_is_refused_before_it_is_allocated(
    ckpt_path: Path,
) -> None:
    # A consistent entry of 1 TiB in a data file of a few bytes: read made the tensor first (a RuntimeError
    # of the allocator, or the memory taken), verify a placeholder of one checksum block (MemoryError).
    m = await _saved(ckpt_path)
    n = 1 << 40
    block = 1 << 40
    # (Past the file's end: over another tensor's bytes, it is refused as soon as the manifest is read.)
    chunk = Chunk(offsets=(0,), sizes=(n,), file="data-r00000.bin", offset=1 << 20, nbytes=n, checksums=(0,))
    entry = TensorEntry(path=("huge",), dtype="uint8", shape=(n,), chunks=(chunk,))
    _forge(ckpt_path, _with_tensor(m, entry, checksum_block=block))
    with pytest.raises(aiockpt.CorruptionError, match="data file is truncated") as info:
        await aiockpt.read(ckpt_path)
    assert info.value.key == "huge"
    report = await aiockpt.verify(ckpt_path)
    assert [p.key for p in report.problems] == ["huge"]
    assert "truncated" in str(report.problems[0])
    rc, _ = await asyncio.to_thread(_cli, "verify", str(ckpt_path))
    assert rc == 1


async def test_a_fresh_tensor_its_chunks_cannot_fill_is_refused_before_it_is_allocated(
    ckpt_path: Path,
) -> None:
    # The chunk lies inside the file, but holds a sliver of a tensor of 64 GiB.
    m = await _saved(ckpt_path)
    # (Bytes 48-64 of the file: the padding after 'w', in no other chunk.)
    chunk = Chunk(offsets=(0, 0), sizes=(1, 4), file="data-r00000.bin", offset=48, nbytes=16, checksums=(0,))
    entry = TensorEntry(path=("big",), dtype="float32", shape=(1 << 22, 1 << 12), chunks=(chunk,))
    _forge(ckpt_path, _with_tensor(m, entry))
    with pytest.raises(aiockpt.CorruptionError, match="does not hold all of key 'big'"):
        await aiockpt.read(ckpt_path)


async def test_a_data_file_size_the_manifest_overstates_allocates_nothing(ckpt_path: Path) -> None:
    # The page-cache snapshot of a load was sized by the manifest's byte count (a MemoryError at 2**62).
    m = await _saved(ckpt_path)
    _forge(ckpt_path, msgspec.structs.replace(m, files=(FileInfo(name="data-r00000.bin", nbytes=2**62),)))
    evict(ckpt_path / "data-r00000.bin")  # (nothing cached: the snapshot was 2**50 zero bytes)
    target = _template()
    await aiockpt.load(target, ckpt_path)
    assert torch.equal(target["i"], _state()["i"])  # type: ignore[arg-type]


@pytest.mark.timeout(30)
def test_many_small_overlapping_chunks_are_decided_without_a_search_of_hours() -> None:
    # A whole-tensor box and boxes inside it: decided at once (a search of (2n)^3 cells took 13 s at n=40).
    whole = ((0, 0, 0), (128, 128, 128))
    small = [((i, i, i), (1, 1, 1)) for i in range(0, 800, 2)]
    assert _uncovered((0, 0, 0), (128, 128, 128), [*small, whole]) is None
    # Without such a box, too many cells to test is refused rather than searched.
    cubes = [((i, i, i), (2, 2, 2)) for i in range(120)]
    with pytest.raises(ValueError, match="tests of a cell"):
        _uncovered((0, 0, 0), (128, 128, 128), [*cubes, ((0, 0, 0), (128, 128, 127))])


async def test_many_small_chunks_over_the_same_bytes_are_refused(ckpt_path: Path) -> None:
    """Boxes of one element each, all over the same 8 bytes of the file, their checksum right."""
    m = await _saved(ckpt_path)
    stored = m.tensors[_entry(m, "i")].chunks[0]
    cell = 8  # one int64 element, at the start of the tensor's own bytes (checksummed below)
    data = (ckpt_path / stored.file).read_bytes()[stored.offset : stored.offset + cell]
    shape = (64, 64, 64)
    boxes = [((i, i, i), (1, 1, 1)) for i in range(0, 64, 2)] + [
        ((j, 0, 1), (1, 1, 1)) for j in range(1, 64, 2)
    ]
    chunks = tuple(
        Chunk(
            offsets=o,
            sizes=s,
            file=stored.file,
            offset=stored.offset,
            nbytes=cell,
            checksums=(crc32c.crc32c(data),),
        )
        for o, s in boxes
    )
    forged = _with_entry(m, "i", shape=shape, chunks=chunks)
    _forge(ckpt_path, forged)
    target = _template()
    target["i"] = torch.zeros(shape, dtype=torch.int64)
    with pytest.raises(aiockpt.FormatError, match=r"tensor 'i': chunks over the same bytes of data-r00000"):
        await aiockpt.load(target, ckpt_path)


async def test_a_tensor_claiming_more_than_its_file_holds_through_shared_bytes_is_refused(
    ckpt_path: Path,
) -> None:
    """Every row's chunk the same bytes of the file, with the right checksum: with 4,096 rows of 4 MiB, a
    read of a checkpoint of 4 MiB allocated (and filled) 16 GiB, and verify called it healthy."""
    m = await _saved(ckpt_path)
    stored = m.tensors[_entry(m, "i")].chunks[0]
    row = stored.nbytes  # one row: the tensor's own bytes, at its own offset
    rows = 4096
    chunks = tuple(msgspec.structs.replace(stored, offsets=(r, 0), sizes=(1, row // 8)) for r in range(rows))
    _forge(ckpt_path, _with_entry(m, "i", shape=(rows, row // 8), chunks=chunks))
    await _every_reader_refuses(ckpt_path, aiockpt.FormatError, MANIFEST_NAME, "chunks over the same bytes")


async def test_random_forged_manifests_never_escape_as_raw_errors(ckpt_path: Path) -> None:
    """A seeded sample of the fuzzer's mutations of chunks and shapes: a CheckpointError or success only."""
    m = await _saved(ckpt_path)
    rng = random.Random(1)
    values = [-1, 0, 1, 3, 2**31, 2**62, 2**63 - 1]
    for _ in range(40):
        i = rng.randrange(len(m.tensors))
        entry = m.tensors[i]
        chunk = entry.chunks[0]
        field = rng.choice(["offsets", "sizes", "offset", "nbytes", "checksums", "shape"])
        if field in ("offsets", "sizes", "shape"):
            dims = list(getattr(entry if field == "shape" else chunk, field))
            if dims:
                dims[rng.randrange(len(dims))] = rng.choice(values)
            else:
                dims.append(rng.choice(values))
            new: object = tuple(dims)
        elif field == "checksums":
            new = chunk.checksums[:-1]
        else:
            new = rng.choice(values)
        if field == "shape":
            entry = msgspec.structs.replace(entry, shape=new)
        else:
            entry = msgspec.structs.replace(entry, chunks=(msgspec.structs.replace(chunk, **{field: new}),))
        tensors = (*m.tensors[:i], entry, *m.tensors[i + 1 :])
        _forge(ckpt_path, msgspec.structs.replace(m, tensors=tensors), rng.choice([1, 2]))
        for op in ("load", "read", "verify"):
            with contextlib.suppress(aiockpt.CheckpointError):
                await _run(op, ckpt_path)


async def test_inspect_lists_a_tensor_of_a_dtype_this_torch_lacks(ckpt_path: Path) -> None:
    # A newer torch's dtype (or a forged one) is the readers' to refuse by key; inspect raised a raw
    # ValueError computing its byte count.
    m = await _saved(ckpt_path)
    first = m.tensors[0]
    forged = msgspec.structs.replace(first, dtype="float99")
    _forge(ckpt_path, msgspec.structs.replace(m, tensors=(forged, *m.tensors[1:])))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli(["inspect", "--json", str(ckpt_path)]) == 0
    doc = msgspec.json.decode(out.getvalue())
    listed = next(t for t in doc["tensors"] if t["path"] == list(first.path))
    assert listed["dtype"] == "float99"
    assert listed["nbytes"] == first.chunks[0].nbytes
    with pytest.raises(aiockpt.CheckpointError, match="float99"):
        await aiockpt.read(ckpt_path)


async def test_overlapping_chunk_boxes_that_count_as_the_whole_tensor_are_refused(ckpt_path: Path) -> None:
    # Rows 0-1 and 1-2 of a 4-row tensor hold 12 elements, as many as the tensor: the load's count took
    # them for all of it, read row 1 twice and row 3 never (left as it was in place, zeros when fresh).
    x = torch.arange(12.0).reshape(4, 3)
    await aiockpt.save({"x": x}, ckpt_path)
    m = _manifest(ckpt_path)
    whole = m.tensors[0].chunks[0]
    data = (ckpt_path / whole.file).read_bytes()[whole.offset : whole.offset + whole.nbytes]

    def rows(first: int) -> Chunk:
        at = first * 12
        crc = crc32c.crc32c(data[at : at + 24])
        return Chunk(
            offsets=(first, 0),
            sizes=(2, 3),
            file=whole.file,
            offset=whole.offset + at,
            nbytes=24,
            checksums=(crc,),
        )

    entry = msgspec.structs.replace(m.tensors[0], chunks=(rows(0), rows(1)))
    _forge(ckpt_path, msgspec.structs.replace(m, tensors=(entry,)))
    target: dict[str, object] = {"x": torch.full((4, 3), -1.0)}
    with pytest.raises(aiockpt.FormatError, match="overlap") as info:
        await aiockpt.load(target, ckpt_path)
    assert "'x'" in str(info.value)
    assert torch.equal(target["x"], torch.full((4, 3), -1.0))  # type: ignore[arg-type]
    with pytest.raises(aiockpt.FormatError, match="overlap"):
        await aiockpt.read(ckpt_path)
