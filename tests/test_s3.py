"""The S3 backend against a real S3 protocol server (moto, on 127.0.0.1), with injected faults."""

from __future__ import annotations

import gc
import re
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from functools import partial
from pathlib import Path

import anyio
import anyio.to_thread
import msgspec
import obstore
import pytest
import torch
from conftest import (
    DTYPE_NAMES,
    assert_tree_equal,
    layouts,
    make_model,
    make_optimizer,
    random_tensor,
    snapshot,
    train_step,
    zero_tensor,
)
from obstore.store import S3Store
from test_event_loop import guard as guard  # the blocking-call detector, as a fixture

import aiockpt
from aiockpt import (
    Checkpointer,
    CheckpointExistsError,
    CheckpointNotFoundError,
    CorruptionError,
    IOConfig,
    S3Options,
    StorageError,
)
from aiockpt._storage import S3Path, resolve
from aiockpt._storage._s3 import S3Target

from distributed_util import run_world
from s3_util import FaultProxy, S3Server, s3_server

pytestmark = pytest.mark.timeout(60)

# Small parts and blocks, so that tensors of a few hundred KiB go up as multipart uploads of many parts.
OPTS = S3Options(part_size=64 << 10, concurrency=4)
IO = IOConfig(checksum_block=16 << 10)
BIG = 100_000  # float32 elements: ~390 KiB, 7 parts


@pytest.fixture(scope="module")
def server() -> Iterator[S3Server]:
    with s3_server() as s:
        yield s


@pytest.fixture
def bucket(server: S3Server) -> Iterator[str]:
    name = server.bucket()
    with server.env():
        yield name


def client(bucket: str) -> S3Store:
    return S3Store(bucket, client_options={"allow_http": True})


async def keys(bucket: str, prefix: str) -> list[str]:
    found = await obstore.list(client(bucket), prefix).collect_async()
    return sorted(m["path"] for m in found)


# The token of a save, in the names of its objects on S3 (``data-rNNNNN-<token>.bin``).
TOKEN = re.compile(r"(?<=-)[0-9a-f]{16}(?=\.bin$|\.json$)")


def untokened(names: Sequence[str]) -> list[str]:
    """``names`` with each save's token replaced by ``<token>``, sorted."""
    return sorted(TOKEN.sub("<token>", n) for n in names)


def token_of(name: str) -> str:
    found = TOKEN.search(name)
    assert found is not None, name
    return found[0]


def mixed_state(seed: int) -> dict[str, object]:
    gen = torch.Generator().manual_seed(seed)
    dtypes = [getattr(torch, n) for n in DTYPE_NAMES if isinstance(getattr(torch, n, None), torch.dtype)]
    return {
        "dtypes": {str(d): random_tensor(d, (33,), gen) for d in dtypes},
        "layouts": layouts(lambda shape: random_tensor(torch.float32, shape, gen)),
        "big": random_tensor(torch.float32, (BIG,), gen),
        "big_rows": random_tensor(torch.bfloat16, (300, 257), gen),
        "meta": {"step": seed, "name": "run", "ratio": 0.5, "none": None, "raw": b"\x00\x01"},
    }


def zeros_like(state: object) -> object:
    if isinstance(state, torch.Tensor):
        return zero_tensor(state.dtype, tuple(state.shape))
    if isinstance(state, dict):
        return {k: zeros_like(v) for k, v in state.items()}
    if isinstance(state, list):
        return [zeros_like(v) for v in state]
    if isinstance(state, tuple):
        return tuple(zeros_like(v) for v in state)
    return state


