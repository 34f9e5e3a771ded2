"""Walking a user's state: Stateful detection, key rendering and flattening into a :class:`~._format.Node`.

Runs in a worker thread (it calls user ``state_dict()`` methods and may touch many objects), never on the
event loop. Pure apart from those calls.
"""

from __future__ import annotations

import collections
import pickle
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, cast, runtime_checkable

import torch
from torch.nn.parameter import is_lazy

from ._errors import StateError
from ._format import (
    BytesNode,
    DictNode,
    Key,
    KeyPath,
    ListNode,
    Node,
    PickleNode,
    TensorNode,
    TupleNode,
    ValueNode,
)
from ._threads import OFFER_ITEMS, dismantle, yield_gil

# int64 range: msgpack's signed integers; unsigned values up to 2**64 - 1 are encodable too.
_INT_MIN, _INT_MAX = -(2**63), 2**64 - 1
# The deepest nesting of containers saved. The flattener recurses three frames a level and a load about
# two, and user ``state_dict()`` calls need frames too: deeper states would end in a RecursionError, at
# save or at load, under Python's default recursion limit (1000).
MAX_DEPTH = 100


@runtime_checkable
class Stateful(Protocol):
    """Anything with ``state_dict()`` and ``load_state_dict()``: modules, optimizers, LR schedulers."""

    def state_dict(self) -> Mapping[str, object]:
        """Return the object's state as a mapping."""
        ...

    # (A dict, as aiockpt hands over: torch's optimizers and schedulers take ``dict[str, Any]``, which a
    # parameter typed ``Mapping`` here would not match, a parameter type being contravariant.)
    def load_state_dict(self, state_dict: dict[str, Any], /) -> object:
        """Restore the object's state from a dict."""
        ...


def is_stateful(obj: object) -> bool:
    """Whether ``obj`` is saved through its ``state_dict()`` (tensors never are, nor classes).

    A class such as ``torch.optim.AdamW`` has both methods, unbound: it passes the runtime protocol check.
    """
    if type(obj) in _PLAIN:  # (the protocol check takes ~40 us: a list of 10^5 ints took seconds)
        return False
    return not isinstance(obj, (torch.Tensor, type)) and isinstance(obj, Stateful)


_PLAIN = frozenset({int, float, bool, str, bytes, complex, type(None)})
_BUILTIN_CONTAINERS = frozenset({dict, list, tuple, collections.OrderedDict, collections.defaultdict})


def spelled_int(key: object) -> int | None:
    """``int(key)`` for a key that ``str`` of an int made (``"7"``; not ``"07"``, ``"+7"``, non-ASCII).

    What DCP makes of an int key (it stores every mapping key as ``str(key)``): an optimizer's state ids.
    """
    if isinstance(key, str) and key.isascii() and key.isdigit() and str(int(key)) == key:
        return int(key)
    return None


