"""The blocking facade, used from plain (non-async) code as a synchronous training loop would."""

from __future__ import annotations

import queue
import threading
from collections.abc import Generator
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
from conftest import (
    assert_tree_equal,
    at,
    exists,
    flip_byte,
    make_model,
    make_optimizer,
    make_scheduler,
    read_text,
    snapshot,
    tensor_at,
    tmp_entries,
    train_step,
)

import aiockpt
import aiockpt.sync
from aiockpt import SaveState
from aiockpt._load import read_manifest

pytestmark = pytest.mark.timeout(60)


def training_state(seed: int = 0) -> tuple[dict[str, object], torch.nn.Module, torch.optim.Optimizer]:
    model = make_model(seed)
    opt = make_optimizer(model)
    sched = make_scheduler(opt)
    return {"model": model, "optim": opt, "sched": sched, "step": 0}, model, opt


def test_sync_checkpointer_training_loop(root: Path) -> None:
    state, model, opt = training_state()
    sched = state["sched"]
    assert isinstance(sched, torch.optim.lr_scheduler.StepLR)
    expected: dict[int, object] = {}
    with aiockpt.sync.Checkpointer(root, keep_last=2) as ckpt:
        assert ckpt.steps() == []
        assert ckpt.latest_step() is None
        for step in range(1, 5):
            train_step(model, opt, sched, step)
            state["step"] = step
            expected[step] = snapshot(state)
            h = ckpt.save(state, step=step, async_op=True)
            assert h.state is not SaveState.STAGING
            train_step(model, opt, sched, 100 + step)  # the loop goes on while the save is written
            meta = h.result()
            assert isinstance(meta, aiockpt.Metadata)
            assert meta.step == step
            assert h.done()
            assert h.state is SaveState.COMMITTED
        assert ckpt.steps() == [3, 4]
        assert ckpt.latest_step() == 4
        assert_tree_equal(ckpt.read(), expected[4])
        assert_tree_equal(ckpt.read(3), expected[3])

    assert read_text(root / "latest").strip() == "step-00000004"
    assert tmp_entries(root) == []

    # Resume in a fresh process-like setting: new objects, new Checkpointer.
    state2, _, _ = training_state(seed=1)
    with aiockpt.sync.Checkpointer(root) as ckpt2:
        assert ckpt2.load(state2) == 4
        assert state2["step"] == 4
        assert_tree_equal(snapshot(state2), expected[4])
        assert ckpt2.load(state2, step=3) == 3
        assert_tree_equal(snapshot(state2), expected[3])


def test_sync_checkpointer_blocking_save(root: Path) -> None:
    state: dict[str, object] = {"w": torch.arange(10.0), "epoch": 1}
    with aiockpt.sync.Checkpointer(root) as ckpt:
        meta = ckpt.save(state, step=1)
        assert isinstance(meta, aiockpt.Metadata)
        assert exists(root / "step-00000001" / "manifest.msgpack")
        with pytest.raises(aiockpt.CheckpointExistsError):
            ckpt.save(state, step=1)
        target: dict[str, object] = {"w": torch.zeros(10), "epoch": 0}
        w = target["w"]
        assert ckpt.load(target) == 1
        assert target["w"] is w
        assert_tree_equal(target, state)


def test_sync_checkpointer_empty_root(root: Path) -> None:
    target: dict[str, object] = {"w": torch.ones(2)}
    with aiockpt.sync.Checkpointer(root) as ckpt:
        assert ckpt.load(target) is None
        with pytest.raises(aiockpt.CheckpointNotFoundError):
            ckpt.load(target, step=1)
    assert torch.equal(tensor_at(target, "w"), torch.ones(2))


def test_sync_async_save_snapshot_taken_at_staging(root: Path) -> None:
    w = torch.randn(1 << 20)
    state: dict[str, object] = {"w": w}
    expected = snapshot(state)
    with aiockpt.sync.Checkpointer(root) as ckpt:
        h = ckpt.save(state, step=1, async_op=True)
        w.mul_(-1)
        h.result()
        assert_tree_equal(ckpt.read(1), expected)


def test_sync_close_waits_for_saves_in_flight(root: Path) -> None:
    with aiockpt.sync.Checkpointer(root) as ckpt:
        h = ckpt.save({"w": torch.ones(1 << 20)}, step=3, async_op=True)
    assert h.done()
    assert h.state is SaveState.COMMITTED
    assert exists(root / "step-00000003" / "manifest.msgpack")


