"""Per-rank state (format version 3): its encoding, the checks of a manifest that holds it, the tree of one
rank (``project``), and the readers end to end.

The save side that writes per-rank state needs a distributed job (``test_distributed.py``); here a
single-process checkpoint's manifest is rewritten to hold what such a save writes.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import crc32c
import msgspec
import pytest
import torch

import aiockpt
from aiockpt import sync
from aiockpt._body import body_version, decode_body, encode_body, tree_blobs, tree_from_blobs, tree_records
from aiockpt._cli._app import run as cli
from aiockpt._codec import SLICE
from aiockpt._format import (
    ENCODER,
    ENVELOPE_DECODER,
    MANIFEST_NAME,
    MAX_READ_DEPTH,
    BytesNode,
    DictNode,
    Key,
    ListNode,
    Manifest,
    Node,
    OpenNode,
    PickleNode,
    RanksNode,
    TensorEntry,
    TensorNode,
    TupleNode,
    ValueNode,
)
from aiockpt._load._manifest import check_manifest, decode_manifest
from aiockpt._load._ranks import project
from aiockpt._save._finish import encode_manifest
from aiockpt._world import LocalWorld

pytestmark = pytest.mark.timeout(60)


def _v(value: int | str | None) -> ValueNode:
    return ValueNode(value=value)


def _ranks(*items: Node, ranks: tuple[int, ...] | None = None) -> RanksNode:
    """Per-rank state: ``items`` of ranks ``0, 1, ...`` (or of ``ranks``)."""
    return RanksNode(ranks=tuple(range(len(items))) if ranks is None else ranks, items=items)


def _dict(**values: Node) -> DictNode:
    return DictNode(keys=tuple(values), values=tuple(values.values()))


def _manifest(tree: DictNode, *, tensors: int = 0, world_size: int = 2, **fields: object) -> Manifest:
    """A manifest of ``tree`` with ``tensors`` entries (empty tensors, stored in no chunk)."""
    entries = tuple(
        TensorEntry(path=(f"t{i}",), dtype="float32", shape=(0,), chunks=()) for i in range(tensors)
    )
    manifest = Manifest(checksum_block=1 << 22, world_size=world_size, tree=tree, tensors=entries, files=())
    return msgspec.structs.replace(manifest, **fields)


def _raw(manifest: Manifest, version: int | None = None) -> bytes:
    """The manifest file of ``manifest``: as a save writes it, or forged in format ``version``."""
    if version is None:
        return b"".join(encode_manifest(manifest)[0])
    if version == 1:
        body = ENCODER.encode(msgspec.structs.replace(manifest, format_version=1))
    else:
        body = encode_body(manifest, version=version)
    env = {"magic": "aiockpt", "format_version": version, "body_crc32c": crc32c.crc32c(body), "body": body}
    return ENCODER.encode(env)


# --- The encoding -----------------------------------------------------------------------------------------


def _with_ranks() -> DictNode:
    """Per-rank state as a dict value (a tensor, a key only rank 1 has, a dict), a list and a tuple item."""
    return _dict(
        w=TensorNode(index=0),
        rng=_ranks(TensorNode(index=1), TensorNode(index=2)),
        only1=_ranks(_v(7), ranks=(1,)),
        loader=_ranks(_dict(pos=_v(3), origin=_v("a")), DictNode(keys=(), values=()), ListNode(items=())),
        hist=ListNode(items=(_v(0), _ranks(_v(1), _v(2), _v(3)))),
        pair=TupleNode(items=(_ranks(TupleNode(items=(_v(1),)), _v("x"), _v(None)), _v(5))),
    )


def test_per_rank_state_is_written_as_format_3_and_read_back() -> None:
    manifest = _manifest(_with_ranks(), tensors=3, world_size=3)
    raw = _raw(manifest)
    env = ENVELOPE_DECODER.decode(raw)
    assert env.format_version == 3
    decoded = decode_manifest(raw, "m")
    assert decoded.format_version == 3
    assert decoded == manifest
    # A RanksNode is stored as an open record of kind "ranks" whose items follow it, without keys.
    records = list(tree_records(manifest.tree))
    assert ("rng", OpenNode(kind="ranks", size=2, ranks=(0, 1))) in records
    at = records.index(("only1", OpenNode(kind="ranks", size=1, ranks=(1,))))
    assert records[at + 1] == (None, _v(7))


def test_a_tree_without_per_rank_state_is_written_as_format_2() -> None:
    # Readable by releases that read up to format 2 (which would refuse version 3 by its envelope).
    flat = DictNode(
        keys=tuple(f"k{i}" for i in range(3 * SLICE)),
        values=tuple(TensorNode(index=0) for _ in range(3 * SLICE)),
    )
    nested = _dict(a=ListNode(items=(flat, TupleNode(items=(_v(1),)))), b=_v(2))
    for tree in (flat, nested):
        manifest = _manifest(tree, tensors=1)
        assert body_version(manifest) == 2
        raw = _raw(manifest)
        assert ENVELOPE_DECODER.decode(raw).format_version == 2
        assert decode_manifest(raw, "m").format_version == 2


class _OpenNodeOfFormat2(msgspec.Struct, frozen=True, kw_only=True, gc=False, tag="open"):
    """``OpenNode`` as releases that read up to format 2 decode it."""

    kind: Literal["dict", "list", "tuple"]
    size: int
    origin: str | None = None


def test_a_format_2_tree_written_now_decodes_with_format_2s_own_schema() -> None:
    # Open records now carry ``ranks`` (empty): a field that readers of format 2 skip.
    leaves = TensorNode | ValueNode | BytesNode | PickleNode
    old = msgspec.msgpack.Decoder(tuple[tuple[Key | None, _OpenNodeOfFormat2 | leaves], ...])
    tree = _dict(
        a=ListNode(items=(TensorNode(index=0),)), b=DictNode(keys=(1,), values=(_v(2),), origin="m.C")
    )
    (blob,) = tree_blobs(tree)
    assert old.decode(blob) == (
        (None, _OpenNodeOfFormat2(kind="dict", size=2)),
        ("a", _OpenNodeOfFormat2(kind="list", size=1)),
        (None, TensorNode(index=0)),
        ("b", _OpenNodeOfFormat2(kind="dict", size=1, origin="m.C")),
        (1, _v(2)),
    )


def test_per_rank_state_deep_or_past_the_first_slices_is_found() -> None:
    leaves = tuple(TensorNode(index=0) for _ in range(2 * SLICE))
    late = DictNode(keys=tuple(range(2 * SLICE + 1)), values=(*leaves, _ranks(_v(1), _v(2))))
    deep: Node = _ranks(_v(1), _v(2))
    for _ in range(50):
        deep = ListNode(items=(_v(0), deep))
    for tree in (late, _dict(x=deep)):
        assert body_version(_manifest(tree, tensors=1)) == 3
        assert tree_from_blobs(tree_blobs(tree)) == tree


def test_a_record_of_another_kind_that_lists_ranks_is_refused() -> None:
    records = [(None, OpenNode(kind="dict", size=1)), ("a", OpenNode(kind="list", size=0, ranks=(0,)))]
    with pytest.raises(msgspec.ValidationError, match=r"a list lists ranks.*record 1"):
        tree_from_blobs((ENCODER.encode(records),))


def test_format_3_is_decoded_as_format_2_is() -> None:
    manifest = _manifest(_with_ranks(), tensors=3, world_size=3)
    body = encode_body(manifest)
    assert decode_body(body, 3).tree == manifest.tree


# --- check_manifest ---------------------------------------------------------------------------------------

# Each: a forged tree of a manifest of 2 ranks and 1 tensor, and words the FormatError names.
FORGED: dict[str, tuple[DictNode, tuple[str, ...]]] = {
    "no rank": (_dict(a=RanksNode(ranks=(), items=())), ("'a'", "lists no rank")),
    "ranks out of order": (_dict(a=_ranks(_v(1), _v(2), ranks=(1, 0))), ("'a'", "increasing order")),
    "a rank twice": (_dict(a=_ranks(_v(1), _v(2), ranks=(0, 0))), ("'a'", "increasing order")),
    "rank past the world": (_dict(a=_ranks(_v(1), _v(2), ranks=(0, 2))), ("'a'", "outside the world of 2")),
    "negative rank": (_dict(a=_ranks(_v(1), _v(2), ranks=(-1, 0))), ("'a'", "outside the world")),
    "more ranks than items": (
        _dict(a=RanksNode(ranks=(0, 1), items=(_v(1),))),
        ("'a'", "2 ranks and 1 items"),
    ),
    "a list item that a rank lacks": (
        _dict(a=_dict(l=ListNode(items=(_v(0), _ranks(_v(1), ranks=(0,)))))),
        ("'a/l/1'", "ranks [1] (of 2)", "list or tuple"),
    ),
    "a tuple item that a rank lacks": (
        _dict(t=TupleNode(items=(_ranks(_v(1), ranks=(1,)),))),
        ("'t/0'", "ranks [0] (of 2)"),
    ),
    "per-rank state in a rank's item": (
        _dict(a=_ranks(_dict(b=_ranks(_v(1), _v(2))), _v(3))),
        ("'a/b'", "inside the state of rank 0"),
    ),
    "per-rank state as a rank's item": (
        _dict(a=_ranks(_v(1), _ranks(_v(1), _v(2)))),
        ("'a'", "inside the state of rank 1"),
    ),
    "a rank's tensor index past the entries": (
        _dict(a=_ranks(TensorNode(index=0), TensorNode(index=1))),
        ("'a' of rank 1", "tensor 1 of 1"),
    ),
    "a tensor index past the entries inside a rank's item": (
        _dict(a=_ranks(_v(0), _dict(b=ListNode(items=(TensorNode(index=-1),))))),
        ("'a/b/0' of rank 1", "tensor -1 of 1"),
    ),
}


@pytest.mark.parametrize("case", sorted(FORGED))
def test_per_rank_state_that_no_save_writes_is_a_format_error(case: str) -> None:
    tree, words = FORGED[case]
    with pytest.raises(aiockpt.FormatError) as info:
        decode_manifest(_raw(_manifest(tree, tensors=1)), "/c/manifest.msgpack")
    assert info.value.file == "/c/manifest.msgpack"
    for word in ("/c/manifest.msgpack", *words):
        assert word in str(info.value)


@pytest.mark.parametrize("version", [1, 2])
def test_per_rank_state_in_a_manifest_of_an_earlier_format_is_a_format_error(version: int) -> None:
    manifest = _manifest(_dict(x=_v(0), a=_ranks(_v(1), _v(2))))
    with pytest.raises(aiockpt.FormatError, match=rf"'a' in a manifest of format version {version}"):
        decode_manifest(_raw(manifest, version), "m")
    assert decode_manifest(_raw(manifest), "m").format_version == 3  # (as a save writes it)


def test_per_rank_state_in_a_part_of_a_collective_free_checkpoint_is_a_format_error() -> None:
    manifest = _manifest(_dict(a=_ranks(_v(1), _v(2))), part_rank=1)
    with pytest.raises(aiockpt.FormatError, match=r"'a' in a part of a collective-free checkpoint"):
        decode_manifest(_raw(manifest), "m")


def _nested(depth: int, ranks_at: int) -> DictNode:
    """A chain of ``depth`` containers (the root the first), the one at ``ranks_at`` per-rank state."""
    node: Node = _v(1)
    for level in reversed(range(1, depth)):
        node = _ranks(node, node) if level == ranks_at else DictNode(keys=("k",), values=(node,))
    return DictNode(keys=("k",), values=(node,))


def test_per_rank_state_counts_as_a_level_of_nesting() -> None:
    deepest = _manifest(_nested(MAX_READ_DEPTH, ranks_at=5))
    check_manifest(deepest, "m")
    assert decode_manifest(_raw(deepest), "m").tree == deepest.tree
    # One level more: refused by the check (a tree built in memory) and by the decoder (a file).
    deeper = _manifest(_nested(MAX_READ_DEPTH + 1, ranks_at=5))
    with pytest.raises(aiockpt.FormatError, match=rf"more than {MAX_READ_DEPTH} levels deep"):
        check_manifest(deeper, "m")
    with pytest.raises(aiockpt.FormatError, match=rf"more than {MAX_READ_DEPTH} levels deep"):
        decode_manifest(_raw(deeper), "m")


async def test_per_rank_state_at_the_deepest_accepted_nesting_is_read(ckpt_path: Path) -> None:
    await aiockpt.save({"k": 0}, ckpt_path)
    deep = _nested(MAX_READ_DEPTH, ranks_at=MAX_READ_DEPTH - 1)  # (the deepest container per-rank)
    _rewrite(ckpt_path, lambda m: msgspec.structs.replace(m, tree=deep, world_size=2))
    node: object = await aiockpt.read(ckpt_path, rank=1)
    for _ in range(MAX_READ_DEPTH - 1):
        node = node["k"]  # type: ignore[index]
    assert node == 1


# --- project ----------------------------------------------------------------------------------------------


def test_a_tree_without_per_rank_state_is_its_own_projection() -> None:
    tree = _dict(a=TensorNode(index=0), b=ListNode(items=(_dict(c=_v(1)),)))
    for rank in (0, 1, 7):
        assert project(tree, rank) is tree


def test_each_rank_gets_its_own_item_and_lacks_keys_only_others_saved() -> None:
    tree = DictNode(
        keys=("w", "rng", "only1", "n"),
        values=(
            TensorNode(index=0),
            _ranks(TensorNode(index=1), TensorNode(index=2)),
            _ranks(_v(7), ranks=(1,)),
            _v(3),
        ),
        origin="m.C",
    )
    assert project(tree, 0) == DictNode(
        keys=("w", "rng", "n"), values=(TensorNode(index=0), TensorNode(index=1), _v(3)), origin="m.C"
    )
    assert project(tree, 1) == DictNode(
        keys=("w", "rng", "only1", "n"),
        values=(TensorNode(index=0), TensorNode(index=2), _v(7), _v(3)),
        origin="m.C",
    )
    # A rank outside the world that saved it gets the state every rank shared.
    assert project(tree, 2) == DictNode(keys=("w", "n"), values=(TensorNode(index=0), _v(3)), origin="m.C")


def test_list_and_tuple_items_are_the_ranks_own() -> None:
    tree = _dict(
        l=ListNode(items=(_v(0), _ranks(_v(1), _v(2)))), t=TupleNode(items=(_ranks(_v("a"), _v("b")),))
    )
    assert project(tree, 1) == _dict(l=ListNode(items=(_v(0), _v(2))), t=TupleNode(items=(_v("b"),)))


def test_a_list_item_that_the_rank_lacks_is_a_state_error_naming_the_key() -> None:
    tree = _dict(a=_dict(l=ListNode(items=(_v(0), _ranks(_v(1), _v(2))))))
    with pytest.raises(aiockpt.StateError, match=r"rank 2 has no state at key 'a/l/1'") as info:
        project(tree, 2)
    assert info.value.key == "a/l/1"


def test_only_the_containers_on_the_way_to_per_rank_state_are_rebuilt() -> None:
    untouched = _dict(
        big=DictNode(keys=tuple(range(3 * SLICE)), values=tuple(_v(i) for i in range(3 * SLICE)))
    )
    flat = DictNode(
        keys=tuple(range(2 * SLICE + 1)),
        values=(*(TensorNode(index=0) for _ in range(2 * SLICE)), _ranks(_v(1), _v(2))),
    )
    tree = _dict(untouched=untouched, path=ListNode(items=(untouched, flat)))
    out = project(tree, 1)
    assert out.values[0] is untouched
    path = out.values[1]
    assert isinstance(path, ListNode)
    assert path.items[0] is untouched
    assert path.items[1] == DictNode(keys=flat.keys, values=(*flat.values[:-1], _v(2)))


def test_the_tensors_of_other_ranks_are_reported() -> None:
    tree = _dict(
        rng=_ranks(TensorNode(index=0), TensorNode(index=1), _dict(x=ListNode(items=(TensorNode(index=2),)))),
        only2=_ranks(TensorNode(index=3), ranks=(2,)),
    )
    others: set[int] = set()
    project(tree, 1, others=others)
    assert others == {0, 2, 3}


# --- End to end -------------------------------------------------------------------------------------------

T0, T1 = torch.arange(4.0), torch.arange(4.0) + 10


def _rewrite(path: Path, change: Callable[[Manifest], Manifest]) -> None:
    """Replace ``path``'s manifest with ``change`` of it, encoded as a save encodes one, atomically."""
    file = path / MANIFEST_NAME
    manifest = decode_manifest(file.read_bytes(), str(file))
    tmp = path / (MANIFEST_NAME + ".tmp")
    tmp.write_bytes(b"".join(encode_manifest(change(manifest))[0]))
    os.replace(tmp, file)