def nested(obj: object) -> Iterator[object]:
    """``obj`` and every value inside it, through mappings, lists and tuples, each before what it holds.

    A mapping yielded may have the values of its keys replaced before the walk goes on into it: the walk
    then goes into the new values.
    """
    yield obj
    if isinstance(obj, Mapping):
        for v in obj.values():
            yield from nested(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from nested(v)


def render(path: KeyPath) -> str:
    """Render a key path for messages: ``("optim", "state", 0, "exp_avg")`` -> ``optim/state/0/exp_avg``.

    A str key that would read as something else is quoted as Python writes it (``x/'0'`` is the str key
    ``"0"``, ``x/0`` the int key; ``'a/b'`` one key, ``a/b`` two; an empty key, one with a control
    character or surrounding spaces); every other key is written as it is.
    """
    return "/".join(map(_key_text, path)) if path else "<root>"


def _key_text(key: Key) -> str:
    if type(key) is not str:
        return str(key)
    if (
        key
        and key.isprintable()
        and key.strip() == key
        and "/" not in key
        and not (key.isascii() and key.lstrip("-").isdigit())
        and key != "<root>"
        and key[0] not in "'\""
    ):
        return key
    return repr(key)


def a_or_an(noun: str) -> str:
    """``noun`` after its indefinite article, for messages: ``an int``, ``a dict``.

    Chosen by its first letter, but for a ``u`` said as "you" (``a uint8``, ``a UserDict``). For error
    messages only: no path that succeeds calls it.
    """
    head = noun[:1].lower()
    vowel = head in "aeiou" and not noun.lower().startswith(("uint", "uni", "use", "usa", "usu", "uti"))
    return f"an {noun}" if head and vowel else f"a {noun}"


def type_name(obj: object) -> str:
    """Return ``module.QualName`` of ``obj``'s type."""
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


# Dtypes whose elements are not whole bytes, and quantized dtypes, have no raw byte layout we can commit to.
UNSUPPORTED_DTYPES = frozenset(
    getattr(torch, name)
    for name in (
        *(f"uint{i}" for i in range(1, 8)),
        *(f"int{i}" for i in range(1, 8)),
        "quint8",
        "qint8",
        "qint32",
        "quint4x2",
        "quint2x4",
        "bits1x8",
        "bits2x4",
        "bits4x2",
        "bits8",
        "bits16",
    )
    if hasattr(torch, name)
)


_DTYPE_NAMES: dict[torch.dtype, str] = {}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).removeprefix("torch.")
    return name


def dtype_from_name(name: str) -> torch.dtype:
    """Inverse of :func:`dtype_name`: only a dtype's own name, never an alias (``"float"``, ``"half"``).

    An alias would read (``torch.float`` is ``torch.float32``) but compare unequal to the name a target's
    dtype has, so a checkpoint that says one reads and does not load. Looked up among torch's attributes
    (``vars``), never with ``getattr``, which imports a submodule a manifest names (``"onnx"``).

    Raises:
        ValueError: ``name`` is not the name of a torch dtype.
    """
    if not _DTYPES_BY_NAME:
        _DTYPES_BY_NAME.update({dtype_name(d): d for d in vars(torch).values() if isinstance(d, torch.dtype)})
    dtype = _DTYPES_BY_NAME.get(name)
    if dtype is None:
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


_DTYPES_BY_NAME: dict[str, torch.dtype] = {}


def check_tensor(tensor: torch.Tensor, path: KeyPath) -> None:
    """Refuse tensors that have no plain strided byte layout, or no data yet.

    Raises:
        StateError: Sparse, quantized, nested, meta or sub-byte tensors, or uninitialized (lazy)
            parameters and buffers, naming the key.
    """
    if (
        tensor.layout is torch.strided
        and tensor.dtype not in UNSUPPORTED_DTYPES
        and not tensor.is_meta
        and not tensor.is_nested
        # A lazy parameter looks like an empty strided tensor until its data is used. Plain tensors, most
        # of a state (``state_dict()`` detaches parameters), never are one: no call for them.
        and (type(tensor) is torch.Tensor or not is_lazy(tensor))
    ):
        return
    problem = None
    if is_lazy(tensor):
        problem = (
            f"it is an uninitialized lazy parameter ({type(tensor).__name__}); materialize it by running a "
            "forward pass through its module before saving"
        )
    elif tensor.layout != torch.strided:
        problem = f"layout {tensor.layout} (convert with .to_dense())"
    elif tensor.is_quantized or tensor.dtype in UNSUPPORTED_DTYPES:
        problem = f"dtype {tensor.dtype} has no byte layout aiockpt supports"
    elif tensor.is_nested:
        problem = "nested tensors are not supported"
    elif tensor.device.type == "meta":
        problem = "a meta tensor has no data"
    if problem is not None:
        raise StateError(f"cannot save tensor at key {render(path)!r}: {problem}", key=render(path))


@dataclass(frozen=True)
class Box:
    """Where a local tensor sits in its global tensor (a DTensor shard).

    Attributes:
        shape: The global shape.
        offsets: The local shard's offset in each dimension.
        replicated: Whether other ranks may hold this very box too, with the same values (written once);
            if not, the box is this rank's alone. Always true of a DTensor's box: some placement may be
            ``Replicate``, or its mesh one of several alike in the checkpoint's group.
    """

    shape: tuple[int, ...]
    offsets: tuple[int, ...]
    replicated: bool


