"""Entry point: ``python -m benchmarks``."""

from __future__ import annotations

from benchmarks._cli import main

raise SystemExit(main())