# complex32 warns "ComplexHalf support is experimental" whenever one is created (by us or by the library).
@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental:UserWarning")
async def test_round_trip_of_a_mixed_state_with_multipart_uploads(server: S3Server, bucket: str) -> None:
    state = mixed_state(1)
    url = f"s3://{bucket}/run1/ckpt-a"
    meta = await aiockpt.save(state, url, io=IO, s3=OPTS, metadata={"loss": 0.5})
    assert meta.path == url
    assert await aiockpt.read_metadata(url, s3=OPTS) == msgspec.structs.replace(
        meta, timings={}, written_bytes=0, direct_bytes=0
    )
    # On S3, a data object's name carries its save's token (racing saves never share an object).
    assert untokened([f.name for f in meta.files]) == ["data-r00000-<token>.bin"]
    assert await keys(bucket, "run1/ckpt-a") == [
        f"run1/ckpt-a/{meta.files[0].name}",
        "run1/ckpt-a/manifest.msgpack",
    ]
    assert server.multipart_uploads(bucket) == 0

    target = zeros_like(state)
    assert isinstance(target, dict)
    await aiockpt.load(target, url, io=IO, s3=OPTS)
    assert_tree_equal(target, state)
    assert_tree_equal(await aiockpt.read(url, io=IO, s3=OPTS), state)


async def test_loads_copy_into_parameters_that_require_grad(bucket: str) -> None:
    """A non-contiguous Parameter is filled by a copy after the download: outside autograd, which
    refuses an in-place copy into a leaf that requires grad."""
    url = f"s3://{bucket}/run1/params"
    saved = {"w": torch.arange(12.0).reshape(3, 4)}
    await aiockpt.save(saved, url, io=IO, s3=OPTS)
    weight = torch.nn.Parameter(torch.zeros(4, 3))
    target: dict[str, object] = {"w": weight.t()}  # a non-contiguous view of a leaf
    await aiockpt.load(target, url, io=IO, s3=OPTS)
    assert torch.equal(weight.detach().t(), saved["w"])


async def test_async_op_and_statefuls(bucket: str) -> None:
    model = make_model(0)
    opt = make_optimizer(model)
    train_step(model, opt, None, 0)
    state: dict[str, object] = {"model": model, "opt": opt, "big": torch.arange(BIG, dtype=torch.float32)}
    expected = snapshot(state)
    handle = await aiockpt.save(state, f"s3://{bucket}/a/b", async_op=True, io=IO, s3=OPTS)
    with torch.no_grad():  # staged: the caller may change the state at once
        for p in model.parameters():
            p.add_(1)
    meta = await handle
    assert meta.nbytes > BIG * 4

    fresh_model = make_model(1)
    fresh: dict[str, object] = {
        "model": fresh_model,
        "opt": make_optimizer(fresh_model),
        "big": torch.zeros(BIG),
    }
    await aiockpt.load(fresh, f"s3://{bucket}/a/b", s3=OPTS)
    assert_tree_equal(snapshot(fresh), expected)


async def test_no_overwrite_and_conditional_manifest(bucket: str) -> None:
    url = f"s3://{bucket}/x"
    await aiockpt.save({"w": torch.ones(3)}, url)
    with pytest.raises(CheckpointExistsError, match="already exists"):
        await aiockpt.save({"w": torch.zeros(3)}, url)
    assert_tree_equal(await aiockpt.read(url), {"w": torch.ones(3)})
    # The commit itself is create-only: a manifest that appeared after the check is never replaced...
    where = resolve(url)
    assert isinstance(where, S3Path)
    original = bytes(await (await obstore.get_async(client(bucket), "x/manifest.msgpack")).bytes_async())
    with pytest.raises(CheckpointExistsError, match="nothing was replaced"):
        await S3Target(where).commit([original[:-2], original[-2:-1], bytes([original[-1] ^ 1])])
    # ...while a retried put of the same bytes (its first attempt landed) is a success.
    await S3Target(where).commit([original[:100], original[100:]])
    assert_tree_equal(await aiockpt.read(url), {"w": torch.ones(3)})


