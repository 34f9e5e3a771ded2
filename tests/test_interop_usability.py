"""Interop usability: what ``read``, ``convert`` and ``aiockpt convert`` say; what garbage collection spares.

- A ``torch.save`` value ``torch.load(weights_only=True)`` refuses: one clean line naming the file, the
  refused global and the key (found by a walk of the file's pickle that runs none of it).
- ``convert(rank=N)`` of an aiockpt checkpoint that ``N`` did not help save: refused, not a state without
  its per-rank keys.
- ``convert(to="dcp")`` of keys that join to one name: one line, as for safetensors, not DCP's traceback.
- A conversion's temp output is owner-locked as a save's: collected once its writer is gone, never before.

Each test failed on the code before these fixes (see the report of the change that added this file).
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import threading
import zipfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

import aiockpt
from aiockpt._fs import collect_garbage
from aiockpt._interop import _convert

pytestmark = pytest.mark.timeout(120)


class Opaque:
    """An object ``torch.load(weights_only=True)`` refuses (a global it does not allow)."""

    def __init__(self, value: int) -> None:
        self.value = value


class Exploit:
    """Unpickled, it would create ``self.path``: proof that a walk of its pickle runs nothing."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Callable[..., object], tuple[str]]:
        return (os.mkdir, (str(self.path),))


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES", "FORCE_COLOR")}


def _cli(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "aiockpt", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=120,
        env=_env(),
        check=False,
    )


def _error_line(result: subprocess.CompletedProcess[str], code: int) -> str:
    """The one ``aiockpt: error:`` line of a failed invocation that exited with ``code``."""
    assert result.returncode == code, (result.returncode, result.stdout, result.stderr)
    errors = [line for line in result.stderr.splitlines() if line.startswith("aiockpt: error:")]
    assert len(errors) == 1, result.stderr
    assert "Traceback" not in result.stderr
    return errors[0]


# --- a torch.save file torch.load(weights_only=True) refuses ---------------------------------------------


@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
async def test_a_refused_numpy_array_names_its_key_and_global_on_one_clean_line(
    tmp_path: Path, legacy: bool
) -> None:
    np = pytest.importorskip("numpy")
    file = tmp_path / "np.pt"
    state = {"model": {"w": torch.ones(3)}, "np_rng": np.random.get_state(), "epoch": 3}
    torch.save(state, file, _use_new_zipfile_serialization=not legacy)
    with pytest.raises(aiockpt.StateError) as info:
        await aiockpt.read(file)
    message = str(info.value)
    # Before: torch's first line only, ending mid-sentence with ANSI bold codes; no global, no key.
    assert "\n" not in message
    assert "\x1b" not in message
    assert str(file) in message
    assert "numpy._core.multiarray._reconstruct" in message or "numpy.core.multiarray._reconstruct" in message
    assert "'np_rng/1'" in message  # np.random.get_state() is a tuple: the array is its item 1
    assert "allow_pickle=True" in message
    assert info.value.key == "np_rng/1"


async def test_every_key_that_needs_the_refused_global_is_named_and_nothing_runs(tmp_path: Path) -> None:
    file = tmp_path / "c.pt"
    pwned = tmp_path / "pwned"
    torch.save({"a": torch.ones(1), "x": [1, {"y": Opaque(1)}], "z": Opaque(2), "e": Exploit(pwned)}, file)
    with pytest.raises(aiockpt.StateError) as info:
        await aiockpt.read(file)
    message = str(info.value)
    assert f"{__name__}.Opaque is not an allowed global" in message
    assert "objects at keys 'x/1/y', 'z' that" in message
    assert info.value.key == "x/1/y"  # where torch.load stopped: the first in the file
    assert not pwned.exists()
    # An object whose global is refused first is named too; its reduce function never runs.
    torch.save({"a": torch.ones(1), "e": Exploit(pwned)}, file)
    with pytest.raises(aiockpt.StateError) as info:
        await aiockpt.read(file)
    assert info.value.key == "e"
    assert "posix.mkdir" in str(info.value)
    assert not pwned.exists()


async def test_a_refusal_without_a_global_keeps_torchs_reason(tmp_path: Path) -> None:
    # A data.pkl of pickle protocol 0 uses opcodes the weights-only unpickler lacks ("Unsupported
    # operand"): torch words that refusal differently, and its reason used to be cut off.
    torch.save({"a": 1}, tmp_path / "base.pt")
    with zipfile.ZipFile(tmp_path / "base.pt") as zin, zipfile.ZipFile(tmp_path / "c.pt", "w") as zout:
        for entry in zin.infolist():
            data = zin.read(entry)
            zout.writestr(
                entry, pickle.dumps({"a": 1}, protocol=0) if entry.filename.endswith("data.pkl") else data
            )
    with pytest.raises(aiockpt.StateError) as info:
        await aiockpt.read(tmp_path / "c.pt")
    message = str(info.value)
    assert "\n" not in message
    assert "Unsupported operand" in message
    assert "allow_pickle=True" in message
    assert info.value.key is None


