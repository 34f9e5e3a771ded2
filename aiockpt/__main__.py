"""``python -m aiockpt``: the command-line tool (see ``aiockpt --help``)."""

from __future__ import annotations

from ._cli import main

if __name__ == "__main__":
    main()
