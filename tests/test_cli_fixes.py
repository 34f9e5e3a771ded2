"""The command line and the manifest's damage rule: a garbled ``latest``, a hit manifest header, NaN, and
text output that escapes what a checkpoint names.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
from pathlib import Path

import crc32c
import msgspec
import pytest
import torch

import aiockpt
from aiockpt import sync
from aiockpt._cli._app import run as cli
from aiockpt._cli.ls import list_root
from aiockpt._format import ENCODER, ENVELOPE_DECODER, FORMAT_VERSION, MAGIC, MANIFEST_NAME, Envelope


def _run_cli(*args: str | Path) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli([str(a) for a in args])
    return rc, out.getvalue(), err.getvalue()


def _one_error_line(err: str) -> str:
    assert "Traceback" not in err
    (line,) = err.splitlines()
    return line


def _root(tmp_path: Path) -> Path:
    root = tmp_path / "root"
    with sync.Checkpointer(root) as ckpt:
        ckpt.save({"w": torch.ones(4)}, step=1)
        ckpt.save({"w": torch.ones(4)}, step=2)
    return root


# --- ls: a `latest` that is not UTF-8 ------------------------------------------------------------------


def test_ls_shows_a_latest_of_non_utf8_bytes(tmp_path: Path) -> None:
    root = _root(tmp_path)
    (root / "latest").write_bytes(b"\xff\xfe")
    steps, _, latest = list_root(root)
    assert latest == "\ufffd\ufffd"
    assert not any(r.latest for r in steps)
    for args in (("ls", root), ("ls", "--json", root)):
        rc, out, err = _run_cli(*args)
        assert rc == 0, err
        assert "Traceback" not in err
    rc, out, _ = _run_cli("ls", root)
    assert "not a committed step here" in out


# --- the manifest: damage is damage, whichever field was hit ------------------------------------------


def _envelope(path: Path) -> Envelope:
    return ENVELOPE_DECODER.decode((path / MANIFEST_NAME).read_bytes())


def _write(path: Path, env: object) -> None:
    (path / MANIFEST_NAME).write_bytes(ENCODER.encode(env))


def test_a_hit_magic_is_damage(tmp_path: Path) -> None:
    root = _root(tmp_path)
    step = root / "step-00000002"
    raw = bytearray((step / MANIFEST_NAME).read_bytes())
    raw[raw.find(MAGIC.encode())] ^= 0x02  # 'a' -> 'c': the body's checksum still matches
    (step / MANIFEST_NAME).write_bytes(raw)
    file = str(step / MANIFEST_NAME)
    with pytest.raises(aiockpt.CorruptionError, match="magic") as info:
        sync.read(step)
    assert info.value.file == file
    report = sync.verify(step)  # reported, not raised
    assert not report.ok
    assert [p.file for p in report.problems] == [file]
    rc, out, err = _run_cli("verify", step)
    assert rc == 1, (out, err)
    rc, out, err = _run_cli("ls", root)
    assert rc == 1, (out, err)
    assert "damaged manifest" in out
    rc, _, err = _run_cli("inspect", step)
    assert rc == 1
    assert file in _one_error_line(err)


def test_a_hit_checksum_field_is_damage_even_with_a_foreign_magic(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    sync.save({"w": torch.ones(4)}, path)
    env = _envelope(path)
    _write(path, msgspec.structs.replace(env, magic="other", body_crc32c=env.body_crc32c ^ 1))
    with pytest.raises(aiockpt.CorruptionError, match="checksum does not match"):
        sync.read(path)


@pytest.mark.parametrize("version", [0, -1, FORMAT_VERSION + 1, 99])
def test_a_hit_format_version_is_damage(tmp_path: Path, version: int) -> None:
    """The envelope's version is not checksummed: one the body contradicts was hit, not written newer."""
    path = tmp_path / "ckpt"
    sync.save({"w": torch.ones(4)}, path)
    _write(path, msgspec.structs.replace(_envelope(path), format_version=version))
    with pytest.raises(aiockpt.CorruptionError, match="damaged"):
        sync.read(path)
    assert not sync.verify(path).ok
    rc, _, err = _run_cli("verify", path)
    assert rc == 1, err


