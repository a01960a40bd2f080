"""A library to mine for tasks: its sdist fetched from PyPI and unpacked, its source and test
files found (``NAME==VERSION``, step 1 of :mod:`legorl.tasks.builder`)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

from legorl.core.errors import LegorlError

PYTEST_FLAGS = "-o addopts= --no-header -rA --tb=no -p no:cacheprovider"


class BuildError(LegorlError):
    """A library could not be turned into tasks (its sdist, its tests, git, a mutation's tests)."""


@dataclass
class Library:
    name: str
    version: str
    root: Path  # the unpacked clean tree
    source_files: list[str]
    test_files: list[str]
    pythonpath: str | None  # "src" for src layouts

    @property
    def test_command(self) -> str:
        prefix = f"PYTHONPATH={self.pythonpath} " if self.pythonpath else ""
        return f"{prefix}python3 -m pytest {PYTEST_FLAGS} {{test_files}}"


def fetch_sdist(spec: str, dest: Path) -> Library:
    """Download and unpack ``NAME==VERSION``'s sdist into ``dest``."""
    name, _, version = spec.partition("==")
    if not name or not version:
        raise BuildError(f"{spec!r}: give NAME==VERSION")
    download = dest / "sdist"
    download.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps", "-q", "-d", str(download), spec], capture_output=True, text=True,
    )
    archives = sorted(download.glob("*.tar.gz"))
    if proc.returncode != 0 or not archives:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or [""]
        raise BuildError(f"pip download {spec} failed: {tail[0]}")
    root = dest / "clean"
    shutil.rmtree(root, ignore_errors=True)
    with tarfile.open(archives[0]) as tar:
        tar.extractall(dest / "unpacked", filter="data")
    (top,) = [p for p in (dest / "unpacked").iterdir() if p.is_dir()]
    top.rename(root)
    return describe(name, version, root)


def describe(name: str, version: str, root: Path) -> Library:
    """Find the library's source and test files in an unpacked tree."""
    for junk in list(root.glob("*.egg-info")) + list(root.glob("src/*.egg-info")):
        shutil.rmtree(junk)
    tests, sources = [], []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        parts = rel.split("/")
        if parts[0] in ("docs", "doc", "examples", "benchmarks", "tools", "scripts") or path.name in (
            "setup.py", "noxfile.py", "conftest.py", "fabfile.py"
        ):
            continue
        if "tests" in parts[:-1] or "test" in parts[:-1]:
            if path.name.startswith("test_") or path.name.endswith("_test.py"):
                tests.append(rel)
        elif not path.name.startswith("test_") and path.name != "__main__.py":
            sources.append(rel)
    if not tests:
        raise BuildError(f"{name} {version}: its sdist ships no tests")
    if not sources:
        raise BuildError(f"{name} {version}: no library source found")
    pythonpath = "src" if (root / "src").is_dir() and any(s.startswith("src/") for s in sources) else None
    return Library(name, version, root, sources, tests, pythonpath)
