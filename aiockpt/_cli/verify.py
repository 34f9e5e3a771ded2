"""``aiockpt verify PATH``: read back every byte of a checkpoint and check every block's checksum."""

from __future__ import annotations

import anyio
import click

from .._options import IOConfig
from .._verify import VerifyReport, verify
from ._common import (
    human_bytes,
    json_option,
    no_progress_option,
    print_json,
    printable,
    progress_bar,
    resolve_checkpoint,
    show_progress,
    step_option,
)

SCHEMA = "aiockpt.verify/1"


def _report_json(report: VerifyReport) -> None:
    print_json(
        {
            "schema": SCHEMA,
            "path": report.path,
            "ok": report.ok,
            "tensors": report.num_tensors,
            "chunks": report.num_chunks,
            "nbytes": report.nbytes,
            "problems": [{"key": p.key, "file": p.file, "message": str(p)} for p in report.problems],
        }
    )


@click.command("verify", short_help="Check every checksum of a checkpoint.")
@click.argument("path")
@step_option
@click.option(
    "--threads",
    type=click.IntRange(min=1),
    default=None,
    help="Reader threads [default: one fewer than the CPUs, 1 to 4].",
)
@no_progress_option
@json_option
def command(path: str, step: int | None, threads: int | None, no_progress: bool, as_json: bool) -> int:
    """Check the integrity of the checkpoint at PATH.

    Reads every chunk of every data file and checks every block's CRC32C, and the manifest's checksum,
    in bounded memory. Prints one line per damaged chunk (naming its key and file) and exits with 1 if
    there is any, 0 if everything verified. PATH is a checkpoint directory, or a Checkpointer root (then
    its newest step, or --step).
    """
    directory, note = resolve_checkpoint(path, step)
    if note is not None and not as_json:
        click.echo(f"verifying {directory.name}, {note}", err=True)
    with progress_bar(show_progress(no_progress), f"verifying {directory.name}") as progress:
        report = anyio.run(lambda: verify(directory, io=IOConfig(threads=threads), progress=progress))
    if as_json:
        _report_json(report)
    else:
        for problem in report.problems:
            click.echo(printable(f"CORRUPT {problem}"))
        what = f"{report.num_tensors} tensor(s), {report.num_chunks} chunk(s), {human_bytes(report.nbytes)}"
        if report.ok:
            click.echo(printable(f"OK: {what} verified in {report.path}"))
        else:
            click.echo(printable(f"FAILED: {len(report.problems)} damaged in {report.path} ({what})"))
    return 0 if report.ok else 1
