"""The load pipeline, mirror of the save: manifest -> match against the target -> read -> hand over.

Nothing in the target is modified until the match found no difference (or ``strict=False``) and every
byte read has verified against its checksum: a load that fails leaves the target as it was, except for
tensors already filled in place when a later block fails verification.
"""

from __future__ import annotations

import warnings
from collections.abc import MutableMapping
from pathlib import Path
from typing import cast

import anyio
import torch

from .._errors import StateError, StateMismatchError, StateMismatchWarning
from .._format import Key, Manifest
from .._gc import paused
from .._options import IOConfig
from .._threads import run_sync
from .._tree import render
from ._manifest import is_checkpoint, published_parts, read_manifest
from ._match import LoadPlan, match
from ._read import read_into

__all__ = ["is_checkpoint", "published_parts", "read_manifest", "run_load", "run_read"]


async def _fill(
    path: Path, manifest: Manifest, plan: LoadPlan, io: IOConfig, limiter: anyio.CapacityLimiter | None
) -> None:
    await read_into(path, manifest, plan.destinations, threads=io.threads, limiter=limiter)

    def hand_over() -> None:
        for obj, sd, key in plan.statefuls:
            try:
                if isinstance(obj, torch.nn.Module):
                    obj.load_state_dict(cast("dict[str, object]", sd), strict=False)
                else:
                    obj.load_state_dict(sd)  # type: ignore[attr-defined]
            except Exception as exc:
                raise StateError(
                    f"load_state_dict of {type(obj).__name__} at key {render(key)!r} failed: {exc}",
                    key=render(key),
                ) from exc

    if plan.statefuls:
        await run_sync(hand_over, limiter)


async def run_load(
    state: MutableMapping[str, object],
    path: Path,
    *,
    strict: bool,
    allow_pickle: bool,
    io: IOConfig,
    limiter: anyio.CapacityLimiter | None = None,
) -> Manifest:
    """Load the checkpoint at ``path`` into ``state`` in place (see :func:`aiockpt.load`)."""
    with paused(io.pause_gc):
        return await _load(state, path, strict=strict, allow_pickle=allow_pickle, io=io, limiter=limiter)


async def _load(
    state: MutableMapping[str, object],
    path: Path,
    *,
    strict: bool,
    allow_pickle: bool,
    io: IOConfig,
    limiter: anyio.CapacityLimiter | None,
) -> Manifest:
    manifest = await run_sync(lambda: read_manifest(path), limiter)
    plan = await run_sync(lambda: match(manifest, state, allow_pickle=allow_pickle), limiter)
    if plan.differences:
        if strict:
            raise StateMismatchError(plan.differences)
        warnings.warn(
            f"loaded {path} partially; not loaded: " + "; ".join(plan.differences),
            StateMismatchWarning,
            stacklevel=3,
        )
    await _fill(path, manifest, plan, io, limiter)
    for container, key, value in plan.assign:
        container[key] = value
    return manifest


async def run_read(
    path: Path, *, allow_pickle: bool, io: IOConfig, limiter: anyio.CapacityLimiter | None = None
) -> dict[Key, object]:
    """Read the checkpoint at ``path`` into a fresh tree of CPU tensors (see :func:`aiockpt.read`)."""
    with paused(io.pause_gc):
        return await _read(path, allow_pickle=allow_pickle, io=io, limiter=limiter)


async def _read(
    path: Path, *, allow_pickle: bool, io: IOConfig, limiter: anyio.CapacityLimiter | None
) -> dict[Key, object]:
    manifest = await run_sync(lambda: read_manifest(path), limiter)
    plan = await run_sync(lambda: match(manifest, None, allow_pickle=allow_pickle), limiter)
    await _fill(path, manifest, plan, io, limiter)
    return plan.result