@pytest.mark.parametrize(
    ("message", "expected"),
    [
        (
            "Weights only load failed. This file can still be loaded, to do so you have two options, "
            "\x1b[1mdo those steps only if you trust the source of the checkpoint\x1b[0m. \n\t(1) In "
            "PyTorch 2.6, we changed it.\n\t(2) Alternatively, check the following error message.\n\t"
            "WeightsUnpickler error: Unsupported global: GLOBAL a.b.C was not an allowed global by "
            "default. Please use `x`.\n\nCheck the documentation of torch.load to learn more.",
            ("a.b.C", "a.b.C is not an allowed global"),
        ),
        (
            "Weights only load failed. In PyTorch 2.6, we changed it.\n\n\nTrying to load unsupported "
            "GLOBAL posix.system whose module posix is blocked.\n\nCheck the documentation of torch.load.",
            ("posix.system", "posix.system is of a blocked module"),
        ),
        (
            "Weights only load failed. ``torch.nested`` and ``torch._dynamo`` must be imported to load "
            "nested jagged tensors (NJTs)\n In PyTorch 2.6, we changed it.\n",
            (
                None,
                "``torch.nested`` and ``torch._dynamo`` must be imported to load nested jagged tensors "
                "(NJTs)",
            ),
        ),
        ("something else entirely", (None, "something else entirely")),
        ("\x1b[1m\x1b[0m", (None, "torch.load gave no reason")),
    ],
    ids=["global", "blocked", "import", "unknown", "empty"],
)
def test_torchs_refusal_reduces_to_its_reason(message: str, expected: tuple[str | None, str]) -> None:
    from aiockpt._interop._torchfile import _reason  # (here: the code before it had none)

    assert _reason(message) == expected


# --- convert --rank N of a checkpoint N did not help save ------------------------------------------------


async def _two_rank_checkpoint(step: Path) -> None:
    """A collective-free checkpoint of two ranks, each with its own ``seed`` (per-rank state)."""
    for rank in range(2):
        await aiockpt.save({"w": torch.ones(3), "seed": 100 + rank}, step / f"rank-{rank:05d}-of-00002")


async def test_convert_refuses_a_rank_outside_the_world_that_saved_the_checkpoint(tmp_path: Path) -> None:
    step = tmp_path / "step"
    await _two_rank_checkpoint(step)
    out = await aiockpt.convert(step, tmp_path / "r1.pt", to="torch", rank=1)
    assert torch.load(out)["seed"] == 101
    # Before: rank 7 got only the shared state, without "seed", and no word of it.
    with pytest.raises(
        aiockpt.CheckpointError, match=r"rank 7 is not one of the 2 rank\(s\) that saved"
    ) as info:
        await aiockpt.convert(step, tmp_path / "r7.pt", to="torch", rank=7)
    assert "0 to 1" in str(info.value)
    assert not (tmp_path / "r7.pt").exists()
    # A foreign source holds no per-rank state: any rank reads it, as before.
    torch.save({"w": torch.ones(2)}, tmp_path / "foreign.pt")
    await aiockpt.convert(tmp_path / "foreign.pt", tmp_path / "f7.safetensors", to="safetensors", rank=7)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f7.safetensors", "foreign.pt", "r1.pt", "step"]


# --- convert to DCP: keys that join to one name ----------------------------------------------------------


@pytest.mark.parametrize(
    "state",
    [
        {"a.b": torch.ones(2), "a": {"b": torch.zeros(2)}},
        {"a.b": 3, "a": {"b": torch.zeros(2)}},
        {"l": [torch.ones(1), 2], "l.1": 5},
    ],
    ids=["tensors", "value-and-tensor", "list-item"],
)
async def test_convert_to_dcp_refuses_keys_joined_to_one_name_in_one_line(
    tmp_path: Path, state: dict[str, object]
) -> None:
    await aiockpt.save(state, tmp_path / "src")
    with pytest.raises(aiockpt.StateError) as info:
        await aiockpt.convert(tmp_path / "src", tmp_path / "out", to="dcp")
    message = str(info.value)
    assert "\n" not in message  # before: 24 lines of DCP's traceback
    assert "once joined with '.'" in message
    name = "a.b" if "a" in state else "l.1"
    assert f"both named {name!r}" in message
    assert info.value.key is not None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


async def test_convert_to_dcp_keeps_lists_dcp_stores_whole(tmp_path: Path) -> None:
    # A list of plain values is one DCP value ("l"), and so is a tuple ("t"): "l.1" and "t.0" name others.
    state: dict[str, object] = {"w": torch.ones(2), "l": [1, 2], "l.1": 5, "t": (torch.ones(1), 2), "t.0": 1}
    await aiockpt.save(state, tmp_path / "src")
    await aiockpt.convert(tmp_path / "src", tmp_path / "out", to="dcp")
    got = await aiockpt.read(tmp_path / "out", allow_pickle=True)  # (DCP pickles the tuple: ours)
    assert (got["l"], got["l.1"], got["t.0"]) == ([1, 2], 5, 1)