@dataclass
class Flattened:
    """A state split into its structure and its tensors.

    Attributes:
        tree: The structure, with tensors replaced by indices into ``tensors``.
        tensors: Unique local tensors in first-seen order (tied tensors appear once; a DTensor appears as
            its local shard).
        paths: The key path of the first occurrence of each tensor.
        boxes: For each tensor, where it sits in its global tensor (``None``: it is the whole tensor).
    """

    tree: DictNode
    tensors: list[torch.Tensor] = field(default_factory=list)
    paths: list[KeyPath] = field(default_factory=list)
    boxes: list[Box | None] = field(default_factory=list)


def dtensor_type() -> type[torch.Tensor] | None:
    """``DTensor``, if ``torch.distributed.tensor`` was imported (if not, no tensor can be one)."""
    mod = sys.modules.get("torch.distributed.tensor")
    return getattr(mod, "DTensor", None) if mod is not None else None


def shard_of(t: torch.Tensor, path: KeyPath) -> tuple[torch.Tensor, Box]:
    """The local tensor of a DTensor and its box in the global tensor.

    Raises:
        StateError: The DTensor has a ``Partial`` placement (a pending reduction), naming the key.
    """
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    placements = t.placements  # type: ignore[attr-defined]
    if any(p.is_partial() for p in placements):
        raise StateError(
            f"cannot save DTensor at key {render(path)!r}: its placements {placements} include a pending "
            "reduction (Partial); redistribute it to Shard or Replicate first",
            key=render(path),
        )
    local = t.to_local()  # type: ignore[attr-defined]
    shape, offsets = compute_local_shape_and_global_offset(t.shape, t.device_mesh, placements)  # type: ignore[attr-defined]
    if tuple(shape) != tuple(local.shape):
        # (DTensor.from_local(..., run_check=False) with shards of its own sizes:) the box would pair
        # torch's offsets with other sizes, overlapping a neighbour's or leaving elements unwritten.
        raise StateError(
            f"cannot save DTensor at key {render(path)!r}: its local shard is {list(local.shape)}, where "
            f"its placements {placements} over its mesh give {list(shape)}; redistribute it (or build it "
            "with shards of the sizes torch gives them)",
            key=render(path),
        )
    # Replicated, in that other ranks may hold this very box, and then with the same values: a Replicate
    # placement, or a mesh that is a sub-mesh of the checkpoint's group (a tensor-parallel mesh inside each
    # data-parallel replica). Such a box is written once.
    return local, Box(shape=tuple(t.shape), offsets=tuple(offsets), replicated=True)


