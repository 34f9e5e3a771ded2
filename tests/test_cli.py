"""The ``aiockpt`` command line, run through its real entry points (``python -m aiockpt`` and the console
script) in subprocesses, on checkpoints made here with the library.

Each subprocess imports torch (a few seconds), so independent invocations run concurrently.
"""

from __future__ import annotations

import json
import math
import os
import pty
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import crc32c
import msgspec
import pytest
import torch
from conftest import file_size, flip_byte, listdir, make_model

import aiockpt
from aiockpt import sync
from aiockpt._format import ENCODER, ENVELOPE_DECODER, MANIFEST_NAME
from aiockpt._fs import LOCK_SUFFIX, OwnerLock
from aiockpt._load import read_manifest

Result = subprocess.CompletedProcess[str]


def _script() -> str | None:
    """The installed ``aiockpt`` console script (the venv's first), or ``None``."""
    return shutil.which("aiockpt", path=str(Path(sys.executable).parent)) or shutil.which("aiockpt")


def _env() -> dict[str, str]:
    # Not a terminal: no progress bar, no colours; the width is the tool's own for pipes.
    return {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES", "FORCE_COLOR")}


def cli(*args: str | Path, script: bool = False) -> Result:
    """Run ``python -m aiockpt ARGS`` (or the console script) and return what it did."""
    if script:
        exe = _script()
        if exe is None:
            pytest.skip("the aiockpt console script is not installed (pip install -e '.[cli]')")
        cmd = [exe]
    else:
        cmd = [sys.executable, "-m", "aiockpt"]
    return subprocess.run(
        [*cmd, *map(str, args)], capture_output=True, text=True, timeout=120, env=_env(), check=False
    )


def cli_many(*calls: tuple[str | Path, ...]) -> list[Result]:
    """Run several independent invocations at once."""
    with ThreadPoolExecutor(len(calls)) as pool:
        return list(pool.map(lambda args: cli(*args), calls))


def cli_on_tty_stderr(*args: str | Path) -> tuple[int, str, str]:
    """Run ``python -m aiockpt ARGS`` with stderr on a pseudo-terminal: ``(code, stdout, terminal)``."""
    controller, terminal = pty.openpty()
    env = _env() | {"TERM": "xterm"}
    cmd = [sys.executable, "-m", "aiockpt", *map(str, args)]
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=terminal, text=True, env=env) as proc:
        os.close(terminal)
        seen: list[bytes] = []

        def drain() -> None:  # the child blocks once the terminal's buffer is full
            while True:
                try:
                    data = os.read(controller, 1 << 16)
                except OSError:  # EIO: the child closed its end
                    return
                if not data:
                    return
                seen.append(data)

        reader = threading.Thread(target=drain)
        reader.start()
        out, _ = proc.communicate(timeout=120)
        reader.join(timeout=30)
    os.close(controller)
    return proc.returncode, out, b"".join(seen).decode(errors="replace")


def one_error_line(r: Result, code: int) -> str:
    """Assert a failure reported as one line on stderr, without a traceback; return the line."""
    assert r.returncode == code, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr
    lines = r.stderr.splitlines()
    assert len(lines) == 1, r.stderr
    return lines[0]


def _state(seed: int = 0) -> dict[str, object]:
    g = torch.Generator().manual_seed(seed)
    tied = torch.randn(3, 5, generator=g)
    return {
        "model": make_model(seed),
        "emb": torch.randn(40, 16, generator=g).to(torch.bfloat16),
        "ids": torch.arange(1000, dtype=torch.int64),
        "tied": tied,
        "tied_again": tied,
        "epoch": 3,
        "name": "run-a",
        "lr": math.inf,
        "blob": b"\x00\x01\x02",
        "nothing": None,
        "flags": (True, 2.5),
    }


def _save_steps(
    root: Path, steps: list[int], *, keep_last: int | None = None, keep_every: int | None = None
) -> None:
    with sync.Checkpointer(root, keep_last=keep_last, keep_every=keep_every) as ckpt:
        for s in steps:
            ckpt.save(_state(s), step=s, metadata={"epoch": s})


def _key_line(text: str, key: str) -> str:
    """The line of a table whose first cell is ``key``."""
    lines = [ln for ln in text.splitlines() if ln.split()[:1] == [key]]
    assert len(lines) == 1, f"{key!r} in:\n{text}"
    return lines[0]


# --- ls -------------------------------------------------------------------------------------------------


