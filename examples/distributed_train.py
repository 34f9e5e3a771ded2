r"""Data-parallel FSDP2 training on CPU, launched by torchrun, with async checkpoints and resume.

    python -m torch.distributed.run --standalone --nproc-per-node 2 examples/distributed_train.py \\
        --root /tmp/dist-ckpt --steps 40 --save-every 10

Each rank trains a ``fully_shard``-ed MLP on its own slice of a synthetic dataset (gloo, CPU). Every
``--save-every`` steps all ranks call ``await ckpt.save(state, step=step, async_op=True)``: the call
returns once this rank's shards are staged, training goes on, and rank 0 publishes the checkpoint once
every rank has written its part. On start, ``await ckpt.load(state)`` resumes from the latest committed
step, into whatever world size this launch has. ``--stop-at`` ends a launch early, as a preemption would;
launching again resumes.
"""

from __future__ import annotations

import argparse
import asyncio
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import aiockpt


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step * 1000 + rank)
    x = torch.randn(32, 16, generator=gen)
    return x, x.sin().sum(dim=1, keepdim=True)


async def train(args: argparse.Namespace) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 1))
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state: dict[str, object] = {"model": model, "optim": optim, "step": 0}

    def say(msg: str) -> None:
        if rank == 0:
            print(msg, flush=True)

    async with aiockpt.Checkpointer(args.root, keep_last=2) as ckpt:
        resumed = await ckpt.load(state)
        start = 0 if resumed is None else int(state["step"])  # type: ignore[call-overload]
        say(
            f"world size {world}: "
            + ("starting from scratch" if resumed is None else f"resumed from step {start}")
        )
        handle: aiockpt.SaveHandle | None = None
        for step in range(start + 1, args.steps + 1):
            x, y = batch(step, rank)
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()  # type: ignore[no-untyped-call]
            optim.step()
            optim.zero_grad()
            state["step"] = step
            if step % args.save_every == 0:
                if handle is not None:
                    await handle  # one save in flight at a time
                t0 = time.perf_counter()
                handle = await ckpt.save(state, step=step, async_op=True)
                staged_ms = (time.perf_counter() - t0) * 1e3
                say(f"step {step:4d}  loss {loss.item():.5f}  save staged in {staged_ms:.1f} ms")
            if step == args.stop_at:
                say(f"stopping at step {step} (as if preempted)")
                break
        if handle is not None:
            meta = await handle
            say(f"last checkpoint: step {meta.step}, {meta.nbytes} bytes, written by {meta.world_size} ranks")
        say(f"committed steps: {ckpt.steps()}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", required=True)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--save-every", type=int, default=10)
    parser.add_argument("--stop-at", type=int, default=0)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    try:
        asyncio.run(train(args))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
