"""GPU paths: staging from CUDA tensors into pinned memory, loading into CUDA tensors, stream order.

Skipped where CUDA is not available (CI, the CPU machines); run on a GPU machine with ``pytest -m gpu``.
The stream tests fail when a save's device-to-host copy, or a load's host-to-device copy, is enqueued on
a worker thread's default stream instead of the caller's current stream: a kernel the caller enqueued
before the call on a side stream then has not run yet when the copy does.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch
from conftest import (
    assert_child_exits_cleanly,
    assert_tree_equal,
    dtype_params,
    get_dtype,
    layouts,
    make_model,
    make_optimizer,
    mapping_at,
    random_tensor,
    resident_memory,
    snapshot,
    tensor_at,
    tensors_in,
    zero_tensor,
)

import aiockpt
import aiockpt.sync
from aiockpt._memory import StagingPool
from aiockpt._pages import HUGE_PAGE

from distributed_util import run_world

F = TypeVar("F", bound=Callable[..., Any])

CUDA = torch.cuda.is_available()


def on_gpu(fn: F) -> F:
    """Mark a test ``gpu`` and skip it where CUDA is not available."""
    marked: F = pytest.mark.gpu(pytest.mark.skipif(not CUDA, reason="needs a CUDA device")(fn))
    return marked


# GPU cycles a side-stream kernel sleeps before writing: about 0.1-0.3 s on current GPUs, far longer
# than a copy of the few MiB these tests save takes to be enqueued and run.
_SLEEP_CYCLES = 300_000_000


def _stream() -> torch.cuda.Stream:
    return torch.cuda.Stream()  # type: ignore[no-untyped-call]


def _sleep_on_gpu() -> None:
    """Keep the current stream busy for a while: work enqueued after this runs late."""
    torch.cuda._sleep(_SLEEP_CYCLES)  # type: ignore[no-untyped-call]


def _scribble(tree: object) -> None:
    """Overwrite every byte of every tensor's storage (any dtype, any layout)."""
    for t in tensors_in(tree):
        torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage()).fill_(0x5A)


def test_without_cuda_in_use_calls_run_unwrapped() -> None:
    """A process that never touched CUDA notes nothing: worker calls are not wrapped at all."""
    from aiockpt import _cuda  # here: the GPU tests also run against versions without this module

    if torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        pytest.skip("CUDA is in use in this process")
    assert _cuda.caller() is None

    def fn() -> int:
        return 1

    with _cuda.noting():
        assert _cuda.as_caller(fn) is fn


