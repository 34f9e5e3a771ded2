"""Saves to S3 that race, crash or stall, against a real S3 protocol server (moto, on 127.0.0.1).

Each save's objects carry a token of its own (``data-rNNNNN-<token>.bin``), so racing saves never touch
each other's objects; a lease object (``lease-<token>.json``) tells an abandoned save from a running one.
Crashes are real: a child process is SIGKILLed while a fault proxy holds one of its requests.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import anyio
import anyio.to_thread
import msgspec
import obstore
import pytest
import torch
from conftest import assert_tree_equal
from test_s3 import bucket as bucket  # the suite's moto server and a bucket of it, as fixtures
from test_s3 import client
from test_s3 import keys as s3_keys
from test_s3 import server as server

import aiockpt
from aiockpt import Checkpointer, CheckpointExistsError, S3Options, StorageError
from aiockpt._format import data_file_name
from aiockpt._save._global_plan import global_plan
from aiockpt._save._local_plan import LocalPlan, WriteItem
from aiockpt._storage import S3Path
from aiockpt._storage._s3_lease import Owner, clear, lease_name, owner

from s3_util import FaultProxy, S3Server

pytestmark = pytest.mark.timeout(90)

OPTS = S3Options(part_size=64 << 10, concurrency=4)
BIG = 100_000  # float32 elements: ~390 KiB, 7 parts of 64 KiB
DATA = re.compile(r"data-r\d{5}-(?P<token>[0-9a-f]{16})\.bin")
CHILD_TIMEOUT = 60.0  # seconds a child process may take to reach the request the proxy holds


async def keys(bucket: str, prefix: str) -> list[str]:
    """The keys under the prefix ``prefix/``."""
    return await s3_keys(bucket, prefix + "/")


def names(listed: list[str]) -> list[str]:
    return sorted(k.rpartition("/")[2] for k in listed)


# --- Racing saves ------------------------------------------------------------------------------------------


async def _save_racing(
    outcome: dict[str, object], name: str, ckpt: Checkpointer, value: float, step: int
) -> None:
    state = {"w": torch.full((BIG,), value), "by": name}
    try:
        outcome[name] = await ckpt.save(state, step=step)
    except CheckpointExistsError as exc:
        outcome[name] = exc


async def test_racing_saves_of_one_step_leave_the_winner_loadable(bucket: str) -> None:
    """Two Checkpointers on one root save each step at once: one commits, and its checkpoint is whole.

    Before data objects were named per save, the loser overwrote the winner's ``data-r00000.bin`` (and its
    cleanup could delete it): the winner returned, and its checkpoint failed to load."""
    root = f"s3://{bucket}/race"
    async with Checkpointer(root, s3=OPTS) as a, Checkpointer(root, s3=OPTS) as b:
        for step in range(1, 6):
            outcome: dict[str, object] = {}
            async with anyio.create_task_group() as tg:
                tg.start_soon(_save_racing, outcome, "a", a, 1.0, step)
                tg.start_soon(_save_racing, outcome, "b", b, 2.0, step)
            won = [n for n, o in outcome.items() if isinstance(o, aiockpt.Metadata)]
            assert len(won) == 1, outcome
            tree = await a.read(step)
            assert_tree_equal(tree, {"w": torch.full((BIG,), 1.0 if won[0] == "a" else 2.0), "by": won[0]})
            # Only the winner's objects are left: the loser deleted its own, and no lease remains.
            meta = outcome[won[0]]
            assert isinstance(meta, aiockpt.Metadata)
            listed = names(await keys(bucket, f"race/step-{step:08d}"))
            assert listed == sorted(["manifest.msgpack", *(f.name for f in meta.files)])


def test_data_file_names_carry_the_tag_only_where_given() -> None:
    item = WriteItem(
        path=("w",), dtype="float32", shape=(4,), offsets=(0,), sizes=(4,), nbytes=16, replicated=False
    )
    plans = [LocalPlan(rank=0, items=(item,)), LocalPlan(rank=1, items=())]
    assert [r.file for r in global_plan(plans).ranks] == ["data-r00000.bin", "data-r00001.bin"]
    tagged = global_plan(plans, tag="0123456789abcdef")
    assert [r.file for r in tagged.ranks] == [
        "data-r00000-0123456789abcdef.bin",
        "data-r00001-0123456789abcdef.bin",
    ]
    assert [c.file for c in tagged.tensors[0].chunks] == ["data-r00000-0123456789abcdef.bin"]
    assert data_file_name(3) == "data-r00003.bin"


async def test_local_saves_keep_plain_names_and_old_s3_checkpoints_still_load(
    bucket: str, tmp_path: Path
) -> None:
    """A checkpoint with plain data names (local, or on S3 by an earlier release) reads from S3."""
    state = {"w": torch.arange(BIG, dtype=torch.float32), "step": 7}
    meta = await aiockpt.save(state, tmp_path / "ckpt")
    assert [f.name for f in meta.files] == ["data-r00000.bin"]
    store = client(bucket)
    for file in sorted((tmp_path / "ckpt").iterdir()):
        await obstore.put_async(store, f"old/step-00000007/{file.name}", file.read_bytes())
    async with Checkpointer(f"s3://{bucket}/old", s3=OPTS) as ckpt:
        assert ckpt.steps() == [7]
        target: dict[str, object] = {"w": torch.zeros(BIG), "step": 0}
        assert await ckpt.load(target) == 7
        assert_tree_equal(target, state)
        await ckpt.save(state, step=8)
        assert ckpt.steps() == [7, 8]


# --- Judging uncommitted saves by their leases -------------------------------------------------------------


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(30)
    return proc.pid


async def _leave(bucket: str, prefix: str, who: Owner | None, token: str) -> None:
    """The objects a save of ``token`` by ``who`` leaves behind when it dies after its upload."""
    store = client(bucket)
    await obstore.put_async(store, f"{prefix}/data-r00000-{token}.bin", b"\x00" * 64)
    if who is not None:
        await obstore.put_async(store, f"{prefix}/{lease_name(token)}", msgspec.json.encode(who))


# Timestamps are whole seconds, and the server's clock is read the same way: an age may come out up to
# 2 s short (never long). A lease of ``LEASE`` seconds surely counts as expired ``EXPIRED`` s after its put.
LEASE = 2.0
EXPIRED = LEASE + 2.2


async def test_leases_tell_abandoned_saves_from_running_ones(bucket: str) -> None:
    here = await anyio.to_thread.run_sync(owner, LEASE)
    assert here.boot is not None  # (Linux tells all three)
    assert here.pid_ns is not None
    assert here.start is not None
    dead = await anyio.to_thread.run_sync(_dead_pid)
    replace = msgspec.structs.replace
    cases: dict[str, Owner | None] = {
        "gone": replace(here, pid=dead),  # its process ended on this host: abandoned at once
        "reused": replace(here, start=here.start + 1),  # this PID is another process now: the same
        "ended": None,  # no lease at all: the save is over (its lease goes last)
        "committing": replace(here, pid=dead, committing=True),  # its manifest put may land yet
        "alive": here,  # this very process
        "elsewhere": replace(here, boot="another-host", pid=dead),  # a PID that cannot be looked up
    }
    for i, (name, who) in enumerate(cases.items()):
        await _leave(bucket, name, who, f"{i:016x}")
    await obstore.put_async(client(bucket), "older/data-r00000.bin", b"\x00" * 64)  # a release without leases

    at_once = {name: await clear(S3Path(bucket, name), strict=True) for name in [*cases, "older"]}
    assert {n for n, c in at_once.items() if c.removed} == {"gone", "reused", "ended"}
    assert {n for n, c in at_once.items() if c.live} == {"alive", "elsewhere", "older"}
    assert {n for n, c in at_once.items() if c.beside} == {"committing"}  # kept; a save may go on beside
    assert "stale_after" in at_once["older"].live[0]
    for name in ("gone", "reused", "ended"):
        assert await keys(bucket, name) == []

    await anyio.sleep(EXPIRED)  # nobody renews these leases
    later = {
        name: await clear(S3Path(bucket, name), strict=True) for name in ("committing", "alive", "elsewhere")
    }
    assert all(c.removed == 1 and not c.live for c in later.values()), later
    older = await clear(S3Path(bucket, "older"), strict=True)  # stale_after (1 hour) is far off
    assert older.live
    assert not older.removed
    assert await keys(bucket, "older") == ["older/data-r00000.bin"]


async def test_a_lease_of_another_host_expires_after_its_own_timeout(bucket: str) -> None:
    """A save refuses a prefix whose lease is fresh, and takes it over once that lease expired."""
    who = msgspec.structs.replace(await anyio.to_thread.run_sync(owner, LEASE), boot="another-host")
    await _leave(bucket, "x", who, "00000000000000aa")
    url = f"s3://{bucket}/x"
    state = {"w": torch.ones(16)}
    with pytest.raises(CheckpointExistsError, match="may still be running") as info:
        await aiockpt.save(state, url)
    assert "another-host" not in str(info.value)  # (the host name is shown, not the boot id)
    assert "lease-00000000000000aa.json" in str(info.value)
    await anyio.sleep(EXPIRED)
    meta = await aiockpt.save(state, url)
    assert names(await keys(bucket, "x")) == sorted(["manifest.msgpack", meta.files[0].name])
    assert_tree_equal(await aiockpt.read(url), state)


async def test_a_running_save_renews_its_lease_and_is_never_collected(server: S3Server, bucket: str) -> None:
    root = f"s3://{bucket}/live"
    opts = S3Options(part_size=OPTS.part_size, lease_timeout=3.0)
    state = {"w": torch.full((BIG,), 3.0)}
    with FaultProxy(server.endpoint) as proxy, server.env(proxy.endpoint):
        proxy.stall = lambda method, path: "partNumber=" in path  # the upload waits, its lease is renewed
        async with Checkpointer(root, s3=opts) as ckpt:
            handle = await ckpt.save(state, step=1, async_op=True)
            assert await anyio.to_thread.run_sync(proxy.stalled.wait, 30.0)
            await anyio.sleep(3.0 + 2.2)  # an unrenewed lease of 3 s would surely count as expired now
            async with Checkpointer(root, s3=opts) as other:  # collects what is abandoned when it opens
                with pytest.raises(CheckpointExistsError, match="may still be running"):
                    await other.save({"w": torch.zeros(BIG)}, step=1)
            assert [k for k in await keys(bucket, "live/step-00000001") if "/lease-" in k]
            assert not handle.done()
            proxy.release()  # the parts held are answered 503, and retried
            await handle
    async with Checkpointer(root, s3=opts) as ckpt:
        target: dict[str, object] = {"w": torch.zeros(BIG)}
        assert await ckpt.load(target) == 1
        assert_tree_equal(target, state)
    assert not [k for k in await keys(bucket, "live/step-00000001") if "/lease-" in k]


class _LeasePuts:
    """A proxy rule (``refuse``, ``stall``): the lease's PUTs after the first, which takes the lease, while
    ``during()``; ``count`` of them all."""

    def __init__(self, during: Callable[[], bool] = lambda: True) -> None:
        self.count = 0
        self._during = during
        self._lock = threading.Lock()

    def __call__(self, method: str, path: str) -> bool:
        if method != "PUT" or "/lease-" not in path:
            return False
        with self._lock:
            self.count += 1
            return self.count > 1 and self._during()


async def test_a_save_whose_lease_lapsed_does_not_commit(server: S3Server, bucket: str) -> None:
    """Renewals that fail for longer than lease_timeout / 2 make the save fail instead of committing:
    another process may have taken it for abandoned meanwhile."""
    url = f"s3://{bucket}/lapsed"
    opts = S3Options(part_size=OPTS.part_size, concurrency=1, lease_timeout=2.0)
    until = 0.0
    renewals = _LeasePuts(lambda: time.monotonic() < until)
    with FaultProxy(server.endpoint) as proxy, server.env(proxy.endpoint):
        proxy.delay = 0.5  # the upload takes over 3 s
        proxy.refuse = renewals
        until = time.monotonic() + 2.5
        with pytest.raises(StorageError, match="unrenewed"):
            await aiockpt.save({"w": torch.ones(BIG)}, url, s3=opts)
    assert renewals.count > 2
    assert await keys(bucket, "lapsed") == []
    assert server.multipart_uploads(bucket) == 0


# --- Crashed saves -----------------------------------------------------------------------------------------

CHILD = """
import sys, anyio, torch, aiockpt
url, how, timeout = sys.argv[1], sys.argv[2], float(sys.argv[3])
opts = aiockpt.S3Options(lease_timeout=timeout)
state = {"w": torch.full((1000,), -1.0)}
async def main():
    if how == "checkpointer":
        async with aiockpt.Checkpointer(url, s3=opts) as ckpt:
            await ckpt.save(state, step=2)
    else:
        await aiockpt.save(state, url, s3=opts)