def _per_rank(m: Manifest) -> Manifest:
    """A checkpoint of ``{"a": T0, "b": T1, "n": 1}`` made one of 2 ranks.

    Rank 0 saved ``{"a": T0}``, rank 1 ``{"a": T1, "n": 7}``: the entry of ``b`` becomes rank 1's of
    ``a``, as a save of two ranks lists it (entries of two ranks at one key path).
    """
    index = {t.path: i for i, t in enumerate(m.tensors)}
    a, b = index[("a",)], index[("b",)]
    tensors = list(m.tensors)
    tensors[b] = msgspec.structs.replace(tensors[b], path=("a",))
    tree = _dict(a=_ranks(TensorNode(index=a), TensorNode(index=b)), n=_ranks(_v(7), ranks=(1,)))
    return msgspec.structs.replace(m, tree=tree, tensors=tuple(tensors), world_size=2)


async def _checkpoint(path: Path) -> Path:
    await aiockpt.save({"a": T0, "b": T1, "n": 1}, path)
    _rewrite(path, _per_rank)
    return path


def _run_cli(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli(list(args))
    return rc, out.getvalue(), err.getvalue()


async def test_read_returns_the_state_of_one_rank(ckpt_path: Path) -> None:
    path = await _checkpoint(ckpt_path)
    assert ENVELOPE_DECODER.decode((path / MANIFEST_NAME).read_bytes()).format_version == 3
    rank0 = await aiockpt.read(path)  # (no distributed job: rank 0)
    assert list(rank0) == ["a"]
    assert torch.equal(rank0["a"], T0)  # type: ignore[arg-type]
    rank1 = await aiockpt.read(path, rank=1)
    assert list(rank1) == ["a", "n"]
    assert torch.equal(rank1["a"], T1)  # type: ignore[arg-type]
    assert rank1["n"] == 7
    assert list(await aiockpt.read(path, rank=2)) == []  # (outside the world: only shared state)
    for bad in (-1, True, 1.0):
        with pytest.raises(aiockpt.CheckpointError, match="rank must be an int"):
            await aiockpt.read(path, rank=bad)  # type: ignore[arg-type]
    synced = await asyncio.to_thread(sync.read, path, rank=1)
    assert torch.equal(synced["a"], T1)  # type: ignore[arg-type]
    assert synced["n"] == 7


async def test_read_and_load_default_to_this_processs_rank(
    ckpt_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = await _checkpoint(ckpt_path)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: 1)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
    assert (await aiockpt.read(path))["n"] == 7
    target: dict[str, object] = {"a": torch.zeros(4), "n": 0}
    await aiockpt.load(target, path)
    assert torch.equal(target["a"], T1)  # type: ignore[arg-type]
    assert target["n"] == 7


async def test_load_fills_this_ranks_state_and_misses_keys_only_others_saved(ckpt_path: Path) -> None:
    path = await _checkpoint(ckpt_path)
    target: dict[str, object] = {"a": torch.zeros(4)}
    await aiockpt.load(target, path)
    assert torch.equal(target["a"], T0)  # type: ignore[arg-type]
    # "n" was saved by rank 1 only: for rank 0 the checkpoint lacks it.
    target = {"a": torch.zeros(4), "n": 0}
    with pytest.raises(aiockpt.StateMismatchError, match="n: missing key"):
        await aiockpt.load(target, path)
    assert torch.equal(target["a"], torch.zeros(4))  # type: ignore[arg-type]
    # ``rank=`` loads another rank's (a save over a process group numbers its ranks in that group).
    target = {"a": torch.zeros(4), "n": 0}
    await asyncio.to_thread(aiockpt.sync.load, target, path, rank=1)
    assert torch.equal(target["a"], T1)  # type: ignore[arg-type]
    assert target["n"] == 7
    with pytest.raises(aiockpt.CheckpointError, match="rank must be an int of at least 0, not -1"):
        await aiockpt.load(target, path, rank=-1)


class _Rank1(LocalWorld):
    rank = 1


async def test_a_checkpointer_reads_the_state_of_its_own_rank(root: Path) -> None:
    async with aiockpt.Checkpointer(root) as ckpt:
        await ckpt.save({"a": T0, "b": T1, "n": 1}, step=1)
        step = ckpt.path_of(1)
        assert isinstance(step, Path)
        _rewrite(step, _per_rank)
        assert list(await ckpt.read()) == ["a"]
        ckpt._world = _Rank1()  # (as a Checkpointer of rank 1 of a job's group is)
        assert (await ckpt.read())["n"] == 7
        target: dict[str, object] = {"a": torch.zeros(4), "n": 0}
        assert await ckpt.load(target) == 1
        assert torch.equal(target["a"], T1)  # type: ignore[arg-type]
        assert target["n"] == 7
        ckpt._world = LocalWorld()
    async with aiockpt.Checkpointer(root, use_collectives=False) as parts:
        parts._part = (1, 2)  # (the rank its parts are saved as, in a job)
        assert (await parts.read())["n"] == 7
        parts._part = None
    rc, out, err = await asyncio.to_thread(_run_cli, "ls", "--json", str(root))
    assert rc == 0, err
    (row,) = json.loads(out)["steps"]
    assert (row["committed"], row["problem"], row["tensors"], row["world_size"]) == (True, None, 2, 2)


async def test_inspect_lists_the_state_of_every_rank(ckpt_path: Path) -> None:
    path = await _checkpoint(ckpt_path)
    rc, out, err = await asyncio.to_thread(_run_cli, "inspect", "--json", str(path))
    assert rc == 0, err
    doc = json.loads(out)
    assert doc["format_version"] == 3
    assert [(t["key"], t["rank"], t["replicated"]) for t in doc["tensors"]] == [
        ("a", 0, False),
        ("a", 1, False),
    ]
    assert [(v["key"], v["rank"], v["value"]) for v in doc["values"]] == [("n", 1, 7)]
    rc, out, err = await asyncio.to_thread(_run_cli, "inspect", str(path))
    assert rc == 0, err
    for key in ("a (rank 0)", "a (rank 1)", "n (rank 1)"):
        assert key in out
    report = await aiockpt.verify(path)
    assert report.ok
    assert report.num_tensors == 2


async def test_convert_takes_one_ranks_state_and_says_so(ckpt_path: Path, tmp_path: Path) -> None:
    # A conversion reads one rank's state: it took rank 0's without a word.
    path = await _checkpoint(ckpt_path)
    rc, _, err = await asyncio.to_thread(
        _run_cli, "convert", str(path), str(tmp_path / "r0.pt"), "--to", "torch"
    )
    assert rc == 0
    assert "holds per-rank state: converting rank 0's (--rank picks another rank's)" in err
    tree = torch.load(tmp_path / "r0.pt", weights_only=True)
    assert torch.equal(tree["a"], T0)
    assert "n" not in tree
    args = ("convert", str(path), str(tmp_path / "r1.pt"), "--to", "torch", "--rank", "1", "--json")
    rc, out, err = await asyncio.to_thread(_run_cli, *args)
    assert rc == 0
    assert json.loads(out)["rank"] == 1
    assert err == ""
    tree = torch.load(tmp_path / "r1.pt", weights_only=True)
    assert torch.equal(tree["a"], T1)
    assert tree["n"] == 7
