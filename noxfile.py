"""Sessions run in the project's environment (`make setup` builds it; torch is CPU-only there)."""

from __future__ import annotations

import glob

import nox

nox.options.sessions = ["lint", "typecheck", "tests"]
nox.options.default_venv_backend = "none"


@nox.session(python=False)
def tests(session: nox.Session) -> None:
    """The test suite: real podman, real harnesses, a real tiny model."""
    session.run("pytest", *session.posargs)


@nox.session(python=False)
def unit(session: nox.Session) -> None:
    """The inner loop's lane, about a minute: no container, harness, GPU, model load, CLI subprocess or
    long run (markers in pyproject.toml; a model load is marked by tests/conftest.py), and none of the
    robustness suites (attacks, chaos, fuzz, load). The full suite is `nox -s tests`."""
    session.run("pytest", "-q", "-m", "not slow and not podman and not harness and not gpu and not heavy",
                *(f"--ignore=tests/{suite}" for suite in ("attacks", "chaos", "fuzz", "load")), *session.posargs)


@nox.session(python=False)
def lint(session: nox.Session) -> None:
    session.run("ruff", "check", ".")


@nox.session(python=False)
def typecheck(session: nox.Session) -> None:
    session.run("mypy", "legorl", "stages", "cli")


@nox.session(python=False)
def bench(session: nox.Session) -> None:
    """Each hot path's benchmark; each prints its ratio against the natural alternative."""
    for script in sorted(glob.glob("benchmarks/*.py")):
        if not script.startswith("benchmarks/gpu_"):  # the GPU table (gpu_check, gpu_env, gpu_rows): `make gpu-check`
            session.run("python", script, *session.posargs)
