"""RL-style weight sharing: a learner saves, two actors watch and hot-load while they keep serving.

    python examples/rl_learner_actor.py [--steps 120] [--save-every 10]

Three processes share one checkpoint root. The learner trains a small policy and saves every
``--save-every`` steps with ``async_op=True`` and ``on_busy="skip"``: it never waits for the disk, and a
save that would have to wait is skipped. Each actor runs one asyncio loop that serves the policy every
2 ms while ``async for step in ckpt.watch()`` follows the learner: each new step is loaded into a spare
policy (``await ckpt.load``, which never blocks the loop), checked against the fingerprint the learner
stored with it, and swapped in, so inference never sees half-loaded weights. Each actor prints the
versions it saw and its event-loop lag.
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


def make_policy() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 8))


def fingerprint(policy: nn.Module) -> float:
    return float(sum(p.detach().double().sum() for p in policy.parameters()))


async def learner(root: Path, steps: int, save_every: int) -> None:
    policy = make_policy()
    optim = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    saved, skipped = [], 0
    async with aiockpt.Checkpointer(root, keep_last=3, max_inflight=1, on_busy="skip") as ckpt:
        for step in range(1, steps + 1):
            x = torch.randn(64, 32)
            loss = policy(x).square().mean()
            loss.backward()
            optim.step()
            optim.zero_grad()
            await asyncio.sleep(0.005)  # the rest of a learner's step: rollouts, queues
            if step % save_every == 0 or step == steps:
                state = {"policy": policy, "step": step, "fingerprint": fingerprint(policy)}
                handle = await ckpt.save(state, step=step, async_op=True)
                if handle.skipped:
                    skipped += 1
                else:
                    saved.append(step)
        await ckpt.wait()
        if steps not in ckpt.steps():  # the last save may have been skipped: make it durable
            await ckpt.save({"policy": policy, "step": steps, "fingerprint": fingerprint(policy)}, step=steps)
            saved.append(steps)
    (root / DONE).write_text(str(steps))
    print(f"learner: saved steps {saved}, skipped {skipped} save(s) while one was still writing", flush=True)


async def actor(name: str, root: Path) -> None:
    serving, spare = make_policy(), make_policy()
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

    async def follow(ckpt: aiockpt.Checkpointer) -> None:
        nonlocal serving, spare
        async for _ in ckpt.watch(poll_interval=0.05):
            target: dict[str, object] = {"policy": spare, "step": 0, "fingerprint": 0.0}
            step = await ckpt.load(target)  # the newest committed step, even if more landed meanwhile
            assert step is not None
            assert target["step"] == step
            if fingerprint(spare) != target["fingerprint"]:
                raise RuntimeError(f"{name}: weights of step {step} do not match the learner's fingerprint")
            serving, spare = spare, serving
            versions.append(step)

    async def until_learner_done() -> None:
        marker = anyio.Path(root / DONE)
        while True:
            if await marker.exists() and versions and versions[-1] >= int(await marker.read_text()):
                return
            await anyio.sleep(0.05)

    async with aiockpt.Checkpointer(root) as ckpt, anyio.create_task_group() as tg:
        for task in (measure_lag, serve):
            tg.start_soon(task)
        tg.start_soon(follow, ckpt)
        with anyio.fail_after(60):
            await until_learner_done()
        tg.cancel_scope.cancel()
    ms = sorted(v * 1e3 for v in lags)
    p99 = ms[int(len(ms) * 0.99)] if ms else float("nan")
    print(f"{name}: versions seen {versions}; {len(versions)} hot-loads; loop lag p99 {p99:.2f} ms, "
          f"max {ms[-1]:.2f} ms", flush=True)  # fmt: skip
    if not versions:
        raise SystemExit(f"{name}: saw no version")


def run(role: str, root: str, args: argparse.Namespace) -> None:
    if role == "learner":
        asyncio.run(learner(Path(root), args.steps, args.save_every))
    else:
        asyncio.run(actor(role, Path(root)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default=None, help="checkpoint root (default: a temporary dir)")
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--save-every", type=int, default=10)
    args = parser.parse_args()
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