# --- the command line shows each of these as one line -----------------------------------------------------


def test_the_command_line_reports_each_refusal_in_one_line(tmp_path: Path) -> None:
    np = pytest.importorskip("numpy")
    torch.save({"w": torch.ones(2), "np_rng": np.random.get_state()}, tmp_path / "np.pt")
    step = tmp_path / "step"
    anyio.run(_two_rank_checkpoint, step)
    aiockpt.sync.save({"a.b": torch.ones(2), "a": {"b": torch.zeros(2)}}, tmp_path / "clash")
    calls = [
        ("convert", tmp_path / "np.pt", tmp_path / "np.safetensors", "--to", "safetensors"),
        ("convert", step, tmp_path / "r7.pt", "--to", "torch", "--rank", "7"),
        ("convert", tmp_path / "clash", tmp_path / "clash-dcp", "--to", "dcp"),
    ]
    with ThreadPoolExecutor(len(calls)) as pool:  # each call spends seconds importing torch
        refused, rank7, clash = pool.map(lambda args: _cli(*args), calls)
    line = _error_line(refused, 2)
    assert "'np_rng/1'" in line
    assert "--allow-pickle" in line
    assert "\x1b" not in refused.stderr
    assert "rank 7 is not one of the 2 rank(s) that saved" in _error_line(rank7, 2)
    assert "two keys are both named 'a.b'" in _error_line(clash, 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["clash", "np.pt", "step"]


# --- garbage collection and a conversion's temp output ----------------------------------------------------

_OUTPUTS = [
    pytest.param("torch", "m.pt", "write_torch", id="torch-file"),
    pytest.param("safetensors", "m.safetensors", "write_safetensors", id="safetensors-file"),
    pytest.param("safetensors", "hf", "write_safetensors", id="hf-dir"),
    pytest.param("dcp", "d", "write_dcp", id="dcp-dir"),
]


@pytest.mark.parametrize(("to", "name", "writer"), _OUTPUTS)
async def test_garbage_collection_spares_a_conversion_in_progress(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, to: str, name: str, writer: str
) -> None:
    # Converting into a Checkpointer root while a Checkpointer opens it (its collect_garbage runs): before,
    # the temp output had no owner lock, and a temp dir went at once, a temp file once 60 s old
    # (stale_after=0 stands for a conversion that long), under the writer's feet.
    torch.save({"w": torch.arange(1000.0), "b": torch.ones(3)}, tmp_path / "src.pt")
    written, release = threading.Event(), threading.Event()
    original = getattr(_convert, writer)

    def blocked(*args: Any) -> None:  # in the writer thread: the output is written, not yet renamed
        original(*args)
        written.set()
        assert release.wait(60)

    monkeypatch.setattr(_convert, writer, blocked)
    removed: list[Path] = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(lambda: aiockpt.convert(tmp_path / "src.pt", tmp_path / name, to=to))  # type: ignore[arg-type]
        try:
            assert await anyio.to_thread.run_sync(written.wait, 60)
            assert any(p.name.startswith(".tmp-") for p in tmp_path.iterdir())
            removed = await anyio.to_thread.run_sync(lambda: collect_garbage(tmp_path, stale_after=0))
        finally:
            release.set()
    assert removed == []
    got = await aiockpt.read(tmp_path / name)
    assert isinstance(got["w"], torch.Tensor)
    assert torch.equal(got["w"], torch.arange(1000.0))
    # No temp data and no lock file is left behind.
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["src.pt", name])


_CRASH = """
import os, sys, anyio, aiockpt
from aiockpt._interop import _convert

writer = getattr(_convert, sys.argv[3])

def crash(*args):
    writer(*args)
    os._exit(3)  # the process dies with its output written, not yet renamed

setattr(_convert, sys.argv[3], crash)
anyio.run(lambda: aiockpt.convert(sys.argv[1], sys.argv[2], to=sys.argv[4]))
"""


@pytest.mark.parametrize(("to", "name", "writer"), [_OUTPUTS[0], _OUTPUTS[3]])
def test_garbage_collection_removes_a_crashed_conversions_temp_output_at_once(
    tmp_path: Path, to: str, name: str, writer: str
) -> None:
    # Before: a crashed conversion to a file left a loose temp file that went only once 60 s old.
    torch.save({"w": torch.ones(10)}, tmp_path / "src.pt")
    args = [tmp_path / "src.pt", tmp_path / name, writer, to]
    crashed = subprocess.run(
        [sys.executable, "-c", _CRASH, *map(str, args)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert crashed.returncode == 3, crashed.stderr
    assert any(p.name.startswith(".tmp-") for p in tmp_path.iterdir())
    removed = collect_garbage(tmp_path)
    assert removed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src.pt"]