anyio.run(main)
"""


def _kill_when_stalled(proxy: FaultProxy, url: str, how: str, lease_timeout: float) -> None:
    """Run a save in a child process through ``proxy``; SIGKILL it once the proxy holds a request."""
    env = {
        **os.environ,
        "AWS_ENDPOINT_URL": proxy.endpoint,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_REGION": "us-east-1",
    }
    child = subprocess.Popen([sys.executable, "-c", CHILD, url, how, str(lease_timeout)], env=env)
    try:
        assert proxy.stalled.wait(CHILD_TIMEOUT), (
            f"the child ended ({child.poll()}) before the request to hold"
        )
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(30)  # reaped: not a zombie
    assert child.returncode == -signal.SIGKILL


@pytest.mark.parametrize("how", ["checkpointer", "one-shot"])
async def test_a_save_killed_before_its_commit_is_collected_at_once(
    server: S3Server, bucket: str, how: str
) -> None:
    """The restarted job (same host) finds the crashed save's objects abandoned at once, and so does its
    next save of that step, with the default options: no waiting out ``stale_after``."""
    if how == "checkpointer":
        root = f"s3://{bucket}/job"
        async with Checkpointer(root) as ckpt:
            await ckpt.save({"w": torch.full((1000,), 1.0)}, step=1)
        url, prefix = root, "job/step-00000002"
    else:
        url, prefix = f"s3://{bucket}/one", "one"
    with FaultProxy(server.endpoint) as proxy:
        proxy.stall = _LeasePuts()  # the commit's first step: its data is uploaded
        await anyio.to_thread.run_sync(_kill_when_stalled, proxy, url, how, 120.0)
    left = names(await keys(bucket, prefix))
    assert len(left) == 2, left  # the data object, uploaded, and the lease: no manifest
    assert DATA.fullmatch(left[0])
    assert left[1].startswith("lease-")

    state = {"w": torch.full((1000,), 2.0)}
    if how == "checkpointer":
        async with Checkpointer(url) as ckpt:
            assert ckpt.steps() == [1]
            assert await keys(bucket, prefix) == []  # collected when it opened
            await ckpt.save(state, step=2)
            target: dict[str, object] = {"w": torch.zeros(1000)}
            assert await ckpt.load(target) == 2
    else:
        meta = await aiockpt.save(state, url)  # the save collects it itself
        assert names(await keys(bucket, prefix)) == sorted(["manifest.msgpack", meta.files[0].name])
        target = {"w": torch.zeros(1000)}
        await aiockpt.load(target, url)
    assert_tree_equal(target, state)


async def test_a_save_killed_while_committing_is_taken_over_by_the_next_save(
    server: S3Server, bucket: str
) -> None:
    """A manifest put in flight when its process died may still land, so nothing of that save is deleted
    while it could: the next save of the prefix goes on beside it, the create-only manifest put lets one
    of the two commit, and the winner deletes the dead save's objects."""
    url = f"s3://{bucket}/committing"
    with FaultProxy(server.endpoint) as proxy:
        proxy.stall = lambda method, path: (
            method == "PUT" and path.split("?")[0].endswith("/manifest.msgpack")
        )
        await anyio.to_thread.run_sync(_kill_when_stalled, proxy, url, "one-shot", 120.0)
    left = await keys(bucket, "committing")
    assert len(left) == 2, left
    lease = [k for k in left if "/lease-" in k]
    raw = await (await obstore.get_async(client(bucket), lease[0])).bytes_async()
    assert msgspec.json.decode(bytes(raw), type=Owner).committing

    cleared = await clear(S3Path(bucket, "committing"), strict=False)  # as a Checkpointer opening
    assert cleared.beside
    assert not cleared.removed
    assert await keys(bucket, "committing") == left
    state = {"w": torch.full((1000,), 2.0)}
    meta = await aiockpt.save(state, url)  # at once, with the default lease_timeout of 120 s
    assert names(await keys(bucket, "committing")) == sorted(["manifest.msgpack", meta.files[0].name])
    assert_tree_equal(await aiockpt.read(url), state)
