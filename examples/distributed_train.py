r"""Data-parallel FSDP2 training on CPU, launched by torchrun, with async checkpoints and resume.

    python -m torch.distributed.run --standalone --nproc-per-node 2 examples/distributed_train.py \
        --root /tmp/dist-ckpt --steps 40 --save-every 10

Every rank runs the same asyncio loop on a ``fully_shard``-ed MLP (gloo, CPU), training on its own shard of
a synthetic regression dataset. The forward/backward/optimizer step runs in a worker thread, so the event
loop stays free to drive the checkpoint in flight.

* Every ``--save-every`` steps all ranks call ``await ckpt.save(state, step=step, async_op=True)`` with the
  same step (saves are collective): the call returns once this rank's shards are *staged* (copied aside),
  training goes on, each rank writes its own shards and rank 0 publishes the checkpoint once every rank has
  written its part. The previous save is awaited before the next one starts.
* On start, ``step = await ckpt.load(state)`` restores the latest committed step (model and AdamW state
  are DTensor shards; they load into whatever world size this launch has), or returns ``None``. A rank
  the saved run did not have keeps its freshly seeded noise generator (below).
* ``--stop-at`` ends a launch early, as a preemption would (the save in flight still completes); launching
  again resumes from the last committed step.
* Each rank adds noise of its own to its inputs, from a generator seeded per rank. Its state is saved
  under one key, ``"rng"``, on every rank, and each rank gets its own back (per-rank state): a resumed
  run on as many ranks draws the same noise, so it trains exactly as an uninterrupted one.

Rank 0 prints the progress: the global loss, how long each save took to stage (the training stall) and to
become durable.
"""

from __future__ import annotations

import argparse
import asyncio

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn import functional as F

import aiockpt

FEATURES, HIDDEN, BATCH, SAMPLES = 16, 64, 32, 4096


def dataset() -> tuple[torch.Tensor, torch.Tensor]:
    """The whole synthetic dataset, the same on every rank: y = sin(2 x.w) for a fixed w."""
    gen = torch.Generator().manual_seed(1234)
    x = torch.randn(SAMPLES, FEATURES, generator=gen)
    w = torch.randn(FEATURES, 1, generator=gen) / FEATURES**0.5
    return x, torch.sin(2 * x @ w)


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


async def train(args: argparse.Namespace) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    torch.manual_seed(0)  # the same initial weights on every rank, before sharding
    model = nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, 1))
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(100 + rank)  # this rank's input noise (below)
    state: dict[str, object] = {"model": model, "optim": optim, "step": 0, "rng": torch.get_rng_state()}

    xs, ys = dataset()
    xs, ys = xs[rank::world], ys[rank::world]  # this rank's shard of the data

    def train_step(step: int) -> float:
        """One step on this rank's batch number ``step``; returns the loss averaged over all ranks.

        The batch is a function of ``step``, so a resumed run trains on the very batches it would have.
        """
        rows = torch.arange((step - 1) * BATCH, step * BATCH) % len(xs)
        noisy = xs[rows] + 0.05 * torch.randn(BATCH, FEATURES)  # from this rank's generator
        loss = F.mse_loss(model(noisy), ys[rows])
        optim.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]  # unannotated in torch; FSDP2 reduce-scatters here
        optim.step()
        total = loss.detach().clone()
        dist.all_reduce(total)  # gloo has no AVG: sum, then divide
        return total.item() / world

    def say(msg: str) -> None:
        if rank == 0:
            print(msg, flush=True)

    async def durable(handle: aiockpt.SaveHandle) -> None:
        """Wait until the save is committed on every rank, then say what it cost."""
        meta = await handle  # the checkpoint's Metadata, or the save's error
        phases = ", ".join(f"{k} {ms(meta.timings[k])}" for k in ("stage", "write", "finish"))
        say(
            f"  checkpoint {meta.step} durable {ms(handle.metrics.total_seconds)} after the call "
            f"({phases}); {meta.nbytes} bytes from {meta.world_size} rank{'s' * (meta.world_size > 1)}"
        )

    async with aiockpt.Checkpointer(args.root, keep_last=2) as ckpt:
        # A rank the saved run did not have (the world grew) has no generator of its own to resume.
        grown = bool(ckpt.steps()) and rank >= (await ckpt.metadata()).world_size
        target = {k: v for k, v in state.items() if not (grown and k == "rng")}
        resumed = await ckpt.load(target)  # the latest committed step, or None
        state.update(target)
        torch.set_rng_state(state["rng"])  # type: ignore[arg-type]  # this rank's own, as it saved it
        start = 0 if resumed is None else resumed
        how = "starting from scratch" if resumed is None else f"resumed from step {start}"
        say(f"world size {world}: {how}")
        pending: aiockpt.SaveHandle | None = None  # the save in flight
        for step in range(start + 1, args.steps + 1):
            loss = await asyncio.to_thread(train_step, step)
            state["step"] = step
            if step % args.save_every == 0:
                if pending is not None:
                    await durable(pending)  # one save in flight at a time
                state["rng"] = torch.get_rng_state()
                pending = await ckpt.save(state, step=step, async_op=True)  # every rank, the same step
                say(
                    f"step {step:4d}  loss {loss:.5f}  save started: staged in "
                    f"{ms(pending.metrics.staging_seconds)}, written in the background"
                )
            if step == args.stop_at:
                say(f"stopping at step {step} (as if preempted)")
                break
        if pending is not None:
            await durable(pending)
        say(f"committed steps: {ckpt.steps()}")


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--root", required=True, help="checkpoint root directory (shared by all ranks)")
    parser.add_argument("--steps", type=int, default=40, help="train up to this step")
    parser.add_argument("--save-every", type=int, default=10, help="checkpoint every N steps")
    parser.add_argument("--stop-at", type=int, default=0, help="end this launch after that step")
    args = parser.parse_args()
    dist.init_process_group("gloo")  # torchrun sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT
    try:
        asyncio.run(train(args))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