@pytest.mark.parametrize("copies", ["one by one", "scattered", "scattered, out of memory"])
def test_device_reader_verifies_runs_and_copies_them_into_their_sinks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, copies: str
) -> None:
    """The reader of GPU-bound runs, on CPU sinks: bytes land at their places, damage is reported."""
    import crc32c

    from aiockpt._load import _device
    from aiockpt._load._device import DeviceReader
    from aiockpt._runs import Piece, group, split

    scattered: list[int] = []
    if copies != "one by one":  # the last two spans (150,000 and 70,000 bytes) are scattered, not the first
        monkeypatch.setattr(_device, "_SCATTER_BELOW", 180_000)
        monkeypatch.setattr(_device, "_SCATTER_BATCH", 1)  # in two _foreach_copy_ calls
        real_scatter = _device._scatter

        def spy(buffer: torch.Tensor, spans: list[_device.Span]) -> None:
            scattered.append(len(spans))
            real_scatter(buffer, spans)

        monkeypatch.setattr(_device, "_scatter", spy)
    if copies == "scattered, out of memory":

        def out_of_memory(self: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory")

        monkeypatch.setattr(torch.Tensor, "to", out_of_memory)

    block = 64 << 10
    gen = torch.Generator().manual_seed(5)
    # Three chunks with alignment gaps between them: the first two land side by side in one sink (so the
    # gap between them must not be copied), the third in the middle of a larger one.
    layout = [(0, 200_000), (200_704, 150_000), (352_256, 70_000)]
    size = layout[-1][0] + layout[-1][1]
    data = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=gen)
    path = tmp_path / "data.bin"
    path.write_bytes(data.numpy().tobytes())
    first_two = torch.zeros(350_000, dtype=torch.uint8)
    third = torch.zeros(80_000, dtype=torch.uint8)[10_000:]
    places = [(first_two, 0), (first_two, 200_000), (third, 0)]
    sizes = memoryview(bytearray(size))  # only lengths are taken from it
    pieces: list[Piece] = []
    checksums: list[tuple[int, ...]] = []
    for item, (offset, n) in enumerate(layout):
        pieces += split(offset, sizes[:n], item, block)
        raw = data.numpy().tobytes()[offset : offset + n]
        checksums.append(tuple(crc32c.crc32c(raw[i : i + block]) for i in range(0, n, block)))
    runs = group(pieces)
    assert len(runs) == 1, "the gaps are small: one run, three sinks"

    def locate(p: Piece) -> tuple[torch.Tensor, int]:
        sink, at = places[p.item]
        return sink, at + p.offset - layout[p.item][0]

    def landed(item: int) -> torch.Tensor:
        sink, at = places[item]
        return sink[at : at + layout[item][1]]

    reader = DeviceReader(max(r.end - r.offset for r in runs))
    fd = os.open(path, os.O_RDONLY)
    try:
        assert reader.read(fd, runs[0], locate, checksums) == ([], [])
        for item, (offset, n) in enumerate(layout):
            assert torch.equal(landed(item), data[offset : offset + n]), f"chunk {item}"
        assert scattered == ([] if copies == "one by one" else [2])

        first_two.zero_()
        third.zero_()
        damaged = [*checksums[:1], (checksums[1][0] ^ 1, *checksums[1][1:]), *checksums[2:]]
        short, bad = reader.read(fd, runs[0], locate, damaged)
        assert short == []
        assert [(p.item, p.block) for p in bad] == [(1, 0)]
        assert not first_two.any(), "nothing of a damaged run is copied"
        assert not third.any(), "nothing of a damaged run is copied"

        past = group(split(size - 1000, sizes[:5000], 0, block))[0]  # runs past the end of the file
        short, bad = reader.read(fd, past, locate, None)
        assert (len(short), bad) == (1, [])
    finally:
        os.close(fd)


class _FakeCudart:
    """Stands in for ``torch.cuda.cudart()``: records registrations, fails them when told to."""

    class cudaError:  # the runtime's names
        success = 0
        memory_allocation = 2

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.calls: list[tuple[str, int, int]] = []
        self.resident: bytes | None = None  # which pages were touched when registered (mincore)

    def cudaHostRegister(self, address: int, size: int, flags: int) -> int:
        self.calls.append(("register", address, size))
        self.resident = resident_memory(address, size)
        return self.cudaError.memory_allocation if self.fail else self.cudaError.success

    def cudaHostUnregister(self, address: int) -> int:
        self.calls.append(("unregister", address, 0))
        return self.cudaError.success


def _asks_torch_for_pinned_memory(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, object]]:
    """Make ``torch.empty`` record its keyword arguments and allocate unpinned memory (there is no CUDA)."""
    asked: list[dict[str, object]] = []
    real_empty = torch.empty

    def empty(*args: Any, **kwargs: Any) -> torch.Tensor:
        asked.append(kwargs)
        return real_empty(*args, **{k: v for k, v in kwargs.items() if k != "pin_memory"})

    monkeypatch.setattr(torch, "empty", empty)
    return asked


def _fake_cuda(monkeypatch: pytest.MonkeyPatch, *, fail: bool = False) -> _FakeCudart:
    """Registration calls faked (there is no CUDA), and pinned staging asked for as if there were."""
    from aiockpt import _memory

    fake = _FakeCudart(fail)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(_memory, "cuda_available", lambda: True)
    return fake


