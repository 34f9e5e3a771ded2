"""Developer tasks: `nox -s tests`, `nox -s lint typecheck`, `nox -s demo`, `nox -s bench`, `nox -s slow`.

Every session pins torch to the local CPU build first, so a fresh environment never resolves an unpinned
torch (which would download several GB of CUDA wheels); the package metadata keeps a plain lower bound.
"""

from __future__ import annotations

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
