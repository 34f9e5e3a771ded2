"""``aiockpt prune ROOT``: Checkpointer retention, applied by hand, and temp data of crashed saves removed."""

from __future__ import annotations

from pathlib import Path

import click

from .._checkpointer import collect_temp, delete_steps, doomed_steps, latest_of, scan_steps, step_dir_name
from .._errors import CheckpointError, CheckpointNotFoundError
from .._load import is_checkpoint, read_manifest
from .._storage import local
from ._common import disk_usage, human_bytes, json_option, print_json, printable

SCHEMA = "aiockpt.prune/1"


def _damaged_newest(directory: Path, steps: list[int], keep_last: int) -> dict[int, str]:
    """The newest ``steps`` whose manifest cannot be read, down to the ``keep_last``-th readable one.

    Counted in ``--keep-last``, a damaged newest step left nothing loadable: the healthy ones went.

    Returns:
        Each such step, with why its manifest cannot be read.
    """
    damaged: dict[int, str] = {}
    readable = 0
    for step in reversed(steps):
        if readable == keep_last:
            break
        try:
            read_manifest(directory / step_dir_name(step))
        except CheckpointError as exc:
            damaged[step] = str(exc)
        else:
            readable += 1
    return damaged


@click.command("prune", short_help="Delete old steps and temp data of crashed saves.")
@click.argument("root")
@click.option(
    "--keep-last", type=click.IntRange(min=1), required=True, help="Keep the newest N committed steps."
)
@click.option(
    "--keep-every", type=click.IntRange(min=1), default=None, help="Also keep every step divisible by K."
)
@click.option("--dry-run", is_flag=True, help="Delete nothing; print what would be deleted.")
@json_option
def command(root: str, keep_last: int, keep_every: int | None, dry_run: bool, as_json: bool) -> None:
    """Delete old committed steps of ROOT, and temp data left by crashed saves.

    Applies the retention of `Checkpointer(keep_last=N, keep_every=K)`: the newest N steps and every
    step divisible by K stay (so the newest step always does, and so does the one `latest` names).
    Temp data goes only once its writer is gone: saves running in other processes are safe. That
    includes the temp parts that ranks of a collective-free job left inside step directories. A newest
    step whose manifest is damaged is kept and not counted: the N kept are N readable ones.
    """
    directory = local(root, "the aiockpt command line")
    if not directory.is_dir():
        what = "it is not a directory" if directory.exists() else "it does not exist"
        raise CheckpointNotFoundError(f"no Checkpointer root at {directory}: {what}")
    if is_checkpoint(directory):
        raise CheckpointNotFoundError(f"{directory} is a checkpoint, not a Checkpointer root")
    steps = scan_steps(directory)
    try:
        latest = latest_of(directory)
    except OSError as exc:  # (a directory in its place, say): as the Checkpointer's retention, go on
        reason = exc.strerror or exc
        click.echo(f"aiockpt: {directory / 'latest'} cannot be read ({reason}): ignored", err=True)
        latest = None
    damaged = _damaged_newest(directory, steps, keep_last)
    for step, why in damaged.items():
        line = f"aiockpt: {step_dir_name(step)} is kept, not counted in --keep-last: {why}"
        click.echo(printable(line), err=True)  # (``why``: a damaged manifest's error, naming its keys)
    counted = [s for s in steps if s not in damaged]
    doomed = doomed_steps(
        counted, keep_last=keep_last, keep_every=keep_every, protect=() if latest is None else (latest,)
    )
    sizes = {s: disk_usage(directory / step_dir_name(s)) for s in doomed}
    # Temp data inside a doomed step goes with the step (and its size with the step's).
    doomed_dirs = {directory / step_dir_name(s) for s in doomed}
    garbage = [p for p in collect_temp(directory, dry_run=True) if p.parent not in doomed_dirs]
    garbage_sizes = {p: disk_usage(p) for p in garbage}
    if not dry_run:
        doomed = delete_steps(directory, doomed)
        garbage = collect_temp(directory)
    freed = sum(sizes[s] for s in doomed) + sum(garbage_sizes.get(p, 0) for p in garbage)
    kept = [s for s in steps if s not in doomed]
    if as_json:
        print_json(
            {
                "schema": SCHEMA,
                "root": str(directory),
                "dry_run": dry_run,
                "deleted_steps": doomed,
                "removed_temp": [str(p.relative_to(directory)) for p in garbage],
                "kept_steps": kept,
                "damaged_steps": sorted(damaged),
                "freed_nbytes": freed,
            }
        )
        return
    verb = "would delete" if dry_run else "deleted"
    for s in doomed:
        click.echo(f"{verb} {step_dir_name(s)} ({human_bytes(sizes[s])})")
    for p in garbage:
        size = human_bytes(garbage_sizes.get(p, 0))
        click.echo(printable(f"{verb} {p.relative_to(directory)} ({size}): temp data whose writer is gone"))
    entries = "entry" if len(garbage) == 1 else "entries"
    click.echo(
        f"{verb} {len(doomed)} step(s) and {len(garbage)} temp {entries}, {human_bytes(freed)}; "
        f"kept {len(kept)} step(s): {kept}"
    )
