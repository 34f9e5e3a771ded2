"""Encoding and decoding large msgspec structs a slice of items at a time, offering the GIL in between.

A plan, a write result or a manifest of 20,000 tensors is one msgspec call of 3-20 ms, a single C call
that holds the GIL all along: the event loop's thread, woken meanwhile, waits for all of it. Here the
items of one large tuple field are encoded (or decoded) :data:`SLICE` at a time with
:func:`~aiockpt._threads.yield_gil` between slices, and spliced into (or out of) the enclosing struct as
raw msgpack: the bytes are exactly those of a one-shot encode. Or, with ``blobs``, each slice is stored
as a msgpack ``bin`` of its own, which a decoder of the enclosing struct skips by its length: the
encoding of the messages between ranks and, from format version 2 on, of the manifest's tensor entries.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from itertools import islice
from typing import Any, Generic, TypeVar

import msgspec

from ._gc import collect_young
from ._threads import yield_gil

S = TypeVar("S", bound=msgspec.Struct)

# Items per slice: about 0.3 ms of msgspec work for the structs of a plan or manifest.
SLICE = 512

_ENCODER = msgspec.msgpack.Encoder()


def _array_header(n: int) -> bytes:
    """The msgpack header of an array of ``n`` items, in its shortest form (as msgspec writes it)."""
    if n < 16:
        return bytes((0x90 | n,))
    if n < 1 << 16:
        return b"\xdc" + n.to_bytes(2, "big")
    return b"\xdd" + n.to_bytes(4, "big")


def bin_header(n: int) -> bytes:
    """The msgpack header of a ``bin`` of ``n`` bytes, in its shortest form (as msgspec writes it)."""
    if n < 1 << 8:
        return b"\xc4" + n.to_bytes(1, "big")
    if n < 1 << 16:
        return b"\xc5" + n.to_bytes(2, "big")
    return b"\xc6" + n.to_bytes(4, "big")


def _array_items(encoded: bytes) -> memoryview:
    """The bytes of the items of ``encoded``, a msgpack array, without its header."""
    first = encoded[0]
    skip = 1 if 0x90 <= first <= 0x9F else 3 if first == 0xDC else 5
    return memoryview(encoded)[skip:]


def slice_blobs(items: Iterable[object]) -> tuple[bytes, ...]:
    """``items`` encoded :data:`SLICE` at a time, each slice a msgpack array, offering the GIL in between."""
    it = iter(items)
    out: list[bytes] = []
    while batch := list(islice(it, SLICE)):
        yield_gil()
        out.append(_ENCODER.encode(batch))
    return tuple(out)


def encode(obj: msgspec.Struct, field: str, *, blobs: bool = False) -> bytes:
    """``msgspec.msgpack.encode(obj)``, with the items of the tuple field ``field`` encoded in slices.

    With ``blobs`` the field is written as a list of msgpack ``bin`` values, each one slice's encoded
    items, for :class:`SlicedDecoder` ``(blobs=True)`` only: a decoder skips a ``bin`` by its length,
    where finding the end of 20,000 inline items means walking each (2-3 ms in one call).
    """
    items = getattr(obj, field)
    if blobs:
        slices = slice_blobs(items)
        yield_gil()
        return _ENCODER.encode(msgspec.structs.replace(obj, **{field: slices}))
    if len(items) <= SLICE:
        return _ENCODER.encode(obj)
    parts: list[bytes | memoryview] = [_array_header(len(items))]
    for start in range(0, len(items), SLICE):
        yield_gil()
        parts.append(_array_items(_ENCODER.encode(items[start : start + SLICE])))
    raw = msgspec.Raw(b"".join(parts))
    yield_gil()
    # replace() does not type-check, so the field may hold the already encoded items.
    return _ENCODER.encode(msgspec.structs.replace(obj, **{field: raw}))


def _splice_mark(i: int) -> bytes:
    """A msgpack str (16 bytes) that stands for the ``i``-th spliced field in an encoded outline."""
    return b"\xb0\x00aiockpt\x00splice" + bytes((i,))


def encode_parts(obj: msgspec.Struct, blobs: Mapping[str, Sequence[bytes]]) -> list[bytes]:
    """``obj`` encoded with each field named in ``blobs`` as its list of msgpack ``bin``, in pieces.

    Joined, the pieces are the bytes of ``msgspec.msgpack.encode(replace(obj, **blobs))``, but no blob is
    copied: joining the megabytes of a large manifest is one C call that holds the GIL for milliseconds
    (most of it first touches of new memory); a writer hands the pieces to ``writev`` instead. The
    fields are encoded as placeholder strings, and the outline is cut where they are.
    """
    marks = {name: _splice_mark(i) for i, name in enumerate(blobs)}
    yield_gil()
    outline = _ENCODER.encode(msgspec.structs.replace(obj, **{k: msgspec.Raw(m) for k, m in marks.items()}))
    if any(outline.count(mark) != 1 for mark in marks.values()):
        # A value of another field happens to hold a placeholder: encode whole instead.
        return [_ENCODER.encode(msgspec.structs.replace(obj, **{k: tuple(v) for k, v in blobs.items()}))]
    parts: list[bytes] = []
    rest = outline
    for name in sorted(blobs, key=lambda name: outline.index(marks[name])):
        head, _, rest = rest.partition(marks[name])
        parts += (head, _array_header(len(blobs[name])))
        for blob in blobs[name]:
            parts += (bin_header(len(blob)), blob)
    parts.append(rest)
    return parts


def _outline_of(
    type_: type[msgspec.Struct], raw: Mapping[str, Any], required: Collection[str] = ()
) -> type[msgspec.Struct]:
    """A struct with ``type_``'s fields and options, but the types in ``raw`` for some fields.

    Decoding into it leaves those fields as raw msgpack (``raw`` maps them to ``msgspec.Raw`` or
    ``tuple[msgspec.Raw, ...]``), to be decoded later, in slices. The fields named in ``required`` have
    no default in it: decoding refuses data without them.
    """
    fields: list[tuple[str, Any] | tuple[str, Any, Any]] = []
    for info in msgspec.structs.fields(type_):
        typ = raw.get(info.name, info.type)
        if info.name in required:
            fields.append((info.name, typ))
        elif info.default_factory is not msgspec.NODEFAULT:
            fields.append((info.name, typ, msgspec.field(default_factory=info.default_factory)))
        else:
            fields.append((info.name, typ, info.default))
    config = type_.__struct_config__
    return msgspec.defstruct(
        f"{type_.__name__}Outline",
        fields,
        kw_only=True,
        frozen=True,
        gc=False,
        array_like=config.array_like,
        forbid_unknown_fields=config.forbid_unknown_fields,
    )


class SlicedDecoder(Generic[S]):
    """Decodes msgpack into ``type_`` like ``msgspec.msgpack.Decoder``, the items of ``field`` in slices.

    ``item`` is the type of one item of the tuple field ``field``. ``converted`` maps other large fields
    to ``(wire type, convert)``: the outline decodes the field as the wire type (``msgspec.Raw`` leaves
    it undecoded), and ``convert``, called after offering the GIL, turns that into the field's value (a
    decoder's ``decode`` for a field decoded in a call of its own; a function for a field stored in
    another shape than it has in memory). Errors name a bad item as ``field[i]``, or as
    ``"{item_name} {i}"`` if given. ``blobs`` reads what :func:`encode` ``(blobs=True)`` writes. Fields
    named in ``required`` must be in the data, whatever default ``type_`` gives them.
    """

    def __init__(
        self,
        type_: type[S],
        field: str,
        item: Any,
        *,
        converted: Mapping[str, tuple[Any, Callable[[Any], Any]]] | None = None,
        item_name: str | None = None,
        blobs: bool = False,
        required: Collection[str] = (),
    ) -> None:
        self._type = type_
        self._field = field
        self._blobs = blobs
        self._converted = {name: convert for name, (_, convert) in (converted or {}).items()}
        raw: dict[str, Any] = {name: wire for name, (wire, _) in (converted or {}).items()}
        # Blobs are decoded as views into ``data``, not copied out of it (megabytes for a manifest).
        raw[field] = tuple[memoryview, ...] if blobs else tuple[msgspec.Raw, ...]
        self._outline = msgspec.msgpack.Decoder(_outline_of(type_, raw, required))
        self._items = msgspec.msgpack.Decoder(tuple[item, ...])
        self._raws = msgspec.msgpack.Decoder(tuple[msgspec.Raw, ...])
        self._item = msgspec.msgpack.Decoder(item)
        self._item_name = item_name

    def _where(self, i: int) -> str:
        return f"{self._item_name} {i}" if self._item_name else f"{self._field}[{i}]"

    def decode(self, data: bytes | memoryview) -> S:
        """Decode and validate ``data``.

        Raises:
            msgspec.ValidationError: ``data`` does not match the type; the message names the item. A
                ``converted`` field's function may raise it too.
            msgspec.DecodeError: ``data`` is not valid msgpack.
        """
        outline = self._outline.decode(data)
        values = {name: getattr(outline, name) for name in outline.__struct_fields__}
        for name, convert in self._converted.items():
            yield_gil()
            values[name] = convert(values[name])
        items: list[object] = []
        if self._blobs:
            blobs: tuple[memoryview, ...] = values[self._field]
            for n, blob in enumerate(blobs):
                yield_gil()
                try:
                    items.extend(self._items.decode(blob))
                except msgspec.DecodeError:
                    self._name_bad(self._raws.decode(blob), n * SLICE)
                    raise
        else:
            raws: tuple[msgspec.Raw, ...] = values[self._field]
            for start in range(0, len(raws), SLICE):
                yield_gil()
                chunk = raws[start : start + SLICE]
                try:
                    items.extend(self._items.decode(_array_header(len(chunk)) + b"".join(chunk)))
                except msgspec.DecodeError:
                    self._name_bad(chunk, start)
                    raise
        values[self._field] = tuple(items)
        if len(items) > SLICE:
            collect_young()  # that tuple, made whole
        return self._type(**values)

    def _name_bad(self, chunk: Sequence[msgspec.Raw], start: int) -> None:
        """Decode ``chunk`` (items ``start`` on) item by item; raise naming the first bad one, if any."""
        for i, raw in enumerate(chunk, start):
            try:
                self._item.decode(raw)
            except msgspec.ValidationError as exc:
                raise msgspec.ValidationError(f"{exc} (in {self._where(i)})") from exc
            except msgspec.DecodeError as exc:
                raise msgspec.DecodeError(f"{exc} (in {self._where(i)})") from exc
