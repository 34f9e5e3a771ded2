"""Load planning: match the checkpoint's tree against the target state. Pure apart from ``state_dict()``.

The walk builds a *result* tree shaped like the checkpoint, whose tensor leaves are destinations: the
target's own tensors where they fit (filled in place), fresh CPU tensors where the target has none. Every
difference (missing or unexpected key, shape, dtype or kind mismatch) is collected, so a strict load fails
with all of them at once before any byte is read. A target tensor that a load cannot fill in place (on
the meta device, sparse, or with elements sharing memory) is such a difference too.

Entries that a Stateful's ``state_dict()`` lacks are created from the checkpoint and handed to its
``load_state_dict`` (an optimizer that never stepped has no per-parameter state yet), except for
``nn.Module``, whose state dict is always complete, so extra entries there are differences.
"""

from __future__ import annotations

import collections
import enum
import inspect
import io
import math
import os
import pickle
from collections.abc import Collection, Iterator, Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch.nn.parameter import is_lazy

from .._errors import CorruptionError, StateError, StorageError
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
from .._fs import irregular
from .._gc import paused
from .._memory import byte_view, contiguous_strides
from .._storage import Location, S3Path
from .._tree import (
    a_or_an,
    dtensor_type,
    dtype_from_name,
    dtype_name,
    is_stateful,
    render,
    shard_of,
    spelled_int,
)
from ._aliasing import Aliasing, aliasing
from ._mapped import Mapper


class _Missing:
    def __repr__(self) -> str:
        return "MISSING"


MISSING = _Missing()


class _Owner(enum.Enum):
    """The kind of Stateful whose state dict holds a value: what a target tensor there is to a load.

    A module's and an optimizer's tensors are filled in place, and must fit; an LR scheduler's are read
    fresh (see :meth:`_Matcher.in_place`); another Stateful's are filled in place where they fit, read
    fresh where they do not (its state may grow, as its entries may).
    """

    NONE = "none"
    MODULE = "module"
    OPTIMIZER = "optimizer"
    SCHEDULER = "scheduler"
    OTHER = "other"


_EXTRA_STATE = torch.nn.modules.module._EXTRA_STATE_KEY_SUFFIX


def _opaque_extra_state(sd: Mapping[object, object]) -> Mapping[object, object]:
    """A module's state dict ``sd`` as a template, its extra state (``get_extra_state``) left unshaped.

    torch hands a module's extra state to its ``set_extra_state`` as it was saved, whatever its shape (a
    serialized blob, empty before first use; a history of any length): the checkpoint's value is read
    fresh, as where the target has none.
    """
    if not any(type(k) is str and k.endswith(_EXTRA_STATE) for k in sd):
        return sd
    return {k: MISSING if type(k) is str and k.endswith(_EXTRA_STATE) else v for k, v in sd.items()}


@dataclass(slots=True)
class Destination:
    """Where tensor ``index`` of the manifest goes: ``tensor`` (in place) and any further tied targets.

    ``offsets`` places ``tensor`` in the global tensor when it is a shard (a DTensor's local tensor);
    ``None`` means it is the whole tensor. Keys that the checkpoint ties (one tensor saved once) and the
    target holds apart are further targets: ``also`` holds those of ``tensor``'s box (copied from it once
    it is read), ``shards`` those of another box (a DTensor laid out otherwise, a plain tensor where
    ``tensor`` is a shard), each read from the chunks like ``tensor``.

    ``view``, when set, is the bytes of a fresh contiguous ``tensor``, cut from its slab's view (cheaper
    than a view made per tensor). ``mapped``: ``tensor`` is a view of its data file's mapping (see
    ``_mapped``), whose pages the read stage populates and verifies instead of reading into them.
    """

    index: int
    tensor: torch.Tensor
    fresh: bool
    also: list[torch.Tensor] = field(default_factory=list)
    offsets: tuple[int, ...] | None = None
    shards: tuple[Destination, ...] = ()  # (a tuple: no list made per destination, as ``also`` is)
    view: memoryview | None = None
    mapped: bool = False


@dataclass
class LoadPlan:
    """The outcome of matching.

    Attributes:
        result: The rebuilt tree (a dict), tensor leaves being destinations.
        destinations: One per manifest tensor that is loaded.
        statefuls: ``(object, state dict, key path, loose)`` to call ``load_state_dict`` on, innermost
            first; with ``strict=False`` where ``loose`` (a module whose tensors read in place were left
            out of its state dict, or one whose ``load_state_dict`` takes ``strict``).
        assign: ``(container, key, value)`` to set in the target's own containers, innermost first.
        differences: Every mismatch found.
        aliasing: The destinations' memory, and those that share an earlier one's (a load in place).
    """

    result: dict[Key, object]
    assign: list[tuple[Any, Key, object]] = field(default_factory=list)
    destinations: dict[int, Destination] = field(default_factory=dict)
    statefuls: list[tuple[object, dict[Key, object], KeyPath, bool]] = field(default_factory=list)
    differences: list[str] = field(default_factory=list)
    aliasing: Aliasing | None = None


def _describe(obj: object) -> str:
    if isinstance(obj, torch.Tensor) and is_lazy(obj):
        return "an uninitialized lazy parameter (no shape until its module's first forward)"
    if isinstance(obj, torch.Tensor) and obj.is_nested:  # (whose shape may be unknown)
        return f"a nested tensor {str(obj.dtype).removeprefix('torch.')}"
    if isinstance(obj, torch.Tensor):
        return f"a tensor {str(obj.dtype).removeprefix('torch.')}{list(obj.shape)}"
    return a_or_an(type(obj).__name__)


def _entry_desc(e: TensorEntry) -> str:
    return f"{e.dtype}{list(e.shape)}"


_STRIDED = torch.strided


