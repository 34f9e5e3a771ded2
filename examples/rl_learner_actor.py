"""RL-style weight sharing: a learner saves, two actors watch and hot-load while they keep serving.

    python examples/rl_learner_actor.py [--steps 120] [--save-every 10] [--table-mb 0]

Three processes share one checkpoint root. The learner trains a small policy and saves every
``--save-every`` steps with ``async_op=True`` and ``on_busy="skip"``: it never waits for the disk, and a
save that would have to wait is skipped. Each actor runs one asyncio loop that serves the policy every
2 ms while ``async for step in ckpt.watch()`` follows the learner: each new step is loaded into a spare
policy (``await ckpt.load``, which never blocks the loop), checked against the fingerprint the learner
stored with it, and swapped in, so inference never sees half-loaded weights. Each actor prints the
versions it saw and its event-loop lag. ``--table-mb`` makes the policy's checkpoint large (a lookup
table that costs little to serve), to measure the lag while hot-loading hundreds of MB.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import shutil
import sys
import tempfile
import time
from pathlib import Path

import anyio
import torch
from torch import nn

import aiockpt

DONE = "learner-done"


class Policy(nn.Module):
    """A small MLP, plus (``table_mb`` > 0) a large lookup table that makes the checkpoint big.

    The table stands for the embedding tables of recommender or language policies: a lot of bytes to
    hot-load, little compute per request. The learner changes a few of its rows each step.
    """

    table: torch.Tensor

    def __init__(self, table_mb: float = 0.0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.mlp = nn.Sequential(
            nn.Linear(32, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 8)
        )
        rows = int(table_mb * 2**20) // (64 * 4)
        self.register_buffer("table", torch.randn(rows, 64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The MLP's output, shifted by a few table entries (so that serving reads the table)."""
        out: torch.Tensor = self.mlp(x)
        if len(self.table):
            out = out + self.table[: len(x), :8]
        return out


def fingerprint(policy: nn.Module) -> float:
    return float(sum(torch.sum(t.detach(), dtype=torch.float64) for t in policy.state_dict().values()))


async def learner(root: Path, steps: int, save_every: int, table_mb: float) -> None:
    policy = Policy(table_mb)
    optim = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    saved, skipped = [], 0
    async with aiockpt.Checkpointer(root, keep_last=3, max_inflight=1, on_busy="skip") as ckpt:
        for step in range(1, steps + 1):
            x = torch.randn(64, 32)
            loss = policy(x).square().mean()
            loss.backward()
            optim.step()
            optim.zero_grad()
            table = policy.table
            if len(table):
                table[step % len(table)] += 1.0
            await asyncio.sleep(0.005)  # the rest of a learner's step: rollouts, queues
            if step % save_every == 0 or step == steps:
                # Off the loop: summing a large table takes a while.
                mark = await anyio.to_thread.run_sync(fingerprint, policy)
                state = {"policy": policy, "step": step, "fingerprint": mark}
                handle = await ckpt.save(state, step=step, async_op=True)
                if handle.skipped:
                    skipped += 1
                else:
                    saved.append(step)
        await ckpt.wait()
        if steps not in ckpt.steps():  # the last save may have been skipped: make it durable
            mark = await anyio.to_thread.run_sync(fingerprint, policy)
            await ckpt.save({"policy": policy, "step": steps, "fingerprint": mark}, step=steps)
            saved.append(steps)
    # Written whole under another name, then renamed: an actor polling for the marker never reads it
    # half-written (empty).
    (root / f"{DONE}.tmp").write_text(str(steps))
    (root / f"{DONE}.tmp").replace(root / DONE)
    print(f"learner: saved steps {saved}, skipped {skipped} save(s) while one was still writing", flush=True)


