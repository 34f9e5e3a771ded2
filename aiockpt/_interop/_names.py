"""Trees for sources that address values by flat names (DCP FQNs, safetensors tensor names).

DCP and safetensors store each value under one string: its key path joined with ``"."``. DCP's flattening
decides what a leaf is: mapping keys become ``str(key)``; a list is walked by index when it holds a tensor
or a mapping somewhere, else it is one value, and so is a tuple. Hugging Face names follow the same rule
(``model.layers.0.weight``).

To load such a source, aiockpt's matcher (``_load/_match.py``) is handed a tree shaped like the *target*:
every target leaf whose joined name the source has becomes that source entry, target leaves the source
lacks are left out (the matcher reports them missing), and source names no target leaf claims are placed
under the deepest target container they extend (reported unexpected, or created inside a Stateful whose
state grows lazily, as an optimizer's does). Strictness, DTensor chunk intersection, Statefuls and
in-place filling then work exactly as for native checkpoints. Pure apart from ``state_dict()`` calls.
"""

from __future__ import annotations

import pickle
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Union

import torch

from .._errors import StateError
from .._format import DictNode, Key, KeyPath, ListNode, Node, PickleNode
from .._tree import MAX_DEPTH, flatten, is_stateful, nested, render, spelled_int, type_name

# A tree under construction: nodes, dicts and lists of them.
_Draft = Union[Node, dict[Key, "_Draft"], list["_Draft"]]  # noqa: UP007 (a recursive alias needs Union)


class _Items(dict[Key, _Draft]):
    """A list under construction, by index: DCP's key path of an entry says it is a list's item."""


def join(path: KeyPath) -> str:
    """The flat name of ``path`` as DCP and Hugging Face spell it: ``("a", "b", 0)`` -> ``a.b.0``."""
    return ".".join(str(k) for k in path)


def is_leaf(value: object) -> bool:
    """Whether DCP stores ``value`` under one name (the rule of DCP's ``traverse_state_dict``).

    A list is one value unless it, or a list nested in it at any depth, holds a tensor, a mapping or a
    Stateful. The nested lists are walked without recursion, each once: a list may hold itself.
    """
    if isinstance(value, Mapping) or is_stateful(value):
        return False
    if not isinstance(value, list):
        return True
    todo, seen = [value], {id(value)}
    while todo:
        for v in todo.pop():
            if isinstance(v, (torch.Tensor, Mapping)) or is_stateful(v):
                return False
            if isinstance(v, list) and id(v) not in seen:
                seen.add(id(v))
                todo.append(v)
    return True


def value_node(value: object, name: str) -> Node:
    """The node of a plain value read from a foreign source (a tensor inside a value is kept pickled).

    Raises:
        StateError: ``value`` cannot be stored (it cannot even be pickled), naming ``name``.
    """
    try:
        flat = flatten({"v": value}, allow_pickle=True)
    except StateError as exc:
        raise StateError(f"cannot represent the value of {name!r}: {exc}", key=name) from exc
    if not flat.tensors:
        return flat.tree.values[0]
    return PickleNode(data=pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL), type_name=type_name(value))


def _freeze(draft: _Draft) -> Node:
    if isinstance(draft, _Items) and set(draft) == set(range(len(draft))):  # (else: an index is missing)
        return ListNode(items=tuple(_freeze(draft[i]) for i in range(len(draft))))
    if isinstance(draft, dict):
        return DictNode(keys=tuple(draft), values=tuple(_freeze(v) for v in draft.values()))
    if isinstance(draft, list):
        return ListNode(items=tuple(_freeze(v) for v in draft))
    return draft


def _freeze_nested(draft: dict[Key, _Draft]) -> DictNode:
    """Freeze a tree built from paths: int-keyed dicts holding ``0..n-1`` in order become lists."""

    def one(d: _Draft) -> Node:
        if not isinstance(d, dict):
            return _freeze(d)
        keys = list(d)
        if keys and keys == list(range(len(keys))):
            return ListNode(items=tuple(one(v) for v in d.values()))
        return DictNode(keys=tuple(keys), values=tuple(one(v) for v in d.values()))

    return DictNode(keys=tuple(draft), values=tuple(one(v) for v in draft.values()))


