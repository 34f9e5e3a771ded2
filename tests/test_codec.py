"""``_codec``: sliced encoding is byte-identical to msgspec's, sliced decoding equal and as strict."""

from __future__ import annotations

import msgspec
import pytest

from aiockpt._codec import SLICE, SlicedDecoder, encode, encode_parts, slice_blobs
from aiockpt._format import ENCODER, Chunk, TensorEntry
from aiockpt._save._local_plan import LocalPlan, WriteItem
from aiockpt._save._write import WriteResult


def _result(n: int) -> WriteResult:
    return WriteResult(rank=1, checksums=tuple((i, i * 7 % 2**32) for i in range(n)), nbytes=n)


def _plan(n: int) -> LocalPlan:
    items = tuple(
        WriteItem(
            path=("m", f"t{i}"),
            dtype="float32",
            shape=(i, 2),
            offsets=(0, 0),
            sizes=(i, 2),
            nbytes=8 * i,
            replicated=i % 2 == 0,
        )
        for i in range(n)
    )
    return LocalPlan(rank=0, items=items)


# Around the slice size and msgpack's array-header sizes (fixarray < 16, array16 < 65536, array32).
SIZES = [0, 1, 15, 16, SLICE, SLICE + 1, 3 * SLICE + 17, 65535, 65536, 70_000]


@pytest.mark.parametrize("n", SIZES)
def test_sliced_encoding_is_byte_identical_and_decodes_back(n: int) -> None:
    result = _result(n)
    data = encode(result, "checksums")
    assert data == ENCODER.encode(result)
    assert SlicedDecoder(WriteResult, "checksums", tuple[int, ...]).decode(data) == result


def test_plans_and_entries_of_nested_structs_round_trip() -> None:
    plan = _plan(2 * SLICE + 3)
    data = encode(plan, "items")
    assert data == ENCODER.encode(plan)
    assert SlicedDecoder(LocalPlan, "items", WriteItem).decode(data) == plan


def test_a_bad_item_is_named_by_its_index() -> None:
    good = _result(3 * SLICE)
    checksums: list[object] = list(good.checksums)
    checksums[700] = ("not", "ints")
    data = ENCODER.encode(msgspec.structs.replace(good, checksums=tuple(checksums)))
    with pytest.raises(msgspec.ValidationError, match=r"in checksums\[700\]"):
        SlicedDecoder(WriteResult, "checksums", tuple[int, ...]).decode(data)


def test_other_fields_are_still_validated() -> None:
    data = ENCODER.encode({"rank": "zero", "checksums": [], "nbytes": 0})
    with pytest.raises(msgspec.ValidationError, match="rank"):
        SlicedDecoder(WriteResult, "checksums", tuple[int, ...]).decode(data)


def test_array_like_structs_keep_their_layout() -> None:
    chunk = Chunk(offsets=(0,), sizes=(3,), file="f", offset=0, nbytes=12, checksums=(1,))
    entry = TensorEntry(path=("w",), dtype="float32", shape=(3,), chunks=(chunk,) * (SLICE + 5))
    data = encode(entry, "chunks")
    assert data == ENCODER.encode(entry)
    assert SlicedDecoder(TensorEntry, "chunks", Chunk).decode(data) == entry


# --- Blobs: messages between ranks --------------------------------------------------------------------


@pytest.mark.parametrize("n", [0, 1, SLICE, SLICE + 1, 3 * SLICE + 17])
def test_blob_encoding_round_trips_and_stores_one_bin_per_slice(n: int) -> None:
    plan = _plan(n)
    data = encode(plan, "items", blobs=True)
    assert SlicedDecoder(LocalPlan, "items", WriteItem, blobs=True).decode(data) == plan
    # The field holds -(-n // SLICE) bin values, each a slice's items: nothing inline to walk.
    raw = msgspec.msgpack.decode(data)
    blobs = raw[1] if isinstance(raw, list) else raw["items"]
    assert [type(b) for b in blobs] == [bytes] * (-(-n // SLICE))
    assert sum(len(msgspec.msgpack.decode(b)) for b in blobs) == n


def test_a_bad_item_in_a_blob_is_named_by_its_index() -> None:
    good = _result(3 * SLICE)
    checksums: list[object] = list(good.checksums)
    checksums[700] = ("not", "ints")
    data = encode(msgspec.structs.replace(good, checksums=tuple(checksums)), "checksums", blobs=True)
    with pytest.raises(msgspec.ValidationError, match=r"in checksums\[700\]"):
        SlicedDecoder(WriteResult, "checksums", tuple[int, ...], blobs=True).decode(data)


def test_blob_and_inline_encodings_are_not_mixed_up() -> None:
    data = encode(_result(SLICE + 1), "checksums")
    with pytest.raises(msgspec.ValidationError):
        SlicedDecoder(WriteResult, "checksums", tuple[int, ...], blobs=True).decode(data)


# --- Pieces: a manifest written without joining its blobs ----------------------------------------------


@pytest.mark.parametrize("n", [0, 1, SLICE + 1, 60 * SLICE])
def test_pieces_join_to_the_one_shot_encoding(n: int) -> None:
    # 60 slices of plan items make blobs over 64 KiB (a bin32 header); small ones take bin8 and bin16.
    plan = _plan(n)
    blobs = {"items": slice_blobs(plan.items)}
    parts = encode_parts(plan, blobs)
    joined = b"".join(parts)
    assert joined == ENCODER.encode(msgspec.structs.replace(plan, items=blobs["items"]))
    assert joined == encode(plan, "items", blobs=True)
    assert SlicedDecoder(LocalPlan, "items", WriteItem, blobs=True).decode(joined) == plan
    # No blob was copied into a new buffer: each is a piece of its own.
    assert all(any(part is blob for part in parts) for blob in blobs["items"])


def test_pieces_of_two_fields_keep_the_struct_order() -> None:
    entry = TensorEntry(path=("w",), dtype="float32", shape=(3,), chunks=())
    blobs = {"chunks": (b"c1", b"c2"), "path": (b"p" * 300,)}  # given out of the struct's order
    joined = b"".join(encode_parts(entry, blobs))
    whole = msgspec.structs.replace(entry, path=blobs["path"], chunks=blobs["chunks"])
    assert joined == ENCODER.encode(whole)


def test_a_value_that_holds_a_placeholder_is_encoded_whole() -> None:
    # A field's own value contains the bytes that stand for the spliced field: no cut may use them.
    mark = b"\xb0\x00aiockpt\x00splice\x00"
    entry = TensorEntry(path=(mark[1:].decode(),), dtype="float32", shape=(3,), chunks=())
    blobs = {"chunks": (b"xyz",)}
    parts = encode_parts(entry, blobs)
    assert len(parts) == 1
    assert parts[0] == ENCODER.encode(msgspec.structs.replace(entry, chunks=blobs["chunks"]))