async def test_missing_and_incomplete_checkpoints_are_not_loaded(bucket: str) -> None:
    with pytest.raises(CheckpointNotFoundError, match="does not exist"):
        await aiockpt.read(f"s3://{bucket}/nothing")
    await obstore.put_async(client(bucket), "half/data-r00000.bin", b"\x00" * 64)
    with pytest.raises(CheckpointNotFoundError, match="incomplete"):
        await aiockpt.load({"w": torch.zeros(16)}, f"s3://{bucket}/half")
    with pytest.raises(CheckpointExistsError, match="uncommitted save"):
        await aiockpt.save({"w": torch.zeros(16)}, f"s3://{bucket}/half")


async def test_corruption_names_the_key_and_the_object_url(bucket: str) -> None:
    url = f"s3://{bucket}/c"
    state = {"a": torch.arange(1000, dtype=torch.int64), "b": torch.ones(BIG)}
    name = (await aiockpt.save(state, url, io=IO, s3=OPTS)).files[0].name
    manifest = await aiockpt.read(url)
    assert_tree_equal(manifest, state)
    store = client(bucket)
    data = bytearray(await (await obstore.get_async(store, f"c/{name}")).bytes_async())
    data[len(data) - 5] ^= 0x40  # inside "b", stored last
    await obstore.put_async(store, f"c/{name}", bytes(data))
    with pytest.raises(CorruptionError) as info:
        await aiockpt.load({"a": torch.zeros(1000, dtype=torch.int64), "b": torch.zeros(BIG)}, url, s3=OPTS)
    assert info.value.key == "b"
    assert info.value.file == f"{url}/{name}"
    assert f"{url}/{name}" in str(info.value)
    assert "'b'" in str(info.value)

    await obstore.put_async(store, f"c/{name}", bytes(data[:100]))
    with pytest.raises(CorruptionError, match="truncated"):
        await aiockpt.read(url)
    await obstore.delete_async(store, f"c/{name}")
    with pytest.raises(CorruptionError, match="missing"):
        await aiockpt.read(url)


async def test_checkpointer_steps_latest_retention_and_resume(bucket: str) -> None:
    root = f"s3://{bucket}/run"
    async with Checkpointer(root, keep_last=2, io=IO, s3=OPTS) as ckpt:
        assert ckpt.steps() == []
        assert await ckpt.load({"w": torch.zeros(4)}) is None
        for step in (1, 2, 3):
            await ckpt.save({"w": torch.full((BIG,), float(step)), "step": step}, step=step)
        handle = await ckpt.save({"w": torch.full((BIG,), 4.0), "step": 4}, step=4, async_op=True)
        await handle
        assert ckpt.steps() == [3, 4]
        assert ckpt.latest_step() == 4
        with pytest.raises(CheckpointExistsError):
            await ckpt.save({"w": torch.zeros(1)}, step=4)
    listed = await keys(bucket, "run")
    assert untokened(listed) == [
        "run/latest",
        "run/step-00000003/data-r00000-<token>.bin",
        "run/step-00000003/manifest.msgpack",
        "run/step-00000004/data-r00000-<token>.bin",
        "run/step-00000004/manifest.msgpack",
    ]
    latest = await (await obstore.get_async(client(bucket), "run/latest")).bytes_async()
    assert bytes(latest) == b"step-00000004\n"

    async with Checkpointer(root, keep_last=2, s3=OPTS) as again:  # resume in a "new process"
        assert again.steps() == [3, 4]
        target: dict[str, object] = {"w": torch.zeros(BIG), "step": 0}
        assert await again.load(target) == 4
        assert_tree_equal(target, {"w": torch.full((BIG,), 4.0), "step": 4})
        assert await again.load(target, step=3) == 3
        assert target["step"] == 3
        with pytest.raises(CheckpointNotFoundError):
            await again.load(target, step=1)


