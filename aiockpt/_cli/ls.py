"""``aiockpt ls ROOT``: the steps of a Checkpointer root, and whatever else is in it."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path

import click
from rich import box
from rich.table import Table
from rich.text import Text

from .._checkpointer import LATEST, STEP_RE, step_of
from .._errors import CheckpointError, CheckpointNotFoundError, CorruptionError
from .._format import PART_RE, part_dir_name
from .._fs import LOCK_SUFFIX, TMP_PREFIX, is_temp, owner_alive
from .._load import is_checkpoint, published_parts, read_manifest
from .._load._manifest import first_missing, missing_ranks
from .._storage import local
from ._common import (
    disk_usage,
    human_bytes,
    iso_utc,
    json_option,
    local_time,
    print_json,
    printable,
    shown,
    stdout,
)

SCHEMA = "aiockpt.ls/1"
_TMP_STEP_PREFIX = f"{TMP_PREFIX}step-"
_TMP_DEL_PREFIX = f"{TMP_PREFIX}del-"


@dataclass
class StepRow:
    """A ``step-NNNNNNNN`` directory."""

    step: int
    name: str
    path: str
    committed: bool
    nbytes: int
    created_at: float | None = None
    created: str | None = None
    tensors: int | None = None
    world_size: int | None = None
    collective_free: bool = False
    latest: bool = False
    problem: str | None = None
    damaged: bool = False  # its manifest fails verification: ``ls`` exits 1, as ``verify`` does


@dataclass
class OtherRow:
    """Temp data: a save in progress or abandoned, an interrupted deletion, a loose temp file."""

    name: str
    path: str
    kind: str
    step: int | None
    nbytes: int
    detail: str


def _step_of(name: str) -> int | None:
    m = STEP_RE.match(name.removeprefix(_TMP_DEL_PREFIX).removeprefix(TMP_PREFIX))
    return int(m.group(1)) if m else None


def _step_row(path: Path, step: int) -> StepRow:
    row = StepRow(step=step, name=path.name, path=str(path), committed=False, nbytes=disk_usage(path))
    parts = published_parts(path)
    row.collective_free = parts is not None
    if not is_checkpoint(path):
        if parts is None:
            row.problem = "not a checkpoint: no manifest"
        else:
            world, dirs = parts
            have = {int(m.group(1)) for d in dirs if (m := PART_RE.fullmatch(d.name))}
            # (the world size is a directory's name: ranks are named, and looked for, a few at most)
            writing = [r for r in first_missing(have, world) if _part_in_progress(path, r, world)]
            row.problem = (
                f"incomplete: the parts of ranks {missing_ranks(have, world)} (of {world}) are missing"
            )
            if writing:
                row.problem += f"; ranks {writing} are writing theirs"
        return row
    row.committed = True
    try:
        manifest = read_manifest(path)
    except CorruptionError as exc:
        row.problem, row.damaged = f"damaged manifest: {exc}", True
        return row
    except CheckpointError as exc:  # (a newer format version, say: not damage)
        row.problem = f"unreadable manifest: {exc}"
        return row
    row.created_at = manifest.created_at
    row.created = iso_utc(manifest.created_at)
    row.tensors = len(manifest.tensors)
    row.world_size = manifest.world_size
    return row


def _part_in_progress(step_dir: Path, rank: int, world: int) -> bool:
    prefix = f"{TMP_PREFIX}{part_dir_name(rank, world)}-"
    try:
        names = os.listdir(step_dir)
    except FileNotFoundError:
        return False
    return any(
        n.startswith(prefix) and not n.endswith(LOCK_SUFFIX) and owner_alive(step_dir / (n + LOCK_SUFFIX))
        for n in names
    )


def _other_row(path: Path) -> OtherRow | None:
    name = path.name
    is_dir = path.is_dir()
    if name.endswith(LOCK_SUFFIX) and path.with_name(name.removesuffix(LOCK_SUFFIX)).exists():
        return None  # the owner lock of a temp directory, reported with it
    step = _step_of(name)
    if name.startswith(_TMP_DEL_PREFIX):
        kind, detail = "deleting", "a retention deletion, in progress or interrupted"
    elif is_dir and name.startswith(_TMP_STEP_PREFIX):
        if owner_alive(path.with_name(name + LOCK_SUFFIX)):
            kind, detail = "in-progress", "a save in progress (its writer holds the lock)"
        else:
            kind, detail = "abandoned", "left by a crashed or killed save; removed by prune or the next open"
    else:
        kind, detail = "temp-file", "a temporary file"
    return OtherRow(name=name, path=str(path), kind=kind, step=step, nbytes=disk_usage(path), detail=detail)


def list_root(root: Path) -> tuple[list[StepRow], list[OtherRow], str | None]:
    """The step directories, the temp entries and the ``latest`` pointer of ``root``. Blocking.

    Raises:
        CheckpointNotFoundError: ``root`` does not exist, is not a directory, or is a checkpoint itself.
    """
    if not root.is_dir():
        what = "it is not a directory" if root.exists() else "it does not exist"
        raise CheckpointNotFoundError(f"no Checkpointer root at {root}: {what}")
    if is_checkpoint(root):
        raise CheckpointNotFoundError(
            f"{root} is a checkpoint, not a Checkpointer root: see `aiockpt inspect {root}`"
        )
    steps: list[StepRow] = []
    others: list[OtherRow] = []
    latest: str | None = None
    for entry in sorted(root.iterdir()):
        if (step := step_of(entry.name)) is not None and entry.is_dir():
            steps.append(_step_row(entry, step))
        elif is_temp(entry.name):  # (another program's .tmp- data is not listed: prune leaves it)
            if (other := _other_row(entry)) is not None:
                others.append(other)
        elif entry.name == LATEST and entry.is_file():
            # (as ``latest_of`` reads it: a garbled pointer is shown, and names no step, never a crash)
            latest = entry.read_text(errors="replace").strip() or None
    steps.sort(key=lambda r: r.step)
    for row in steps:
        row.latest = row.name == latest
    return steps, others, latest


def _render(root: Path, steps: list[StepRow], others: list[OtherRow], latest: str | None) -> None:
    out = stdout()
    committed = [r for r in steps if r.committed]
    table = Table(box=box.SIMPLE, title=Text(printable(str(root))), title_justify="left")
    table.add_column("step", justify="right")
    table.add_column("created")
    table.add_column("size", justify="right")
    table.add_column("tensors", justify="right")
    table.add_column("ranks", justify="right")
    table.add_column("", overflow="fold")
    for r in steps:
        notes = []
        if r.latest:
            notes.append("<- latest")
        if r.collective_free and r.committed:
            notes.append("collective-free")
        if r.problem:
            notes.append(f"! {printable(r.problem)}")  # (a damaged manifest's error names its keys)
        table.add_row(
            str(r.step),
            local_time(r.created_at) if r.created_at is not None else "-",
            human_bytes(r.nbytes),
            str(r.tensors) if r.tensors is not None else "-",
            str(r.world_size) if r.world_size is not None else "-",
            Text(", ".join(notes)),
        )
    if steps:
        out.print(table)
    else:
        click.echo(printable(f"{root}: no checkpoints"))
    for o in others:  # (a temp name is any name with the temp prefix)
        click.echo(f"! {shown(o.name)}: {o.kind} ({human_bytes(o.nbytes)}): {o.detail}")
    total = sum(r.nbytes for r in committed)
    summary = f"{len(committed)} committed step(s), {human_bytes(total)}"
    if damaged := sum(r.damaged for r in steps):
        summary += f" ({damaged} with a damaged manifest)"
    if latest is not None:
        summary += f"; latest -> {shown(latest)}"  # (the pointer file's text, whatever it holds)
        if not any(r.latest for r in committed):
            summary += " (! not a committed step here)"
    click.echo(summary)


@click.command("ls", short_help="List the checkpoints of a Checkpointer root.")
@click.argument("root")
@json_option
def command(root: str, as_json: bool) -> int:
    """List the checkpoints of a Checkpointer ROOT.

    Shows each step with its creation time, size on disk, tensor count and number of ranks, marks the
    one `latest` points to, and flags what is not a complete checkpoint: saves in progress, temp data
    of crashed saves, interrupted deletions, collective-free checkpoints with missing parts, and steps
    whose manifest is damaged (then it exits with 1, as verify does).
    """
    directory = local(root, "the aiockpt command line")
    steps, others, latest = list_root(directory)
    if as_json:
        print_json(
            {
                "schema": SCHEMA,
                "root": str(directory),
                "latest": latest,
                "steps": [asdict(r) for r in steps],
                "other": [asdict(o) for o in others],
            }
        )
    else:
        _render(directory, steps, others, latest)
    return 1 if any(r.damaged for r in steps) else 0  # damage found, as with ``verify``