def tree_of(entries: Mapping[str, Node], paths: Mapping[str, KeyPath] | None) -> DictNode:
    """The tree of a source read on its own (:func:`aiockpt.read`).

    With ``paths`` (DCP's record of each name's original key path) the nested structure is rebuilt, list
    indices included; without it the result is flat, one key per name (as ``safetensors.torch.load_file``).
    """
    root: dict[Key, _Draft] = {}
    for name, node in entries.items():
        path = paths.get(name) if paths is not None else None
        if not path or not all(isinstance(k, (str, int)) for k in path) or not isinstance(path[0], str):
            path = (name,)
        cur = root
        for k in path[:-1]:
            nxt = cur.setdefault(k, {})
            if not isinstance(nxt, dict):  # a name that is both a value and a prefix: keep it flat
                cur = root
                path = (name,)
                break
            cur = nxt
        if path[-1] in cur:
            cur = root
            path = (name,)
        cur[path[-1]] = node
    return _freeze_nested(root)


def _param_ids(groups: object) -> set[int] | None:
    """The parameter ids an optimizer state dict's ``param_groups`` list, or ``None`` if it is none."""
    if not isinstance(groups, (list, tuple)) or not groups:
        return None
    ids: set[int] = set()
    for group in groups:
        params = group.get("params") if isinstance(group, Mapping) else None
        if not isinstance(params, (list, tuple)):
            return None
        for pid in params:
            if type(pid) is not int or pid in ids:
                return None
            ids.add(pid)
    return ids


def restore_optimizer_ids(tree: dict[Key, object]) -> int:
    """Give the per-parameter state of every optimizer state dict in ``tree`` its int keys back, in place.

    DCP stores every mapping key as ``str(key)`` and records no more of it, so a DCP checkpoint read on
    its own (:func:`aiockpt.read`) has ``{"state": {"0": ...}, "param_groups": [{"params": [0, ...]}]}``
    where the optimizer saved ``{"state": {0: ...}, ...}``: handed to ``Optimizer.load_state_dict``,
    such state is kept under the str keys, of no parameter, and the optimizer starts afresh. The ints
    are restored only where that is what the optimizer saved beyond doubt: a mapping with ``"state"``
    and ``"param_groups"``, whose groups' ``params`` are distinct ints, and every key of whose
    ``"state"`` is the decimal string of one of them. Anything else is left as it is (an optimizer state
    dict keyed by parameter name, as ``get_state_dict`` makes, has no such keys).

    Returns:
        How many optimizer state dicts were changed.
    """
    changed = 0
    for obj in nested(tree):
        if isinstance(obj, dict):
            state, ids = obj.get("state"), _param_ids(obj.get("param_groups"))
            if isinstance(state, dict) and state and ids is not None:
                ints = [i for i in map(spelled_int, state) if i is not None and i in ids]
                if len(ints) == len(state):  # (distinct: decimal strings of distinct ints)
                    obj["state"] = dict(zip(ints, state.values(), strict=True))
                    changed += 1
    return changed


@dataclass
class _Container:
    depth: int
    inside_stateful: bool
    draft: dict[Key, _Draft]


class _Cut:
    """What :meth:`_Shaper.walk` returns for a target container it cannot walk, the source has nothing under.

    Such a container closes a cycle, or nests more than ``MAX_DEPTH`` deep. The outermost container above
    it that the source has no entry under either is left out, and so reported missing (``cfg: missing
    key``), as a native load reports a target key its checkpoint lacks.
    """


_CUT = _Cut()


