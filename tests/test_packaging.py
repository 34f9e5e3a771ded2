"""The package version has one source, and the installed distribution agrees with it."""

from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

import aiockpt

REPO = Path(__file__).resolve().parents[1]


def test_version_matches_the_installed_distribution() -> None:
    assert aiockpt.__version__ == importlib.metadata.version("aiockpt")


def test_version_is_pep440_and_in_the_changelog() -> None:
    assert re.fullmatch(r"\d+\.\d+\.\d+((a|b|rc)\d+)?(\.dev\d+)?", aiockpt.__version__)
    changelog = (REPO / "CHANGELOG.md").read_text(encoding="utf-8")
    assert "## [Unreleased]" in changelog
    assert f"## [{aiockpt.__version__}]" in changelog
