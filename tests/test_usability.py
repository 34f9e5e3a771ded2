"""Mistakes a user makes, and what aiockpt says about them: arguments of a wrong type, the blocking facade
drifting from the async API, ints a checkpoint cannot hold, a closed pipe under the command line, and a
step that retention deletes as soon as it is saved."""

from __future__ import annotations

import inspect
import math
import os
import subprocess
import sys
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
from conftest import assert_tree_equal, listdir

import aiockpt
import aiockpt.sync
from aiockpt import Checkpointer, CheckpointError, S3Options, StateError

from s3_util import S3Server, s3_server

pytestmark = pytest.mark.timeout(120)

REPO = Path(aiockpt.__file__).resolve().parent.parent


# --- Checkpointer arguments -----------------------------------------------------------------------------

BAD_ARGUMENTS = [
    ("keep_last", 2.5),  # a float from a config file: every commit's pruning failed (a slice index)
    ("keep_last", "2"),
    ("keep_last", True),
    ("keep_last", 0),
    ("keep_every", 10.0),
    ("keep_every", 0),
    ("max_inflight", 1.5),  # failed at open with a bare TypeError
    ("max_inflight", True),
    ("max_inflight", 0),
    ("on_busy", "drop"),
    ("on_busy", None),
    ("allow_pickle", "false"),  # truthy: it would have turned unpickling on
    ("allow_pickle", 1),
    ("io", {"threads": 2}),
    ("staging_budget", 1.5),
    ("staging_budget", -1),
    ("collective_timeout", 0),
    ("collective_timeout", -5.0),
    ("collective_timeout", math.nan),
    ("collective_timeout", math.inf),
    ("collective_timeout", "60"),
    ("collective_timeout", True),
    ("use_collectives", "no"),
    ("s3", {"endpoint": "http://127.0.0.1:9"}),
]


@pytest.mark.parametrize("facade", ["async", "sync"])
@pytest.mark.parametrize(("name", "value"), BAD_ARGUMENTS, ids=[f"{n}={v!r}" for n, v in BAD_ARGUMENTS])
def test_checkpointer_refuses_an_argument_of_a_wrong_type_or_range_at_once(
    root: Path, facade: str, name: str, value: object
) -> None:
    make: Callable[..., object] = Checkpointer if facade == "async" else aiockpt.sync.Checkpointer
    with pytest.raises(CheckpointError) as info:
        make(root, **{name: value})
    message = str(info.value)
    assert message.startswith(f"{name} must be "), message
    assert message.endswith(f", not {value!r}"), message
    assert not root.exists()  # refused before anything was made


async def test_the_functions_refuse_a_flag_that_is_not_a_bool(tmp_path: Path) -> None:
    """allow_pickle="false" (a str from a config file) is truthy: it used to turn unpickling on."""
    state: dict[str, object] = {"w": torch.ones(2)}
    await aiockpt.save(state, tmp_path / "ok")
    no: Any = "no"  # (what a config file gives; the annotations say bool)
    ok = tmp_path / "ok"
    calls: list[tuple[str, Callable[[], Awaitable[object]]]] = [
        ("allow_pickle", lambda: aiockpt.save(state, tmp_path / "a", allow_pickle=no)),
        ("async_op", lambda: aiockpt.save(state, tmp_path / "b", async_op=no)),
        ("use_collectives", lambda: aiockpt.save(state, tmp_path / "c", use_collectives=no)),
        ("collective_timeout", lambda: aiockpt.save(state, tmp_path / "d", collective_timeout=math.nan)),
        ("strict", lambda: aiockpt.load(state, ok, strict=no)),
        ("allow_pickle", lambda: aiockpt.load(state, ok, allow_pickle=no)),
        ("allow_pickle", lambda: aiockpt.read(ok, allow_pickle=no)),
        ("allow_pickle", lambda: aiockpt.convert(ok, tmp_path / "e.pt", to="torch", allow_pickle=no)),
    ]
    for name, call in calls:
        with pytest.raises(CheckpointError, match=f"^{name} must be"):
            await call()
    async with Checkpointer(tmp_path / "root") as ckpt:
        await ckpt.save(state, step=1)
        with pytest.raises(CheckpointError, match=r"^strict must be a bool, not 'no'"):
            await ckpt.load(state, strict=no)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ok", "root"]  # nothing written