async def actor(name: str, root: Path, table_mb: float) -> None:
    serving, spare = Policy(table_mb), Policy(table_mb)
    lags: list[float] = []
    versions: list[int] = []
    x = torch.randn(16, 32)

    async def measure_lag() -> None:
        while True:
            start = time.perf_counter()
            await asyncio.sleep(0.001)
            lags.append(time.perf_counter() - start - 0.001)

    async def serve() -> None:
        while True:
            with torch.no_grad():
                serving(x)
            await asyncio.sleep(0.002)

    async def hot_load(ckpt: aiockpt.Checkpointer) -> None:
        nonlocal serving, spare
        target: dict[str, object] = {"policy": spare, "step": 0, "fingerprint": 0.0}
        step = await ckpt.load(target)  # the newest committed step, even if more landed meanwhile
        assert step is not None
        assert target["step"] == step
        if await anyio.to_thread.run_sync(fingerprint, spare) != target["fingerprint"]:
            raise RuntimeError(f"{name}: weights of step {step} do not match the learner's fingerprint")
        serving, spare = spare, serving
        versions.append(step)

    async def follow(ckpt: aiockpt.Checkpointer) -> None:
        async for _ in ckpt.watch(poll_interval=0.05):
            await hot_load(ckpt)

    async def learner_done() -> int:
        """The learner's last step, once it has committed it (and every other)."""
        marker = anyio.Path(root / DONE)
        while True:
            if await marker.exists():
                return int(await marker.read_text())
            await anyio.sleep(0.05)

    async def seen(last: int) -> None:
        while True:
            if versions and versions[-1] >= last:
                return
            await anyio.sleep(0.05)

    async with aiockpt.Checkpointer(root) as ckpt, anyio.create_task_group() as tg:
        for task in (measure_lag, serve):
            tg.start_soon(task)
        with anyio.fail_after(60):
            async with anyio.create_task_group() as following:
                following.start_soon(follow, ckpt)
                last = await learner_done()
                with anyio.move_on_after(2):  # the watch sees the last step at its next poll
                    await seen(last)
                following.cancel_scope.cancel()
            if not versions or versions[-1] < last:
                # The watch began after the learner's last save (this actor started late, or the learner
                # was fast): it never yields a step committed before it began. Load the newest now.
                await hot_load(ckpt)
        tg.cancel_scope.cancel()
    ms = sorted(v * 1e3 for v in lags)
    p99 = ms[int(len(ms) * 0.99)] if ms else float("nan")
    print(f"{name}: versions seen {versions}; {len(versions)} hot-loads; loop lag p99 {p99:.2f} ms, "
          f"max {ms[-1]:.2f} ms", flush=True)  # fmt: skip
    if not versions:
        raise SystemExit(f"{name}: saw no version")


def run(role: str, root: str, args: argparse.Namespace) -> None:
    # Three processes share this machine: give each one intra-op thread, as a deployment would. With
    # torch's default (one per CPU) the OpenMP workers of three processes oversubscribe the CPUs and
    # every small forward pass on an actor's event loop waits for them (loop-lag p99 ~60 ms on 2 vCPUs,
    # with or without checkpointing).
    torch.set_num_threads(1)
    if role == "learner":
        asyncio.run(learner(Path(root), args.steps, args.save_every, args.table_mb))
    else:
        asyncio.run(actor(role, Path(root), args.table_mb))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default=None, help="checkpoint root (default: a temporary dir)")
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--save-every", type=int, default=10)
    parser.add_argument(
        "--table-mb", type=float, default=0.0, help="add a lookup table of this many MB to the policy"
    )
    args = parser.parse_args()
    if args.steps < 1 or args.save_every < 1 or args.table_mb < 0:
        parser.error("--steps and --save-every must be at least 1, --table-mb not negative")
    if args.root is not None and Path(args.root).exists() and any(Path(args.root).iterdir()):
        # A run's steps and its "learner-done" marker would meet the next run's (step 10 exists).
        parser.error(f"--root {args.root} is not empty: each run starts a new learner")
    root = Path(args.root or tempfile.mkdtemp(prefix="aiockpt-rl-"))
    root.mkdir(parents=True, exist_ok=True)
    ctx = mp.get_context("spawn")
    roles = ["actor-1", "actor-2", "learner"]  # actors first: they must see the learner's saves
    procs = [ctx.Process(target=run, args=(role, str(root), args), name=role) for role in roles]
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.join(120)
        failed = [p.name for p in procs if p.exitcode != 0]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        if args.root is None:
            shutil.rmtree(root, ignore_errors=True)
    if failed:
        print(f"failed: {failed}", file=sys.stderr)
        return 1
    print("all processes finished")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