def test_pinned_buffer_is_exactly_as_large_as_asked_and_unregistered_when_its_last_view_dies(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # CPU-only: the registration calls are faked; what is checked is the size, and that the pages are
    # unregistered once (not before the last view of the tensor is gone, and before they are unmapped).
    from aiockpt import _cuda

    fake = _fake_cuda(monkeypatch)
    n = 3 * 2**20 + 5  # torch's pinned allocator would take 4 MiB
    buf = _cuda.pinned_empty(n)
    assert buf.numel() == n
    assert buf.dtype == torch.uint8
    assert fake.calls == [("register", buf.data_ptr(), n)]
    # Registering untouched pages faults them in under the process's mmap_lock, stalling the event
    # loop's thread should it map memory meanwhile (start a worker thread): they are touched before.
    if fake.resident is not None:
        assert all(fake.resident), f"{fake.resident.count(0)} of {len(fake.resident)} pages not touched"
    if sys.platform == "linux":  # private, huge pages where given, not inherited by a forked child
        assert buf.data_ptr() % HUGE_PAGE == 0
        mapping = mapping_at(buf.data_ptr())
        assert mapping is not None
        _, perms, flags = mapping
        assert perms.endswith("p")
        assert "dc" in flags
        assert "hg" in flags
    buf.fill_(7)
    view = buf[n - 10 :]
    del buf
    gc.collect()
    assert len(fake.calls) == 1, "a view still uses the memory"
    assert int(view.sum()) == 70
    del view
    gc.collect()
    assert [c[0] for c in fake.calls] == ["register", "unregister"]
    assert fake.calls[1][1] == fake.calls[0][1]

    # Where registering fails, torch's own pinned allocator is used (here: faked, as there is no CUDA).
    fake = _fake_cuda(monkeypatch, fail=True)
    asked = _asks_torch_for_pinned_memory(monkeypatch)
    buf = _cuda.pinned_empty(n)
    assert buf.numel() == n
    assert asked == [{"dtype": torch.uint8, "pin_memory": True}]
    del buf
    gc.collect()
    assert [c[0] for c in fake.calls] == ["register"], "nothing to unregister"


def test_pinned_buffer_falls_back_to_torchs_allocator_without_private_mappings(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import mmap

    from aiockpt import _cuda

    fake = _FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    monkeypatch.delattr(mmap, "MAP_PRIVATE")  # as on Windows
    asked = _asks_torch_for_pinned_memory(monkeypatch)
    assert _cuda.pinned_empty(100).numel() == 100
    assert asked == [{"dtype": torch.uint8, "pin_memory": True}]
    assert fake.calls == []


@on_gpu
@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental:UserWarning")  # torch, on complex32
@pytest.mark.parametrize("async_op", [False, True], ids=["durable", "async_op"])
@pytest.mark.parametrize("name", dtype_params())
async def test_every_dtype_and_layout_round_trips_from_and_into_gpu(
    tmp_path: Path, name: str, async_op: bool
) -> None:
    dtype = get_dtype(name)
    # The same bases drawn twice: one tree on the CPU (the expectation), one on the GPU (saved), so
    # that the GPU tree has the same views and the comparisons need no CUDA kernel for this dtype.
    gen_a, gen_b = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    expected = layouts(lambda shape: random_tensor(dtype, shape, gen_a))
    state = layouts(lambda shape: random_tensor(dtype, shape, gen_b).cuda())
    expected["tied"] = [tensor_at(expected, "full"), tensor_at(expected, "full")[1:3]]
    state["tied"] = [tensor_at(state, "full"), tensor_at(state, "full")[1:3]]  # one storage, two keys
    path = tmp_path / "ckpt"
    if async_op:
        handle = await aiockpt.save(state, path, async_op=True)
        _scribble(state)  # staged: mutating the GPU tensors must not change what is written
        await handle
    else:
        await aiockpt.save(state, path)
    read = await aiockpt.read(path)
    assert all(t.is_cpu for t in tensors_in(read))
    assert_tree_equal(read, expected)

    target = layouts(lambda shape: zero_tensor(dtype, shape).cuda())
    full = tensor_at(target, "full")
    target["tied"] = [full, full[1:3]]
    before = {id(t) for t in tensors_in(target)}
    await aiockpt.load(target, path)
    assert all(t.is_cuda and id(t) in before for t in tensors_in(target)), "loaded in place, on the GPU"
    assert tensor_at(target, "tied", 1).data_ptr() == full[1:3].data_ptr()
    assert_tree_equal(await aiockpt.read(path), expected)  # unchanged by the load
    assert_tree_equal(target, expected)


@on_gpu
async def test_training_state_round_trips_on_gpu_into_fresh_objects(root: Path) -> None:
    model = make_model(0).cuda()
    opt = make_optimizer(model)
    for i in range(3):
        x = torch.randn(16, 4, device="cuda", generator=torch.Generator("cuda").manual_seed(i))
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    state = {"model": model, "optim": opt, "rng": torch.cuda.get_rng_state(), "step": 3}
    expected = snapshot(state)
    async with aiockpt.Checkpointer(root) as ckpt:
        handle = await ckpt.save(state, step=3, async_op=True)
        with torch.no_grad():  # the loop goes on: parameters change on the GPU while the write runs
            for p in model.parameters():
                p.add_(1.0)
        await handle

        fresh = make_model(1).cuda()
        fresh_opt = make_optimizer(fresh)  # never stepped: no per-parameter state yet
        target = {"model": fresh, "optim": fresh_opt, "rng": torch.cuda.get_rng_state(), "step": 0}
        assert await ckpt.load(target) == 3
    assert_tree_equal(snapshot(target), expected)
    assert all(p.is_cuda for p in fresh.parameters())
    exp_avg = [s["exp_avg"] for s in fresh_opt.state.values()]
    assert exp_avg
    assert all(t.is_cuda for t in exp_avg), "optimizer state follows its parameters"


@on_gpu
async def test_checkpoints_move_between_cpu_and_gpu(tmp_path: Path) -> None:
    cpu_model = make_model(0)
    gpu_model = make_model(1).cuda()
    await aiockpt.save({"model": cpu_model}, tmp_path / "from-cpu")
    await aiockpt.load({"model": gpu_model}, tmp_path / "from-cpu")
    assert_tree_equal(gpu_model.state_dict(), cpu_model.state_dict())
    assert all(p.is_cuda for p in gpu_model.parameters())

    with torch.no_grad():
        for p in gpu_model.parameters():
            p.mul_(3.0)
    await aiockpt.save({"model": gpu_model}, tmp_path / "from-gpu")
    await aiockpt.load({"model": cpu_model}, tmp_path / "from-gpu")
    assert_tree_equal(cpu_model.state_dict(), gpu_model.state_dict())


@on_gpu
async def test_staging_buffer_is_pinned_and_reused(root: Path) -> None:
    state = {"w": torch.randn(1 << 20, device="cuda")}
    async with aiockpt.Checkpointer(root, keep_last=5) as ckpt:
        await ckpt.save(state, step=1)
        pool = ckpt._pool
        (first,) = pool._free
        assert first.is_pinned()
        for step in range(2, 5):
            state["w"].add_(1.0)
            meta = await ckpt.save(state, step=step)
            assert meta.step == step
            (again,) = pool._free
            assert again.data_ptr() == first.data_ptr(), "the pinned buffer is reused, not reallocated"
        assert torch.equal(tensor_at(await ckpt.read(4), "w"), state["w"].cpu())


@on_gpu
async def test_staging_buffer_is_as_large_as_the_state_and_not_torch_cached_pinned_memory(root: Path) -> None:
    from aiockpt._save import _stage

    # 3 MiB and 12 bytes (and alignment): torch's pinned allocator would hand out (and keep) 4 MiB.
    state = {"w": torch.randn(3 << 18, device="cuda"), "b": torch.randn(3, device="cuda")}
    stats = getattr(torch.cuda.memory, "host_memory_stats", None)
    before = stats()["allocated_bytes.current"] if stats else None
    async with aiockpt.Checkpointer(root) as ckpt:
        handle = await ckpt.save(state, step=1, async_op=True)
        _scribble(state)
        await handle
        (buffer,) = ckpt._pool._free
        assert buffer.is_pinned()
        assert buffer.numel() == _stage.plan_stage(state, copy=True, allow_pickle=False).total < 4 << 20
        if stats:
            assert stats()["allocated_bytes.current"] == before, "not from torch's caching host allocator"
    assert not ckpt._pool._free


async def test_one_shot_pools_borrow_pinned_buffers_of_exact_size_from_a_keeper(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # CPU-only, registration faked. torch's caching allocator made its first 2.1 GiB block in 1.99 s
    # while the event loop's mmap waited 1.88 s for it (H100): one-shot saves borrow kept buffers of
    # their own instead, and only make one (registered, touched first) for a size not kept.
    from aiockpt import _memory

    fake = _fake_cuda(monkeypatch)
    asked = _asks_torch_for_pinned_memory(monkeypatch)
    keeper = _memory.PinnedKeeper(keep=2)

    async def one_save(nbytes: int) -> int:
        pool = StagingPool(pinned_from=keeper)
        buf = pool.take(await pool.claim(nbytes, pinned=True))
        assert buf.numel() == nbytes
        address = buf.data_ptr()
        pool.release(buf)
        del buf
        pool.close()
        return address

    n = 3 * 2**20 + 5
    first = await one_save(n)
    assert await one_save(n) == first, "kept and lent again"
    assert [c[0] for c in fake.calls] == ["register"]
    assert keeper.held_bytes == n
    await one_save(n + 4096)  # another size: made, and kept beside the first
    await one_save(n + 8192)  # a third: the oldest kept is freed
    gc.collect()
    assert [c for c in fake.calls if c[0] == "unregister"] == [("unregister", first, 0)]
    assert keeper.held_bytes == 2 * n + 12288
    assert asked == [], "torch's caching pinned allocator is not asked"
    assert keeper.take(n + 8192).numel() == n + 8192  # (freed with the fake still in place)
    assert keeper.take(n + 4096).numel() == n + 4096
    assert keeper.held_bytes == 0


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork on this platform")
def test_a_forked_child_makes_its_own_one_shot_pinned_buffers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Kept buffers are MADV_DONTFORK: in a child their addresses hold nothing (touching: SIGSEGV)."""
    from aiockpt._memory import ONE_SHOT_PINNED

    _fake_cuda(monkeypatch)
    n = 1 << 20
    kept = ONE_SHOT_PINNED.take(n)
    address = kept.data_ptr()
    ONE_SHOT_PINNED.give(kept)
    del kept
    pid = os.fork()
    if pid == 0:  # the child: no pytest, no event loop; only the keeper (and no torch kernels: their
        code = 1  # thread pool does not survive a fork)
        try:
            buf = ONE_SHOT_PINNED.take(n)  # the parent's kept one would be unmapped here
            ctypes.memset(buf.data_ptr(), 1, n)
            code = 0 if ctypes.string_at(buf.data_ptr() + n - 1, 1) == b"\x01" else 2
        finally:
            os._exit(code)
    try:
        assert_child_exits_cleanly(pid)
    finally:
        again = ONE_SHOT_PINNED.take(n)  # the parent still has it; freed with the fake in place
    assert again.data_ptr() == address


@on_gpu
async def test_one_shot_saves_of_gpu_tensors_stage_in_kept_pinned_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from aiockpt import _api, _memory
    from aiockpt._cuda import pinned_empty

    keeper = _memory.PinnedKeeper(keep=2)
    monkeypatch.setattr(_api, "ONE_SHOT_PINNED", keeper)
    made: list[int] = []

    def spy(nbytes: int) -> torch.Tensor:
        made.append(nbytes)
        return pinned_empty(nbytes)

    monkeypatch.setattr(_memory, "pinned_empty", spy)
    state = {"w": torch.randn(3 << 18, device="cuda"), "b": torch.arange(10, device="cuda")}
    await aiockpt.save(state, tmp_path / "a")
    state["w"].add_(1.0)
    expected = {k: v.cpu() for k, v in state.items()}
    handle = await aiockpt.save(state, tmp_path / "b", async_op=True)
    _scribble(state)
    await handle
    assert len(made) == 1, "the second save borrowed the first one's buffer"
    assert keeper.held_bytes == made[0]
    (buffer,) = keeper._kept
    assert buffer.is_pinned()
    assert_tree_equal(await aiockpt.read(tmp_path / "b"), expected)


class _RegisteringTwice:
    """Wraps ``torch.cuda.cudart()``: each registration fails (the range is registered twice, then undone)."""

    def __init__(self, real: Any) -> None:
        self.real = real
        self.cudaError = real.cudaError

    def cudaHostRegister(self, address: int, size: int, flags: int) -> object:
        assert self.real.cudaHostRegister(address, size, flags) == self.cudaError.success
        err = self.real.cudaHostRegister(address, size, flags)  # already registered: fails
        self.real.cudaHostUnregister(address)
        return err

    def cudaHostUnregister(self, address: int) -> object:
        return self.real.cudaHostUnregister(address)


@on_gpu
def test_a_failed_registration_falls_back_to_torch_and_leaves_no_cuda_error_behind(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The runtime keeps a failed call's error for the thread's next kernel launch check; pinned_empty
    # registers in a thread of its own, so the caller's next kernel is not failed by it.
    from aiockpt import _cuda

    real = torch.cuda.cudart()  # type: ignore[no-untyped-call]
    monkeypatch.setattr(torch.cuda, "cudart", lambda: _RegisteringTwice(real))
    buf = _cuda.pinned_empty(3 << 20)
    assert buf.numel() == 3 << 20
    assert buf.is_pinned()
    x = torch.ones(4, device="cuda").mul_(2)
    torch.cuda.synchronize()
    assert float(x.sum()) == 8.0


@on_gpu
@pytest.mark.parametrize("cat", ["works", "out of memory"])
async def test_many_small_gpu_tensors_are_gathered_in_groups(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cat: str
) -> None:
    from aiockpt._save import _stage

    monkeypatch.setattr(_stage, "_GATHER", 1000)  # groups of a few tensors
    if cat == "out of memory":

        def out_of_memory(group: list[torch.Tensor]) -> torch.Tensor:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 1000 bytes")

        monkeypatch.setattr(torch, "cat", out_of_memory)
    gen_a, gen_b = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    dtypes = [torch.float32, torch.bfloat16, torch.bool, torch.int64, torch.complex64, torch.uint8]
    shapes = [(), (7,), (3, 5), (33, 2), (5, 40)]
    expected = {f"t{i}": random_tensor(dtypes[i % 6], shapes[i % 5], gen_a) for i in range(120)}
    state = {f"t{i}": random_tensor(dtypes[i % 6], shapes[i % 5], gen_b).cuda() for i in range(120)}
    state["t7"] = state["t7"].t()  # non-contiguous, as expected["t7"]
    expected["t7"] = expected["t7"].t()
    handle = await aiockpt.save(state, tmp_path / "ckpt", async_op=True)
    _scribble(state)
    await handle
    assert_tree_equal(await aiockpt.read(tmp_path / "ckpt"), expected)


@on_gpu
async def test_async_save_copies_after_the_callers_side_stream_work(tmp_path: Path) -> None:
    t = torch.zeros(1 << 20, device="cuda")
    torch.cuda.synchronize()
    side = _stream()
    with torch.cuda.stream(side):
        _sleep_on_gpu()
        t.fill_(7.0)  # runs on the side stream only after the sleep
        handle = await aiockpt.save({"t": t}, tmp_path / "ckpt", async_op=True)
        t.fill_(9.0)  # staged: mutating it now must not change what is saved
    await handle
    saved = tensor_at(await aiockpt.read(tmp_path / "ckpt"), "t")
    assert torch.equal(saved, torch.full_like(saved, 7.0))


@on_gpu
async def test_load_copies_after_pending_reads_and_is_done_on_return(tmp_path: Path) -> None:
    await aiockpt.save({"t": torch.full((1 << 20,), 5.0)}, tmp_path / "ckpt")
    dst = torch.zeros(1 << 20, device="cuda")
    torch.cuda.synchronize()
    side = _stream()
    with torch.cuda.stream(side):
        _sleep_on_gpu()
        before = dst * 1  # a pending reader of the old values, as an actor's inference would be
        await aiockpt.load({"t": dst}, tmp_path / "ckpt")
    other = _stream()  # no order with the side stream: sees the values only if the copy is done
    with torch.cuda.stream(other):
        after = dst.clone()
    side.synchronize()
    other.synchronize()
    assert torch.equal(before, torch.zeros_like(before)), "the load overwrote a tensor still being read"
    assert torch.equal(after, torch.full_like(after, 5.0)), "the load returned before its copy was done"


@on_gpu
def test_blocking_facade_copies_after_its_callers_side_stream(root: Path) -> None:
    t = torch.zeros(1 << 20, device="cuda")
    torch.cuda.synchronize()
    results: list[object] = []

    def loop() -> None:  # a synchronous training loop on a thread of its own, on a stream of its own
        side = _stream()
        with aiockpt.sync.Checkpointer(root) as ckpt, torch.cuda.stream(side):
            _sleep_on_gpu()
            t.fill_(3.0)
            handle = ckpt.save({"t": t}, step=1, async_op=True)
            t.fill_(4.0)
            handle.result()
            results.append(ckpt.read(1))

    thread = threading.Thread(target=loop)
    thread.start()
    thread.join(60)
    saved = tensor_at(results[0], "t")
    assert torch.equal(saved, torch.full_like(saved, 3.0))


async def _save_cuda_shards(rank: int, world: int, path: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cuda", (world,))
    full = torch.arange(12 * 10, dtype=torch.float32).reshape(12, 10)
    rows = full.shape[0] // world
    local = full[rank * rows : (rank + 1) * rows].cuda()
    await aiockpt.save({"w": DTensor.from_local(local, mesh, [Shard(0)], run_check=False)}, path)


async def _load_cuda_shards(rank: int, world: int, path: str) -> list[float]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cuda", (world,))
    cols = 10 // world
    local = torch.zeros(12, cols, device="cuda")
    target = DTensor.from_local(local, mesh, [Shard(1)], run_check=False)  # another layout
    await aiockpt.load({"w": target}, path)
    expected = torch.arange(12 * 10, dtype=torch.float32).reshape(12, 10)[:, rank * cols : (rank + 1) * cols]
    assert torch.equal(local.cpu(), expected), f"rank {rank}"
    return local.sum(dim=0).tolist()


@on_gpu
@pytest.mark.dist
def test_cuda_dtensor_shards_reshard_on_load(tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    run_world(_save_cuda_shards, 2, tmp_path, path)
    run_world(_load_cuda_shards, 2, tmp_path, path)
    full = tensor_at(aiockpt.sync.read(path), "w")
    assert torch.equal(full, torch.arange(12 * 10, dtype=torch.float32).reshape(12, 10))
