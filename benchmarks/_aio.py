"""The aiockpt cases: save (blocking and ``async_op=True``), in-place load and read.

aiockpt is imported lazily so that the rest of the suite still runs, with the aiockpt cases reported as
skipped, where the package is missing or broken.
"""

from __future__ import annotations

import importlib
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

State = dict[str, torch.Tensor]


@dataclass(frozen=True)
class Aiockpt:
    """The imported ``aiockpt`` module (typed loosely: the suite depends only on the documented calls)."""

    module: Any
    version: str
    # ``aiockpt.IOConfig`` passed to every call, or None for aiockpt's defaults.
    io: Any = None


def import_aiockpt() -> Aiockpt | str:
    """Import aiockpt and check it has the calls used here.

    Returns:
        The module wrapper, or a one-line reason why the aiockpt cases are skipped.
    """
    try:
        mod = importlib.import_module("aiockpt")
    except Exception as exc:
        return f"aiockpt cannot be imported: {type(exc).__name__}: {exc}"
    missing = [name for name in ("save", "load", "read") if not hasattr(mod, name)]
    if missing:
        return f"aiockpt lacks {', '.join(missing)} (package incomplete)"
    return Aiockpt(mod, str(getattr(mod, "__version__", "?")))


Phases = dict[str, float]


def _phases(meta: object) -> Phases:
    """``Metadata.timings`` (seconds per save phase), or empty if absent."""
    timings = getattr(meta, "timings", None)
    return {str(k): float(v) for k, v in timings.items()} if isinstance(timings, dict) else {}


async def save(aio: Aiockpt, state: State, path: Path) -> tuple[float, Phases]:
    """``await aiockpt.save(state, path)``: returns once durable.

    Returns:
        Elapsed seconds, and the seconds per phase aiockpt reports in ``Metadata.timings``.
    """
    start = time.perf_counter()
    meta = await aio.module.save(state, str(path), io=aio.io)
    return time.perf_counter() - start, _phases(meta)


class AsyncSaver:
    """``await ckpt.save(state, step=n, async_op=True)`` on one long-lived ``aiockpt.Checkpointer``.

    As a training loop does: the Checkpointer keeps its staging buffers between saves, so from the second
    save on, staging copies into memory that is already touched (the first save pays for first touch).
    """

    def __init__(self, aio: Aiockpt, root: Path) -> None:
        self.aio = aio
        self.root = root
        self.ckpt: Any = None
        self.step = 0

    async def save(self, state: State) -> tuple[float, float, Phases]:
        """Save once; returns seconds until staged and until durable (from the call), and phase seconds."""
        if self.ckpt is None:
            self.ckpt = self.aio.module.Checkpointer(str(self.root), keep_last=1, io=self.aio.io)
            await self.ckpt.open()
        self.step += 1
        start = time.perf_counter()
        handle = await self.ckpt.save(state, step=self.step, async_op=True)
        staged = time.perf_counter() - start
        meta = await handle
        return staged, time.perf_counter() - start, _phases(meta)

    async def close(self) -> None:
        """Close the Checkpointer (frees its staging buffers)."""
        if self.ckpt is not None:
            await self.ckpt.aclose()
            self.ckpt = None


async def load(aio: Aiockpt, template: State, path: Path) -> float:
    """``await aiockpt.load(template, path)``: in place into the preallocated template.

    Returns:
        Elapsed seconds.
    """
    start = time.perf_counter()
    await aio.module.load(template, str(path), io=aio.io)
    return time.perf_counter() - start


async def read(aio: Aiockpt, path: Path) -> tuple[float, dict[str, object]]:
    """``await aiockpt.read(path)``: a fresh tree of tensors.

    Returns:
        Elapsed seconds and the tree read.
    """
    start = time.perf_counter()
    tree: dict[str, object] = await aio.module.read(str(path), io=aio.io)
    return time.perf_counter() - start, tree
