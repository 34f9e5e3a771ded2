"""What the subcommands share: consoles, number and date formats, escaping, JSON output, path resolution."""

from __future__ import annotations

import contextlib
import errno
import io
import json
import math
import os
import sys
from collections.abc import Callable, Iterable, Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, cast

import click
from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)
from rich.table import Table

from .._checkpointer import scan_steps, step_dir_name
from .._errors import CheckpointNotFoundError
from .._load import is_checkpoint
from .._storage import local

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer

# Piped output is read by people with wide terminals, by grep and by tests: wide enough that key paths
# seldom fold. An explicit COLUMNS wins.
_PIPE_WIDTH = 200
_KEY_WIDTH = 60


class _WholeWrites(io.RawIOBase):
    """A file descriptor each ``write`` to which writes all its bytes, or raises (``BrokenPipeError``).

    Python's own stdout does not: a write that a pipe's reader leaves half done (``| head``) returns
    short, and its text layer drops the rest without a word, so a command whose last write that was
    would end as if its output were all out (status 0). Here the rest is written again, and the closed
    pipe raises.
    """

    def __init__(self, fd: int) -> None:
        super().__init__()
        self._fd = fd

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self._fd

    def isatty(self) -> bool:
        return os.isatty(self._fd)

    def write(self, b: ReadableBuffer) -> int:
        with memoryview(b) as view, view.cast("B") as data:
            done = 0
            while done < len(data):
                done += os.write(self._fd, data[done:])
        return done


@contextlib.contextmanager
def stdout_written_whole() -> Iterator[None]:
    """Within the block, ``sys.stdout`` writes through :class:`_WholeWrites`: a closed pipe always raises.

    Only the process's own stdout is replaced, and put back after; one a caller replaced already (a
    test capturing it) is left alone. A closed pipe costs what was still pending in the block's stdout;
    the process's stdout holds nothing that a flush at exit could fail on.
    """
    real = sys.stdout
    try:
        fd = real.fileno() if sys.stdout is sys.__stdout__ else -1
    except (OSError, ValueError):  # no file descriptor
        fd = -1
    if fd < 0:
        yield
        return
    real.flush()
    # No buffer between the two: what a failed write held is dropped with it, so no later flush (at the
    # end of the block, at exit) fails again. (Typed as the buffered writer that TextIOWrapper's stub
    # names; it calls only what a raw stream has.)
    raw = cast("io.BufferedWriter", _WholeWrites(fd))
    line_buffering = bool(real.line_buffering)
    whole = io.TextIOWrapper(raw, encoding=real.encoding, errors=real.errors, line_buffering=line_buffering)
    sys.stdout = whole
    try:
        yield
    finally:
        sys.stdout = real
        # A failed flush drops what was pending: the detach after it (which flushes too) cannot fail.
        with contextlib.suppress(OSError, ValueError):
            whole.flush()
        with contextlib.suppress(OSError, ValueError):
            whole.detach()


class _Console(Console):
    """A rich console whose closed output (``aiockpt inspect ROOT | head``) raises ``BrokenPipeError``.

    As ``click.echo`` does there; rich's own handling exits with status 1, which the command line means
    as damage found. The command group turns the error into its exit code (see ``_app``).
    """

    def on_broken_pipe(self) -> None:
        self.quiet = True  # nothing more is written: the reader is gone
        raise BrokenPipeError(errno.EPIPE, os.strerror(errno.EPIPE))


def stdout() -> Console:
    """The console for a command's tables (plain lines go through ``click.echo``)."""
    wide = not sys.stdout.isatty() and "COLUMNS" not in os.environ
    return _Console(highlight=False, width=_PIPE_WIDTH if wide else None)


def stderr() -> Console:
    """The console for progress bars."""
    return _Console(stderr=True, highlight=False)


def show_progress(no_progress: bool) -> bool:
    """Whether to draw progress bars: on a terminal, unless ``--no-progress``."""
    return not no_progress and sys.stderr.isatty()