async def test_checkpointer_collects_only_stale_incomplete_steps(bucket: str) -> None:
    root = f"s3://{bucket}/gc"
    async with Checkpointer(root, s3=OPTS) as ckpt:
        await ckpt.save({"w": torch.ones(8)}, step=1)
    await obstore.put_async(client(bucket), "gc/step-00000002/data-r00000.bin", b"\x00" * 32)

    async with Checkpointer(root, s3=OPTS) as ckpt:  # recent: maybe a save running elsewhere
        assert ckpt.steps() == [1]
    assert "gc/step-00000002/data-r00000.bin" in await keys(bucket, "gc")

    # Object stores keep mtimes in whole seconds, and ages go by the server's clock read the same way:
    # an age may come out up to 2 s short, so 1 s of age is sure after 3 s and a bit.
    await anyio.sleep(3.2)
    stale = S3Options(part_size=OPTS.part_size, stale_after=1.0)
    async with Checkpointer(root, s3=stale) as ckpt:
        assert ckpt.steps() == [1]
        assert ckpt.latest_step() == 1
    assert untokened(await keys(bucket, "gc")) == [
        "gc/latest",
        "gc/step-00000001/data-r00000-<token>.bin",
        "gc/step-00000001/manifest.msgpack",
    ]


async def test_a_save_to_a_checkpointer_root_is_refused_and_deletes_nothing(bucket: str) -> None:
    """Its objects under deeper prefixes (the steps) and its ``latest`` are nothing a save left behind.

    They were taken for an abandoned save's objects: once older than ``stale_after`` a save to the root
    deleted them all (every committed step) and committed there; before, it was refused as if a save
    were in progress.
    """
    root = f"s3://{bucket}/run"
    async with Checkpointer(root, s3=OPTS) as ckpt:
        for step in (1, 2):
            await ckpt.save({"w": torch.full((8,), float(step))}, step=step)
    before = await keys(bucket, "run")
    await anyio.sleep(3.2)  # older than stale_after below, by the server's whole-second clock
    stale = S3Options(part_size=OPTS.part_size, stale_after=1.0)
    with pytest.raises(
        CheckpointExistsError, match=r"holds objects under deeper prefixes \(s3://.*/run/step-"
    ):
        await aiockpt.save({"w": torch.zeros(8)}, root, s3=stale)
    assert await keys(bucket, "run") == before
    async with Checkpointer(root, s3=stale) as ckpt:
        assert ckpt.steps() == [1, 2]


async def test_latest_only_moves_forward(bucket: str) -> None:
    """Two writers of one root: a late save of an older step put its own step in ``latest``, which then
    named step 3 beside a committed step 5 (a local root's ``latest`` stays at 5)."""
    root = f"s3://{bucket}/forward"
    async with Checkpointer(root, s3=OPTS) as a, Checkpointer(root, s3=OPTS) as b:
        await a.save({"w": torch.ones(4)}, step=5)
        await b.save({"w": torch.ones(4)}, step=3)  # b opened before step 5 was there
        assert await a.refresh() == [3, 5]
    latest = await obstore.get_async(client(bucket), "forward/latest")
    assert bytes(await latest.bytes_async()).strip() == b"step-00000005"


async def test_watch_polls_the_listing(bucket: str) -> None:
    root = f"s3://{bucket}/w"
    seen: list[int] = []

    async def learner() -> None:
        async with Checkpointer(root, s3=OPTS) as ckpt:
            for step in (5, 6):
                await anyio.sleep(0.3)
                await ckpt.save({"w": torch.full((4,), float(step))}, step=step)

    async def actor(watcher: Checkpointer) -> AsyncIterator[int]:
        async for step in watcher.watch(poll_interval=0.1):
            yield step

    async with Checkpointer(root, s3=OPTS) as watcher:
        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                tg.start_soon(learner)
                async for step in actor(watcher):
                    seen.append(step)
                    target: dict[str, object] = {"w": torch.zeros(4)}
                    await watcher.load(target, step=step)
                    assert_tree_equal(target, {"w": torch.full((4,), float(step))})
                    if step == 6:
                        break
    assert seen[-1] == 6
    assert set(seen) <= {5, 6}