def _tie_key(t: torch.Tensor, box: Box | None) -> tuple[object, ...]:
    # Same memory, dtype, shape and strides, and the same place in the same global tensor: the very same
    # bytes (a plain tensor that is a DTensor's local shard is not that DTensor). Whether they are the same
    # values too is told by ``_same_values`` on a match only: two calls fewer per tensor of 10^4.
    if t.is_cpu:
        return (t.data_ptr(), t.dtype, t.shape, t.stride(), box)
    return (t.device, t.data_ptr(), t.dtype, t.shape, t.stride(), box)


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` of one tie key read alike (``z.conj()`` has ``z``'s bytes, not its values)."""
    return a.is_conj() == b.is_conj() and a.is_neg() == b.is_neg()


def _utf8(s: str) -> bool:
    """Whether ``s`` can be encoded as UTF-8 (it has no lone surrogate), as every str of a manifest is."""
    try:
        s.encode()
    except UnicodeEncodeError:
        return False
    return True


def int_text(value: int) -> str:
    """``value`` in decimal, or its size when that would be long (or beyond ``str``'s digit limit)."""
    if value.bit_length() <= 256:
        return str(value)
    return f"{'-' if value < 0 else ''}<{value.bit_length()} bits>"


class _Flattener:
    def __init__(self, allow_pickle: bool) -> None:
        self.allow_pickle = allow_pickle
        self.tensors: list[torch.Tensor] = []
        self.paths: list[KeyPath] = []
        self.boxes: list[Box | None] = []
        self.dtensor = dtensor_type()
        self.seen: dict[tuple[object, ...], int] = {}
        self.active: set[int] = set()  # ids of containers on the current path, to refuse cycles

    def node(self, obj: object, path: KeyPath) -> Node:
        if isinstance(obj, torch.Tensor):
            return self.tensor(obj, path)
        if type(obj) is str and not obj.isascii() and not _utf8(obj):  # (ASCII: no call per str)
            raise StateError(
                f"cannot save the str at key {render(path)!r}: it is not valid Unicode (a lone surrogate) "
                "and cannot be encoded as UTF-8",
                key=render(path),
            )
        if obj is None or type(obj) in (bool, str, float):
            return ValueNode(value=cast("bool | str | float | None", obj))
        if type(obj) is int and _INT_MIN <= obj <= _INT_MAX:
            return ValueNode(value=obj)
        if type(obj) is bytes:
            return BytesNode(value=obj)
        if isinstance(obj, (Mapping, list, tuple)) or is_stateful(obj):
            if id(obj) in self.active:
                raise StateError(f"the state contains a cycle at key {render(path)!r}", key=render(path))
            if len(path) >= MAX_DEPTH:
                raise StateError(
                    f"the state nests containers more than {MAX_DEPTH} levels deep, at key {render(path)!r}",
                    key=render(path),
                )
            self.active.add(id(obj))
            try:
                return self.container(obj, path)
            finally:
                self.active.discard(id(obj))
        return self.fallback(obj, path)

    def container(self, obj: object, path: KeyPath) -> Node:
        # A Stateful is saved through its state_dict() even where it is a mapping or a sequence too
        # (a load hands such an object its state, as DCP saves it); the builtin containers are none.
        if type(obj) not in _BUILTIN_CONTAINERS and is_stateful(obj):
            return self.stateful(obj, path)
        if isinstance(obj, Mapping):
            return self.mapping(obj, path, origin=None)
        if type(obj) is list:
            return ListNode(items=tuple(self.node(v, (*path, i)) for i, v in enumerate(obj)))
        if type(obj) is tuple:
            return TupleNode(items=tuple(self.node(v, (*path, i)) for i, v in enumerate(obj)))
        assert isinstance(obj, (list, tuple))  # subclasses (namedtuple, torch.Size) would lose their type
        return self.fallback(obj, path)

    def stateful(self, obj: object, path: KeyPath) -> DictNode:
        try:
            sd = obj.state_dict()  # type: ignore[attr-defined]
        except Exception as exc:  # (not BaseException: KeyboardInterrupt, SystemExit, cancellation pass)
            raise StateError(
                f"state_dict() of {type_name(obj)} at key {render(path)!r} failed: {exc}", key=render(path)
            ) from exc
        if not isinstance(sd, Mapping):
            raise StateError(
                f"state_dict() of {type_name(obj)} at key {render(path)!r} returned "
                f"{type(sd).__name__}, not a mapping",
                key=render(path),
            )
        return self.mapping(sd, path, origin=type_name(obj))

    def mapping(self, obj: Mapping[object, object], path: KeyPath, origin: str | None) -> DictNode:
        keys: list[Key] = []
        values: list[Node] = []
        for k, v in obj.items():
            if not (type(k) is str or (type(k) is int and path)):
                allowed = "str" if not path else "str or int"
                kind = a_or_an(type(k).__name__)
                raise StateError(
                    f"key {k!r} under {render(path)!r} is {kind}; keys here must be {allowed}",
                    key=render((*path, cast("Key", k))),  # (written as str() writes it)
                )
            if type(k) is int and not _INT_MIN <= k <= _INT_MAX:
                raise StateError(
                    f"key {k!r} under {render(path)!r} is outside the int keys a checkpoint can store "
                    "([-2**63, 2**64 - 1])",
                    key=render((*path, k)),
                )
            if type(k) is str and not k.isascii() and not _utf8(k):  # (ASCII: no call per key)
                raise StateError(
                    f"key {k!r} under {render(path)!r} is not valid Unicode (a lone surrogate) and cannot be "
                    "encoded as UTF-8",
                    key=render((*path, k)),
                )
            keys.append(k)
            values.append(self.node(v, (*path, k)))
            if not len(keys) % OFFER_ITEMS:
                yield_gil()
        return DictNode(keys=tuple(keys), values=tuple(values), origin=origin)

    def tensor(self, t: torch.Tensor, path: KeyPath) -> TensorNode:
        box = None
        dtensor = self.dtensor
        if dtensor is not None and isinstance(t, dtensor):
            t, box = shard_of(t, path)
        check_tensor(t, path)
        tie = _tie_key(t, box) if t.numel() > 0 else None
        seen = None if tie is None else self.seen.get(tie)
        if tie is not None and seen is not None and not _same_values(self.tensors[seen], t):
            # These bytes were first seen read otherwise (through a lazy conj or neg bit, or without):
            # this reading is tied to its own first occurrence, under a longer key.
            tie = (*tie, t.is_conj(), t.is_neg())
            seen = self.seen.get(tie)
        if seen is not None:
            return TensorNode(index=seen)
        index = len(self.tensors)
        self.tensors.append(t)
        self.paths.append(path)
        self.boxes.append(box)
        if tie is not None:  # (the first view of these bytes is the one tied to)
            self.seen[tie] = index
        return TensorNode(index=index)

    def fallback(self, obj: object, path: KeyPath) -> PickleNode:
        if not self.allow_pickle:
            if type(obj) is int:  # (an int in range is a ValueNode: only one outside it gets here)
                raise StateError(
                    f"cannot save the int {int_text(obj)} at key {render(path)!r}: it is outside the ints "
                    "a checkpoint stores as plain values ([-2**63, 2**64 - 1]); pass allow_pickle=True to "
                    "store it pickled (loading pickles can run code)",
                    key=render(path),
                )
            raise StateError(
                f"cannot save {type_name(obj)} at key {render(path)!r} without pickle; "
                "pass allow_pickle=True to store arbitrary objects (loading them can run code)",
                key=render(path),
            )
        try:
            data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:
            raise StateError(
                f"cannot pickle {type_name(obj)} at key {render(path)!r}: {exc}", key=render(path)
            ) from exc
        return PickleNode(data=data, type_name=type_name(obj))


def flatten(state: Mapping[str, object], *, allow_pickle: bool) -> Flattened:
    """Split ``state`` into its structure and its unique tensors, calling ``state_dict()`` on Statefuls.

    Args:
        state: A mapping with str keys at the top.
        allow_pickle: Store objects of other types by pickling them instead of refusing them.

    Returns:
        The structure and the tensors.

    Raises:
        StateError: ``state`` is not a mapping, a key has an unsupported type or value (an int key outside
            int64/uint64, a str that is not valid Unicode), an object cannot be stored (without
            ``allow_pickle``: an object of another type, or an int value outside int64/uint64), or the state
            contains a cycle or nests containers more than :data:`MAX_DEPTH` levels deep, a tensor cannot
            be saved (see :func:`check_tensor`), or a Stateful's ``state_dict()`` raised (the cause
            chained); the message names the key path.
    """
    if not isinstance(state, Mapping):
        raise StateError(f"the state must be a mapping with str keys, not {type_name(state)}")
    f = _Flattener(allow_pickle)
    f.active.add(id(state))  # (a cycle through the top: at the key that reaches it again)
    tree = f.mapping(cast("Mapping[object, object]", state), (), origin=None)
    flat = Flattened(tree=tree, tensors=f.tensors, paths=f.paths, boxes=f.boxes)
    box: list[object] = [f]  # its index of tied storages, one entry per tensor, freed in slices
    del f
    dismantle(box)
    return flat