def test_a_newer_manifest_is_a_format_error_not_damage(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    sync.save({"w": torch.ones(4)}, path)
    env = _envelope(path)
    body = ENCODER.encode({**msgspec.msgpack.decode(env.body), "format_version": FORMAT_VERSION + 1})
    newer = msgspec.structs.replace(
        env, format_version=FORMAT_VERSION + 1, body=body, body_crc32c=crc32c.crc32c(body)
    )
    _write(path, newer)
    with pytest.raises(aiockpt.FormatError, match="upgrade aiockpt") as info:
        sync.read(path)
    assert not isinstance(info.value, aiockpt.CorruptionError)
    with pytest.raises(aiockpt.FormatError, match="upgrade aiockpt"):
        sync.verify(path)
    rc, _, err = _run_cli("verify", path)
    assert rc == 2, err


@pytest.mark.parametrize("content", [b"", b"garbage", b"\x82\xa5magic\xa3bad"])
def test_a_file_that_is_no_manifest_is_reported(tmp_path: Path, content: bytes) -> None:
    (tmp_path / MANIFEST_NAME).write_bytes(content)
    with pytest.raises(aiockpt.CorruptionError, match="damaged or not an aiockpt manifest") as info:
        sync.read(tmp_path)
    assert info.value.file == str(tmp_path / MANIFEST_NAME)


# --- convert of a damaged torch.save file --------------------------------------------------------------


def test_convert_of_a_truncated_torch_file_exits_1(tmp_path: Path) -> None:
    src = tmp_path / "x.pt"
    torch.save({"w": torch.randn(64, 64)}, src)
    os.truncate(src, src.stat().st_size - 10)
    rc, _, err = _run_cli("convert", src, tmp_path / "out", "--to", "aiockpt")
    assert rc == 1
    line = _one_error_line(err)
    assert str(src) in line
    assert "damaged" in line
    assert not (tmp_path / "out").exists()


def test_convert_under_a_file_is_one_line_naming_it(tmp_path: Path) -> None:
    sync.save({"w": torch.ones(2)}, tmp_path / "src")
    (tmp_path / "notadir").write_text("hi")
    rc, _, err = _run_cli("convert", tmp_path / "src", tmp_path / "notadir" / "out.pt", "--to", "torch")
    assert rc == 2
    line = _one_error_line(err)
    assert f"{tmp_path / 'notadir'} is not a directory" in line
    assert "already exists" not in line


# --- inspect: NaN metadata -----------------------------------------------------------------------------


def test_inspect_shows_nan_metadata_as_a_float(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    sync.save({"w": torch.ones(2)}, path, metadata={"loss": math.nan, "tag": "nan", "lr": 0.5})
    rc, out, err = _run_cli("inspect", path)
    assert rc == 0, err
    assert "loss = nan" in out
    assert "loss = 'nan'" not in out
    assert "tag = 'nan'" in out  # a str stays quoted
    assert "lr = 0.5" in out
    rc, out, _ = _run_cli("inspect", "--json", path)
    assert rc == 0
    assert '"loss": "nan"' in out  # JSON has no NaN: stringified there, as documented


# --- text output escapes what a checkpoint names ----------------------------------------------------------

_ESC = "\x1b[31m"


class _Odd:
    """A Stateful whose class name holds an escape sequence (its name is saved as the state's origin)."""

    def state_dict(self) -> dict[str, object]:
        return {"n": 1}

    def load_state_dict(self, state: dict[str, object]) -> None:
        del state


_Odd.__qualname__ = _Odd.__name__ = f"Odd{_ESC}"


def test_inspect_text_escapes_keys_metadata_and_names_and_json_stays_exact(tmp_path: Path) -> None:
    """Control characters reached the terminal: an escape sequence raw, a newline as a forged row."""
    path = tmp_path / "ckpt"
    state = {"k\nfake  float32  (9,)": torch.ones(2), f"v{_ESC}": "x\ny", "obj": _Odd()}
    sync.save(state, path, metadata={f"m{_ESC}": "v\nw", "plain": 1})
    rc, out, err = _run_cli("inspect", path)
    assert rc == 0, err
    assert "\x1b" not in out
    assert not any(line.lstrip().startswith("fake") for line in out.splitlines())
    assert "'k\\nfake  float32  (9,)'" in out
    assert "'m\\x1b[31m' = 'v\\nw'" in out
    assert "plain = 1" in out  # printable names are shown as they are
    assert "'v\\x1b[31m'" in out
    assert "Odd\\x1b[31m" in out
    rc, out, _ = _run_cli("inspect", "--json", path)
    assert rc == 0
    doc = json.loads(out)
    assert doc["user_metadata"] == {f"m{_ESC}": "v\nw", "plain": 1}
    assert [t["path"] for t in doc["tensors"]] == [["k\nfake  float32  (9,)"]]
    assert {v["value"] for v in doc["values"]} >= {"x\ny"}
    assert [s["type"] for s in doc["statefuls"]] == [f"{__name__}.Odd{_ESC}"]


def test_ls_text_escapes_temp_names_and_the_latest_pointer(tmp_path: Path) -> None:
    root = _root(tmp_path)
    (root / "latest").write_text(f"step-{_ESC}")
    temp = f".tmp-x{_ESC}-0123abcd"
    (root / temp).write_bytes(b"")
    rc, out, err = _run_cli("ls", root)
    assert rc == 0, err
    assert "\x1b" not in out
    assert "! '.tmp-x\\x1b[31m-0123abcd': temp-file" in out
    assert "latest -> 'step-\\x1b[31m'" in out
    rc, out, _ = _run_cli("ls", "--json", root)
    doc = json.loads(out)
    assert doc["latest"] == f"step-{_ESC}"
    assert [o["name"] for o in doc["other"]] == [temp]


def test_an_error_line_is_escaped(tmp_path: Path) -> None:
    rc, _, err = _run_cli("inspect", tmp_path / f"no{_ESC}pe")
    assert rc != 0
    line = _one_error_line(err)
    assert "\x1b" not in line
    assert "no\\x1b[31mpe" in line