def _unfillable(t: torch.Tensor) -> str | None:
    """Why a load cannot fill ``t`` in place, as a phrase (``"a tensor float32[4] on the meta device..."``).

    ``None`` where it can. A load writes the target's own memory, element by element: a tensor of another
    layout than strided (sparse, MKL-DNN) has no such memory, nor has one on the meta device (a load
    would leave it as it is: aiockpt fills tensors, it does not replace them as
    ``load_state_dict(assign=True)`` does). Nor can it write a tensor whose elements share memory by a
    stride of 0 over a dimension of more than one (``expand()``), which ``copy_`` refuses: exactly the
    overlap torch tells cheaply. Elements that overlap otherwise (only ``as_strided`` makes them) are
    written as ``copy_`` writes them, as ``load_state_dict`` would.
    """
    if t.layout is not _STRIDED:
        return f"{_describe(t)} of layout {str(t.layout).removeprefix('torch.')}, which a load cannot fill"
    if t.is_meta:
        return (
            f"{_describe(t)} on the meta device: it has no memory to load into (a load fills tensors in "
            "place; materialize it first, as Module.to_empty(device=...) does)"
        )
    if any(s == 0 and n > 1 for n, s in zip(t.shape, t.stride(), strict=True)):
        return (
            f"{_describe(t)} whose elements share memory (stride {list(t.stride())}, an expanded view): "
            "a load cannot fill it in place"
        )
    return None


# The per-parameter state that torch's own optimizers (``torch.optim``) keep in their parameter's shape:
# each is made by ``zeros_like``/``full_like`` of the parameter or its gradient, and stepped with it
# elementwise (Adam's ``exp_avg``, SGD's ``momentum_buffer``, Adafactor's ``variance``, kept for a 1-d
# parameter only...). Other state has other shapes: ``step``, ASGD's ``eta`` (scalars), Adafactor's
# ``row_var``/``col_var`` (factored), LBFGS's flat vectors of every parameter. A never-stepped optimizer
# has no state for the matcher to compare the checkpoint's with (a stepped one's is compared in place),
# so state of these names is compared with the target's parameter instead: where the target is one of
# torch's optimizers, state of another shape would fail its next step (or step wrongly, broadcast), so
# no load it can use is refused. Other optimizers' state is not judged, subclasses' included: their
# names promise nothing (GaLore's ``exp_avg`` is of a projected, smaller shape). Names from torch 2.x.
_PARAM_SHAPED = frozenset(
    {
        "exp_avg",
        "exp_avg_sq",
        "max_exp_avg_sq",
        "exp_inf",
        "momentum_buffer",
        "square_avg",
        "acc_delta",
        "grad_avg",
        "sum",
        "ax",
        "prev",
        "step_size",
        "variance",
    }
)