def test_sync_close_refuses_a_cancel_that_is_not_a_bool(root: Path) -> None:
    """``close(cancel="false")``, a config file's "do not cancel", cancelled the save in flight."""
    ckpt = aiockpt.sync.Checkpointer(root)
    h = ckpt.save({"w": torch.ones(1 << 20)}, step=3, async_op=True)
    with pytest.raises(aiockpt.CheckpointError, match="cancel must be a bool, not 'false'"):
        ckpt.close(cancel="false")  # type: ignore[arg-type]
    ckpt.close()
    assert h.state is SaveState.COMMITTED
    with pytest.raises(aiockpt.CheckpointError, match="cancel must be a bool"):
        ckpt.close(cancel=None)  # type: ignore[arg-type]


def test_sync_watch_refuses_a_coalesce_that_is_not_a_bool(root: Path) -> None:
    with aiockpt.sync.Checkpointer(root) as ckpt:
        steps = ckpt.watch(poll_interval=0.01, coalesce="false")  # type: ignore[arg-type]
        with pytest.raises(aiockpt.CheckpointError, match="coalesce must be a bool, not 'false'"):
            next(steps)


def test_sync_failures_propagate(root: Path) -> None:
    with aiockpt.sync.Checkpointer(root) as ckpt:
        with pytest.raises(aiockpt.StateError, match="x/y"):
            ckpt.save({"x": {"y": object()}}, step=1)
        with pytest.raises(aiockpt.StateError):
            ckpt.save({"x": {"y": object()}}, step=1, async_op=True)
        assert ckpt.steps() == []
    assert tmp_entries(root) == []


def test_sync_on_busy_skip(root: Path) -> None:
    with aiockpt.sync.Checkpointer(root, max_inflight=1, on_busy="skip") as ckpt:
        h1 = ckpt.save({"w": torch.ones(1 << 21)}, step=1, async_op=True)
        h2 = ckpt.save({"w": torch.ones(1 << 21)}, step=2, async_op=True)
        assert h2.state is SaveState.SKIPPED
        assert h2.skipped
        with pytest.raises(aiockpt.BusyError):
            h2.result()
        h1.result()
        assert ckpt.steps() == [1]


def test_sync_close_stops_the_loop_thread(root: Path) -> None:
    before = {t.ident for t in threading.enumerate()}
    with aiockpt.sync.Checkpointer(root) as ckpt:
        ckpt.save({"w": torch.ones(3)}, step=1)
    leaked = [t for t in threading.enumerate() if t.ident not in before and t.name == "aiockpt-sync"]
    assert leaked == []


def test_sync_module_functions_roundtrip(tmp_path: Path) -> None:
    state, model, opt = training_state()
    sched = state["sched"]
    assert isinstance(sched, torch.optim.lr_scheduler.StepLR)
    for i in range(2):
        train_step(model, opt, sched, i)
    state["extras"] = {"tuple": (1, "a"), "bytes": b"\x00\x01", "t": torch.arange(4)}
    expected = snapshot(state)
    path = tmp_path / "ckpt"
    meta = aiockpt.sync.save(state, path)
    assert isinstance(meta, aiockpt.Metadata)
    assert meta.path == str(path)

    got = aiockpt.sync.read(path)
    assert_tree_equal(got, expected)
    assert type(at(got, "extras", "tuple")) is tuple

    state2, model2, opt2 = training_state(seed=5)
    t2 = torch.zeros(4, dtype=torch.int64)
    state2["extras"] = {"tuple": (0, ""), "bytes": b"", "t": t2}
    result = aiockpt.sync.load(state2, path)
    assert result is state2
    assert_tree_equal(snapshot(state2), expected)
    assert state2["model"] is model2
    assert tensor_at(state2, "extras", "t") is t2
    # Both continue identically.
    train_step(model, opt, None, 7)
    train_step(model2, opt2, None, 7)
    assert_tree_equal(model2.state_dict(), model.state_dict())