def test_ls_shows_steps_latest_and_flags_what_is_not_a_checkpoint(root: Path) -> None:
    _save_steps(root, [10, 20, 30])
    # A crashed save (no live owner), a save in progress (its lock held here), and a collective-free
    # checkpoint of two ranks whose rank 1 never published its part.
    crashed = root / ".tmp-step-00000040-0123456789ab"
    crashed.mkdir()
    (crashed / "data-r00000.bin").write_bytes(b"x" * 100)
    running = root / ".tmp-step-00000050-ba9876543210"
    running.mkdir()
    lock = OwnerLock(running.with_name(running.name + LOCK_SUFFIX))
    try:
        sync.save({"w": torch.ones(10)}, root / "step-00000060" / "rank-00000-of-00002")
        text, as_json = cli_many(("ls", root), ("ls", "--json", root))
    finally:
        lock.release()

    assert text.returncode == 0, text.stderr
    out = text.stdout
    assert "<- latest" in _key_line(out, "30")
    assert "latest" not in _key_line(out, "20")
    assert "ranks [1] (of 2) are missing" in _key_line(out, "60")
    flagged = {ln.split(":")[0].removeprefix("! "): ln for ln in out.splitlines() if ln.startswith("! ")}
    assert set(flagged) == {crashed.name, running.name}
    assert flagged[crashed.name].startswith(f"! {crashed.name}: abandoned (100 B)")
    assert flagged[running.name].startswith(f"! {running.name}: in-progress")
    assert "3 committed step(s)" in out
    assert "latest -> step-00000030" in out

    assert as_json.returncode == 0, as_json.stderr
    doc = json.loads(as_json.stdout)
    assert doc["schema"] == "aiockpt.ls/1"
    assert doc["root"] == str(root)
    assert doc["latest"] == "step-00000030"
    rows = {r["step"]: r for r in doc["steps"]}
    assert sorted(rows) == [10, 20, 30, 60]
    assert [s for s, r in rows.items() if r["latest"]] == [30]
    for s in (10, 20, 30):
        manifest = read_manifest(root / f"step-{s:08d}")
        assert rows[s]["committed"] is True
        assert rows[s]["problem"] is None
        assert rows[s]["tensors"] == len(manifest.tensors)
        assert rows[s]["created_at"] == manifest.created_at
        sizes = [file_size(root / f"step-{s:08d}" / n) for n in listdir(root / f"step-{s:08d}")]
        assert rows[s]["nbytes"] == sum(sizes)
    assert rows[60]["committed"] is False
    assert rows[60]["collective_free"] is True
    others = {o["name"]: o for o in doc["other"]}
    assert set(others) == {crashed.name, running.name}
    assert others[crashed.name]["kind"] == "abandoned"
    assert others[crashed.name]["step"] == 40
    assert others[crashed.name]["nbytes"] == 100
    assert others[running.name]["kind"] == "in-progress"


# --- inspect --------------------------------------------------------------------------------------------


def test_ls_flags_a_damaged_manifest_and_exits_1(root: Path) -> None:
    """It was listed with the decoder's message only and ``ls`` exited 0, where the docs promise
    ``damaged manifest: ...`` and exit code 1 for damage found."""
    _save_steps(root, [10, 20])
    flip_byte(root / "step-00000020" / MANIFEST_NAME, 40)
    text, as_json = cli_many(("ls", root), ("ls", "--json", root))
    assert text.returncode == 1, text.stderr
    assert "! damaged manifest: " in _key_line(text.stdout, "20")
    assert "(1 with a damaged manifest)" in text.stdout
    assert as_json.returncode == 1
    rows = {r["step"]: r for r in json.loads(as_json.stdout)["steps"]}
    assert rows[20]["damaged"] is True
    assert rows[20]["problem"].startswith("damaged manifest: ")
    assert rows[10]["damaged"] is False
    assert rows[10]["problem"] is None