@pytest.mark.parametrize(
    "kwargs",
    [
        {"keep_last": 1, "keep_every": 1, "max_inflight": 3, "staging_budget": 0},
        {"keep_last": None, "keep_every": None, "staging_budget": None, "io": None, "s3": None},
        {"collective_timeout": 5, "on_busy": "skip", "allow_pickle": True, "use_collectives": False},
        {"collective_timeout": 0.5, "on_busy": "error", "io": aiockpt.IOConfig()},
    ],
)
def test_checkpointer_takes_every_documented_kind_of_value(root: Path, kwargs: dict[str, object]) -> None:
    ckpt = Checkpointer(root, **kwargs)  # type: ignore[arg-type]
    for name, value in kwargs.items():
        if name not in ("io", "staging_budget", "collective_timeout", "use_collectives", "s3"):
            assert getattr(ckpt, name) == value


# --- The blocking facade takes what the async API takes ----------------------------------------------------

# Parameters of the async API that the blocking facade leaves out on purpose: each sync.save call runs an
# event loop that ends with it, so a save going on in the background (async_op) has nowhere to go on.
NOT_IN_SYNC = {"save": {"async_op"}}


def _params(fn: Callable[..., object]) -> list[tuple[str, object, object, object]]:
    return [
        (p.name, p.kind, p.default, p.annotation)
        for p in inspect.signature(fn).parameters.values()
        if p.name != "self"
    ]


@pytest.mark.parametrize("name", ["save", "load", "read"])
def test_sync_functions_take_the_arguments_of_their_async_twins(name: str) -> None:
    skip = NOT_IN_SYNC.get(name, set())
    expected = [p for p in _params(getattr(aiockpt, name)) if p[0] not in skip]
    assert _params(getattr(aiockpt.sync, name)) == expected


def test_sync_checkpointer_takes_the_arguments_of_the_async_one() -> None:
    assert _params(aiockpt.sync.Checkpointer.__init__) == _params(Checkpointer.__init__)
    shared = [
        m
        for m in vars(aiockpt.sync.Checkpointer)
        if not m.startswith("_") and callable(getattr(Checkpointer, m, None))
    ]
    assert {"save", "load", "read", "reserve"} <= set(shared)
    for method in shared:
        sync_params = _params(getattr(aiockpt.sync.Checkpointer, method))
        assert sync_params == _params(getattr(Checkpointer, method)), method


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Server]:
    with s3_server() as server:
        yield server


def test_the_blocking_facade_passes_s3_options_on(s3: S3Server, monkeypatch: pytest.MonkeyPatch) -> None:
    # Credentials from the environment, but the endpoint only from S3Options: without s3= reaching the
    # store, every call would go to AWS instead of the test server.
    bucket = s3.bucket()
    for key, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    opts = S3Options(endpoint=s3.endpoint, max_retries=0)
    state: dict[str, object] = {"w": torch.arange(8, dtype=torch.float32), "step": 3}
    url = f"s3://{bucket}/one"
    aiockpt.sync.save(state, url, s3=opts)
    assert_tree_equal(aiockpt.sync.read(url, s3=opts), state)
    target: dict[str, object] = {"w": torch.zeros(8), "step": 0}
    aiockpt.sync.load(target, url, s3=opts)
    assert_tree_equal(target, state)
    with aiockpt.sync.Checkpointer(f"s3://{bucket}/root", keep_last=1, s3=opts) as ckpt:
        ckpt.save(state, step=1)
        ckpt.save(state, step=2, async_op=True).result()
        assert ckpt.steps() == [2]
        assert_tree_equal(ckpt.read(), state)


# --- Ints a checkpoint cannot hold as values ------------------------------------------------------------


@pytest.mark.parametrize("value", [2**64, -(2**63) - 1, 2**200])
async def test_an_int_outside_the_stored_range_is_refused_as_such(ckpt_path: Path, value: int) -> None:
    with pytest.raises(StateError) as info:
        await aiockpt.save({"run": {"seed": value}}, ckpt_path)
    message = str(info.value)
    assert f"the int {value} at key 'run/seed'" in message, message
    assert "outside the ints a checkpoint stores as plain values ([-2**63, 2**64 - 1])" in message, message
    assert "builtins.int" not in message, message
    assert info.value.key == "run/seed"
    assert not ckpt_path.exists()
    # The metadata of a save says the same of such an int.
    with pytest.raises(StateError, match=r"outside .*\[-2\*\*63, 2\*\*64 - 1\]"):
        await aiockpt.save({"w": torch.ones(1)}, ckpt_path, metadata={"seed": value})


async def test_a_huge_int_is_refused_without_printing_its_digits(ckpt_path: Path) -> None:
    with pytest.raises(StateError, match=r"the int <20001 bits> at key 'seed'"):
        await aiockpt.save({"seed": 2**20000}, ckpt_path)  # str() would exceed Python's digit limit
    with pytest.raises(StateError, match=r"metadata key 'seed': the value <20001 bits> is outside"):
        await aiockpt.save({}, ckpt_path, metadata={"seed": 2**20000})  # (was a bare ValueError)