class _Matcher:
    def __init__(
        self, manifest: Manifest, allow_pickle: bool, mapper: Mapper | None, data: Location | None
    ) -> None:
        self.m = manifest
        self.allow_pickle = allow_pickle
        self.mapper = mapper
        self.files = _DataFiles(data) if data is not None else None
        self.plan = LoadPlan(result={})
        # Containers of the user's own state are updated in place (others may hold references to them);
        # a Stateful's state dict is rebuilt fresh and handed to its load_state_dict.
        self.inside_stateful = 0
        # The kind of the innermost Stateful whose state dict is being matched (see ``_Owner``).
        self.owner = _Owner.NONE
        self.params: dict[KeyPath, torch.Tensor] = {}
        # The key paths of the optimizers' ``state`` mappings (see ``_ids``).
        self.states: set[KeyPath] = set()
        # The optimizers (their key paths) whose state names say which state has its parameter's shape.
        self.shaped: set[KeyPath] = set()
        # The state dicts of LR schedulers, and the param groups of optimizers, in the target: where some
        # keys the checkpoint lacks keep the target's value (see ``_kept``).
        self.schedulers: set[KeyPath] = set()
        self.groups: set[KeyPath] = set()
        self.slabs = _Slabs()
        self.dtensor = dtensor_type()

    def diff(self, line: str) -> None:
        self.plan.differences.append(line)

    def build(self, node: Node, tmpl: object, path: KeyPath, *, create: bool) -> object:
        if tmpl is MISSING and type(node) is TensorNode:
            return self.fresh(node, path)  # the bulk of aiockpt.read: skip the checks below
        if tmpl is not MISSING and not isinstance(tmpl, torch.Tensor) and is_stateful(tmpl):
            return self.stateful(node, tmpl, path)
        if not isinstance(tmpl, (torch.Tensor, Mapping, list, tuple)):
            tmpl = MISSING  # a plain value in the target is simply replaced by the checkpoint's
        if isinstance(node, TensorNode):
            return self.tensor(node, tmpl, path)
        if isinstance(tmpl, torch.Tensor):
            if create:  # inside a Stateful that takes what it is given (an optimizer's float "step")
                return self.build(node, MISSING, path, create=create)
            self.diff(f"{render(path)}: the target holds {_describe(tmpl)}, the checkpoint {_kind_a(node)}")
            return tmpl
        if isinstance(node, DictNode):
            if tmpl is MISSING or isinstance(tmpl, Mapping):
                return self.mapping(node, tmpl, path, create=create)
            self.diff(f"{render(path)}: the target holds {_describe(tmpl)}, the checkpoint a dict")
            return tmpl
        if isinstance(node, (ListNode, TupleNode)):
            return self.sequence(node, tmpl, path, create=create)
        if isinstance(node, (ValueNode, BytesNode)):
            if tmpl is not MISSING:  # a container here: plain values in the target were made MISSING above
                self.diff(
                    f"{render(path)}: the target holds {_describe(tmpl)}, the checkpoint {_kind_a(node)}"
                )
                return tmpl
            return node.value
        assert isinstance(node, PickleNode), "per-rank state is projected before the match (_ranks.project)"
        return self.unpickle(node, path)

    def stateful(self, node: Node, obj: object, path: KeyPath) -> object:
        if not isinstance(node, DictNode):
            self.diff(f"{render(path)}: the target is {_describe(obj)}, the checkpoint {_kind_a(node)}")
            return obj
        template = obj.state_dict()  # type: ignore[attr-defined]
        if isinstance(obj, torch.nn.Module):
            node = _rewrapped(node, template)
        if isinstance(obj, torch.optim.Optimizer):
            if (unfit := _unfit_groups(node, obj)) is not None:
                # Its load_state_dict would refuse them, once the load had filled its state (and the
                # model's) in place: a difference now, so that nothing is read.
                self.diff(f"{render((*path, 'param_groups'))}: {unfit}")
                return obj
            self.note_params(obj, template, path)
        owner = _Owner.OTHER
        if isinstance(obj, torch.nn.Module):
            owner = _Owner.MODULE
        elif isinstance(obj, torch.optim.Optimizer):
            owner = _Owner.OPTIMIZER
        elif isinstance(obj, torch.optim.lr_scheduler.LRScheduler):
            owner = _Owner.SCHEDULER
            self.schedulers.add(path)
            nested = template.get("_schedulers")  # SequentialLR's and ChainedScheduler's, saved within
            if isinstance(nested, list):
                self.schedulers.update((*path, "_schedulers", i) for i in range(len(nested)))
        # A module's state dict lists every entry it has; other Statefuls may grow entries lazily.
        complete = owner is _Owner.MODULE
        shape = _opaque_extra_state(template) if complete else template
        outer, self.owner = self.owner, owner
        self.inside_stateful += 1
        try:
            sd = self.mapping(node, shape, path, create=not complete)
        finally:
            self.inside_stateful -= 1
            self.owner = outer
        loose = False
        if isinstance(obj, torch.nn.Module) and _stock_loading(obj):
            # Tensors read in place into the module's own memory need no second copy: hand over the rest.
            # (A module that loads its own way gets them all, as from load_state_dict(torch.load(...)):
            # torch's copy of a tensor onto its own memory copies nothing.)
            own = _storages(obj)
            sd = {k: v for k, v in sd.items() if not (v is template.get(k) and _storage(v) in own)}
            loose = True
        elif isinstance(obj, torch.nn.Module):
            loose = _takes_strict(obj)  # (an override of its own: called as its signature says)
        if isinstance(obj, torch.nn.Module) and hasattr(template, "_metadata"):
            # Each submodule's state-dict version, which its _load_from_state_dict reads: without it, a
            # module that migrates old checkpoints (``_version``) took the values for an old format's. The
            # target's own, as DCP gives: the checkpoint was saved from the same classes, or it would not
            # match. (A checkpoint stores no versions.)
            sd = collections.OrderedDict(sd)
            sd._metadata = template._metadata  # type: ignore[attr-defined]
        self.plan.statefuls.append((obj, sd, path, loose))
        return obj

    def note_params(self, opt: torch.optim.Optimizer, sd: Mapping[str, object], path: KeyPath) -> None:
        """Remember which parameter each optimizer-state id stands for, and where the param groups are.

        State the optimizer has not created yet is then created like its parameter (a DTensor shard for a
        DTensor parameter), as the optimizer itself would, and checked against it where the optimizer is
        one of torch's (see ``_PARAM_SHAPED``). A param group's setting that the checkpoint lacks may keep
        the optimizer's own value (see :meth:`_kept`).
        """
        groups = sd.get("param_groups")
        if not isinstance(groups, list):
            return
        module = type(opt).__module__
        if module == "torch.optim" or module.startswith("torch.optim."):
            self.shaped.add(path)
        self.groups.update((*path, "param_groups", i) for i in range(len(groups)))
        self.states.add((*path, "state"))
        for group, live in zip(groups, opt.param_groups, strict=False):
            ids = group.get("params", []) if isinstance(group, Mapping) else []
            for pid, param in zip(ids, live["params"], strict=False):
                key: KeyPath = (*path, "state", cast("Key", pid))
                self.params[key] = param

    def _ids(self, keys: tuple[Key, ...], path: KeyPath) -> tuple[Key, ...]:
        """The keys of an optimizer's ``state`` at ``path``, with DCP's str ids made its int ids again.

        DCP stores every mapping key as ``str(key)``, so an optimizer's state converted from a DCP
        checkpoint by other tools (``dcp_to_torch_save``; aiockpt's ``convert`` restores the ints) is
        keyed ``"0"``, ``"1"``...: handed to ``load_state_dict`` as they are, torch keeps such entries
        under the str keys, of no parameter, and the optimizer starts afresh without a word. A key that
        is the decimal string of one of the optimizer's parameter ids, where the checkpoint lacks that
        int, is that id (as loading from the DCP directory itself makes it: ``_interop/_names.py``).
        """
        present = set(keys)
        out: list[Key] = []
        for k in keys:
            i = spelled_int(k)
            if i is not None and i not in present and (*path, i) in self.params:
                k = i
            out.append(k)
        return tuple(out)

    def _kept(self, path: KeyPath, name: object, value: object) -> bool:
        """Whether the target's key ``name`` at ``path``, which the checkpoint lacks, keeps ``value``.

        So it does where an older torch saved no such key and torch's own ``load_state_dict`` takes the
        state without it: a scheduler's private attribute (``_is_initial``; its ``load_state_dict``
        updates its ``__dict__``, so what is missing stays) and an optimizer's on/off setting of a param
        group (``decoupled_weight_decay``, ``fused``, ``capturable``, ``foreach``..., a bool or ``None``,
        for which the optimizer fills in a default), and a param group's ``param_names`` (an optimizer
        built from ``named_parameters()`` keeps its own, loading the state of one built from
        ``parameters()``). Anything else missing (a group's ``params`` or ``lr``, a scheduler's
        ``last_epoch``) is a difference: the state of another kind of object.
        """
        if path in self.schedulers:
            return isinstance(name, str) and name.startswith("_")
        if path not in self.groups or name == "params":
            return False
        return name == "param_names" or value is None or isinstance(value, bool)

    def apart(self) -> None:
        """Refuse a memory that the target ties under two keys, of which the checkpoint holds other values.

        Filled one after the other, the memory would keep the later key's values, the earlier key's lost
        without a word (as ``load_state_dict`` loses them): a model that ties ``lm_head.weight`` to
        ``embed.weight`` loading a checkpoint of one that does not. Where the two keys' checksums agree
        (saved alike) the values are one and the load goes on. Otherwise the later key is a difference,
        found before anything is written, and not loaded (``strict=False``): the memory keeps the
        earlier key's values. Only the same elements are compared (views alike); memory that partly
        overlaps another's is read as it comes, later keys last, and so are the keys of a foreign
        checkpoint (it has no checksums to compare). Sets the plan's ``aliasing``, for the reader.
        """
        if self.m.checksum_algorithm == "none":
            return
        destinations = self.plan.destinations
        found = aliasing(destinations)
        if found.tied:
            first: dict[tuple[object, ...], int] = {}
            for index, dest in destinations.items():
                if not dest.fresh:
                    first.setdefault(_layout(dest.tensor), index)
            tensors = self.m.tensors
            dropped = False
            for index in found.tied:
                earlier = first[_layout(destinations[index].tensor)]
                if earlier == index:
                    continue
                if _same_values(tensors[earlier], tensors[index]) is False:
                    key, other = render(tensors[index].path), render(tensors[earlier].path)
                    self.diff(
                        f"{key}: the target ties it to {other} (one memory), the checkpoint holds the two "
                        "apart, with other values"
                    )
                    del destinations[index]
                    dropped = True
            if dropped:
                found = aliasing(destinations)
        self.plan.aliasing = found

    def preallocate(self, unwanted: Collection[int]) -> None:
        """Destinations for every small tensor of the checkpoint, made in bulk (``aiockpt.read``).

        The walk then finds them as it finds a tensor tied to one met before. Tensors of a dtype this
        torch lacks are left to :meth:`fresh`, which reports them, and so are those in ``unwanted``
        (other ranks' per-rank state, which the tree read may still refer to through a tie).
        """
        wanted: dict[tuple[torch.dtype, tuple[int, ...]], list[int]] = {}
        for i, entry in enumerate(self.m.tensors):
            if unwanted and i in unwanted:
                continue
            try:
                dtype = dtype_from_name(entry.dtype)
            except ValueError:
                continue
            wanted.setdefault((dtype, entry.shape), []).append(i)
        destinations = self.plan.destinations
        for i, tensor, view in self.slabs.many(wanted):
            destinations[i] = Destination(i, tensor, True, view=view)

    def mapping(
        self, node: DictNode, tmpl: Mapping[object, object] | _Missing, path: KeyPath, *, create: bool
    ) -> dict[Key, object]:
        out: dict[Key, object] = {}
        if tmpl is MISSING:
            # The bulk of aiockpt.read: a tensor already has its destination (made in bulk, or tied).
            destinations = self.plan.destinations
            for k, child in zip(node.keys, node.values, strict=True):
                dest = destinations.get(child.index) if type(child) is TensorNode else None
                out[k] = (
                    dest.tensor if dest is not None else self.build(child, MISSING, (*path, k), create=create)
                )
            return out
        have = tmpl if isinstance(tmpl, Mapping) else {}
        created = 0
        keys = self._ids(node.keys, path) if self.states and path in self.states else node.keys
        for k, child in zip(keys, node.values, strict=True):
            sub = (*path, k)
            if k in have:
                t = have[k]
                if type(child) is TensorNode and type(t) is torch.Tensor:
                    out[k] = self.in_place(child, t, sub)  # the bulk of a load in place, as build would
                else:
                    out[k] = self.build(child, t, sub, create=create)
            elif create:
                found = len(self.plan.differences)
                value = self.build(child, MISSING, sub, create=create)
                # An entry built with a difference is left out whole (strict=False): a parameter's optimizer
                # state missing one tensor would break the optimizer's next step, none makes it start anew.
                if len(self.plan.differences) == found:
                    created += 1
                    out[k] = value
            else:
                self.diff(f"{render(sub)}: unexpected key (in the checkpoint, not in the target)")
        # ``out`` has every key of the target that the checkpoint has, and the keys created; when their
        # count covers the target's, none is missing (a manifest repeating a key only lowers the count).
        # Not a set of the checkpoint's keys: at 10^4 keys, building one holds the GIL for milliseconds,
        # and so does the collector's first visit of its strings.
        if isinstance(tmpl, Mapping) and len(out) - created < len(tmpl) and path not in self.states:
            # (An optimizer's state for a parameter the checkpoint has none for is dropped, as torch's
            # load_state_dict drops it: the checkpoint's parameter had no gradient yet.)
            for name in tmpl:
                if name in out:
                    continue
                if self._kept(path, name, tmpl[name]):
                    out[cast("Key", name)] = tmpl[name]
                    continue
                missing = (*path, cast("Key", name))
                self.diff(f"{render(missing)}: missing key (in the target, not in the checkpoint)")
        if isinstance(tmpl, MutableMapping) and not self.inside_stateful:
            # A tensor loaded in place is already there: only entries that change are set.
            self.plan.assign.extend((tmpl, k, v) for k, v in out.items() if v is not have.get(k, MISSING))
            self.plan.result = out
            return cast("dict[Key, object]", tmpl)
        return out

    def sequence(self, node: ListNode | TupleNode, tmpl: object, path: KeyPath, *, create: bool) -> object:
        kind = list if isinstance(node, ListNode) else tuple
        if tmpl is MISSING:
            items = [self.build(c, MISSING, (*path, i), create=create) for i, c in enumerate(node.items)]
        elif isinstance(tmpl, (list, tuple)) and len(tmpl) != len(node.items) and create:
            # Inside a Stateful that grows its state (a history, LBFGS's old_dirs): the checkpoint's items,
            # as its load_state_dict would take them.
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
        if isinstance(tmpl, torch.Tensor) and is_lazy(tmpl):
            return self.lazy(node, tmpl, path)
        dtensor = self.dtensor
        if dtensor is not None and isinstance(tmpl, dtensor):
            entry = self.m.tensors[node.index]
            local, box = shard_of(tmpl, path)
            if dtype_name(local.dtype) != entry.dtype or box.shape != entry.shape:
                self.diff(f"{render(path)}: the target is a DTensor {dtype_name(local.dtype)}"
                          f"{list(box.shape)}, the checkpoint {_entry_desc(entry)}")  # fmt: skip
            elif (why := _unfillable(local)) is not None:
                self.diff(f"{render(path)}: the target is a DTensor whose local shard is {why}")
            else:
                dest = self.plan.destinations.get(node.index)
                if dest is None:
                    self.plan.destinations[node.index] = Destination(
                        node.index, local, False, offsets=box.offsets
                    )
                else:
                    _tie(dest, local, box.offsets)
            return tmpl
        if isinstance(tmpl, torch.Tensor):
            return self.in_place(node, tmpl, path)
        if tmpl is not MISSING:
            self.diff(f"{render(path)}: the target holds {_describe(tmpl)}, the checkpoint a tensor")
            return tmpl
        return self.fresh(node, path)

    def lazy(self, node: TensorNode, tmpl: torch.Tensor, path: KeyPath) -> object:
        """An uninitialized lazy parameter or buffer (``nn.LazyLinear``): it has no shape to load into.

        Inside a Stateful's state dict the entry is read fresh and handed to its ``load_state_dict``, which
        materializes it (as a lazy module's does); anywhere else it is a difference.
        """
        if self.inside_stateful:
            return self.fresh(node, path)
        self.diff(f"{render(path)}: the target holds {_describe(tmpl)}, the checkpoint a tensor")
        return tmpl

    def in_place(self, node: TensorNode, tmpl: torch.Tensor, path: KeyPath) -> object:
        """``tmpl`` (not a DTensor) as the destination of ``node``, if it has the entry's dtype and shape.

        And if a load can fill it in place (see :func:`_unfillable`): a target it cannot is a difference,
        found here before anything is written. Within the state of an LR scheduler, and within that of a
        Stateful other than torch's where ``tmpl`` does not fit, the tensor is read fresh instead.
        """
        owner = self.owner
        if owner is _Owner.SCHEDULER:
            # A scheduler's load_state_dict replaces its attributes with what it is given (as after
            # torch.load), and its tensors (a tensor lr's) are not memory to fill in place: a freshly
            # built SequentialLR shares its first child's _last_lr tensors, a trained one its current
            # child's. Read fresh, they come back tied as they were saved.
            return self.fresh(node, path)
        index = node.index
        entry = self.m.tensors[index]
        try:
            fits = dtype_name(tmpl.dtype) == entry.dtype and tmpl.shape == entry.shape  # (a Size is a tuple)
        except RuntimeError:
            if not tmpl.is_nested:
                raise
            fits = False  # a nested tensor of strided layout has no shape (one of jagged layout has)
        if not fits:
            if owner is _Owner.OTHER:
                # A Stateful of the user's grows its state as it may (a replay buffer's tensor of
                # another length): its load_state_dict takes what was saved, as from torch.load.
                return self.fresh(node, path)
            self.diff(f"{render(path)}: the target is {_describe(tmpl)}, the checkpoint {_entry_desc(entry)}")
            return tmpl
        # Three tests pass nearly every target (a contiguous strided CPU or GPU tensor); only the others,
        # which may still be fine (a transposed view), are looked at closely. The layout goes first: a
        # sparse CSR tensor refuses is_contiguous().
        if tmpl.layout is not _STRIDED or tmpl.is_meta or not tmpl.is_contiguous():
            why = _unfillable(tmpl)
            if why is not None:
                if owner is _Owner.OTHER:
                    return self.fresh(node, path)
                self.diff(f"{render(path)}: the target is {why}")
                return tmpl
        destinations = self.plan.destinations
        dest = destinations.get(index)
        if dest is None:
            destinations[index] = Destination(index, tmpl, False)
        else:
            _tie(dest, tmpl, None)
        return tmpl

    def fresh(self, node: TensorNode, path: KeyPath) -> object:
        """The tensor built for ``node`` where the target has none (shared by every node tied to it)."""
        entry = self.m.tensors[node.index]
        dest = self.plan.destinations.get(node.index)
        if dest is None:
            dtensor = self.dtensor
            try:
                dtype_ = dtype_from_name(entry.dtype)
            except ValueError:
                self.diff(f"{render(path)}: dtype {entry.dtype} is unknown to this torch")
                return None
            param = self.params.get(path[:-1]) if self.params else None
            if param is not None:
                if self.misshapen(entry, param, path):
                    return None
                if dtensor is not None and isinstance(param, dtensor) and tuple(param.shape) == entry.shape:
                    return self.shard_like(node.index, param, dtype_)
            mapped = self.mapper.tensor(entry, dtype_) if self.mapper is not None else None
            if mapped is not None:
                dest = Destination(node.index, mapped, True, mapped=True)
            else:
                if self.files is not None and math.prod(entry.shape) * dtype_.itemsize >= _Slabs.SMALL:
                    self.files.check(entry, path)  # before memory of the size the manifest says is taken
                fresh, view = self.slabs.empty(entry.shape, dtype_)
                dest = Destination(node.index, fresh, True, view=view)
            self.plan.destinations[node.index] = dest
        return dest.tensor

    def misshapen(self, entry: TensorEntry, param: torch.Tensor, path: KeyPath) -> bool:
        """Whether ``entry``, optimizer state at ``path`` created for ``param``, is a difference (noted).

        It is where torch's optimizers keep state of that name in their parameter's shape, and the
        target's parameter has another (see ``_PARAM_SHAPED``).
        """
        if path[-1] not in _PARAM_SHAPED or path[:-3] not in self.shaped or is_lazy(param):
            return False
        if tuple(param.shape) == entry.shape:  # (a DTensor's global shape, as the entry's)
            return False
        self.diff(
            f"{render(path)}: the checkpoint holds {_entry_desc(entry)}, optimizer state of its parameter's "
            f"shape, and the target's parameter is {_describe(param)}"
        )
        return True

    def shard_like(self, index: int, param: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """A new DTensor laid out like ``param``, as the destination of tensor ``index``."""
        from torch.distributed.tensor import DTensor

        local_like, box = shard_of(param, ())
        local = torch.empty(local_like.shape, dtype=dtype, device=local_like.device)
        self.plan.destinations[index] = Destination(index, local, fresh=True, offsets=box.offsets)
        return DTensor.from_local(
            local,
            param.device_mesh,  # type: ignore[attr-defined]
            param.placements,  # type: ignore[attr-defined]
            run_check=False,
            shape=param.shape,
            stride=param.stride(),
        )

    def unpickle(self, node: PickleNode, path: KeyPath) -> object:
        if not self.allow_pickle:
            try:
                return plain_unpickle(node.data)
            except Exception:
                raise StateError(
                    f"key {render(path)!r} holds a pickled {node.type_name}; loading it can run code: "
                    "pass allow_pickle=True (--allow-pickle on the command line) if you trust this "
                    "checkpoint",
                    key=render(path),
                ) from None
        try:
            return pickle.loads(node.data)
        except Exception as exc:
            key = render(path)
            raise StateError(f"cannot unpickle {node.type_name} at key {key!r}: {exc}", key=key) from exc


# What wrappers put before the names of a module's state: ``torch.compile``'s ``OptimizedModule`` and
# ``DistributedDataParallel`` (or ``DataParallel``) hold the model as ``_orig_mod`` or ``module``.
_WRAPPERS = ("_orig_mod.", "module.")


def _harmless(module: str, name: str) -> object | None:
    """The global ``module.name`` where it builds a plain value, else ``None``.

    Those are a torch dtype, ``torch.Size``, ``torch.device``, ``complex`` and ``OrderedDict``, which
    ``torch.load(weights_only=True)`` allows too.
    """
    if module == "torch":
        if name in ("Size", "device"):
            found: object = getattr(torch, name)
            return found
        value = vars(torch).get(name)  # (not getattr: torch's module __getattr__ imports some names)
        return value if isinstance(value, torch.dtype) else None
    if (module, name) == ("builtins", "complex"):
        return complex
    if (module, name) == ("collections", "OrderedDict"):
        return collections.OrderedDict
    return None


class _NothingImported(pickle.Unpickler):
    """An unpickler that imports nothing but a few plain values' types (see :func:`_harmless`).

    What it builds are the values a pickle holds by itself, and dtypes, sizes, devices, complex numbers.
    """

    def find_class(self, module: str, name: str, /) -> Any:
        found = _harmless(module, name)
        if found is None:
            raise pickle.UnpicklingError(f"{module}.{name} would be imported")
        return found


def plain_unpickle(data: bytes) -> object:
    """Unpickle ``data`` where that imports nothing but plain values' types, and so runs no code. Blocking.

    What such a pickle holds: ints, floats, strings, bytes, and lists, tuples, dicts and sets of them (an
    int outside int64 and uint64 is stored pickled, and so is such a value of a foreign checkpoint, which
    ``torch.load(weights_only=True)`` built), and torch dtypes, ``torch.Size``, ``torch.device``,
    ``complex`` and ``OrderedDict`` values (a ``torch.save`` file's ``dtype`` entry, say). Every callable a
    pickle can call (``REDUCE``, ``NEWOBJ``, ``INST``...) and every class it can build comes from
    ``find_class``, which returns only those; persistent ids and out-of-band buffers are refused by
    default.

    Raises:
        pickle.UnpicklingError: The pickle would import something.
        Exception: ``data`` is no pickle (what ``pickle`` raises for it).
    """
    return _NothingImported(io.BytesIO(data)).load()


def _unfit_groups(node: DictNode, opt: torch.optim.Optimizer) -> str | None:
    """Why the checkpoint's param groups cannot be loaded into ``opt``, or ``None``.

    As ``Optimizer.load_state_dict`` refuses them: another number of groups, or of parameters in a group.
    """
    if "param_groups" not in node.keys:
        return None
    saved = node.values[node.keys.index("param_groups")]
    if not isinstance(saved, ListNode):
        return None
    live = opt.param_groups
    if len(saved.items) != len(live):
        return f"the target has {len(live)} param group(s), the checkpoint {len(saved.items)}"
    for i, (group, mine) in enumerate(zip(saved.items, live, strict=True)):
        if isinstance(group, DictNode) and "params" in group.keys:
            params = group.values[group.keys.index("params")]
            if isinstance(params, ListNode) and len(params.items) != len(mine["params"]):
                return (
                    f"group {i} of the target has {len(mine['params'])} parameter(s), the checkpoint's "
                    f"{len(params.items)}"
                )
    return None


def _stock_loading(module: torch.nn.Module) -> bool:
    """Whether ``module`` loads a state dict as ``torch.nn.Module`` does, with no code of its own.

    That is: ``load_state_dict`` not overridden, no load hooks, and every submodule's
    ``_load_from_state_dict`` one of torch's. Such a module takes a partial state dict with
    ``strict=False``, the keys it lacks left as they are; code of its own may instead read any key, or
    load strictly whatever it is asked.
    """
    if type(module).load_state_dict is not torch.nn.Module.load_state_dict:
        return False
    for sub in module.modules():
        if getattr(sub, "_load_state_dict_pre_hooks", None) or getattr(
            sub, "_load_state_dict_post_hooks", None
        ):
            return False
        if not type(sub)._load_from_state_dict.__module__.startswith("torch."):
            return False
    return True


def _takes_strict(module: torch.nn.Module) -> bool:
    """Whether ``module.load_state_dict`` takes ``strict=`` (an override may not)."""
    try:
        parameters = inspect.signature(module.load_state_dict).parameters
    except (TypeError, ValueError):  # no signature to read: call it as torch's
        return True
    return "strict" in parameters or any(p.kind is p.VAR_KEYWORD for p in parameters.values())


def _unwrapped(name: str) -> str:
    """``name`` without the wrappers' prefixes it begins with (``_orig_mod.module.x``: ``x``)."""
    while True:
        for prefix in _WRAPPERS:
            if name.startswith(prefix):
                name = name[len(prefix) :]
                break
        else:
            return name


def _rewrapped(node: DictNode, template: Mapping[str, object]) -> DictNode:
    """``node``, a module's saved state, under the names of its ``template`` where only wrappers differ.

    A model saved compiled (``torch.compile``) or wrapped in ``DistributedDataParallel`` has every name
    prefixed (``_orig_mod.0.weight``), and one loaded so has too: an actor loading a compiled learner's
    weights into a plain model would miss every key. A saved name that is one of the target's once the
    wrappers' prefixes are taken off both becomes the target's, where such names are unique on both
    sides; the others stay as saved, and the match reports them. A wrapper prefixes every name, so a
    first saved name that the target has means none differs: the common case costs one lookup.
    """
    if not node.keys or node.keys[0] in template or not all(isinstance(k, str) for k in node.keys):
        return node
    wanted = {_unwrapped(k): k for k in template}
    bare = [_unwrapped(cast("str", k)) for k in node.keys]
    if len(wanted) != len(template) or len(set(bare)) != len(bare):
        return node  # two names alike but for wrappers: which is which is unknown
    keys = tuple(cast("Key", wanted.get(b, k)) for b, k in zip(bare, node.keys, strict=True))
    return DictNode(keys=keys, values=node.values, origin=node.origin)


class _Slabs:
    """Fresh small tensors carved out of shared slabs (one per dtype at a time), not one allocation each.

    Allocating (and first touching) thousands of tiny tensors one by one dominated ``read`` of states
    with many small tensors; slabs make it a few large allocations. Large tensors get their own memory.
    Each small tensor comes with its bytes as a slice of its slab's ``memoryview``: a tenth of the cost
    of a view made from the tensor, which counts at 10^4 tensors.

    A dtype's first slab is ``FIRST`` bytes, each next one twice the last, up to ``SLAB``: ``torch.save``
    of a tensor writes its whole storage, and a few small tensors (a fresh optimizer's state, created
    by a load) written so took 16 MiB, their slab, where they hold a few KiB.
    """

    FIRST = 64 << 10
    SLAB = 16 << 20
    SMALL = 64 << 10
    ALIGN = 64
    # Tensors one unbind makes: it holds the GIL throughout, ~0.3 ms per 512 here.
    BATCH = 512

    def __init__(self) -> None:
        # Per dtype: the slab, its bytes, and the elements used so far.
        self.slabs: dict[torch.dtype, tuple[torch.Tensor, memoryview, int]] = {}
        self.strides: dict[tuple[int, ...], tuple[int, ...]] = {}

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, memoryview | None]:
        """A new contiguous tensor and, for one cut from a slab, its bytes."""
        size = dtype.itemsize
        numel = math.prod(shape)
        if not numel or numel * size >= self.SMALL:
            return torch.empty(shape, dtype=dtype), None
        need = self._padded(numel, size)
        slab, raw, used = self._room(dtype, need)
        self.slabs[dtype] = (slab, raw, used + need)
        # as_strided makes the view in one call (slicing and reshaping takes two, at twice the cost).
        return slab.as_strided(shape, self._strides(shape), used), raw[used * size : (used + numel) * size]

    def many(
        self, wanted: Mapping[tuple[torch.dtype, tuple[int, ...]], list[int]]
    ) -> Iterator[tuple[int, torch.Tensor, memoryview]]:
        """Small tensors for many items at once: ``wanted`` maps (dtype, shape) to the items' ids.

        Tensors of one dtype and shape are cut from a slab side by side, up to ``BATCH`` of them made by
        one ``unbind`` (0.5 µs a tensor here, against 1.2-1.7 µs for one ``as_strided`` each, which
        counts at 10^4 tensors). Yields ``(id, tensor, bytes)``; shapes too large for a slab (or empty)
        are left out, for :meth:`empty`.
        """
        for (dtype, shape), ids in wanted.items():
            size = dtype.itemsize
            numel = math.prod(shape)
            if not numel or numel * size >= self.SMALL:
                continue
            padded = self._padded(numel, size)
            strides = (padded, *self._strides(shape))
            done = 0
            while done < len(ids):
                slab, raw, used = self._room(dtype, padded)
                count = min(len(ids) - done, (slab.numel() - used) // padded, self.BATCH)
                self.slabs[dtype] = (slab, raw, used + count * padded)
                tensors = slab.as_strided((count, *shape), strides, used).unbind(0)
                for i, tensor in zip(ids[done : done + count], tensors, strict=True):
                    yield i, tensor, raw[used * size : (used + numel) * size]
                    used += padded
                done += count

    def _padded(self, numel: int, size: int) -> int:
        """Elements one tensor of ``numel`` takes in a slab, so that the next one starts aligned."""
        step = max(1, self.ALIGN // size)
        return -(-numel // step) * step

    def _room(self, dtype: torch.dtype, need: int) -> tuple[torch.Tensor, memoryview, int]:
        """The slab of ``dtype`` and its elements used, a new slab where ``need`` elements do not fit."""
        slab, raw, used = self.slabs.get(dtype, (None, None, 0))
        if slab is None or raw is None or used + need > slab.numel():
            grown = self.FIRST // dtype.itemsize if slab is None else 2 * slab.numel()
            slab = torch.empty(max(need, min(grown, self.SLAB // dtype.itemsize)), dtype=dtype)
            raw, used = byte_view(slab), 0
        return slab, raw, used

    def _strides(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        strides = self.strides.get(shape)
        if strides is None:
            strides = self.strides[shape] = contiguous_strides(shape)
        return strides


class _DataFiles:
    """The data files of a checkpoint, for refusing a fresh tensor that they cannot fill before it is made.

    A fresh tensor takes the memory its manifest entry's shape says; the read stage finds a missing or
    short data file only once every destination is made. A damaged or forged manifest could so have a
    load allocate any amount of memory before failing: a large fresh tensor is made only once its
    chunks lie inside their files, and hold at least as many bytes as the tensor. On object storage the
    files are the data objects, sized by a request each (from the matcher's worker thread).
    """

    def __init__(self, directory: Location) -> None:
        self.directory = directory
        self.sizes: dict[str, int | None] = {}  # per file, its size (``None``: it cannot be looked up)
        self.kinds: dict[str, str] = {}  # per local file that is no regular file, what it is (see irregular)
        self.errors: dict[str, OSError] = {}  # per local file that is there but cannot be looked up, why

    def size(self, name: str) -> int | None:
        """The size of data file ``name``; ``None`` where it is missing (or, locally, cannot be looked up).

        Raises:
            StorageError: The request for an object's size failed (after retries).
        """
        if name not in self.sizes:
            if isinstance(self.directory, S3Path):
                from .._storage._s3 import object_size

                self.sizes[name] = object_size(self.directory, name)
            else:
                try:
                    found = os.stat(self.directory / name)
                except OSError as exc:
                    self.sizes[name] = None
                    if not isinstance(exc, FileNotFoundError):  # (EACCES, ELOOP, EIO: not missing)
                        self.errors[name] = exc
                else:
                    self.sizes[name] = found.st_size
                    if (kind := irregular(found.st_mode)) is not None:
                        self.kinds[name] = kind
        return self.sizes[name]

    def check(self, entry: TensorEntry, path: KeyPath) -> None:
        """Refuse ``entry``, read fresh at ``path``, if its data files cannot hold it.

        Raises:
            CorruptionError: A data file of it is missing, no regular file (a directory, say) or too
                short, or its chunks hold fewer bytes than it has (names the key and the file).
            StorageError: A data file of it cannot be looked up (no permission, a symlink loop, an I/O
                error; names the file).
        """
        key = render(path)
        boxes: set[tuple[tuple[int, ...], tuple[int, ...]]] = set()
        stored = 0
        for c in entry.chunks:
            size = self.size(c.file)
            kind = self.kinds.get(c.file)
            if size is None or kind is not None or c.offset + c.nbytes > size:
                file = str(self.directory / c.file)
                if (error := self.errors.get(c.file)) is not None:
                    raise StorageError(f"cannot read {file}: {error.strerror or error}", path=file) from error
                if size is None:
                    what = "data file is missing"
                else:
                    what = "data file is truncated" if kind is None else f"data file is {kind}"
                raise CorruptionError(
                    f"{what} in {file} for key {key!r} (bytes {c.offset}..{c.offset + c.nbytes})",
                    file=file,
                    key=key,
                )
            if (c.offsets, c.sizes) not in boxes:  # (a box listed twice is read once)
                boxes.add((c.offsets, c.sizes))
                stored += c.nbytes
        need = math.prod(entry.shape) * dtype_from_name(entry.dtype).itemsize
        if stored < need:
            raise CorruptionError(
                f"{self.directory} does not hold all of key {key!r} (global shape {list(entry.shape)}): its "
                f"chunks hold {stored} of its {need} bytes",
                file=str(self.directory),
                key=key,
            )


def _tie(dest: Destination, tensor: torch.Tensor, offsets: tuple[int, ...] | None) -> None:
    """``tensor`` (at ``offsets`` of the global tensor; ``None``: all of it) as a further target of ``dest``.

    The checkpoint ties two keys that the target holds apart (see ``Destination``). A target of the box
    of ``dest`` or of one of its shards is copied from that one once read; a target of another box is a
    shard of its own. A target whose memory is already a destination's (the same tensor under two keys,
    or views of one) is left alone: it is filled once.
    """
    box = _box(tensor, offsets)
    for d in (dest, *dest.shards):
        if _box(d.tensor, d.offsets) == box:
            if not any(_same_memory(t, tensor) for t in (d.tensor, *d.also)):
                d.also.append(tensor)
            return
    dest.shards = (*dest.shards, Destination(dest.index, tensor, False, offsets=offsets))


def _same_values(a: TensorEntry, b: TensorEntry) -> bool | None:
    """Whether entries ``a`` and ``b`` hold the same values, by their checksums; ``None``: not known.

    Not known where they were stored in other boxes (by other ranks, or sharded otherwise).
    """
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    mine = {(c.offsets, c.sizes): c.checksums for c in a.chunks}
    theirs = {(c.offsets, c.sizes): c.checksums for c in b.chunks}
    if mine.keys() != theirs.keys():
        return None
    return mine == theirs


def _box(t: torch.Tensor, offsets: tuple[int, ...] | None) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Where ``t`` lies in the global tensor: its offsets and shape."""
    return (offsets if offsets is not None else (0,) * t.dim()), tuple(t.shape)


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` are the same elements of the same memory (one tensor, or views alike)."""
    return a is b or _layout(a) == _layout(b)


def _layout(t: torch.Tensor) -> tuple[object, ...]:
    return (t.device, t.data_ptr(), t.dtype, t.shape, t.stride())


def _local(t: torch.Tensor) -> torch.Tensor:
    dtensor = dtensor_type()
    return t.to_local() if dtensor is not None and isinstance(t, dtensor) else t  # type: ignore[attr-defined]


def _storage(obj: object) -> int | None:
    if not isinstance(obj, torch.Tensor) or is_lazy(obj):  # (an uninitialized one has no storage yet)
        return None
    local = _local(obj)
    if local.is_meta:
        return None
    try:
        return local.untyped_storage().data_ptr()
    except NotImplementedError:  # a sparse or MKL-DNN tensor: no storage of its own
        return None


def _storages(module: torch.nn.Module) -> set[int | None]:
    """Storages of the module's parameters and buffers."""
    return {_storage(t) for t in (*module.parameters(), *module.buffers())} - {None, 0}


def _kind_a(node: Node) -> str:
    """:func:`_kind` after its indefinite article: ``an int``, ``a dict``."""
    return a_or_an(_kind(node))


def _kind(node: Node) -> str:
    if isinstance(node, ValueNode):
        return type(node.value).__name__
    names = {DictNode: "dict", ListNode: "list", TupleNode: "tuple", TensorNode: "tensor", BytesNode: "bytes"}
    return names.get(type(node), "pickled object")


def match(
    manifest: Manifest,
    state: MutableMapping[str, object] | None,
    *,
    allow_pickle: bool,
    mapper: Mapper | None = None,
    data: Location | None = None,
    unwanted: Collection[int] = (),
) -> LoadPlan:
    """Match ``manifest`` against ``state`` (``None``: build everything fresh, as :func:`aiockpt.read`).

    With ``mapper``, fresh tensors that can be are views of their data file's mapping (see ``_mapped``).
    With ``data``, the directory (or object prefix) of the data files, a large fresh tensor is made only
    where they hold it (see ``_DataFiles``). A fresh read makes the manifest's small tensors up front,
    all but those in ``unwanted`` (other ranks' per-rank state; one that the tree refers to after all,
    through a tie, is made when the walk meets it).

    Raises:
        StateError: A pickled object is met without ``allow_pickle``, or cannot be unpickled (names the key).
        CorruptionError: With ``data``, a fresh tensor's data file is missing, no regular file or too
            short, or its chunks hold less than it.
        StorageError: With ``data`` on object storage, a request for a data object's size failed.
    """
    m = _Matcher(manifest, allow_pickle, mapper, data)
    tmpl = MISSING if state is None else cast("Mapping[object, object]", state)
    with paused():
        if state is None:
            m.preallocate(unwanted)
        result = m.mapping(manifest.tree, tmpl, (), create=False)
    if state is None:
        m.plan.result = result
    else:
        m.apart()
    return m.plan