def test_inspect_describes_every_tensor_and_value(root: Path, tmp_path: Path) -> None:
    _save_steps(root, [5, 7])
    path = root / "step-00000007"
    state = _state(7)
    # A collective-free checkpoint of two ranks: "shared" was written by both, the others by one each.
    parts = tmp_path / "parts"
    sync.save({"only0": torch.ones(4), "shared": torch.zeros(8)}, parts / "rank-00000-of-00002")
    sync.save({"only1": torch.ones(2), "shared": torch.zeros(8)}, parts / "rank-00001-of-00002")
    text, as_json, of_parts = cli_many(
        ("inspect", path), ("inspect", "--json", root), ("inspect", "--json", parts)
    )
    assert as_json.returncode == 0, as_json.stderr
    doc = json.loads(as_json.stdout)
    assert doc["path"] == str(path)  # given a root: its newest step

    manifest = read_manifest(path)
    assert doc["schema"] == "aiockpt.inspect/1"
    assert doc["format_version"] == 2  # (no per-rank state: version 3 only for that)
    assert doc["step"] == 7
    assert doc["world_size"] == 1
    assert doc["created_at"] == manifest.created_at
    assert doc["library_version"] == aiockpt.__version__
    assert doc["user_metadata"] == {"epoch": 7}
    assert doc["files"] == [
        {"name": n, "nbytes": file_size(path / n)} for n in listdir(path) if n != MANIFEST_NAME
    ]

    model = state["model"]
    assert isinstance(model, torch.nn.Module)
    expected = {f"model/{k}": v for k, v in model.state_dict().items()}
    expected |= {k: v for k, v in state.items() if isinstance(v, torch.Tensor) and k != "tied_again"}
    tensors = {t["key"]: t for t in doc["tensors"]}
    assert set(tensors) == set(expected)
    for key, t in expected.items():
        row = tensors[key]
        assert row["dtype"] == str(t.dtype).removeprefix("torch.")
        assert row["shape"] == list(t.shape)
        assert row["nbytes"] == t.numel() * t.element_size()
        assert row["replicated"] is False
        assert [c["sizes"] for c in row["chunks"]] == [list(t.shape)]
        assert row["files"] == ["data-r00000.bin"]
    assert tensors["tied"]["aliases"] == ["tied_again"]

    values = {v["key"]: (v["type"], v["value"]) for v in doc["values"]}
    assert values["epoch"] == ("int", 3)
    assert values["name"] == ("str", "run-a")
    assert values["lr"] == ("float", "inf")
    assert values["nothing"] == ("None", None)
    assert values["flags/0"] == ("bool", True)
    assert values["flags/1"] == ("float", 2.5)
    assert [v["nbytes"] for v in doc["values"] if v["key"] == "blob"] == [3]
    assert {s["key"]: s["type"] for s in doc["statefuls"]} == {
        "model": "torch.nn.modules.container.Sequential"
    }
    # Nothing is per-rank state: every leaf is the state every rank shares.
    assert {x["rank"] for x in (*doc["tensors"], *doc["values"], *doc["statefuls"])} == {None}

    assert text.returncode == 0, text.stderr
    out = text.stdout
    assert str(path) in _key_line(out, "checkpoint")
    assert _key_line(out, "step").split() == ["step", "7"]
    assert "epoch = 7" in _key_line(out, "metadata")
    assert _key_line(out, "emb").split()[:5] == ["emb", "bfloat16", "(40,", "16)", "1.2"]
    assert _key_line(out, "ids").split()[:4] == ["ids", "int64", "(1000,)", "7.8"]
    for key in expected:
        assert _key_line(out, key).split()[-3:] == ["1", "data-r00000.bin", "no"]
    assert "= tied_again" in [ln.strip() for ln in out.splitlines()]

    assert of_parts.returncode == 0, of_parts.stderr
    doc = json.loads(of_parts.stdout)
    assert doc["world_size"] == 2
    assert {t["key"]: t["replicated"] for t in doc["tensors"]} == {
        "only0": False,
        "shared": True,
        "only1": False,
    }
    assert {t["key"]: t["files"] for t in doc["tensors"]} == {
        "only0": ["rank-00000-of-00002/data-r00000.bin"],
        "shared": ["rank-00000-of-00002/data-r00000.bin"],  # read from the first part that has it
        "only1": ["rank-00001-of-00002/data-r00000.bin"],
    }
    assert _key_line(out, "name").split()[1:] == ["str", "'run-a'"]
    assert _key_line(out, "lr").split()[1:] == ["float", "inf"]
    assert _key_line(out, "blob").split()[1:] == ["bytes", "<3", "bytes>"]


# --- verify ---------------------------------------------------------------------------------------------


