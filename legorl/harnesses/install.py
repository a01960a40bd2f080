"""Cached, isolated, version-pinned installs of the five harnesses.

Each harness lives in its own folder ``cache_dir()/harnesses/<name>-<version>``: a virtual
environment for the Python harnesses (mini-swe-agent on the host's Python, the OpenHands SDK on a
Python >= 3.12), an npm prefix for the Node ones (OpenCode, Claude Code, Codex; their CLIs are native
binaries shipped inside the npm packages). Nothing is vendored: Claude Code in particular is
proprietary and only ever installed on the user's machine, at run time, from the npm registry.

An install is complete only once its ``legorl-install.json`` marker exists; a folder without one
(a killed install) is wiped and redone. A file lock keeps concurrent installs of the same harness
apart. The venvs are not relocatable, and the in-container harnesses bind-mount them at the same
path, so an install never moves after it is made.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

from legorl.errors import LegorlError
from legorl.paths import cache_dir, file_lock

MARKER = "legorl-install.json"
# Releases of litellm that were compromised upstream; never let a resolver pick them.
_LITELLM_GUARD = "litellm!=1.82.7,!=1.82.8"


@dataclass(frozen=True)
class Recipe:
    """How to install one harness, pinned to the version its adapter was tested with."""

    name: str
    version: str
    kind: Literal["venv", "npm"]
    packages: tuple[str, ...]
    min_python: tuple[int, int] = (3, 10)
    # npm: the package holding the native binary, and the binary's path inside it.
    native_package: str = ""
    native_path: str = ""
    # venv: a module whose import proves the install works.
    probe_module: str = ""


RECIPES: dict[str, Recipe] = {
    "mini-swe-agent": Recipe(
        "mini-swe-agent", "2.4.6", "venv", ("mini-swe-agent==2.4.6", _LITELLM_GUARD),
        min_python=(3, 11), probe_module="minisweagent.agents.default",
    ),
    "openhands": Recipe(
        "openhands", "1.58.2", "venv",
        # The agent server is pinned to the SDK's version, else pip backtracks to an old one.
        ("openhands-sdk==1.58.2", "openhands-tools==1.58.2", "openhands-agent-server==1.58.2",
         _LITELLM_GUARD),
        min_python=(3, 12), probe_module="openhands.tools.terminal",
    ),
    "opencode": Recipe(
        "opencode", "1.18.33", "npm", ("opencode-ai@1.18.33",),
        native_package="opencode-linux-x64", native_path="bin/opencode",
    ),
    "claude-code": Recipe(
        "claude-code", "2.1.332", "npm", ("@anthropic-ai/claude-code@2.1.332",),
        native_package="@anthropic-ai/claude-code-linux-x64", native_path="claude",
    ),
    # The platform package is a static (musl) binary: it runs in any task image.
    "codex": Recipe(
        "codex", "0.171.0", "npm", ("@openai/codex@0.171.0",),
        native_package="@openai/codex-linux-x64", native_path="vendor/x86_64-unknown-linux-musl/bin/codex",
    ),
}


@dataclass
class Installation:
    """A completed install, as recorded in its marker file."""

    name: str
    version: str
    root: str
    kind: str
    packages: list[str]
    python: str | None = None  # venv interpreter
    base_prefix: str | None = None  # the interpreter installation the venv points into
    binary: str | None = None  # native CLI (npm harnesses)
    installed_at: float = 0.0
    extra: dict[str, str] = field(default_factory=dict)

    @property
    def path(self) -> Path:
        return Path(self.root)

    def mounts(self) -> list[tuple[str, str, bool]]:
        """Read-only bind mounts that make this install usable inside a container at the same paths."""
        paths = [self.root] + ([self.base_prefix] if self.base_prefix else [])
        return [(p, p, True) for p in paths]


def recipe(name: str) -> Recipe:
    try:
        return RECIPES[name]
    except KeyError:
        raise LegorlError(f"unknown harness '{name}' (known: {', '.join(RECIPES)})") from None


def harness_root(name: str) -> Path:
    r = recipe(name)
    return cache_dir() / "harnesses" / f"{r.name}-{r.version}"


def installed(name: str) -> Installation | None:
    """The completed install of ``name`` at its pinned version, or None."""
    marker = harness_root(name) / MARKER
    if not marker.exists():
        return None
    try:
        return Installation(**json.loads(marker.read_text()))
    except (ValueError, TypeError):
        return None


def require(name: str) -> Installation:
    """The install of ``name``; installs it on first use (cached afterwards)."""
    return installed(name) or install(name)


# --------------------------------------------------------------------------- interpreters


def _python_version(exe: str) -> tuple[int, int] | None:
    try:
        out = subprocess.run(
            [exe, "-c", "import sys; print(sys.version_info[0], sys.version_info[1])"],
            capture_output=True, text=True, timeout=20,
        ).stdout.split()
        return int(out[0]), int(out[1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def _candidates() -> Iterator[str]:
    yield getattr(sys, "_base_executable", sys.executable)
    for minor in range(10, 16):
        found = shutil.which(f"python3.{minor}")
        if found:
            yield found
    pyenv = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    if pyenv.is_dir():
        for d in sorted(pyenv.iterdir(), key=lambda p: [int(x) for x in re.findall(r"\d+", p.name)]):
            exe = d / "bin" / "python3"
            if re.fullmatch(r"3\.\d+\.\d+", d.name) and exe.exists():
                yield str(exe)


def find_python(min_version: tuple[int, int], explicit: str | None = None) -> str:
    """A CPython interpreter of at least ``min_version``: ``explicit`` if given, else the first found
    among this interpreter, ``python3.X`` on PATH and pyenv-built versions."""
    want = ".".join(map(str, min_version))
    if explicit:
        got = _python_version(explicit)
        if got is None or got < min_version:
            raise LegorlError(f"--python {explicit}: not a Python >= {want} interpreter")
        return explicit
    for exe in _candidates():
        got = _python_version(exe)
        if got is not None and got >= min_version:
            return str(Path(exe).resolve())
    raise LegorlError(f"no Python >= {want} found (install one, e.g. with pyenv or uv, and pass --python)")


# --------------------------------------------------------------------------- installing


def _run(cmd: list[str], log: Path, what: str, env: dict[str, str] | None = None) -> None:
    with open(log, "a") as handle:
        handle.write(f"$ {' '.join(cmd)}\n")
        handle.flush()
        proc = subprocess.run(cmd, stdout=handle, stderr=subprocess.STDOUT, env=env)
    if proc.returncode != 0:
        tail = log.read_text(errors="replace").strip().splitlines()[-1:] or [""]
        raise LegorlError(f"installing {what} failed (exit {proc.returncode}): {tail[0]} — see {log}")


def _install_venv(r: Recipe, root: Path, log: Path, python: str | None) -> Installation:
    base = find_python(r.min_python, python)
    venv = root / "venv"
    _run([base, "-m", "venv", str(venv)], log, r.name)
    py = venv / "bin" / "python"
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    _run([str(py), "-m", "pip", "install", "--quiet", *r.packages], log, r.name, env)
    prefix = subprocess.run(
        [str(py), "-c", "import sys; print(sys.base_prefix)"], capture_output=True, text=True, check=True
    ).stdout.strip()
    return Installation(
        r.name, r.version, str(root), r.kind, list(r.packages), python=str(py), base_prefix=prefix
    )


def _install_npm(r: Recipe, root: Path, log: Path) -> Installation:
    npm = shutil.which("npm")
    if npm is None:
        raise LegorlError(f"installing {r.name} needs npm (Node.js) on PATH")
    # --engine-strict=false: Claude Code declares node>=22 but its CLI is a native binary, and
    # without an exact pin npm on an older Node would silently pick an old release.
    _run([npm, "install", "--prefix", str(root), "--no-audit", "--no-fund", "--engine-strict=false",
          *r.packages], log, r.name)
    binary = root / "node_modules" / r.native_package / r.native_path
    if not binary.exists():
        raise LegorlError(f"installing {r.name}: native binary {binary} is missing (unsupported platform?)")
    return Installation(r.name, r.version, str(root), r.kind, list(r.packages), binary=str(binary))


def install(name: str, force: bool = False, python: str | None = None) -> Installation:
    """Install harness ``name`` at its pinned version into the cache (no-op when already there)."""
    r = recipe(name)
    root = harness_root(name)
    with file_lock(root.parent / f".{root.name}.lock"):
        done = installed(name)
        if done is not None and not force:
            return done
        if root.exists():
            shutil.rmtree(root)
        root.mkdir(parents=True)
        log = root / "install.log"
        inst = _install_venv(r, root, log, python) if r.kind == "venv" else _install_npm(r, root, log)
        inst.installed_at = time.time()
        tmp = root / f".{MARKER}.tmp"
        tmp.write_text(json.dumps(asdict(inst), indent=2))
        os.replace(tmp, root / MARKER)
        return inst


def check(inst: Installation, timeout: float = 60) -> tuple[bool, str]:
    """Whether an install works here: the venv imports the harness, the native binary runs."""
    r = recipe(inst.name)
    if inst.kind == "venv":
        cmd = [inst.python or "", "-c", f"import {r.probe_module}"]
    else:
        cmd = [inst.binary or "", "--version"]
    env = {**os.environ, "HOME": str(inst.path / "probe-home"), "LITELLM_LOCAL_MODEL_COST_MAP": "True",
           "DISABLE_AUTOUPDATER": "1", "OPENCODE_DISABLE_AUTOUPDATE": "1"}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, str(exc).splitlines()[0]
    out = (proc.stdout + proc.stderr).strip().splitlines()
    if proc.returncode != 0:
        return False, out[-1] if out else f"exit {proc.returncode}"
    return True, out[0] if out and inst.kind == "npm" else "ok"
