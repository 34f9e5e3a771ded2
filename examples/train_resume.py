"""Train, get killed, resume: the aiockpt main demo.

An asyncio training loop (a small MLP learning a synthetic regression task, AdamW, a OneCycle learning-rate
schedule, dropout) checkpoints every ``--save-every`` steps with ``aiockpt.Checkpointer``:

* ``await ckpt.save(state, step=step, async_op=True)`` returns as soon as the state is *staged* (copied
  aside), so training goes on while the checkpoint is written, checksummed, fsynced and committed;
* the state holds the model, optimizer, scheduler, step and the torch RNG state, so a resumed run draws
  the very same batches and dropout masks.

Phase 1 runs in a child process that is killed with SIGKILL part way through, possibly in the middle of
a save. Phase 2 builds fresh objects, calls ``await ckpt.load(state)`` to restore the latest committed
checkpoint and trains to the end. The result must be bit-identical to an uninterrupted run of the same
seed; the script exits non-zero when it is not.

Run it with ``python examples/train_resume.py`` (``--help`` for the options).
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

import aiockpt

SEED = 0
FEATURES, HIDDEN, BATCH = 32, 512, 64
LOG_EVERY = 10
# The task: y = sin(2 x.w) for a fixed unit-scale w (own generator: it never touches the global RNG).
TEACHER = torch.randn(FEATURES, 1, generator=torch.Generator().manual_seed(1234)) / FEATURES**0.5
PREFIX = "  [phase 1] "


class Trainer:
    """Model, optimizer and LR scheduler, built deterministically from ``SEED``."""

    def __init__(self, total_steps: int) -> None:
        torch.manual_seed(SEED)
        self.model = nn.Sequential(
            nn.Linear(FEATURES, HIDDEN),
            nn.GELU(),
            nn.Dropout(0.1),
            nn.Linear(HIDDEN, HIDDEN),
            nn.GELU(),
            nn.Linear(HIDDEN, 1),
        )
        self.optim = torch.optim.AdamW(self.model.parameters(), lr=1e-3, weight_decay=0.01)
        self.sched = torch.optim.lr_scheduler.OneCycleLR(self.optim, max_lr=1e-2, total_steps=total_steps)

    def state(self, step: int) -> dict[str, object]:
        """What a checkpoint holds; Statefuls (model, optimizer, scheduler) are saved via state_dict()."""
        return {
            "model": self.model,
            "optim": self.optim,
            "sched": self.sched,
            "step": step,
            "rng": torch.get_rng_state(),
        }

    def train_step(self) -> float:
        """One optimizer step on a fresh random batch; returns its loss."""
        x = torch.randn(BATCH, FEATURES)  # the data comes from the global RNG: it must be checkpointed
        loss = F.mse_loss(self.model(x), torch.sin(2 * x @ TEACHER))
        self.optim.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]  # unannotated in torch
        self.optim.step()
        self.sched.step()
        return loss.item()


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


async def report(handle: aiockpt.SaveHandle, now: int, log: str) -> None:
    """Wait until the save is durable, then say what it cost."""
    meta = await handle  # the Metadata of the committed checkpoint (or the save's error)
    phases = ", ".join(f"{k} {ms(meta.timings[k])}" for k in ("write", "finish"))
    print(
        f"{log}step {now:4d}  checkpoint {meta.step} committed: {meta.nbytes / 1e6:.2f} MB, "
        f"durable {ms(handle.metrics.total_seconds)} after the call ({phases}) while training went on"
    )


async def train(
    trainer: Trainer,
    ckpt: aiockpt.Checkpointer | None,
    *,
    start: int,
    steps: int,
    save_every: int,
    log: str | None = "  ",
) -> float:
    """Train steps ``start + 1 .. steps``, checkpointing every ``save_every``; return the last loss."""
    pending: aiockpt.SaveHandle | None = None  # the save in flight
    loss = float("nan")
    for step in range(start + 1, steps + 1):
        # The step runs in a worker thread, so the event loop stays free to drive the save in flight.
        loss = await asyncio.to_thread(trainer.train_step)
        if pending is not None and (pending.done() or step % save_every == 0):
            # Report a save once it has committed, or wait for it before the next one (backpressure).
            await report(pending, step, log or "")
            pending = None
        if ckpt is not None and step % save_every == 0:
            pending = await ckpt.save(trainer.state(step), step=step, async_op=True)
            print(
                f"{log}step {step:4d}  save started: staged in {ms(pending.metrics.staging_seconds)}, "
                "the rest goes on in the background"
            )
        if log is not None and step % LOG_EVERY == 0:
            print(f"{log}step {step:4d}  loss {loss:.5f}  lr {trainer.sched.get_last_lr()[0]:.2e}")
    if pending is not None:
        await report(pending, steps, log or "")
    return loss


async def child(args: argparse.Namespace) -> None:
    """Phase 1, in its own process: train from scratch until the parent kills us."""
    torch.set_num_threads(1)
    async with aiockpt.Checkpointer(args.root, keep_last=3) as ckpt:
        await train(Trainer(args.steps), ckpt, start=0, steps=args.steps, save_every=args.save_every, log="")


async def run_and_kill(args: argparse.Namespace) -> None:
    """Start phase 1 in a child process and SIGKILL it once it reports step ``--crash-at``."""
    cmd = [sys.executable, "-u", __file__, "--child", "--root", str(args.root), "--steps", str(args.steps)]
    proc = await asyncio.create_subprocess_exec(
        *cmd, "--save-every", str(args.save_every), stdout=asyncio.subprocess.PIPE
    )
    assert proc.stdout is not None
    killed = False
    async for raw in proc.stdout:
        line = raw.decode().rstrip()
        print(PREFIX + line)
        words = line.split()
        step = int(words[1]) if words[:1] == ["step"] else 0
        if step >= args.crash_at:
            proc.kill()  # SIGKILL: no clean-up, no finally blocks, a save may be half-written
            killed = True
            print(
                f"  >>> SIGKILL sent to the training process (pid {proc.pid}) after it reported step {step}"
            )
            break
    returncode = await proc.wait()
    if not killed:
        raise SystemExit(f"phase 1 ended on its own (exit code {returncode}) before it could be interrupted")


def temp_dirs(root: Path) -> list[str]:
    """Directories of saves that never committed (``.tmp-*``)."""
    return sorted(p.name for p in root.iterdir() if p.name.startswith(".tmp-") and p.is_dir())


def describe_root(root: Path) -> str:
    committed = sorted(p.name for p in root.glob("step-*"))
    latest = (root / "latest").read_text().strip() if (root / "latest").exists() else None
    return f"committed {committed}, latest -> {latest}, unfinished saves {temp_dirs(root) or 'none'}"


async def main(args: argparse.Namespace) -> int:
    torch.set_num_threads(1)  # deterministic and polite on a small machine
    root: Path = args.root
    print(f"aiockpt demo: {args.steps} steps, a checkpoint every {args.save_every} (keep_last=3) in {root}")

    print(f"phase 1: training in a child process, to be killed after step {args.crash_at}")
    await run_and_kill(args)
    print(f"on disk after the crash: {describe_root(root)}")
    leftover = temp_dirs(root)

    print("phase 2: fresh model, optimizer and scheduler; resuming from the latest committed checkpoint")
    trainer = Trainer(args.steps)
    state = trainer.state(0)
    async with aiockpt.Checkpointer(root, keep_last=3) as ckpt:
        if leftover:  # opening a Checkpointer collects the temp data of saves whose process is gone
            print(f"  removed on open: {leftover}; left: {temp_dirs(root) or 'none'}")
        t0 = time.perf_counter()
        resumed = await ckpt.load(state)
        rng = state["rng"]
        assert isinstance(rng, torch.Tensor)
        torch.set_rng_state(rng)
        if resumed is None:  # nothing committed before the crash: start over
            print("  no committed checkpoint: starting from scratch")
        else:
            print(
                f"  resumed from step {resumed} in {ms(time.perf_counter() - t0)} "
                f"(state['step'] = {state['step']}); continuing to step {args.steps}"
            )
        start = resumed or 0
        loss = await train(trainer, ckpt, start=start, steps=args.steps, save_every=args.save_every)
    print(f"  final loss {loss:.6f}; on disk: {describe_root(root)}")

    print(f"reference: the same seed trained {args.steps} steps without interruption or checkpoints")
    ref = Trainer(args.steps)
    ref_loss = await train(ref, None, start=0, steps=args.steps, save_every=args.save_every, log=None)
    print(f"  final loss {ref_loss:.6f}")

    same_weights = all(
        torch.equal(a, b)
        for a, b in zip(ref.model.state_dict().values(), trainer.model.state_dict().values(), strict=True)
    )
    matches = same_weights and ref_loss == loss
    print(f"resumed run matches uninterrupted run: {matches}")
    return 0 if matches else 1


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--root", type=Path, help="checkpoint directory (default: a fresh temporary one)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary checkpoint directory")
    parser.add_argument("--steps", type=int, default=300, help="training steps (default: 300)")
    parser.add_argument("--save-every", type=int, default=25, help="steps between checkpoints (default: 25)")
    parser.add_argument("--crash-at", type=int, help="kill phase 1 after this step (default: 2/3 of --steps)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.crash_at is None:
        args.crash_at = args.steps * 2 // 3
    if not 0 < args.crash_at < args.steps:
        parser.error("--crash-at must lie between 0 and --steps")
    return args


if __name__ == "__main__":
    args = parse_args()
    if args.child:
        asyncio.run(child(args))
        sys.exit(0)
    temporary = args.root is None
    if temporary:
        args.root = Path(tempfile.mkdtemp(prefix="aiockpt-demo-"))
    elif args.root.exists() and any(args.root.iterdir()):
        sys.exit(f"--root {args.root} is not empty; give a new or empty directory")
    try:
        code = asyncio.run(main(args))
    finally:
        if temporary and not args.keep:
            shutil.rmtree(args.root, ignore_errors=True)
        elif temporary:
            print(f"checkpoints kept in {args.root}")
    sys.exit(code)