def test_sync_module_functions_errors(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    with pytest.raises(aiockpt.CheckpointNotFoundError):
        aiockpt.sync.read(path)
    aiockpt.sync.save({"a": torch.ones(2)}, path)
    with pytest.raises(aiockpt.CheckpointExistsError):
        aiockpt.sync.save({"a": torch.zeros(2)}, path)
    with pytest.raises(aiockpt.StateMismatchError, match="b"):
        aiockpt.sync.load({"a": torch.zeros(2), "b": torch.zeros(1)}, path)
    assert_tree_equal(aiockpt.sync.read(path), {"a": torch.ones(2)})


def test_sync_handles_answer_after_close_and_a_closed_checkpointer_says_so(root: Path) -> None:
    """``result()``/``cancel()`` of a save that ended, and every call on a closed Checkpointer, used to
    fail with anyio's "This portal is not running"."""
    with aiockpt.sync.Checkpointer(root) as ckpt:
        handle = ckpt.save({"w": torch.ones(1 << 20)}, step=1, async_op=True)
    assert handle.result().step == 1
    handle.cancel()  # ended: nothing to do
    assert handle.state is SaveState.COMMITTED
    ckpt.wait()  # nothing in flight
    for call in (
        lambda: ckpt.save({"w": torch.ones(2)}, step=2),
        ckpt.steps,
        lambda: ckpt.load({"w": torch.zeros(1 << 20)}),
        ckpt.read,
    ):
        with pytest.raises(aiockpt.CheckpointError, match="closed"):
            call()


async def test_sync_module_functions_refuse_a_running_event_loop(tmp_path: Path) -> None:
    """They would block the loop (and anyio refused with a bare RuntimeError)."""
    path = tmp_path / "ckpt"
    with pytest.raises(aiockpt.CheckpointError, match=r"await aiockpt\.save"):
        aiockpt.sync.save({"a": torch.ones(2)}, path)
    await aiockpt.save({"a": torch.ones(2)}, path)
    with pytest.raises(aiockpt.CheckpointError, match=r"await aiockpt\.load"):
        aiockpt.sync.load({"a": torch.zeros(2)}, path)
    with pytest.raises(aiockpt.CheckpointError, match=r"await aiockpt\.read"):
        aiockpt.sync.read(path)


# --- verify, convert ------------------------------------------------------------------------------------


def test_sync_verify_finds_a_corrupted_chunk(ckpt_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    aiockpt.sync.save(
        {"a": torch.randn(64, 64, generator=g), "b": torch.arange(1000)},
        ckpt_path,
        io=aiockpt.IOConfig(checksum_block=4096),
    )
    seen: list[tuple[int, int, int]] = []
    report = aiockpt.sync.verify(
        ckpt_path, progress=lambda done, total: seen.append((threading.get_ident(), done, total))
    )
    assert isinstance(report, aiockpt.VerifyReport)
    assert report.ok
    assert report.num_tensors == 2
    assert seen[-1][1:] == (report.nbytes, report.nbytes)
    assert {ident for ident, _, _ in seen} == {threading.get_ident()}  # on the caller's thread

    (entry,) = [t for t in read_manifest(ckpt_path).tensors if t.path == ("a",)]
    (chunk,) = entry.chunks
    flip_byte(ckpt_path / chunk.file, chunk.offset + 4096 + 3)  # block 1 of "a"
    report = aiockpt.sync.verify(ckpt_path)
    assert not report.ok
    (problem,) = report.problems
    assert isinstance(problem, aiockpt.CorruptionError)
    assert problem.key == "a"
    assert "checksum mismatch in block 1" in str(problem)

    with pytest.raises(aiockpt.CheckpointNotFoundError):
        aiockpt.sync.verify(ckpt_path.parent / "nope")


def test_sync_convert_writes_a_readable_checkpoint(tmp_path: Path) -> None:
    state: dict[str, object] = {"w": torch.arange(12.0).reshape(3, 4), "n": {"b": torch.ones(2)}}
    src = tmp_path / "src"
    aiockpt.sync.save(state, src)
    seen: list[tuple[int, int]] = []
    out = aiockpt.sync.convert(
        src, tmp_path / "model.safetensors", to="safetensors", progress=lambda *a: seen.append(a)
    )
    assert out == tmp_path / "model.safetensors"
    assert_tree_equal(aiockpt.sync.read(out), {"w": state["w"], "n.b": at(state, "n", "b")})
    assert seen[-1] == (14 * 4, 14 * 4)
    back = aiockpt.sync.convert(out, tmp_path / "back", to="aiockpt")
    assert aiockpt.sync.verify(back).ok
    assert_tree_equal(aiockpt.sync.read(back), {"w": state["w"], "n.b": at(state, "n", "b")})

    with pytest.raises(aiockpt.CheckpointExistsError):
        aiockpt.sync.convert(src, back, to="aiockpt")
    no: Any = "no"  # (what a config file gives; the annotations say bool)
    with pytest.raises(aiockpt.CheckpointError, match=r"^allow_pickle must be a bool"):
        aiockpt.sync.convert(src, tmp_path / "e.pt", to="torch", allow_pickle=no)
    bad: Any = "pickle"
    with pytest.raises(aiockpt.CheckpointError, match=r"^to must be"):
        aiockpt.sync.convert(src, tmp_path / "f", to=bad)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["back", "model.safetensors", "src"]


async def test_sync_verify_and_convert_refuse_a_running_event_loop(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    await aiockpt.save({"a": torch.ones(2)}, path)
    with pytest.raises(aiockpt.CheckpointError, match=r"await aiockpt\.verify"):
        aiockpt.sync.verify(path)
    with pytest.raises(aiockpt.CheckpointError, match=r"await aiockpt\.convert"):
        aiockpt.sync.convert(path, tmp_path / "out.pt", to="torch")
    assert not exists(tmp_path / "out.pt")


# --- refresh, path_of, watch ----------------------------------------------------------------------------


def filled(step: int) -> dict[str, object]:
    return {"w": torch.full((1 << 10,), float(step))}


def next_within(steps: Generator[int, None, None], timeout: float = 10) -> int:
    """``next(steps)``, run in a thread and waited for at most ``timeout`` seconds.

    One that times out stays blocked until the test closes the watching Checkpointer, which ends it.
    """
    got: queue.Queue[int | BaseException] = queue.Queue()

    def take() -> None:
        try:
            got.put(next(steps))
        except BaseException as exc:  # raised below, in the test's thread
            got.put(exc)

    threading.Thread(target=take, name="next-within").start()
    result = got.get(timeout=timeout)
    if isinstance(result, BaseException):
        raise result
    return result


def test_sync_refresh_sees_steps_of_another_writer_and_path_of_names_a_step(root: Path) -> None:
    with aiockpt.sync.Checkpointer(root) as reader, aiockpt.sync.Checkpointer(root) as writer:
        assert reader.refresh() == []
        writer.save(filled(3), step=3)
        writer.save(filled(5), step=5)
        assert reader.refresh() == [3, 5]
        assert reader.path_of(5) == root / "step-00000005"
        assert_tree_equal(aiockpt.sync.read(str(reader.path_of(3))), filled(3))
    assert reader.path_of(7) == root / "step-00000007"  # no event loop needed, also once closed
    with pytest.raises(aiockpt.CheckpointError, match="closed"):
        reader.refresh()


def test_sync_watch_yields_the_steps_another_thread_commits_from_its_first_next(root: Path) -> None:
    with aiockpt.sync.Checkpointer(root) as watcher, aiockpt.sync.Checkpointer(root) as writer:
        writer.save(filled(1), step=1)
        steps = watcher.watch(poll_interval=0.02, coalesce=False)
        writer.save(filled(2), step=2)  # before the first next(), which lists the root: not yielded
        stop = threading.Event()

        def write_later() -> None:
            # Until the watch yields one: a step committed before its first listing (on a loaded
            # machine, later than any fixed wait) is not new.
            for step in range(4, 400):
                if stop.wait(0.05):
                    return
                writer.save(filled(step), step=step)

        thread = threading.Thread(target=write_later)
        thread.start()
        try:
            first = next_within(steps)
        finally:
            stop.set()
            thread.join()
        assert first >= 4
        writer.save(filled(3), step=3)  # older than the newest: yielded too (coalesce=False)
        seen = [first]
        while seen[-1] != 3:  # after the steps the writer committed before it stopped
            seen.append(next_within(steps))
        assert 2 not in seen
        assert seen[:-1] == sorted(seen[:-1])
        steps.close()


def test_sync_watch_yields_a_step_an_async_checkpointer_commits(root: Path) -> None:
    enough = threading.Event()

    async def write() -> None:
        # Until the watch yields one (bounded): a step committed before its first listing is not new.
        async with aiockpt.Checkpointer(root) as writer:
            for step in range(10, 1000, 10):
                await anyio.sleep(0.05)
                await writer.save(filled(step), step=step)
                if enough.is_set():
                    return

    with aiockpt.sync.Checkpointer(root) as watcher:
        thread = threading.Thread(target=anyio.run, args=(write,))
        thread.start()
        seen: list[int] = []
        try:
            for step in watcher.watch(poll_interval=0.02):
                seen.append(step)
                break
        finally:
            enough.set()
            thread.join()
        (step,) = seen
        assert step % 10 == 0
        assert_tree_equal(watcher.read(step), filled(step))