async def test_transient_upload_part_failures_are_retried(server: S3Server, bucket: str) -> None:
    state = {"big": torch.arange(BIG, dtype=torch.float32)}
    with FaultProxy(server.endpoint) as proxy, server.env(proxy.endpoint):
        proxy.fail_first = 2
        await aiockpt.save(state, f"s3://{bucket}/retried", io=IO, s3=OPTS)
        assert proxy.failed == 2
        assert proxy.passed >= 6
    assert_tree_equal(await aiockpt.read(f"s3://{bucket}/retried", s3=OPTS), state)
    assert server.multipart_uploads(bucket) == 0


async def test_upload_failing_mid_way_leaves_nothing_and_keeps_earlier_checkpoints(
    server: S3Server, bucket: str
) -> None:
    root = f"s3://{bucket}/faulty"
    async with Checkpointer(root, s3=OPTS, io=IO) as ckpt:
        await ckpt.save({"big": torch.full((BIG,), 1.0)}, step=1)
    impatient = S3Options(part_size=OPTS.part_size, concurrency=2, max_retries=1, retry_timeout=5.0)
    with FaultProxy(server.endpoint) as proxy, server.env(proxy.endpoint):
        proxy.pass_then_fail = 2
        async with Checkpointer(root, s3=impatient, io=IO) as ckpt:
            started = time.monotonic()
            with pytest.raises(StorageError) as info:
                await ckpt.save({"big": torch.full((BIG,), 2.0)}, step=2)
            assert time.monotonic() - started < 20
            assert f"{root}/step-00000002/data-r00000-" in str(info.value)
            assert proxy.failed >= 1
            assert ckpt.steps() == [1]
    assert server.multipart_uploads(bucket) == 0  # the client aborted it
    assert not [k for k in await keys(bucket, "faulty") if "step-00000002" in k]
    async with Checkpointer(root, s3=OPTS) as ckpt:
        assert ckpt.steps() == [1]
        target: dict[str, object] = {"big": torch.zeros(BIG)}
        assert await ckpt.load(target) == 1
        assert_tree_equal(target, {"big": torch.full((BIG,), 1.0)})
        await ckpt.save({"big": torch.full((BIG,), 2.0)}, step=2)  # the step is free again
        assert ckpt.steps() == [1, 2]


async def test_a_listing_cancelled_in_flight_leaves_the_client_working(server: S3Server, bucket: str) -> None:
    """A Checkpointer's open cancelled while its listing is in flight, then a garbage collection.

    The listing was an async iteration of obstore's stream: the stream given up part-way was dropped by
    Python's collector, outside obstore's runtime, which panicked (``PanicException`` out of
    ``gc.collect()``) and left the store's client broken: every later request of the process failed
    with ``RustPanic``.
    """
    root = f"s3://{bucket}/listed"
    with FaultProxy(server.endpoint) as proxy, server.env(proxy.endpoint):
        proxy.stall = lambda method, path: method == "GET" and "list-type" in path
        opening = Checkpointer(root, s3=OPTS)
        with pytest.raises(TimeoutError), anyio.fail_after(1.0):
            await opening.open()
        assert proxy.stalled.is_set()
        proxy.release()
        await anyio.sleep(1.0)  # the held listing is answered
        gc.collect()
        async with Checkpointer(root, s3=OPTS) as ckpt:
            await ckpt.save({"w": torch.ones(4)}, step=1)
            assert ckpt.steps() == [1]


async def test_a_commit_that_landed_though_reported_failed_is_committed(
    server: S3Server, bucket: str
) -> None:
    """The manifest put lands, its answer is lost, and no retry is left: the save raised StorageError,
    and its Checkpointer knew nothing of the step that was committed and loadable."""
    root = f"s3://{bucket}/landed"
    once = S3Options(part_size=OPTS.part_size, max_retries=0)
    with FaultProxy(server.endpoint) as proxy, server.env(proxy.endpoint):
        proxy.lose_answer = lambda method, path: method == "PUT" and "manifest.msgpack" in path
        async with Checkpointer(root, s3=once) as ckpt:
            meta = await ckpt.save({"w": torch.ones(4)}, step=1)
            assert meta.step == 1
            assert ckpt.steps() == [1]
            assert ckpt.latest_step() == 1


