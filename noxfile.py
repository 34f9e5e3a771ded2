"""Developer tasks: `nox -s tests`, `nox -s lint typecheck`, `nox -s demo`, `nox -s bench`, `nox -s slow`,
`nox -s docs`, `nox -s build`.

Every session pins torch to the local CPU build first, so a fresh environment never resolves an unpinned
torch (which would download several GB of CUDA wheels); the package metadata keeps a plain lower bound.
"""

from __future__ import annotations

import shutil
import tarfile
import zipfile
from pathlib import Path

import nox

TORCH = "torch==2.13.0"

nox.options.sessions = ["lint", "typecheck", "tests"]
nox.options.default_venv_backend = "venv"
nox.options.reuse_existing_virtualenvs = True


def _install(session: nox.Session, extras: str = "") -> None:
    session.install(TORCH)
    session.install("-e", f".[{extras}]" if extras else ".")


@nox.session
def tests(session: nox.Session) -> None:
    """Run the test suite (bounded variants of the slow trials included)."""
    _install(session, "test")
    session.run("pytest", *session.posargs)


@nox.session
def slow(session: nox.Session) -> None:
    """Run the full stress and crash trials that CI only runs in bounded form."""
    _install(session, "test")
    session.run("pytest", "-m", "slow", "--run-slow", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    """Ruff lint and format check."""
    session.install("ruff>=0.6")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def typecheck(session: nox.Session) -> None:
    """Mypy in strict mode over the package, tests, examples and benchmarks."""
    _install(session, "dev")
    session.run("mypy")


@nox.session
def demo(session: nox.Session) -> None:
    """The main demo: an async training loop that checkpoints, is interrupted and resumes."""
    _install(session)
    session.run("python", "examples/train_resume.py", *session.posargs)


@nox.session
def bench(session: nox.Session) -> None:
    """Benchmarks against torch.save, safetensors, DCP and the machine's own limits."""
    _install(session, "bench")
    session.run("python", "-m", "benchmarks", *session.posargs)


@nox.session
def docs(session: nox.Session) -> None:
    """Build the documentation site into site/ (mkdocs --strict: any warning fails the build)."""
    _install(session, "docs")
    session.run("mkdocs", "build", "--strict", *session.posargs, env={"NO_MKDOCS_2_WARNING": "1"})


@nox.session
def build(session: nox.Session) -> None:
    """Build the sdist and wheel into dist/, check their metadata (twine) and what they contain."""
    session.install("build", "twine")
    shutil.rmtree("dist", ignore_errors=True)
    session.run("python", "-m", "build")
    dist = sorted(str(p) for p in Path("dist").iterdir())
    session.run("twine", "check", "--strict", *dist)
    (wheel,) = Path("dist").glob("*.whl")
    (sdist,) = Path("dist").glob("*.tar.gz")
    with zipfile.ZipFile(wheel) as zf:
        in_wheel = set(zf.namelist())
    with tarfile.open(sdist) as tf:
        # Drop the leading "aiockpt-X.Y.Z/" of every member.
        in_sdist = {name.partition("/")[2] for name in tf.getnames()}
    missing = [
        f"{wheel.name}: {name}"
        for name in ("aiockpt/py.typed", "aiockpt/__init__.py")
        if name not in in_wheel
    ]
    missing += [
        f"{sdist.name}: {name}"
        for name in (
            "aiockpt/py.typed",
            "tests/conftest.py",
            "tests/golden/v1/manifest.msgpack",
            "docs/index.md",
            "mkdocs.yml",
            "CHANGELOG.md",
        )
        if name not in in_sdist
    ]
    if missing:
        session.error("missing from the distributions: " + ", ".join(missing))
    session.log(
        f"{wheel.name} ({len(in_wheel)} files) and {sdist.name} ({len(in_sdist)} files) look complete"
    )
