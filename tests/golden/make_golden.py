"""Writes the golden checkpoint of the current format version (run once per new format version).

    python tests/golden/make_golden.py

The checkpoint of each format version is committed and never rewritten: ``tests/test_format.py`` loads
every one of them, so later versions of aiockpt must keep reading them.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import aiockpt

sys.path.insert(0, str(Path(__file__).resolve().parent))
from golden_state import golden_state


async def main() -> None:
    target = Path(__file__).resolve().parent / f"v{aiockpt.FORMAT_VERSION}"
    await aiockpt.save(golden_state(), target, metadata={"purpose": "golden"})
    print(f"wrote {target}")


if __name__ == "__main__":
    asyncio.run(main())
