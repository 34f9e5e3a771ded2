"""``_body``: format 2's flat tree rebuilds every tree exactly and refuses records that form none."""

from __future__ import annotations

from pathlib import Path

import crc32c
import msgspec
import pytest
import torch

import aiockpt
from aiockpt._body import tree_blobs, tree_from_blobs, tree_records
from aiockpt._codec import SLICE
from aiockpt._format import (
    ENCODER,
    ENVELOPE_DECODER,
    MANIFEST_NAME,
    BytesNode,
    DictNode,
    ListNode,
    Node,
    OpenNode,
    PickleNode,
    TensorNode,
    TupleNode,
    ValueNode,
)


def _varied() -> DictNode:
    """Every node kind, int and str keys, empty containers of each kind, an origin, some nesting."""
    leaves: tuple[Node, ...] = (
        TensorNode(index=0),
        ValueNode(value=None),
        ValueNode(value=1.5),
        ValueNode(value="s"),
        ValueNode(value=True),
        BytesNode(value=b"\x00\x01"),
        PickleNode(data=b"p", type_name="m.C"),
    )
    inner = DictNode(
        keys=(0, 1, "x"), values=(TensorNode(index=1), ListNode(items=leaves), TupleNode(items=()))
    )
    return DictNode(
        keys=("model", "empty_dict", "empty_list", "t", "optim"),
        values=(
            DictNode(keys=("w",), values=(TensorNode(index=0),), origin="torch.nn.Linear"),
            DictNode(keys=(), values=()),
            ListNode(items=()),
            TupleNode(items=(inner, ListNode(items=(TupleNode(items=()),)))),
            DictNode(keys=("state",), values=(inner,), origin="torch.optim.AdamW"),
        ),
    )


def _flat(n: int) -> DictNode:
    return DictNode(
        keys=tuple(f"k{i}" for i in range(n)), values=tuple(TensorNode(index=i) for i in range(n))
    )


def _deep(depth: int) -> DictNode:
    node: Node = ValueNode(value=depth)
    for i in range(depth):
        node = ListNode(items=(node,)) if i % 2 else DictNode(keys=(i,), values=(node,))
    return DictNode(keys=("deep",), values=(node,))


# Record counts around the slice size: the root and n children.
@pytest.mark.parametrize(
    "tree",
    [_varied(), _flat(0), _flat(SLICE - 2), _flat(SLICE - 1), _flat(SLICE), _flat(3 * SLICE + 5), _deep(150)],
    ids=["varied", "empty", "slice-1", "slice", "slice+1", "slices", "deep"],
)
def test_the_tree_is_rebuilt_exactly(tree: DictNode) -> None:
    blobs = tree_blobs(tree)
    assert all(len(msgspec.msgpack.decode(b)) <= SLICE for b in blobs)
    assert sum(len(msgspec.msgpack.decode(b)) for b in blobs) == len(list(tree_records(tree)))
    assert tree_from_blobs(blobs) == tree


def test_records_are_the_preorder_walk() -> None:
    tree = DictNode(
        keys=("a", 7), values=(ListNode(items=(TensorNode(index=0), ValueNode(value=2))), ValueNode(value=3))
    )
    assert list(tree_records(tree)) == [
        (None, OpenNode(kind="dict", size=2)),
        ("a", OpenNode(kind="list", size=2)),
        (None, TensorNode(index=0)),
        (None, ValueNode(value=2)),
        (7, ValueNode(value=3)),
    ]


def _blobs(*records: tuple[object, object]) -> tuple[bytes, ...]:
    """``records`` encoded two per blob, so that errors are located across blobs too."""
    return tuple(ENCODER.encode(list(records[i : i + 2])) for i in range(0, len(records), 2))


ROOT1 = (None, OpenNode(kind="dict", size=1))


@pytest.mark.parametrize(
    ("records", "message"),
    [
        (
            (ROOT1, ("a", ValueNode(value=1)), ("b", ValueNode(value=2))),
            r"follows the complete tree.*record 2",
        ),
        ((ROOT1, (None, ValueNode(value=1))), r"dict entry has no key.*record 1"),
        (
            (ROOT1, ("l", OpenNode(kind="list", size=1)), ("k", ValueNode(value=1))),
            r"list has a key.*record 2",
        ),
        ((ROOT1, ("l", OpenNode(kind="tuple", size=2)), (None, ValueNode(value=1))), r"end before.*record 2"),
        (((None, OpenNode(kind="list", size=0)),), r"root is not a dict.*record 0"),
        ((("k", OpenNode(kind="dict", size=0)),), r"root is not a dict.*record 0"),
        (((None, ValueNode(value=1)),), r"root is not a dict.*record 0"),
        ((), r"end before"),
    ],
    ids=["trailing", "no-key", "key-in-list", "short", "list-root", "keyed-root", "leaf-root", "none"],
)
def test_records_that_form_no_tree_are_refused_by_index(
    records: tuple[tuple[object, object], ...], message: str
) -> None:
    with pytest.raises(msgspec.ValidationError, match=message):
        tree_from_blobs(_blobs(*records))


def test_a_bad_record_among_whole_slices_of_leaves_is_found() -> None:
    # Slices of a dict's leaf entries are taken whole; one without a key must still be named.
    n = 3 * SLICE
    records: list[tuple[object, object]] = [(None, OpenNode(kind="dict", size=n))]
    records += [(f"k{i}", TensorNode(index=i)) for i in range(n)]
    bad = 1 + SLICE + 10
    records[bad] = (None, TensorNode(index=0))
    blobs = tuple(ENCODER.encode(records[i : i + SLICE]) for i in range(0, len(records), SLICE))
    with pytest.raises(msgspec.ValidationError, match=rf"dict entry has no key.*record {bad}\)"):
        tree_from_blobs(blobs)
    records[bad] = ("k", OpenNode(kind="list", size=0))  # a container among them: taken one by one
    blobs = tuple(ENCODER.encode(records[i : i + SLICE]) for i in range(0, len(records), SLICE))
    tree = tree_from_blobs(blobs)
    assert tree.keys[bad - 1] == "k"
    assert tree.values[bad - 1] == ListNode(items=())
    assert tree.values[-1] == TensorNode(index=n - 1)


def test_a_negative_size_or_unknown_kind_is_refused() -> None:
    for record in ({"type": "open", "kind": "dict", "size": -1}, {"type": "open", "kind": "set", "size": 1}):
        with pytest.raises(msgspec.ValidationError):
            tree_from_blobs((ENCODER.encode([[None, record]]),))


async def test_a_damaged_tree_is_a_format_error_naming_the_record(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    await aiockpt.save({"a": torch.zeros(2), "b": 1}, path)
    file = path / MANIFEST_NAME
    env = ENVELOPE_DECODER.decode(file.read_bytes())
    # One record too many: the root says 2 entries, a third follows them.
    wire = msgspec.msgpack.decode(env.body)
    wire["tree"] = [*wire["tree"], ENCODER.encode([["c", ValueNode(value=2)]])]
    new = ENCODER.encode(wire)
    file.write_bytes(ENCODER.encode(msgspec.structs.replace(env, body=new, body_crc32c=crc32c.crc32c(new))))
    with pytest.raises(aiockpt.FormatError, match=r"cannot be decoded.*tree record 3") as info:
        await aiockpt.read(path)
    assert info.value.file == str(file)