async def test_ints_at_the_ends_of_the_range_are_values_and_beyond_them_pickle_can_store_them(
    tmp_path: Path,
) -> None:
    ends = {"low": -(2**63), "high": 2**64 - 1}
    await aiockpt.save(ends, tmp_path / "ends")
    assert await aiockpt.read(tmp_path / "ends") == ends
    beyond = {"low": -(2**63) - 1, "high": 2**64}
    await aiockpt.save(beyond, tmp_path / "beyond", allow_pickle=True)
    assert await aiockpt.read(tmp_path / "beyond", allow_pickle=True) == beyond


# --- The command line under a closed pipe ---------------------------------------------------------------


@pytest.mark.parametrize("args", [("inspect",), ("inspect", "--json")], ids=" ".join)
def test_the_cli_stops_quietly_with_141_when_its_output_is_closed(
    tmp_path: Path, args: tuple[str, ...]
) -> None:
    # Exit 1 would say "damage found", and 0 that all was written. The output is far more than a pipe
    # holds (64 KiB), so the command is still writing when the reader goes away; `inspect` writes through
    # rich, `--json` through click.
    path = tmp_path / "ckpt"
    aiockpt.sync.save({f"t{i:05d}": torch.zeros(1) for i in range(3000)}, path)
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES", "FORCE_COLOR")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "aiockpt", *args, str(path)]
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env) as proc:
        assert proc.stdout is not None
        assert proc.stderr is not None
        first = proc.stdout.readline()
        proc.stdout.close()  # `| head -1`
        err = proc.stderr.read()
        code = proc.wait(timeout=120)
    assert first.strip(), "the command wrote nothing"
    assert (code, err.decode()) == (141, "")


# --- A step that retention deletes as soon as it is saved -----------------------------------------------


def _step_dir(step: int) -> str:
    return f"step-{step:08d}"


async def test_a_step_saved_below_the_kept_ones_is_deleted_at_once_and_the_save_warns(root: Path) -> None:
    async with Checkpointer(root, keep_last=2) as ckpt:  # run 1
        for step in (10, 11):
            await ckpt.save({"run": 1, "step": step}, step=step)
    async with Checkpointer(root, keep_last=2) as ckpt:  # run 2, counting from 1 again in the same root
        with pytest.warns(RuntimeWarning) as caught:
            meta = await ckpt.save({"run": 2, "step": 1}, step=1)
        assert len(caught) == 1
        message = str(caught[0].message)
        assert message.startswith(f"step 1 was deleted from {root} at once"), message
        assert "(keep_last=2) keeps steps [10, 11]" in message, message
        # Deliberate: the step is gone, and the newest step stays the latest.
        assert not Path(meta.path).exists()
        assert ckpt.steps() == [10, 11]
        target: dict[str, object] = {"run": 0, "step": 0}
        assert await ckpt.load(target) == 11
        # A background save warns alike, and a step saved in order does not.
        with pytest.warns(RuntimeWarning, match="step 2 was deleted .* at once"):
            await (await ckpt.save({"run": 2, "step": 2}, step=2, async_op=True))
        await ckpt.save({"run": 2, "step": 12}, step=12)
        await ckpt.wait()
        assert listdir(root) == ["latest", _step_dir(11), _step_dir(12)]


async def test_two_saves_in_flight_that_commit_out_of_order_do_not_warn(root: Path) -> None:
    """A large step 1 committing after a small step 2 is pruned (keep_last=1) without a word: no mistake."""
    async with Checkpointer(root, keep_last=1, max_inflight=2) as ckpt:
        gate = anyio.Event()
        real = ckpt._after_commit

        async def held(step: int, newest: int | None = None) -> None:
            if step == 1:
                await gate.wait()  # step 1 commits after step 2
            await real(step, newest)

        ckpt._after_commit = held  # type: ignore[method-assign]
        first = await ckpt.save({"w": torch.ones(4)}, step=1, async_op=True)
        await ckpt.save({"w": torch.ones(4)}, step=2)
        gate.set()
        await first  # (warnings are errors here)
        assert ckpt.steps() == [2]


def test_the_blocking_facade_warns_alike(root: Path) -> None:
    with aiockpt.sync.Checkpointer(root, keep_last=1, keep_every=100) as ckpt:
        ckpt.save({"x": 1}, step=5)
        with pytest.warns(RuntimeWarning, match=r"\(keep_last=1, keep_every=100\) keeps steps \[5\]"):
            ckpt.save({"x": 1}, step=3)
        assert ckpt.steps() == [5]
