"""Command line: parse options, build the states, run the suite, print the markdown report."""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from benchmarks import _aio, _machine, _report, _suite
from benchmarks._results import Results
from benchmarks._state import (
    SMALL_VECTORS,
    build_small_state,
    build_transformer_state,
    make_template,
    state_nbytes,
)

GIB = 1024**3


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse the command line.

    Args:
        argv: Arguments without the program name; ``None`` reads ``sys.argv``.

    Returns:
        The parsed options.
    """
    p = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description=(
            "aiockpt against torch.save, safetensors, DCP and the machine's own limits (memcpy, fsync'd "
            "write, cold read), on a transformer-like state (A) and a many-small-tensors state (B)."
        ),
    )
    p.add_argument("--size-gib", type=float, default=2.0, help="size of state A in GiB (default: 2.0)")
    p.add_argument("--small-count", type=int, default=20000, help="tensors in state B (default: 20000)")
    p.add_argument("--small-bytes", type=int, default=4096, help="bytes per state-B tensor (default: 4096)")
    p.add_argument(
        "--dir",
        type=Path,
        default=Path("bench-out"),
        help="scratch directory; what the run creates there is removed afterwards (default: ./bench-out)",
    )
    p.add_argument(
        "--only",
        default=None,
        help=(
            "comma list of states (large, small), machine limits (memcpy, write, read, lag) and libraries "
            "(aiockpt, torch, safetensors, dcp); a kind left out means all of it, e.g. 'small,aiockpt,dcp'"
        ),
    )
    p.add_argument(
        "--repeat", type=int, default=1, help="repeats per case; the best is reported (default: 1)"
    )
    p.add_argument(
        "--io-threads",
        type=int,
        default=None,
        help="IOConfig(threads=N) for every aiockpt case (default: aiockpt's own, one fewer than the CPUs)",
    )
    p.add_argument("--json", type=Path, default=None, help="also write the results as JSON to this path")
    args = p.parse_args(argv)
    if args.size_gib <= 0 or args.small_count < 1 or args.small_bytes < 4 or args.repeat < 1:
        p.error("--size-gib must be > 0, --small-count >= 1, --small-bytes >= 4, --repeat >= 1")
    if args.io_threads is not None and args.io_threads < 1:
        p.error("--io-threads must be >= 1")
    try:
        args.selection = _suite.parse_only(args.only)
    except ValueError as exc:
        p.error(str(exc))
    return args


def _run(args: argparse.Namespace, scratch: Path, results: Results, aio: _aio.Aiockpt | None) -> None:
    sel: _suite.Selection = args.selection
    suite = _suite.Suite(scratch, args.repeat, sel, aio, results)
    try:
        if "large" in sel.states:
            start = time.perf_counter()
            state = build_transformer_state(int(args.size_gib * GIB))
            template = make_template(state)
            n = state_nbytes(state)
            shapes = sorted({"x".join(map(str, t.shape)) for t in state.values() if t.dim() == 2})
            matrices = len(state) - SMALL_VECTORS
            results.states["A"] = {
                "tensors": len(state),
                "nbytes": n,
                "description": (
                    f"transformer-like, {len(state)} tensors, {n / GIB:.2f} GiB ({n / 1e9:.2f} GB): "
                    f"{matrices} bf16 matrices ({', '.join(shapes)}) + {SMALL_VECTORS} fp32 vectors of 4096"
                ),
            }
            print(f"[bench] state A built in {time.perf_counter() - start:.1f} s", file=sys.stderr)
            suite.run_state("A", state, template, limits=True)
            del state, template
            gc.collect()
        if "small" in sel.states:
            state = build_small_state(args.small_count, args.small_bytes)
            template = make_template(state)
            n = state_nbytes(state)
            size = next(iter(state.values())).numel() * 4
            results.states["B"] = {
                "tensors": len(state),
                "nbytes": n,
                "description": f"{len(state)} fp32 tensors of {size} bytes, {n / 1e6:.1f} MB in a flat dict",
            }
            suite.run_state("B", state, template, limits=False)
    finally:
        suite.close()


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark suite and print the markdown report on stdout (progress goes to stderr).

    Args:
        argv: Arguments without the program name; ``None`` reads ``sys.argv``.

    Returns:
        The exit status: 0, or 1 when a case failed or loaded wrong data.
    """
    args = parse_args(argv)
    imported = _aio.import_aiockpt()
    aio = imported if isinstance(imported, _aio.Aiockpt) else None
    if aio is not None and args.io_threads is not None:
        aio = dataclasses.replace(aio, io=aio.module.IOConfig(threads=args.io_threads))
    root: Path = args.dir
    created_root = not root.exists()
    root.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="run-", dir=root))
    results = Results(
        machine=_machine.describe(scratch, aio.version if aio else "not available"),
        config={
            "size_gib": args.size_gib,
            "small_count": args.small_count,
            "small_bytes": args.small_bytes,
            "repeat": args.repeat,
            "only": args.only or "all",
            "torch_threads": torch.get_num_threads(),
            "aiockpt_io_threads": "n/a" if aio is None else (aio.io or aio.module.IOConfig()).thread_count,
        },
    )
    if isinstance(imported, str):
        results.skipped.append(f"aiockpt cases: {imported}")
        print(f"[bench] skipping aiockpt cases: {imported}", file=sys.stderr)
    try:
        _run(args, scratch, results, aio)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        if created_root:
            shutil.rmtree(root, ignore_errors=True)
    print(_report.markdown(results))
    if args.json is not None:
        args.json.write_text(json.dumps(_report.to_json(results), indent=2) + "\n")
    return 1 if results.failures else 0
