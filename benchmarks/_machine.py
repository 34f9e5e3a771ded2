"""A description of the machine the figures were taken on."""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path

import torch

from . import idle_pages


def _mem_total() -> str:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return f"{int(line.split()[1]) / 1024**2:.1f} GiB"
    except OSError:
        pass
    return "?"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


def _filesystem(path: Path) -> str:
    """Device and type of the mount holding ``path`` (longest matching mount point in /proc/mounts)."""
    target = str(path.resolve())
    best = ("", "?", "?")
    try:
        for line in Path("/proc/mounts").read_text().splitlines():
            dev, mnt, fstype = line.split()[:3]
            inside = target == mnt or target.startswith(mnt.rstrip("/") + "/")
            if inside and len(mnt) > len(best[0]):
                best = (mnt, dev, fstype)
    except (OSError, ValueError):
        pass
    return f"{best[2]} on {best[1]} (mounted at {best[0] or '?'})"


def describe(scratch: Path, aiockpt_version: str) -> dict[str, str]:
    """Machine, OS and library versions, and the file system the benchmark writes to.

    Args:
        scratch: The directory the checkpoints are written to.
        aiockpt_version: Version string of the aiockpt under test (or why it is absent).

    Returns:
        Ordered ``name -> value`` pairs for the report header.
    """
    try:
        import safetensors

        st_version = str(safetensors.__version__)
    except ImportError:
        st_version = "not installed"
    return {
        "cpu": f"{os.cpu_count()} logical cores ({_cpu_model()})",
        "torch threads": str(torch.get_num_threads()),
        "memory": _mem_total(),
        "kernel": platform.release(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "safetensors": st_version,
        "aiockpt": aiockpt_version,
        "file system": _filesystem(scratch),
        # Where touching memory again is slow once it sat idle, so is any Python code that has not run
        # for a while, an event loop's included (see benchmarks/idle_pages.py).
        "memory touched again": _idle_touch(),
    }


def _idle_touch() -> str:
    try:
        return idle_pages.summary()
    except (AttributeError, OSError, ValueError, RuntimeError) as exc:  # no MAP_PRIVATE or /proc here
        return f"not measured ({exc})"