def test_verify_passes_then_names_every_damaged_key_and_file(ckpt_path: Path) -> None:
    sync.save(_state(), ckpt_path)
    ok = cli("verify", "--no-progress", ckpt_path, script=True)
    assert ok.returncode == 0, ok.stderr
    assert ok.stderr == ""  # no progress bar when stderr is not a terminal
    assert ok.stdout.startswith("OK:")

    manifest = read_manifest(ckpt_path)
    chunks = {"/".join(map(str, t.path)): c for t in manifest.tensors for c in t.chunks}
    data = ckpt_path / chunks["emb"].file
    flip_byte(data, chunks["emb"].offset + 7)
    last = max(chunks, key=lambda k: chunks[k].offset)  # whichever tensor ends the file
    os.truncate(data, chunks[last].offset + chunks[last].nbytes - 1)

    text, as_json = cli_many(("verify", ckpt_path), ("verify", "--json", ckpt_path))
    assert text.returncode == 1, text.stderr
    assert text.stderr == ""
    problems = [ln for ln in text.stdout.splitlines() if ln.startswith("CORRUPT")]
    assert len(problems) == 2, text.stdout
    assert "checksum mismatch" in problems[0]
    assert "'emb'" in problems[0]
    assert str(data) in problems[0]
    assert "truncated" in problems[1]
    assert f"'{last}'" in problems[1]
    assert str(data) in problems[1]
    assert text.stdout.splitlines()[-1].startswith("FAILED: 2 damaged")

    assert as_json.returncode == 1
    doc = json.loads(as_json.stdout)
    assert doc["ok"] is False
    assert [(p["key"], p["file"]) for p in doc["problems"]] == [("emb", str(data)), (last, str(data))]


def test_verify_draws_a_progress_bar_on_a_terminal_unless_told_not_to(ckpt_path: Path) -> None:
    sync.save({"x": torch.ones(4 << 20)}, ckpt_path)
    with ThreadPoolExecutor(2) as pool:
        bar, quiet = pool.map(
            lambda a: cli_on_tty_stderr(*a), [("verify", ckpt_path), ("verify", "--no-progress", ckpt_path)]
        )
    for code, out, _ in (bar, quiet):
        assert code == 0
        assert out.startswith("OK: 1 tensor(s), 1 chunk(s), 16.0 MiB")
    assert "verifying ckpt" in bar[2]
    assert "16.0 MiB" in bar[2]  # the byte count of the bar
    assert quiet[2] == ""


def test_user_errors_are_one_line_and_exit_2(ckpt_path: Path, tmp_path: Path) -> None:
    sync.save(_state(), ckpt_path)
    newer = tmp_path / "newer"
    shutil.copytree(ckpt_path, newer)
    env = ENVELOPE_DECODER.decode((newer / MANIFEST_NAME).read_bytes())
    # A newer manifest's body says its version too (the envelope alone saying so is damage).
    body = ENCODER.encode({**msgspec.msgpack.decode(env.body), "format_version": 99})
    newer_env = msgspec.structs.replace(env, format_version=99, body=body, body_crc32c=crc32c.crc32c(body))
    (newer / MANIFEST_NAME).write_bytes(ENCODER.encode(newer_env))
    (ckpt_path / MANIFEST_NAME).unlink()

    no_manifest, missing, bad_flag, newer_format = cli_many(
        ("verify", ckpt_path),
        ("ls", tmp_path / "nope"),
        ("prune", "--keep-last", "0", tmp_path),
        ("inspect", newer),
    )
    assert f"{ckpt_path} is not an aiockpt checkpoint: it has no manifest" in one_error_line(no_manifest, 2)
    assert f"{tmp_path / 'nope'}: it does not exist" in one_error_line(missing, 2)
    assert "--keep-last" in one_error_line(bad_flag, 2)
    assert "format version 99" in one_error_line(newer_format, 2)


def test_step_with_a_path_that_is_no_root_is_a_usage_error(ckpt_path: Path, tmp_path: Path) -> None:
    """``--step`` used to be ignored there: the command went on with another checkpoint, and exit 0."""
    sync.save(_state(), ckpt_path)
    empty = tmp_path / "empty"
    empty.mkdir()
    source = tmp_path / "src.pt"
    torch.save({"w": torch.ones(2)}, source)
    converted, verified = cli_many(
        ("convert", source, tmp_path / "out", "--to", "aiockpt", "--step", "3"),
        ("verify", empty, "--step", "3"),
    )
    assert f"--step 3: {source} is not a Checkpointer root" in one_error_line(converted, 2)
    assert f"--step 3: {empty} is not a Checkpointer root" in one_error_line(verified, 2)
    assert not (tmp_path / "out").exists()