@dataclass
class _Shaper:
    entries: Mapping[str, Node]
    paths: Mapping[str, KeyPath] | None
    used: dict[str, KeyPath] = field(default_factory=dict)  # entry name -> the target key path it fills
    containers: dict[str, _Container] = field(default_factory=dict)
    differences: list[str] = field(default_factory=list)
    active: set[int] = field(default_factory=set)  # ids of the target containers on the current path
    below: set[str] = field(init=False)  # "" and every entry's name and ``.``-prefix: paths with entries

    def __post_init__(self) -> None:
        self.below = {""}
        for name in self.entries:
            self.below.add(name)
            cut = name.find(".")
            while cut >= 0:
                self.below.add(name[:cut])
                cut = name.find(".", cut + 1)

    def walk(self, obj: object, path: KeyPath, inside: bool) -> _Draft | _Cut | None:
        """The draft of the target's ``obj`` at ``path``: ``None`` where the source has nothing for it.

        Raises:
            StateError: The target nests containers more than ``MAX_DEPTH`` levels deep (as a native save
                refuses) where the source has entries below that depth, naming the key.
        """
        if not (isinstance(obj, Mapping) or is_stateful(obj) or (isinstance(obj, list) and not is_leaf(obj))):
            return self.leaf(path)
        if id(obj) in self.active or len(path) >= MAX_DEPTH:
            if join(path) not in self.below:
                return _CUT
            if id(obj) not in self.active:
                raise StateError(
                    f"the state nests containers more than {MAX_DEPTH} levels deep, at key {render(path)!r}",
                    key=render(path),
                )
            # A cycle the source has entries under: left out, so those entries are placed under the
            # container holding it, and the matcher compares them with the target's keys there.
            return None
        self.active.add(id(obj))
        try:
            return self.container(obj, path, inside)
        finally:
            self.active.discard(id(obj))

    def container(self, obj: object, path: KeyPath, inside: bool) -> _Draft | _Cut | None:
        # A container holding a cut one is cut too while the source has no entry under it either.
        cuttable = join(path) not in self.below
        if is_stateful(obj):
            sd = obj.state_dict()  # type: ignore[attr-defined]
            return self.walk(sd, path, True) if isinstance(sd, Mapping) else None
        if isinstance(obj, Mapping):
            draft: dict[Key, _Draft] = {}
            self.containers.setdefault(join(path), _Container(len(path), inside, draft))
            for k, v in obj.items():
                child = self.walk(v, (*path, k), inside)
                if isinstance(child, _Cut) and cuttable:
                    return _CUT
                if child is not None and not isinstance(child, _Cut):
                    draft[k] = child
            return draft
        assert isinstance(obj, list)
        items: list[_Draft] = []
        absent: list[int] = []
        for i, v in enumerate(obj):
            item = self.walk(v, (*path, i), inside)
            if isinstance(item, _Cut) and cuttable:
                return _CUT
            if item is None or isinstance(item, _Cut):
                absent.append(i)
            else:
                items.append(item)
        if absent:
            self.differences += [
                f"{render((*path, i))}: missing key (in the target, not in the checkpoint)" for i in absent
            ]
            return None
        # Within a Stateful, whose state is rebuilt from the checkpoint, the source's list may be longer
        # (an LBFGS's history grows): :meth:`place` adds the items past the target's to this one.
        return _Items(enumerate(items)) if inside else items

    def leaf(self, path: KeyPath) -> Node | None:
        name = join(path)
        node = self.entries.get(name)
        if node is None:
            return None
        other = self.used.setdefault(name, path)
        if other != path:
            # Both keys would be filled with the one value: the first keeps it (as convert refuses them).
            self.differences.append(
                f"{render(path)}: not loaded: it and {render(other)!r} are both named {name!r} once joined "
                f"with '.' (only {render(other)!r} is filled; rename one)"
            )
            return None
        return node

    def place(self, root: dict[Key, _Draft], name: str, node: Node) -> None:
        """Put an entry no target leaf claimed under the deepest target container its name extends.

        The containers the entry needs below it are made: a list where DCP's key path has an index there
        (an ``int``; its mapping keys are all ``str``), else a dict.
        """
        path = self.paths.get(name) if self.paths is not None else None
        where: tuple[_Container, KeyPath] | None = None
        if path:
            for d in range(len(path) - 1, -1, -1):
                c = self.containers.get(join(path[:d]))
                if c is not None and c.depth == d:
                    where = (c, path[d:])
                    break
        else:
            cut = len(name)
            while where is None and cut > 0:
                cut = name.rfind(".", 0, cut)
                c = self.containers.get(name[:cut] if cut > 0 else "")
                if c is not None:
                    where = (c, (name[cut + 1 :],))
        if where is None:
            where = (self.containers[""], (name,))
        container, rest = where
        indexed = [type(k) is int for k in rest]
        if container.inside_stateful:
            # DCP stores every mapping key as a str; an optimizer's per-parameter state is keyed by int.
            rest = tuple(int(k) if isinstance(k, str) and k.isdigit() else k for k in rest)
        cur = container.draft
        for i, k in enumerate(rest[:-1]):
            nxt = cur.setdefault(k, _Items() if indexed[i + 1] else {})
            if not isinstance(nxt, dict):
                break
            cur = nxt
        else:
            if rest[-1] not in cur:
                cur[rest[-1]] = node
                return
        if name not in root:
            root[name] = node
        else:
            self.differences.append(f"{name}: unexpected key (in the checkpoint, not in the target)")


def shaped_like(
    state: Mapping[str, object], entries: Mapping[str, Node], paths: Mapping[str, KeyPath] | None
) -> tuple[DictNode, list[str]]:
    """A tree of ``entries`` shaped like ``state`` (see the module docstring). Calls ``state_dict()``.

    Args:
        state: The load target.
        entries: The source's values by flat name.
        paths: DCP's original key path of each name, when the source recorded them.

    Returns:
        The tree, and differences the matcher cannot see (a list the source holds only partly).
    """
    shaper = _Shaper(entries, paths)
    root = shaper.walk(state, (), False)
    assert isinstance(root, dict)
    for name, node in entries.items():
        if name not in shaper.used:
            shaper.place(root, name, node)
    tree = _freeze(root)
    assert isinstance(tree, DictNode)
    return tree, shaper.differences
