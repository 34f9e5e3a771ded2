"""The ``aiockpt`` command-line tool: ``ls``, ``inspect``, ``verify``, ``prune``, ``convert``.

Its dependencies (click, rich) come with the ``cli`` extra: ``pip install 'aiockpt[cli]'``. One module
per subcommand, each defining a click ``command`` listed in :data:`._app.COMMANDS`.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

_EXTRA = "aiockpt: the command-line tool needs its extra dependencies: pip install 'aiockpt[cli]'"


def main(argv: Sequence[str] | None = None) -> None:
    """Run the command line (the ``aiockpt`` console script and ``python -m aiockpt``) and exit."""
    try:
        from ._app import run
    except ImportError as exc:
        if (exc.name or "").partition(".")[0] not in ("click", "rich"):
            raise
        print(_EXTRA, file=sys.stderr)
        raise SystemExit(2) from None
    raise SystemExit(run(argv))