async def test_a_failed_clean_up_does_not_hide_why_a_save_failed(server: S3Server, bucket: str) -> None:
    """The manifest put fails, and so do the deletes (a policy without DeleteObject): the save raised the
    delete's StorageError, the commit's only in its context."""
    url = f"s3://{bucket}/unclean"
    once = S3Options(part_size=OPTS.part_size, max_retries=0)
    with FaultProxy(server.endpoint) as proxy, server.env(proxy.endpoint):
        proxy.refuse = lambda method, path: (
            ("manifest.msgpack" in path and method == "PUT") or (method == "POST" and "delete" in path)
        )
        with (
            pytest.warns(RuntimeWarning, match="cleaning up after the failed save"),
            pytest.raises(StorageError, match=r"cannot write .*manifest\.msgpack"),
        ):
            await aiockpt.save({"w": torch.ones(4)}, url, s3=once)


async def test_a_request_slower_than_the_clients_default_timeout_succeeds(
    server: S3Server, bucket: str
) -> None:
    """S3Options.request_timeout is the client's: its own default (30 s) failed every part slower than that,
    whatever retry_timeout said. Here a part takes 2.5 s against a 2 s default stand-in and a 5 s option."""
    state = {"big": torch.arange(BIG, dtype=torch.float32)}
    with FaultProxy(server.endpoint) as proxy, server.env(proxy.endpoint):
        proxy.delay = 2.5
        short = S3Options(part_size=OPTS.part_size, max_retries=0, request_timeout=2.0)
        with pytest.raises(StorageError, match="cannot upload"):
            await aiockpt.save(state, f"s3://{bucket}/slow-a", io=IO, s3=short)
        enough = S3Options(part_size=OPTS.part_size, max_retries=0, request_timeout=5.0)
        await aiockpt.save(state, f"s3://{bucket}/slow-b", io=IO, s3=enough)
    assert_tree_equal(await aiockpt.read(f"s3://{bucket}/slow-b", s3=OPTS), state)


async def test_cancelled_upload_leaves_nothing(server: S3Server, bucket: str) -> None:
    url = f"s3://{bucket}/cancelled"
    with FaultProxy(server.endpoint) as proxy, server.env(proxy.endpoint):
        proxy.delay = 0.2
        handle = await aiockpt.save({"big": torch.ones(BIG)}, url, async_op=True, io=IO, s3=OPTS)
        assert await anyio.to_thread.run_sync(proxy.wait_passed, 2, 20.0)  # mid-upload
        handle.cancel()
        with pytest.raises(aiockpt.CheckpointCancelledError):
            await handle
    assert handle.state is aiockpt.SaveState.CANCELLED
    await anyio.sleep(1.0)  # parts still on the wire must not complete the object later
    assert await keys(bucket, "cancelled") == []
    assert server.multipart_uploads(bucket) == 0  # aborted, not dropped
    with pytest.raises(CheckpointNotFoundError, match="does not exist"):
        await aiockpt.read(url)


async def _save_sharded(rank: int, world: int, url: str) -> list[str]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    full = torch.arange(BIG * world, dtype=torch.float32)
    meta = await aiockpt.save(
        {"w": distribute_tensor(full, mesh, [Shard(0)]), "step": 7}, url, io=IO, s3=OPTS
    )
    target = {"w": distribute_tensor(torch.zeros(BIG * world), mesh, [Shard(0)]), "step": 0}
    await aiockpt.load(target, url, s3=OPTS)
    loaded = target["w"]
    assert isinstance(loaded, DTensor)
    assert torch.equal(loaded.to_local(), full.chunk(world)[rank])
    assert target["step"] == 7
    return [f.name for f in meta.files]


