"""The two benchmark states, their load templates and raw byte views of their tensors.

State A looks like a transformer: large bf16 projection matrices plus a few hundred small fp32 vectors.
State B is many small fp32 tensors, where per-tensor overhead dominates. Both are flat ``str -> Tensor``
dicts so that every library under test (safetensors included) takes them as they are.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Mapping

import torch

HIDDEN = 4096
FFN = 11008
SMALL_VECTORS = 200
_PAGE = 4096
# touch_pages reads tensors up to this size byte by byte at their addresses, larger ones with torch.
_SMALL_TOUCH = 32 << 10

# One "layer": four attention projections and three MLP projections, as in a Llama-style block.
_LAYER = (
    ("attn.q_proj", (HIDDEN, HIDDEN)),
    ("attn.k_proj", (HIDDEN, HIDDEN)),
    ("attn.v_proj", (HIDDEN, HIDDEN)),
    ("attn.o_proj", (HIDDEN, HIDDEN)),
    ("mlp.gate_proj", (FFN, HIDDEN)),
    ("mlp.up_proj", (FFN, HIDDEN)),
    ("mlp.down_proj", (HIDDEN, FFN)),
)

State = dict[str, torch.Tensor]


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _matrix_shapes(budget: int) -> list[tuple[str, tuple[int, int]]]:
    """Whole layers' matrices, in order, until the next one would overflow ``budget`` bytes (bf16)."""
    out: list[tuple[str, tuple[int, int]]] = []
    used = 0
    layer = 0
    while True:
        for name, shape in _LAYER:
            size = _numel(shape) * 2
            if used + size > budget:
                if not out and budget >= HIDDEN * 2:
                    # Too small for a single projection: one narrower matrix keeps the state non-trivial.
                    out.append(("layers.0.proj", (budget // (HIDDEN * 2), HIDDEN)))
                return out
            out.append((f"layers.{layer}.{name}.weight", shape))
            used += size
        layer += 1


def build_transformer_state(size_bytes: int, seed: int = 0) -> State:
    """Build state A: bf16 matrices filling ``size_bytes`` plus ``SMALL_VECTORS`` fp32 vectors.

    Values are drawn from N(0, 0.02) with a seeded generator, so every run writes the same bytes.

    Args:
        size_bytes: Target total tensor bytes; the result is at most this (whole matrices only).
        seed: Seed of the ``torch.Generator`` used for every tensor.

    Returns:
        A flat dict of contiguous CPU tensors, each with its own storage.
    """
    gen = torch.Generator().manual_seed(seed)
    small_bytes = SMALL_VECTORS * HIDDEN * 4
    matrices = _matrix_shapes(max(size_bytes - small_bytes, 0))
    layers = max(1, len({name.split(".")[1] for name, _ in matrices}))
    state: State = {}
    for name, shape in matrices:
        state[name] = torch.empty(shape, dtype=torch.bfloat16).normal_(0.0, 0.02, generator=gen)
    for i in range(SMALL_VECTORS):
        layer, j = i % layers, i // layers
        kind = "weight" if j % 2 == 0 else "bias"
        vec = torch.empty(HIDDEN, dtype=torch.float32)
        mean = 1.0 if kind == "weight" else 0.0
        state[f"layers.{layer}.norm{j // 2}.{kind}"] = vec.normal_(mean, 0.02, generator=gen)
    return state


def build_small_state(count: int, nbytes: int, seed: int = 1) -> State:
    """Build state B: ``count`` fp32 tensors of ``nbytes`` bytes each (rounded down to whole floats).

    Args:
        count: Number of tensors.
        nbytes: Bytes per tensor; at least 4.
        seed: Seed of the ``torch.Generator``.

    Returns:
        A flat dict ``{"t00000": ..., ...}`` whose tensors do not share storage.
    """
    numel = max(nbytes // 4, 1)
    gen = torch.Generator().manual_seed(seed)
    flat = torch.empty(count * numel, dtype=torch.float32).normal_(0.0, 1.0, generator=gen)
    width = len(str(max(count - 1, 0)))
    # clone(): separate storages, as real parameters have; views of one buffer would let torch.save and
    # DCP write the shared storage once and would make aiockpt see tied tensors.
    return {f"t{i:0{width}d}": flat[i * numel : (i + 1) * numel].clone() for i in range(count)}


def make_template(state: State) -> State:
    """Return zero-filled tensors of the same keys, shapes and dtypes (pages already touched)."""
    return {key: torch.zeros_like(t) for key, t in state.items()}


def zero_(state: State) -> None:
    """Zero every tensor in place, so a later load that copies nothing cannot pass verification."""
    for t in state.values():
        t.zero_()


def state_nbytes(state: State) -> int:
    """Total tensor bytes of ``state``."""
    return sum(t.numel() * t.element_size() for t in state.values())


def byte_views(state: State) -> list[memoryview]:
    """Writable flat byte memoryviews over every tensor's memory, in key order (zero-copy)."""
    views: list[memoryview] = []
    for t in state.values():
        if not t.is_contiguous() or t.device.type != "cpu":
            raise ValueError("byte views need contiguous CPU tensors")
        # ndarray.data keeps the array, and through it the tensor, alive as long as the view.
        views.append(t.reshape(-1).view(torch.uint8).numpy().data)
    return views


def touch_pages(tree: Mapping[str, object]) -> None:
    """Read one byte of every 4 KiB page of each tensor in ``tree``.

    Loaders that return lazily mapped tensors (``mmap``) have read nothing yet when they return; timing
    this touch with them makes every "fresh" loader deliver data that is actually in memory. For tensors
    already resident it costs a few milliseconds per GiB plus 2-4 µs per small tensor: those are read
    through ``ctypes`` at their addresses, as four tensor operations each (a strided view and a sum)
    cost 15 µs a tensor here, 0.3 s of Python for 20,000 tensors that is not the loader's time.
    """
    for i, t in enumerate(tree.values()):
        if i % 256 == 255:
            # Run in a thread beside an event loop, this loop holds the GIL but for these calls (torch
            # calls release it; ctypes.string_at does not); without them the loop waits up to 5 ms.
            time.sleep(0)
        if not isinstance(t, torch.Tensor) or not t.numel():
            continue
        nbytes = t.nbytes
        if nbytes > _SMALL_TOUCH or not t.is_contiguous():
            t.reshape(-1).view(torch.uint8)[::_PAGE].sum()
            continue
        start = t.data_ptr()
        for address in range(start, start + nbytes, _PAGE):
            ctypes.string_at(address, 1)


def same_tensors(expected: State, actual: Mapping[str, object]) -> list[str]:
    """Keys whose tensors are missing from ``actual`` or differ from ``expected`` (empty when all match)."""
    bad: list[str] = []
    for key, want in expected.items():
        got = actual.get(key)
        if not isinstance(got, torch.Tensor) or got.dtype != want.dtype or not torch.equal(got, want):
            bad.append(key)
    return bad
