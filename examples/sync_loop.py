"""Checkpoint a plain synchronous training loop with ``aiockpt.sync.Checkpointer``.

No asyncio in sight: the blocking facade runs an event loop in a background thread.
``ckpt.save(state, step=step, async_op=True)`` returns once the state is staged, the write goes on while
the loop trains, and ``handle.result()`` blocks until that checkpoint is durable (here: just before the
next save). The loop is interrupted by an exception part way; leaving the ``with`` block still finishes
the save in flight. A fresh model, optimizer and scheduler then resume with ``ckpt.load(state)`` and
must end bit-identical to an uninterrupted run.

Run it with ``python examples/sync_loop.py`` (``--help`` for the options).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

import aiockpt.sync


class Interrupted(Exception):
    """Stands in for whatever stops a real run (preemption, Ctrl-C, a failing node)."""


class Trainer:
    """A small MLP, AdamW and a step LR schedule, built deterministically."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Linear(16, 256), nn.ReLU(), nn.Linear(256, 1))
        self.optim = torch.optim.AdamW(self.model.parameters(), lr=3e-3)
        self.sched = torch.optim.lr_scheduler.StepLR(self.optim, step_size=30, gamma=0.5)

    def state(self, step: int) -> dict[str, object]:
        """Everything a resumed run needs, the RNG state included (it draws the batches)."""
        rng = torch.get_rng_state()
        return {"model": self.model, "optim": self.optim, "sched": self.sched, "step": step, "rng": rng}

    def train(
        self,
        ckpt: aiockpt.sync.Checkpointer | None,
        start: int,
        steps: int,
        save_every: int,
        stop_at: int = 0,
    ) -> float:
        """Train steps ``start + 1 .. steps``; raise :class:`Interrupted` after step ``stop_at``."""
        pending: aiockpt.sync.SyncSaveHandle | None = None
        loss = torch.tensor(float("nan"))
        for step in range(start + 1, steps + 1):
            x = torch.randn(32, 16)
            loss = F.mse_loss(self.model(x), x.sum(dim=1, keepdim=True).tanh())
            self.optim.zero_grad()
            loss.backward()  # type: ignore[no-untyped-call]  # unannotated in torch
            self.optim.step()
            self.sched.step()
            if ckpt is not None and step % save_every == 0:
                if pending is not None:
                    wait_durable(pending)  # at most one save in flight
                pending = ckpt.save(self.state(step), step=step, async_op=True)  # returns once staged
                staged_ms = pending.metrics.staging_seconds * 1e3
                print(f"  step {step:3d}  loss {loss.item():.5f}  save started, staged in {staged_ms:.1f} ms")
            if step == stop_at:
                raise Interrupted(f"interrupted after step {step}")
        if pending is not None:
            wait_durable(pending)
        return loss.item()


def wait_durable(handle: aiockpt.sync.SyncSaveHandle) -> None:
    meta = handle.result()  # blocks until the checkpoint is durable; raises if the save failed
    total_ms = handle.metrics.total_seconds * 1e3
    print(f"  checkpoint {meta.step} durable {total_ms:.1f} ms after the call ({meta.nbytes / 1e3:.0f} kB)")


def main(root: Path, steps: int, save_every: int, crash_at: int) -> int:
    print(f"phase 1: train from scratch, interrupted after step {crash_at}")
    try:
        with aiockpt.sync.Checkpointer(root, keep_last=3) as ckpt:
            Trainer().train(ckpt, 0, steps, save_every, stop_at=crash_at)
    except Interrupted as exc:
        # Leaving the with block waited for the save in flight, so it committed.
        print(f"  {exc}")

    print("phase 2: fresh objects, resume from the latest checkpoint")
    trainer = Trainer()
    state = trainer.state(0)
    with aiockpt.sync.Checkpointer(root, keep_last=3) as ckpt:
        start = ckpt.load(state) or 0
        rng = state["rng"]
        assert isinstance(rng, torch.Tensor)
        torch.set_rng_state(rng)
        print(f"  committed steps {ckpt.steps()}; resumed from step {start}")
        loss = trainer.train(ckpt, start, steps, save_every)
    print(f"  final loss {loss:.6f}")

    reference = Trainer()
    ref_loss = reference.train(None, 0, steps, save_every)
    weights = zip(reference.model.parameters(), trainer.model.parameters(), strict=True)
    matches = ref_loss == loss and all(torch.equal(a, b) for a, b in weights)
    print(f"resumed run matches uninterrupted run: {matches}")
    return 0 if matches else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--root", type=Path, help="checkpoint directory (default: a fresh temporary one)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary checkpoint directory")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--save-every", type=int, default=20)
    parser.add_argument("--crash-at", type=int, default=70)
    args = parser.parse_args()
    if args.steps < 2 or args.save_every < 1:
        parser.error("--steps must be at least 2 and --save-every at least 1")
    if not 0 < args.crash_at < args.steps:  # (else nothing is interrupted, and nothing resumed)
        parser.error("--crash-at must lie between 0 and --steps")
    if args.root is not None and args.root.exists() and any(args.root.iterdir()):
        parser.error(f"--root {args.root} is not empty: the demo trains from scratch into it")
    torch.set_num_threads(1)
    root = args.root or Path(tempfile.mkdtemp(prefix="aiockpt-sync-"))
    try:
        code = main(root, args.steps, args.save_every, args.crash_at)
    finally:
        if args.root is None and not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    sys.exit(code)