@pytest.mark.dist
def test_distributed_save_uploads_one_object_per_rank(bucket: str, tmp_path: Path) -> None:
    url = f"s3://{bucket}/dist"
    files = run_world(_save_sharded, 2, tmp_path, url, timeout=60)
    assert files[0] == files[1]
    assert untokened(files[0]) == ["data-r00000-<token>.bin", "data-r00001-<token>.bin"]
    assert len({token_of(name) for name in files[0]}) == 1  # rank 0's token, on every rank
    tree = anyio.run(partial(aiockpt.read, url, s3=OPTS))
    assert_tree_equal(tree, {"w": torch.arange(BIG * 2, dtype=torch.float32), "step": 7})


async def test_no_blocking_call_on_the_event_loop(bucket: str, guard: list[str]) -> None:
    state = {"model": torch.nn.Linear(64, 64), "x": torch.randn(1000).t(), "big": torch.ones(BIG), "n": 1}
    await aiockpt.save(state, f"s3://{bucket}/a", io=IO, s3=OPTS)
    await (await aiockpt.save(state, f"s3://{bucket}/b", async_op=True, io=IO, s3=OPTS))
    await aiockpt.load(state, f"s3://{bucket}/a", s3=OPTS)
    await aiockpt.read(f"s3://{bucket}/b", s3=OPTS)
    async with Checkpointer(f"s3://{bucket}/root", keep_last=1, io=IO, s3=OPTS) as ckpt:
        for step in range(3):
            await ckpt.save(state, step=step)
        await ckpt.load(state)
    assert guard == []


def test_sync_facade(bucket: str) -> None:
    state: dict[str, object] = {"w": torch.arange(BIG, dtype=torch.float32), "step": 3}
    aiockpt.sync.save(state, f"s3://{bucket}/sync")  # each call runs its own event loop
    assert_tree_equal(aiockpt.sync.read(f"s3://{bucket}/sync"), state)
    with aiockpt.sync.Checkpointer(f"s3://{bucket}/sync-root", keep_last=1) as ckpt:
        ckpt.save(state, step=1)
        ckpt.save(state, step=2, async_op=True).result()
        assert ckpt.steps() == [2]
        target: dict[str, object] = {"w": torch.zeros(BIG), "step": 0}
        assert ckpt.load(target) == 2
    assert_tree_equal(target, state)


@pytest.mark.slow
async def test_large_multipart_upload_through_a_flaky_link(server: S3Server, bucket: str) -> None:
    gen = torch.Generator().manual_seed(3)
    state = {f"t{i}": random_tensor(torch.bfloat16, (4 << 20,), gen) for i in range(8)}  # 64 MiB
    opts = S3Options(part_size=1 << 20, concurrency=8)
    with FaultProxy(server.endpoint) as proxy, server.env(proxy.endpoint):
        proxy.fail_first = 10
        await aiockpt.save(state, f"s3://{bucket}/large", s3=opts)
        assert proxy.failed == 10
        assert_tree_equal(await aiockpt.read(f"s3://{bucket}/large", s3=opts), state)
    assert server.multipart_uploads(bucket) == 0


async def test_bad_urls_and_options() -> None:
    for bad in ("s3://", "s3://bucket", "s3://bucket/", "s3://bucket/a/../b"):
        with pytest.raises(aiockpt.CheckpointError):
            await aiockpt.read(bad)
    # A key the client cannot encode: a bare ValueError from obstore at the first request, before.
    for bad in ("s3://bucket/runs/a\tb", "s3://bucket/a\x00", "s3://bucket/a\x7fb"):
        with pytest.raises(aiockpt.CheckpointError, match="control characters are not allowed"):
            await aiockpt.read(bad)
        with pytest.raises(aiockpt.CheckpointError, match="control characters are not allowed"):
            Checkpointer(bad)
    with pytest.raises(aiockpt.CheckpointError, match="part_size"):
        S3Options(part_size=0)
    with pytest.raises(aiockpt.CheckpointError, match="request_timeout"):
        S3Options(request_timeout=0)
