"""The command group, and the one place where errors become one line on stderr and an exit code.

Exit codes: 0 success; 1 damage found (a verification failure, a damaged manifest); 2 a usage or user
error (bad flag, missing path, not a checkpoint, a format newer than this aiockpt); 130 interrupted.
"""

from __future__ import annotations

from collections.abc import Sequence

import click

from .._errors import CheckpointError, CorruptionError
from .._version import __version__
from . import convert, inspect, ls, prune, verify

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


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "-V", "--version", prog_name="aiockpt")
def cli() -> None:
    """Inspect, verify, prune and convert aiockpt checkpoints."""


for _command in COMMANDS:
    cli.add_command(_command)


def _fail(message: str) -> None:
    click.echo(f"aiockpt: error: {' / '.join(message.splitlines())}", err=True)


def run(argv: Sequence[str] | None = None) -> int:
    """Run the command line on ``argv`` (default: ``sys.argv[1:]``) and return the exit code."""
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
    except OSError as exc:  # e.g. a root that cannot be listed
        where = f": {exc.filename}" if exc.filename else ""
        _fail(f"{exc.strerror or exc}{where}")
        return EXIT_USAGE
    return rv if isinstance(rv, int) else 0
