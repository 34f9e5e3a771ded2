"""What the subcommands share: consoles, number and date formats, JSON output, path resolution."""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
from collections.abc import Callable, Iterable, Iterator
from datetime import datetime, timezone
from pathlib import Path

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

# Piped output is read by people with wide terminals, by grep and by tests: wide enough that key paths
# seldom fold. An explicit COLUMNS wins.
_PIPE_WIDTH = 200
_KEY_WIDTH = 60


def stdout() -> Console:
    """The console for a command's tables (plain lines go through ``click.echo``)."""
    wide = not sys.stdout.isatty() and "COLUMNS" not in os.environ
    return Console(highlight=False, width=_PIPE_WIDTH if wide else None)


def stderr() -> Console:
    """The console for progress bars."""
    return Console(stderr=True, highlight=False)


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
