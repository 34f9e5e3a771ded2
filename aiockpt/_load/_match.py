"""Load planning: match the checkpoint's tree against the target state. Pure apart from ``state_dict()``.

The walk builds a *result* tree shaped like the checkpoint, whose tensor leaves are destinations: the
target's own tensors where they fit (filled in place), fresh CPU tensors where the target has none. Every
difference (missing or unexpected key, shape, dtype or kind mismatch) is collected, so a strict load fails
with all of them at once before any byte is read.

Entries that a Stateful's ``state_dict()`` lacks are created from the checkpoint and handed to its
``load_state_dict`` (an optimizer that never stepped has no per-parameter state yet), except for
``nn.Module``, whose state dict is always complete, so extra entries there are differences.
"""

from __future__ import annotations

import pickle
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any, cast

import torch

from .._errors import StateError
from .._format import (
    BytesNode,
    DictNode,
    Key,
    KeyPath,
    ListNode,
    Manifest,
    Node,
    PickleNode,
    TensorEntry,
    TensorNode,
    TupleNode,
    ValueNode,
)
from .._gc import paused
from .._tree import dtype_from_name, is_stateful, render


class _Missing:
    def __repr__(self) -> str:
        return "MISSING"


MISSING = _Missing()


@dataclass
class Destination:
    """Where tensor ``index`` of the manifest goes: ``tensor`` (in place) and any further tied targets."""

    index: int
    tensor: torch.Tensor
    fresh: bool
    also: list[torch.Tensor] = field(default_factory=list)


@dataclass
class LoadPlan:
    """The outcome of matching.

    Attributes:
        result: The rebuilt tree (a dict), tensor leaves being destinations.
        destinations: One per manifest tensor that is loaded.
        statefuls: ``(object, state dict, key path)`` to call ``load_state_dict`` on, innermost first.
        assign: ``(container, key, value)`` to set in the target's own containers, innermost first.
        differences: Every mismatch found.
    """

    result: dict[Key, object]
    assign: list[tuple[Any, Key, object]] = field(default_factory=list)
    destinations: dict[int, Destination] = field(default_factory=dict)
    statefuls: list[tuple[object, dict[Key, object], KeyPath]] = field(default_factory=list)
    differences: list[str] = field(default_factory=list)


def _describe(obj: object) -> str:
    if isinstance(obj, torch.Tensor):
        return f"a tensor {str(obj.dtype).removeprefix('torch.')}{list(obj.shape)}"
    return f"a {type(obj).__name__}"


def _entry_desc(e: TensorEntry) -> str:
    return f"{e.dtype}{list(e.shape)}"


