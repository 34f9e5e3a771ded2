"""The command group, and the one place where errors become one line on stderr and an exit code.

Exit codes: 0 success; 1 damage found (a verification failure, a damaged manifest); 2 a usage or user
error (bad flag, missing path, not a checkpoint, a format newer than this aiockpt); 130 interrupted; 141
the output was closed before the command wrote it all (``aiockpt inspect ROOT | head``), quietly.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import Any, TextIO

import click

from .._errors import CheckpointError, CorruptionError
from .._version import __version__
from . import convert, inspect, ls, prune, verify
from ._common import printable, stdout_written_whole

# Adding a subcommand: a module defining ``command``, listed here.
COMMANDS: tuple[click.Command, ...] = (
    ls.command,
    inspect.command,
    verify.command,
    prune.command,
    convert.command,
)

EXIT_DAMAGED = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130
# 128 + SIGPIPE: what a shell reports for a command that a closed pipe stopped (`yes | head` with
# `set -o pipefail`). Neither 0, the output is not all out and the command may have stopped before
# its end (a verification unfinished), nor 1, nothing damaged was found.
EXIT_OUTPUT_CLOSED = 141


class _OutputClosed(Exception):
    """The reader of stdout (or stderr) went away while a command wrote to it."""


class _Group(click.Group):
    """The command group, turning a closed output into :class:`_OutputClosed`.

    Click's ``main`` catches ``BrokenPipeError`` itself, and exits with status 1 (damage found, here):
    so it is caught before, in the two places that write (parsing: ``--help``, ``--version``; running a
    subcommand, its parsing included), as a type of error that click lets through to :func:`run`.
    """

    def make_context(self, *args: Any, **kwargs: Any) -> click.Context:
        try:
            return super().make_context(*args, **kwargs)
        except BrokenPipeError as exc:
            raise _OutputClosed from exc

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except BrokenPipeError as exc:
            raise _OutputClosed from exc


def _quiet_closed_outputs() -> None:
    """Point stdout and stderr at ``/dev/null`` where their pipe is closed (what they hold is lost anyway).

    What a stream still buffers is flushed at exit: to a closed pipe that fails, and Python prints an
    error and exits with status 120 instead of the command's. A stream whose flush succeeds now is left
    alone, as is one that is no file of its own (a test's capture).
    """
    for stream in (sys.stdout, sys.stderr):
        if not _flush_fails(stream):
            continue
        try:
            fd = stream.fileno()
        except (OSError, ValueError):
            continue
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, fd)
        finally:
            os.close(devnull)


def _flush_fails(stream: TextIO) -> bool:
    """Whether flushing ``stream`` fails for its pipe being closed (its data is kept for the next try)."""
    try:
        stream.flush()
    except BrokenPipeError:
        return True
    except (OSError, ValueError):  # closed by the program, or no file: no flush at exit fails either
        return False
    return False


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "-V", "--version", prog_name="aiockpt")
def cli() -> None:
    """Inspect, verify, prune and convert aiockpt checkpoints."""


for _command in COMMANDS:
    cli.add_command(_command)


def _fail(message: str) -> None:
    # One line, escaped: an error's message may name keys and values of an untrusted checkpoint.
    click.echo(f"aiockpt: error: {' / '.join(map(printable, message.splitlines()))}", err=True)


def run(argv: Sequence[str] | None = None) -> int:
    """Run the command line on ``argv`` (default: ``sys.argv[1:]``) and return the exit code."""
    with stdout_written_whole():
        try:
            code = _run(argv)
            sys.stdout.flush()  # the output's last bytes: a reader gone shows here too
        except (_OutputClosed, BrokenPipeError):  # (BrokenPipeError: from that flush, or an error's line)
            _quiet_closed_outputs()
            return EXIT_OUTPUT_CLOSED
    return code


def _run(argv: Sequence[str] | None) -> int:
    """:func:`run`, but for a closed output."""
    try:
        rv = cli.main(
            args=list(argv) if argv is not None else None, prog_name="aiockpt", standalone_mode=False
        )
    except click.exceptions.NoArgsIsHelpError as exc:
        click.echo(exc.ctx.get_help(), err=True)
        return EXIT_USAGE
    except click.UsageError as exc:
        hint = f" (see '{exc.ctx.command_path} --help')" if exc.ctx is not None else ""
        _fail(exc.format_message() + hint)
        return EXIT_USAGE
    except click.ClickException as exc:
        _fail(exc.format_message())
        return exc.exit_code
    except click.Abort:
        _fail("interrupted")
        return EXIT_INTERRUPTED
    except CorruptionError as exc:
        _fail(str(exc))
        return EXIT_DAMAGED
    except CheckpointError as exc:
        _fail(str(exc))
        return EXIT_USAGE
    except OSError as exc:  # e.g. a root that cannot be listed (never a closed output: see _Group)
        where = f": {exc.filename}" if exc.filename else ""
        _fail(f"{exc.strerror or exc}{where}")
        return EXIT_USAGE
    return rv if isinstance(rv, int) else 0
