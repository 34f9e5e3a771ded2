"""Per-rank state: where the ranks of a distributed save hold different trees, each rank's is kept.

SPMD ranks mostly save the same structure with the same plain values, and the manifest holds one tree.
But some state differs per rank: each rank's ``torch.get_rng_state()``, a dataloader's position, keys that
name the rank (``dp_rank_3``) and only that rank holds. Written as rank 0's alone, the others' would be
lost without a word. So every rank sends, with its local plan, a digest of its tree and of its tensors'
signatures (:func:`digest`); where all digests are alike (the common case) nothing more happens. Where
they differ, the ranks exchange their trees and signatures (:class:`RankTree`) and every rank merges them
the same way (:func:`~aiockpt._merge.merge`): where the ranks' trees differ, the manifest's tree holds a
:class:`~aiockpt._format.RanksNode` with each rank's own subtree, whose tensors that rank writes as its own
(never deduplicated with another rank's), and a load of rank ``r`` finds its own subtree there.

What counts as differing: the structure (keys, container kinds, a Stateful's class), plain values
(``1``, ``1.0`` and ``True`` differ, as ``0.0`` and ``-0.0`` do; a NaN is itself), and for a plain
tensor its dtype, shape and, up to :data:`COMPARED` bytes, its contents (a 64-bit check of its staged
bytes, :func:`content_hash`). Larger plain tensors are assumed identical where dtype and shape agree
(comparing them would checksum every replicated weight on every rank): a large tensor that differs per
rank belongs in a DTensor, or under a key that names the rank. A DTensor shard is never per-rank state:
one under state that differs between ranks is refused.
"""

from __future__ import annotations

import hashlib
import zlib
from collections.abc import Sequence

import crc32c
import msgspec

from .._body import tree_blobs, tree_from_blobs
from .._codec import slice_blobs
from .._format import ENCODER, DictNode
from .._merge import Signature
from .._threads import yield_gil
from .._tree import Box
from ._local_plan import WriteItem

# Plain tensors up to this many bytes are compared by contents between ranks (an RNG state: 5 KiB).
COMPARED = 64 << 10


class RankTree(msgspec.Struct, frozen=True, gc=False, array_like=True):
    """One rank's message in the ``trees`` exchange.

    Its tree (format 2's records) and the signature of each of its tensors (by index), each in slices
    of encoded msgpack (``_codec.slice_blobs``): no call encodes or decodes more than one slice.
    """

    tree: tuple[bytes, ...]
    signatures: tuple[bytes, ...]


_RANK_TREE = msgspec.msgpack.Decoder(RankTree)
_SIGNATURES = msgspec.msgpack.Decoder(tuple[Signature, ...])


def content_hash(data: memoryview) -> int:
    """A 64-bit check of ``data``: its CRC32C and its CRC-32 (zlib's), two different polynomials.

    32 bits would take two ranks' different RNG states for one once in 4 billion comparisons, and a
    rank's state would be lost without a word: with 1,000 ranks saving every minute, one chance in
    eight a year.
    Two CRCs of different polynomials miss only a difference that both divide (the chance of a random
    one: 2^-64), at hardware speed and zlib's: 20,000 tensors of 4 KiB took 10.7 ms and 16.1 ms here,
    where BLAKE2b took 64.5 ms.
    """
    return (zlib.crc32(data) << 32) | crc32c.crc32c(data)


def signatures(
    items: Sequence[WriteItem], boxes: Sequence[Box | None], sources: Sequence[memoryview]
) -> list[Signature]:
    """The signature of each tensor of a flattened state, from its local plan item and staged bytes.

    One pass with no torch call per tensor (see :func:`content_hash` for its cost).
    """
    out: list[Signature] = []
    for item, box, src in zip(items, boxes, sources, strict=True):
        if box is not None:
            out.append(Signature(True, item.dtype, item.shape, -1))
        else:
            check = content_hash(src) if len(src) <= COMPARED else -1
            out.append(Signature(False, item.dtype, item.shape, check))
    return out


def digest(tree: DictNode, sigs: Sequence[Signature]) -> tuple[int, RankTree]:
    """A 64-bit digest of ``tree`` and ``sigs``; and this rank's message for ``trees`` if it comes.

    BLAKE2b, not a CRC: two ranks whose states differ must not agree by chance (a 32-bit check would,
    once in 4 billion saves, and lose a rank's state without a word). Encoded a slice at a time,
    offering the GIL in between (see ``_codec``). Never 0, which stands for "no digest" (a world of one).
    """
    message = RankTree(tree=tree_blobs(tree), signatures=slice_blobs(sigs))
    h = hashlib.blake2b(digest_size=8)
    for blob in (*message.tree, *message.signatures):
        h.update(blob)
    return int.from_bytes(h.digest(), "little") or 1, message


def encode_rank_tree(message: RankTree) -> bytes:
    """This rank's :class:`RankTree` message, encoded."""
    return ENCODER.encode(message)


def decode_rank_tree(payload: bytes | memoryview) -> tuple[DictNode, tuple[Signature, ...]]:
    """A rank's tree and signatures from its :func:`encode_rank_tree` message.

    Raises:
        msgspec.ValidationError, msgspec.DecodeError: The message is not a RankTree.
    """
    rt = _RANK_TREE.decode(payload)
    sigs: list[Signature] = []
    for blob in rt.signatures:
        yield_gil()
        sigs += _SIGNATURES.decode(blob)
    return tree_from_blobs(rt.tree), tuple(sigs)