class _Matcher:
    def __init__(self, manifest: Manifest, allow_pickle: bool) -> None:
        self.m = manifest
        self.allow_pickle = allow_pickle
        self.plan = LoadPlan(result={})
        # Containers of the user's own state are updated in place (others may hold references to them);
        # a Stateful's state dict is rebuilt fresh and handed to its load_state_dict.
        self.inside_stateful = 0

    def diff(self, line: str) -> None:
        self.plan.differences.append(line)

    def build(self, node: Node, tmpl: object, path: KeyPath, *, create: bool) -> object:
        if tmpl is not MISSING and not isinstance(tmpl, torch.Tensor) and is_stateful(tmpl):
            return self.stateful(node, tmpl, path)
        if not isinstance(tmpl, (torch.Tensor, Mapping, list, tuple)):
            tmpl = MISSING  # a plain value in the target is simply replaced by the checkpoint's
        if isinstance(node, TensorNode):
            return self.tensor(node, tmpl, path)
        if isinstance(tmpl, torch.Tensor):
            self.diff(f"{render(path)}: the target holds {_describe(tmpl)}, the checkpoint a {_kind(node)}")
            return tmpl
        if isinstance(node, DictNode):
            if tmpl is MISSING or isinstance(tmpl, Mapping):
                return self.mapping(node, tmpl, path, create=create)
            self.diff(f"{render(path)}: the target holds {_describe(tmpl)}, the checkpoint a dict")
            return tmpl
        if isinstance(node, (ListNode, TupleNode)):
            return self.sequence(node, tmpl, path, create=create)
        if isinstance(node, ValueNode):
            return node.value
        if isinstance(node, BytesNode):
            return node.value
        return self.unpickle(node, path)

    def stateful(self, node: Node, obj: object, path: KeyPath) -> object:
        if not isinstance(node, DictNode):
            self.diff(f"{render(path)}: the target is a {type(obj).__name__}, the checkpoint a {_kind(node)}")
            return obj
        template = obj.state_dict()  # type: ignore[attr-defined]
        # A module's state dict lists every entry it has; other Statefuls may grow entries lazily.
        complete = isinstance(obj, torch.nn.Module)
        self.inside_stateful += 1
        try:
            sd = self.mapping(node, template, path, create=not complete)
        finally:
            self.inside_stateful -= 1
        if isinstance(obj, torch.nn.Module):
            # Tensors read in place already are the module's own memory: hand over only the rest.
            sd = {k: v for k, v in sd.items() if not (isinstance(v, torch.Tensor) and v is template.get(k))}
        self.plan.statefuls.append((obj, sd, path))
        return obj

    def mapping(
        self, node: DictNode, tmpl: Mapping[object, object] | _Missing, path: KeyPath, *, create: bool
    ) -> dict[Key, object]:
        out: dict[Key, object] = {}
        have = tmpl if isinstance(tmpl, Mapping) else {}
        for k, child in zip(node.keys, node.values, strict=True):
            sub = (*path, k)
            if k in have:
                out[k] = self.build(child, have[k], sub, create=create)
            elif tmpl is MISSING or create:
                out[k] = self.build(child, MISSING, sub, create=create)
            else:
                self.diff(f"{render(sub)}: unexpected key (in the checkpoint, not in the target)")
        if isinstance(tmpl, Mapping):
            present = set(node.keys)
            for name in tmpl:
                if name not in present:
                    missing = (*path, cast("Key", name))
                    self.diff(f"{render(missing)}: missing key (in the target, not in the checkpoint)")
        if isinstance(tmpl, MutableMapping) and not self.inside_stateful:
            self.plan.assign.extend((tmpl, k, v) for k, v in out.items())
            self.plan.result = out
            return cast("dict[Key, object]", tmpl)
        return out

    def sequence(self, node: ListNode | TupleNode, tmpl: object, path: KeyPath, *, create: bool) -> object:
        kind = list if isinstance(node, ListNode) else tuple
        if tmpl is MISSING:
            items = [self.build(c, MISSING, (*path, i), create=create) for i, c in enumerate(node.items)]
        elif isinstance(tmpl, (list, tuple)):
            if len(tmpl) != len(node.items):
                self.diff(
                    f"{render(path)}: the target has {len(tmpl)} items, the checkpoint {len(node.items)}"
                )
                return tmpl
            pairs = enumerate(zip(node.items, tmpl, strict=True))
            items = [self.build(c, t, (*path, i), create=create) for i, (c, t) in pairs]
            if type(tmpl) is list and kind is list and not self.inside_stateful:
                self.plan.assign.extend((tmpl, i, v) for i, v in enumerate(items))
                return tmpl
        else:
            self.diff(f"{render(path)}: the target holds {_describe(tmpl)}, the checkpoint a {kind.__name__}")
            return tmpl
        return items if kind is list else tuple(items)

    def tensor(self, node: TensorNode, tmpl: object, path: KeyPath) -> object:
        entry = self.m.tensors[node.index]
        dest = self.plan.destinations.get(node.index)
        if isinstance(tmpl, torch.Tensor):
            dtype = str(tmpl.dtype).removeprefix("torch.")
            if dtype != entry.dtype or tuple(tmpl.shape) != entry.shape:
                self.diff(
                    f"{render(path)}: the target is {_describe(tmpl)}, the checkpoint {_entry_desc(entry)}"
                )
                return tmpl
            if dest is None:
                self.plan.destinations[node.index] = Destination(node.index, tmpl, fresh=False)
            elif dest.tensor is not tmpl and all(t is not tmpl for t in dest.also):
                dest.also.append(tmpl)  # tied in the checkpoint, separate in the target
            return tmpl
        if tmpl is not MISSING:
            self.diff(f"{render(path)}: the target holds {_describe(tmpl)}, the checkpoint a tensor")
            return tmpl
        if dest is None:
            try:
                dtype_ = dtype_from_name(entry.dtype)
            except ValueError:
                self.diff(f"{render(path)}: dtype {entry.dtype} is unknown to this torch")
                return None
            dest = self.plan.destinations[node.index] = Destination(
                node.index, torch.empty(entry.shape, dtype=dtype_), fresh=True
            )
        return dest.tensor

    def unpickle(self, node: PickleNode, path: KeyPath) -> object:
        if not self.allow_pickle:
            raise StateError(
                f"key {render(path)!r} holds a pickled {node.type_name}; loading it can run code: "
                "pass allow_pickle=True if you trust this checkpoint",
                key=render(path),
            )
        try:
            return pickle.loads(node.data)
        except Exception as exc:
            raise StateError(f"cannot unpickle {node.type_name} at key {render(path)!r}: {exc}") from exc


def _kind(node: Node) -> str:
    if isinstance(node, ValueNode):
        return type(node.value).__name__
    names = {DictNode: "dict", ListNode: "list", TupleNode: "tuple", TensorNode: "tensor", BytesNode: "bytes"}
    return names.get(type(node), "pickled object")


def match(manifest: Manifest, state: MutableMapping[str, object] | None, *, allow_pickle: bool) -> LoadPlan:
    """Match ``manifest`` against ``state`` (``None``: build everything fresh, as :func:`aiockpt.read`).

    Raises:
        StateError: A pickled object is met without ``allow_pickle``.
    """
    m = _Matcher(manifest, allow_pickle)
    tmpl = MISSING if state is None else cast("Mapping[object, object]", state)
    with paused():
        result = m.mapping(manifest.tree, tmpl, (), create=False)
    if state is None:
        m.plan.result = result
    return m.plan