def test_without_the_cli_extra_one_line_says_what_to_install() -> None:
    # The import system refuses a module whose sys.modules entry is None: as if rich were not installed.
    code = "import runpy, sys; sys.modules['rich'] = None; runpy.run_module('aiockpt', run_name='__main__')"
    r = subprocess.run([sys.executable, "-c", code, "ls", "."], capture_output=True, text=True, timeout=120)
    assert "pip install 'aiockpt[cli]'" in one_error_line(r, 2)


# --- prune ----------------------------------------------------------------------------------------------


def test_prune_applies_the_checkpointer_retention_and_removes_crashed_saves(tmp_path: Path) -> None:
    steps = list(range(1, 11))
    root = tmp_path / "run"
    _save_steps(root, steps)
    crashed = root / ".tmp-step-00000011-0123456789ab"
    crashed.mkdir()
    # What a Checkpointer with the same options keeps, saving the same steps.
    reference = tmp_path / "reference"
    _save_steps(reference, steps, keep_last=2, keep_every=4)
    kept = [int(n.removeprefix("step-")) for n in listdir(reference) if n.startswith("step-")]
    assert kept == [4, 8, 9, 10]

    dry = cli("prune", root, "--keep-last", "2", "--keep-every", "4", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert len([n for n in listdir(root) if n.startswith("step-")]) == 10  # nothing deleted
    assert crashed.exists()
    would = [ln.split()[2] for ln in dry.stdout.splitlines() if ln.startswith("would delete step-")]
    assert would == [f"step-{s:08d}" for s in steps if s not in kept]
    assert any(ln.startswith(f"would delete {crashed.name}") for ln in dry.stdout.splitlines())

    real = cli("prune", "--json", root, "--keep-last", "2", "--keep-every", "4", script=True)
    assert real.returncode == 0, real.stderr
    doc = json.loads(real.stdout)
    assert doc["deleted_steps"] == [s for s in steps if s not in kept]
    assert doc["kept_steps"] == kept
    assert doc["removed_temp"] == [crashed.name]
    assert listdir(root) == ["latest", *(f"step-{s:08d}" for s in kept)]
    with sync.Checkpointer(root) as ckpt:
        assert ckpt.steps() == kept
        assert ckpt.load(_state(0)) == 10


def test_prune_goes_on_where_latest_cannot_be_read(tmp_path: Path) -> None:
    """A directory in place of ``latest``: prune exited 2 ("Is a directory"), where the Checkpointer's
    retention, which prune applies, goes on."""
    root = tmp_path / "run"
    _save_steps(root, [1, 2, 3])
    (root / "latest").unlink()
    (root / "latest").mkdir()
    done = cli("prune", root, "--keep-last", "1")
    assert done.returncode == 0, done.stderr
    assert "latest cannot be read (Is a directory): ignored" in done.stderr
    assert [n for n in listdir(root) if n.startswith("step-")] == ["step-00000003"]


def test_prune_and_a_checkpointer_leave_another_programs_temp_data_alone(tmp_path: Path) -> None:
    """Every ``.tmp-`` entry of the root was taken for a crashed save's: a build cache there (or in the
    parent of the real root, pruned by mistake) was deleted."""
    root = tmp_path / "run"
    _save_steps(root, [1, 2])
    foreign = [root / ".tmp-build-cache", root / ".tmp-notes.txt", root / ".tmp-x-123"]
    foreign[0].mkdir()
    (foreign[0] / "blob").write_bytes(b"x" * 9)
    foreign[1].write_text("mine")
    foreign[2].write_text("mine too")
    old = time.time() - 3600
    for path in foreign:
        os.utime(path, (old, old))
    crashed = root / ".tmp-step-00000003-0123456789ab"
    crashed.mkdir()
    listed = cli("ls", "--json", root)
    assert [o["name"] for o in json.loads(listed.stdout)["other"]] == [crashed.name]  # aiockpt's alone
    done = cli("prune", "--json", root, "--keep-last", "5")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["removed_temp"] == [crashed.name]
    assert all(path.exists() for path in foreign)
    with sync.Checkpointer(root) as ckpt:  # its garbage collection, on opening the root
        assert ckpt.steps() == [1, 2]
    assert all(path.exists() for path in foreign)
    assert (foreign[0] / "blob").read_bytes() == b"x" * 9


def test_prune_keeps_a_damaged_newest_step_without_counting_it(tmp_path: Path) -> None:
    """``--keep-last 1`` kept step 3, whose manifest was damaged, and deleted the healthy 1 and 2: nothing
    loadable was left."""
    root = tmp_path / "run"
    _save_steps(root, [1, 2, 3])
    manifest = root / "step-00000003" / "manifest.msgpack"
    data = bytearray(manifest.read_bytes())
    data[-5] ^= 0xFF
    manifest.write_bytes(bytes(data))
    done = cli("prune", "--json", root, "--keep-last", "1")
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    assert doc["deleted_steps"] == [1]
    assert doc["kept_steps"] == [2, 3]
    assert doc["damaged_steps"] == [3]
    assert "step-00000003 is kept, not counted in --keep-last" in done.stderr
    assert torch.equal(sync.read(root / "step-00000002")["emb"], _state(2)["emb"])  # type: ignore[arg-type]


# --- convert --------------------------------------------------------------------------------------------


def test_convert_round_trips_through_every_format_bit_exactly(root: Path, tmp_path: Path) -> None:
    tensors = {
        "emb": torch.randn(40, 16).to(torch.bfloat16),
        "ids": torch.arange(1000, dtype=torch.int64),
        "mask": torch.rand(33) > 0.5,
    }
    with sync.Checkpointer(root) as ckpt:  # the CLI takes a Checkpointer root: its newest step
        ckpt.save({**tensors, "epoch": 3}, step=1)
        ckpt.save({k: v + 1 if v.dtype != torch.bool else ~v for k, v in tensors.items()}, step=2)
    out = tmp_path / "out"
    out.mkdir()
    st, pt, dcp, sharded = out / "w.safetensors", out / "w.pt", out / "dcp", out / "hf"
    first = cli_many(
        ("convert", root, st, "--to", "safetensors", "--step", "1", "--drop-non-tensors"),
        ("convert", root, pt, "--to", "torch", "--step", "1"),
        ("convert", root, dcp, "--to", "dcp", "--step", "1", "--json"),
        ("convert", root, sharded, "--to", "safetensors", "--step", "1", "--drop-non-tensors",
         "--max-shard-size", "2KB"),
    )  # fmt: skip
    for r in first:
        assert r.returncode == 0, r.stderr
    assert first[0].stdout.startswith(f"wrote {st} (safetensors")
    doc = json.loads(first[2].stdout)
    assert doc["schema"] == "aiockpt.convert/1"
    assert (doc["path"], doc["to"]) == (str(dcp), "dcp")
    assert doc["nbytes"] == sum(t.numel() * t.element_size() for t in tensors.values())
    # Past --max-shard-size the Hugging Face layout has shards and an index naming every tensor.
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert sorted(index["weight_map"]) == sorted(tensors)
    assert len(set(index["weight_map"].values())) > 1

    # ... and back into aiockpt checkpoints, each compared with the step-1 tensors.
    back = [out / f"back-{i}" for i in range(4)]
    sources = (st, pt, dcp, sharded)
    second = cli_many(
        *(("convert", src, dst, "--to", "aiockpt") for src, dst in zip(sources, back, strict=True))
    )
    for r in second:
        assert r.returncode == 0, r.stderr
    for dst in back:
        tree = sync.read(dst)
        for key, t in tensors.items():
            got = tree[key]
            assert isinstance(got, torch.Tensor)
            assert got.dtype == t.dtype
            assert torch.equal(got, t), (dst, key)


def test_convert_errors_are_one_line(ckpt_path: Path, tmp_path: Path) -> None:
    sync.save({"w": torch.ones(3), "lr": 0.1}, ckpt_path)
    existing = tmp_path / "exists.pt"
    existing.write_bytes(b"keep me")
    refused, exists, bad_size, bad_format = cli_many(
        ("convert", ckpt_path, tmp_path / "w.safetensors", "--to", "safetensors"),
        ("convert", ckpt_path, existing, "--to", "torch"),
        ("convert", ckpt_path, tmp_path / "x", "--to", "safetensors", "--max-shard-size", "5XB"),
        ("convert", ckpt_path, tmp_path / "y", "--to", "onnx"),
    )
    line = one_error_line(refused, 2)
    assert "'lr'" in line
    assert "--drop-non-tensors" in line
    assert not (tmp_path / "w.safetensors").exists()
    assert "already exists" in one_error_line(exists, 2)
    assert existing.read_bytes() == b"keep me"
    assert "'5XB' is not a size" in one_error_line(bad_size, 2)
    assert "onnx" in one_error_line(bad_format, 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["ckpt", "exists.pt"])