@contextlib.contextmanager
def progress_bar(enabled: bool, label: str) -> Iterator[Callable[[int, int], None] | None]:
    """A ``progress(done, total)`` callback drawing a bytes bar on stderr, or ``None`` when disabled."""
    if not enabled:
        yield None
        return
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(binary_units=True),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=stderr(), transient=True) as bar:
        task = bar.add_task(label, total=None)

        def update(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        yield update


no_progress_option = click.option(
    "--no-progress", is_flag=True, help="Draw no progress bar (none is drawn when stderr is not a terminal)."
)
json_option = click.option("--json", "as_json", is_flag=True, help="Print a machine-readable JSON document.")
step_option = click.option(
    "--step",
    type=click.IntRange(min=0),
    default=None,
    help="With a Checkpointer root: this committed step instead of the newest.",
)


def key_column(table: Table, keys: Iterable[str]) -> None:
    """Add a ``key`` column that other columns shrink for, up to a limit (then keys fold)."""
    table.add_column("key", overflow="fold", min_width=min(_KEY_WIDTH, max(map(len, keys), default=3)))


def printable(text: str) -> str:
    r"""``text`` with each character ``str.isprintable`` refuses written as Python escapes it (``\x1b``).

    For lines of text output that hold what a checkpoint holds (an error's message, a problem found):
    a checkpoint comes from anyone, and a newline in a key would forge a row of a table, an escape
    sequence would reach the terminal (rich's ``Text`` drops only BEL, BS, VT, FF and CR). ``--json``
    output is never escaped: JSON does that itself, exactly.
    """
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def shown(name: str) -> str:
    r"""A name from a checkpoint (a metadata key, a type, a file, a dtype) for text output.

    As ``render`` writes a key: as it is when printable, else quoted and escaped as Python writes it
    (``'m\x1b[31m'``, ``''``): no name reaches the terminal raw, nor reads as two.
    """
    return name if name and name.isprintable() else repr(name)


def human_bytes(n: int) -> str:
    """``1536`` -> ``1.5 KiB``."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{n} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def local_time(ts: float) -> str:
    """A Unix time as local ``YYYY-MM-DD HH:MM:SS``."""
    return datetime.fromtimestamp(ts).astimezone().strftime("%Y-%m-%d %H:%M:%S")


def iso_utc(ts: float) -> str:
    """A Unix time as ISO 8601 UTC (``2026-01-31T12:00:00Z``)."""
    return datetime.fromtimestamp(ts, tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def jsonable(value: object) -> object:
    """A plain value made valid JSON: non-finite floats become the strings ``nan``, ``inf``, ``-inf``."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def print_json(doc: object) -> None:
    """Print ``doc`` as indented JSON on stdout."""
    click.echo(json.dumps(doc, indent=2, allow_nan=False))


def disk_usage(path: Path) -> int:
    """Bytes of the regular files under ``path`` (or of ``path`` itself). Blocking."""
    try:
        if not path.is_dir() or path.is_symlink():
            return path.lstat().st_size
    except FileNotFoundError:
        return 0
    total = 0
    for dirpath, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(FileNotFoundError):  # removed meanwhile (a collector, a deletion)
                total += os.lstat(os.path.join(dirpath, name)).st_size
    return total


def resolve_checkpoint(path: str, step: int | None) -> tuple[Path, str | None]:
    """The checkpoint directory that ``path`` (and ``--step``) name, and a note on how it was chosen.

    ``path`` is a checkpoint directory, or a Checkpointer root: then ``step`` (default: the newest
    committed step) is chosen in it. Blocking.

    Raises:
        click.UsageError: ``--step`` was given with a checkpoint directory, or with a path that is no
            Checkpointer root with committed steps (a foreign checkpoint, an empty directory).
        CheckpointNotFoundError: ``path`` does not exist, is no checkpoint nor root, or lacks ``step``.
    """
    directory = local(path, "the aiockpt command line")
    if is_checkpoint(directory):
        if step is not None:
            raise click.UsageError(f"{directory} is a checkpoint, not a Checkpointer root: drop --step")
        return directory, None
    steps = scan_steps(directory) if directory.is_dir() else []
    if not steps:
        if step is not None:  # (converting or checking something else than asked is no answer)
            raise click.UsageError(
                f"--step {step}: {directory} is not a Checkpointer root with committed steps"
            )
        # Not a root either: let the manifest reader say precisely what is wrong with ``path``.
        return directory, None
    if step is None:
        return directory / step_dir_name(steps[-1]), f"the newest committed step of {directory}"
    if step not in steps:
        raise CheckpointNotFoundError(f"step {step} is not a committed checkpoint in {directory}")
    return directory / step_dir_name(step), None
