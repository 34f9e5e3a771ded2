"""The examples run as users run them: a real interpreter, a real SIGKILL, a real resume."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
MATCHES = "resumed run matches uninterrupted run: True"


def run_example(
    name: str, *args: str, launcher: tuple[str, ...] = (), env_extra: dict[str, str] | None = None
) -> str:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        **(env_extra or {}),
    }
    proc = subprocess.run(
        [sys.executable, *launcher, str(REPO / "examples" / name), *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{name} exited with {proc.returncode}:\n{output}"
    return output


def resumed_step(output: str) -> int:
    found = re.search(r"resumed from step (\d+)", output)
    assert found, output
    return int(found.group(1))


def test_train_resume(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    out = run_example("train_resume.py", "--root", str(root), "--steps", "90", "--save-every", "10")

    assert MATCHES in out
    assert "SIGKILL sent to the training process" in out
    assert "save started: staged in" in out
    assert "checkpoint 10 committed" in out
    # Killed after step 60 (2/3 of 90): the save of step 50 had committed before 60's began, and a
    # committed step is never lost; anything newer is the later save racing the kill.
    step = resumed_step(out)
    assert step % 10 == 0
    assert 50 <= step < 90, out
    # The resumed run kept writing checkpoints; keep_last=3 pruned the rest and nothing is left half-done,
    # but for a lock file under its private name where locks cannot be made unnamed: a kill before its
    # rename leaves it, and it goes only once stale (see aiockpt._fs.OwnerLock).
    private_lock = re.compile(r"\.tmp-step-\d{8}-[0-9a-f]{12}\.lock\.[0-9a-f]{32}")
    assert sorted(p.name for p in root.iterdir() if not private_lock.fullmatch(p.name)) == [
        "latest",
        "step-00000070",
        "step-00000080",
        "step-00000090",
    ]
    assert (root / "latest").read_text().strip() == "step-00000090"


def test_train_resume_removes_its_temporary_root() -> None:
    out = run_example("train_resume.py", "--steps", "30", "--save-every", "5")
    assert MATCHES in out
    found = re.search(r" in (\S+aiockpt-demo-\S+)", out)
    assert found, out
    assert not Path(found.group(1)).exists()


def test_sync_loop(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    out = run_example("sync_loop.py", "--root", str(root), "--crash-at", "70")

    assert MATCHES in out
    assert "interrupted after step 70" in out
    # The save of step 60 was in flight at the interruption; leaving the with block finished it.
    assert resumed_step(out) == 60
    assert (root / "latest").read_text().strip() == "step-00000100"


def test_rl_learner_and_actors(tmp_path: Path) -> None:
    output = run_example("rl_learner_actor.py", "--root", str(tmp_path / "root"), "--steps", "60")
    assert "all processes finished" in output
    for actor in ("actor-1", "actor-2"):
        found = re.search(
            rf"{actor}: versions seen \[([\d, ]+)\]; \d+ hot-loads; loop lag p99 [\d.]+ ms", output
        )
        assert found, output
        versions = [int(v) for v in found.group(1).split(",")]
        assert versions == sorted(set(versions)), f"{actor} saw versions out of order: {versions}"
        assert versions[-1] == 60, output


@pytest.mark.parametrize(
    ("name", "args", "complaint"),
    [
        ("sync_loop.py", ["--crash-at", "100"], "--crash-at must lie between 0 and --steps"),
        ("sync_loop.py", ["--crash-at", "0"], "--crash-at must lie between 0 and --steps"),
        ("sync_loop.py", ["--save-every", "0"], "--save-every at least 1"),
        ("sync_loop.py", ["--root", "{full}"], "is not empty"),
        ("rl_learner_actor.py", ["--root", "{full}"], "is not empty"),
    ],
)
def test_examples_refuse_options_they_cannot_run_with(
    tmp_path: Path, name: str, args: list[str], complaint: str
) -> None:
    """sync_loop.py with no interruption (--crash-at 0 or past --steps) printed "matches: False" and
    exited 1; rl_learner_actor.py run again on its root crashed (step 10 exists) with a traceback."""
    full = tmp_path / "full"
    (full / "step-00000010").mkdir(parents=True)
    proc = subprocess.run(
        [sys.executable, str(REPO / "examples" / name), *(a.format(full=full) for a in args)],
        cwd=REPO,
        env={
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        },
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert complaint in proc.stderr
    assert [p.name for p in full.iterdir()] == ["step-00000010"]  # nothing written there


@pytest.mark.dist
def test_distributed_train_resumes_on_more_ranks(tmp_path: Path) -> None:
    """Its docstring says the state loads into any world size; a third rank had no saved noise generator
    (per-rank state), and the resume failed with a StateMismatchError on rank 2."""
    root = tmp_path / "root"

    def launch(ranks: int, steps: int) -> str:
        torchrun = ("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks))
        args = ["--root", str(root), "--steps", str(steps), "--save-every", "10"]
        return run_example(
            "distributed_train.py", *args, launcher=torchrun, env_extra={"OMP_NUM_THREADS": "1"}
        )

    launch(2, 10)
    grown = launch(3, 20)
    assert "world size 3: resumed from step 10" in grown
    assert "checkpoint 20 durable" in grown


@pytest.mark.dist
def test_distributed_train_with_torchrun_resumes(tmp_path: Path) -> None:
    root = tmp_path / "root"

    def launch(*extra: str) -> str:
        torchrun = ("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2")
        args = ["--root", str(root), "--steps", "40", "--save-every", "10", *extra]
        single_threaded = {"OMP_NUM_THREADS": "1"}
        return run_example("distributed_train.py", *args, launcher=torchrun, env_extra=single_threaded)

    def committed() -> list[str]:
        return sorted(p.name for p in root.iterdir())

    # Interrupted after step 25: the save of step 20 was in flight and completed before the launch ended.
    first = launch("--stop-at", "25")
    assert "world size 2: starting from scratch" in first
    assert "stopping at step 25" in first
    assert "checkpoint 20 durable" in first
    assert committed() == ["latest", "step-00000010", "step-00000020"]

    # The second launch resumes from the last committed step, trains to 40; keep_last=2 pruned the rest.
    second = launch()
    assert resumed_step(second) == 20
    assert "starting from scratch" not in second
    assert "checkpoint 40 durable" in second
    assert committed() == ["latest", "step-00000030", "step-00000040"]
    assert (root / "latest").read_text().strip() == "step-00000040"

    # It trained as an uninterrupted run: same losses, which needs each rank's own input noise back
    # (per-rank RNG state; rank 1 used to resume with rank 0's generator).
    root = tmp_path / "uninterrupted"
    whole = launch()
    for step in (30, 40):
        assert loss_line(second, step) == loss_line(whole, step)


def loss_line(output: str, step: int) -> str:
    """The line rank 0 prints at ``step`` of distributed_train.py, up to its loss."""
    (line,) = [ln for ln in output.splitlines() if ln.startswith(f"step {step:4d}  loss")]
    return line.split("  save started")[0]
