"""Harbor task directories as a task source (``legorl tasks import DIR``).

A Harbor task is a folder::

    instruction.md          the prompt (the row's problem_statement)
    task.toml               [metadata], [verifier] timeout_sec / env, [agent] timeout_sec,
                            [environment] docker_image, build_timeout_sec, cpus, memory, allow_internet
    environment/Dockerfile  the agent's image (its context is environment/, so tests/ never reach it)
    tests/test.sh           run after the agent; writes /logs/verifier/reward.txt (a float) or reward.json
    solution/solve.sh       optional: the reference solution, run once here to record the gold patch

Each becomes a :class:`TaskRow` with ``grader="harbor"``: the image is built offline with podman
(``--pull=never``; a Dockerfile may say ``ARG LEGORL_BASE_IMAGE`` / ``FROM ${LEGORL_BASE_IMAGE}`` for
the base image of ``legorl setup``), tagged by a content hash of the environment so a second import
reuses it, with one layer on top that makes the WORKDIR a one-commit git repository and ``/testbed``
a link to it — the repository legorl's sandboxes take the patch from. ``tests/`` travels only inside
the row (``hidden_tests``) and is uploaded to ``/tests`` by the grader (:mod:`legorl.grading.harbor`).

A bad task directory is reported with its name and the problem; the others are imported.
The container's CPU and memory limits are legorl's (grade options), not the task's, and the network
is always off (``allow_internet`` is ignored).
"""

from __future__ import annotations

import base64
import gzip
import hashlib
import io
import math
import os
import re
import shlex
import stat
import subprocess
import tarfile
import tempfile
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from legorl.core import shards
from legorl.core.errors import LegorlError
from legorl.core.schemas import HARBOR, Kind, TaskRow
from legorl.tasks.importer import ImportResult

TEST_SCRIPT = "tests/test.sh"  # the one "test" of a Harbor task, as grade rows name it
IMAGE_REPO = "localhost/legorl-harbor"
LAYER_VERSION = "1"  # bump when the layer below changes (it is part of the image's hash)
DEFAULT_VERIFIER_TIMEOUT_S = 600.0
DEFAULT_BUILD_TIMEOUT_S = 600.0
SOLVE_TIMEOUT_S = 600.0
MAX_TESTS_BYTES = 8_000_000  # tests/ as a tar.gz: it rides in every task row
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")

# Appended to the task's Dockerfile: the WORKDIR becomes the repository the agent's patch is taken
# from (one commit, fresh history), /testbed a link to it, and the WORKDIR is recorded for grading.
LAYER = r"""
USER root
RUN set -e; d="$(pwd -P)"; \
    case "$d" in /|/tests|/tests/*|/logs|/logs/*|/solution|/solution/*) \
      echo "legorl: the WORKDIR $d cannot hold the agent's repository (set a WORKDIR such as /app)" >&2; exit 1;; esac; \
    command -v git >/dev/null || { echo "legorl: the image has no git" >&2; exit 1; }; \
    command -v setpriv >/dev/null || { echo "legorl: the image has no setpriv (util-linux)" >&2; exit 1; }; \
    if [ "$d" != /testbed ]; then \
      if [ -n "$(ls -A /testbed 2>/dev/null)" ]; then echo "legorl: /testbed is not empty" >&2; exit 1; fi; \
      rm -rf /testbed; ln -s "$d" /testbed; fi; \
    rm -rf .git; git init -q; git add -A; \
    git -c user.name=legorl -c user.email=legorl@localhost commit -q --allow-empty -m "harbor task"; \
    rm -rf /tests /logs /solution
"""


class HarborTaskError(LegorlError):
    def __init__(self, task: str, problem: str):
        super().__init__(f"harbor task {task}: {problem}")
        self.task = task


@dataclass
class HarborTask:
    """One task directory, read and checked (nothing built yet)."""

    name: str
    path: Path
    instruction: str
    config: dict[str, Any]
    verifier_timeout: float
    verifier_env: dict[str, str]
    docker_image: str | None  # a prebuilt image, else environment/Dockerfile
    build_timeout: float

    @property
    def test_command(self) -> str:
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(self.verifier_env.items()))
        return f"{env + ' ' if env else ''}bash /tests/test.sh"


@dataclass
class HarborImportResult(ImportResult):
    errors: list[str] = field(default_factory=list)  # one line per task directory that was not imported


def is_harbor_source(path: Path) -> bool:
    """Whether ``path`` is a Harbor task directory or a folder of them."""
    return path.is_dir() and bool(task_dirs(path))


def task_dirs(root: Path) -> list[Path]:
    """``root`` itself when it is a task (task.toml or instruction.md in it), else its sub-folders that are."""
    def looks_like_task(p: Path) -> bool:
        return (p / "task.toml").exists() or (p / "instruction.md").exists()

    if looks_like_task(root):
        return [root]
    return sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".") and looks_like_task(p))


# --------------------------------------------------------------------------- reading a task directory


def _number(table: dict[str, Any], key: str, where: str, default: float) -> float:
    value = table.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"task.toml: [{where}] {key} must be a positive number of seconds, got {value!r}")
    return float(value)


def _table(config: dict[str, Any], name: str) -> dict[str, Any]:
    value = config.get(name, {})
    if not isinstance(value, dict):
        raise ValueError(f"task.toml: [{name}] must be a table, got {type(value).__name__}")
    return value


def _regular(path: Path, what: str) -> Path:
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        raise ValueError(f"missing {what}") from None
    if not stat.S_ISREG(mode):
        raise ValueError(f"{what} is not a regular file (links and special files are refused)")
    return path


def read_task(path: Path) -> HarborTask:
    """Read and check one task directory; :class:`HarborTaskError` names what is wrong."""
    name = path.name
    try:
        if not NAME_RE.match(name):
            raise ValueError("the directory name must be letters, digits, '.', '_' or '-' (it becomes the instance_id)")
        try:
            instruction = _regular(path / "instruction.md", "instruction.md").read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise ValueError("instruction.md is not UTF-8 text") from None
        if not instruction.strip():
            raise ValueError("instruction.md is empty")
        try:
            config = tomllib.loads(_regular(path / "task.toml", "task.toml").read_text(encoding="utf-8"))
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"task.toml is not valid TOML: {exc}") from None
        verifier, env_table = _table(config, "verifier"), _table(config, "environment")
        _table(config, "agent"), _table(config, "metadata")
        env = verifier.get("env", {})
        if not isinstance(env, dict) or not all(isinstance(k, str) and ENV_NAME_RE.match(k) and isinstance(v, str)
                                                for k, v in env.items()):
            raise ValueError("task.toml: [verifier] env must be a table of NAME = \"string\"")
        image = env_table.get("docker_image")
        if image is not None and (not isinstance(image, str) or not image.strip()):
            raise ValueError(f"task.toml: [environment] docker_image must be an image name, got {image!r}")
        if image is None:
            if not (path / "environment").is_dir():
                raise ValueError("no environment/ folder and no [environment] docker_image")
            if not (path / "environment" / "Dockerfile").exists():
                found = ", ".join(sorted(p.name for p in (path / "environment").iterdir())[:5]) or "nothing"
                raise ValueError(f"environment/ has no Dockerfile (found {found}); only a Dockerfile or a "
                                 "docker_image is supported")
            _regular(path / "environment" / "Dockerfile", "environment/Dockerfile")
        _regular(path / TEST_SCRIPT, TEST_SCRIPT)
        if (path / "solution").exists():
            _regular(path / "solution" / "solve.sh", "solution/solve.sh")
        return HarborTask(
            name=name, path=path, instruction=instruction, config=config,
            verifier_timeout=_number(verifier, "timeout_sec", "verifier", DEFAULT_VERIFIER_TIMEOUT_S),
            verifier_env=dict(env), docker_image=image,
            build_timeout=_number(env_table, "build_timeout_sec", "environment", DEFAULT_BUILD_TIMEOUT_S))
    except (ValueError, OSError) as exc:
        raise HarborTaskError(name, str(exc)) from None


def pack_dir(root: Path, what: str) -> str:
    """``root`` as base64 of a tar.gz (regular files and folders only, owner and times dropped)."""
    buf = io.BytesIO()
    # mtime=0 in the gzip header too: the same tests/ packs to the same bytes (a re-import finds the row unchanged)
    with gzip.GzipFile(fileobj=buf, mode="wb", mtime=0) as gz, \
            tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames.sort()
            for entry in sorted(dirnames) + sorted(filenames):
                full = Path(dirpath) / entry
                rel = full.relative_to(root).as_posix()
                st = full.lstat()
                if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
                    raise ValueError(f"{what}/{rel} is a link or a special file (refused)")
                info = tarfile.TarInfo(rel)
                info.mode, info.mtime = st.st_mode & 0o755, 0
                if stat.S_ISDIR(st.st_mode):
                    info.type = tarfile.DIRTYPE
                    tar.addfile(info)
                else:
                    info.size = st.st_size
                    with open(full, "rb") as fh:
                        tar.addfile(info, fh)
    data = buf.getvalue()
    if len(data) > MAX_TESTS_BYTES:
        raise ValueError(f"{what}/ is {len(data)} bytes packed (at most {MAX_TESTS_BYTES})")
    return base64.b64encode(data).decode("ascii")


# --------------------------------------------------------------------------- the image


def _tree_digest(root: Path) -> str:
    h = hashlib.sha256()
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for entry in sorted(filenames):
            full = Path(dirpath) / entry
            st = full.lstat()
            h.update(f"{full.relative_to(root).as_posix()}\0{st.st_mode:o}\0".encode("utf-8", "surrogateescape"))
            h.update(os.readlink(full).encode() if stat.S_ISLNK(st.st_mode) else full.read_bytes())
            h.update(b"\0")
    return h.hexdigest()


def image_tag(task: HarborTask, base: str) -> str:
    """The image's name: the task's name and a hash of everything the build reads."""
    h = hashlib.sha256(f"{LAYER_VERSION}\0{LAYER}\0{base}\0{task.docker_image or ''}\0".encode())
    if task.docker_image is None:
        h.update(_tree_digest(task.path / "environment").encode())
    return f"{IMAGE_REPO}-{task.name.lower()}:{h.hexdigest()[:16]}"


def _podman(args: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    from legorl.sandbox.host import podman_env, podman_path

    return subprocess.run([podman_path(), *args], capture_output=True, text=True, errors="replace",
                          env=podman_env(), timeout=timeout)


def build_image(task: HarborTask, log: Callable[[str], None] = lambda _s: None) -> tuple[str, str]:
    """Build (or reuse) the task's image offline; its name and WORKDIR."""
    from legorl.sandbox.host import base_image

    base = base_image()
    tag = image_tag(task, base)
    if _podman(["image", "exists", tag], 60).returncode != 0:
        log(f"{task.name}: building {tag}")
        with tempfile.TemporaryDirectory(prefix="legorl-harbor-") as tmp:
            if task.docker_image is None:
                context = task.path / "environment"
                dockerfile = (context / "Dockerfile").read_text(encoding="utf-8", errors="surrogateescape")
            else:
                context = Path(tmp) / "context"
                context.mkdir()
                dockerfile = f"FROM {task.docker_image}\n"
            (Path(tmp) / "Dockerfile").write_text(dockerfile + "\n" + LAYER, encoding="utf-8", errors="surrogateescape")
            try:
                proc = _podman(["build", "-q", "--pull=never", "--network=none", "--build-arg",
                                f"LEGORL_BASE_IMAGE={base}", "-f", str(Path(tmp) / "Dockerfile"), "-t", tag,
                                str(context)], task.build_timeout)
            except subprocess.TimeoutExpired:
                raise HarborTaskError(task.name, f"the image build ran past {task.build_timeout:g} s") from None
        if proc.returncode != 0:
            lines = [ln for ln in (proc.stderr + proc.stdout).strip().splitlines() if ln.strip()]
            why = next((ln for ln in lines if ln.startswith("legorl: ")), lines[-1] if lines else "")
            raise HarborTaskError(task.name, f"environment/Dockerfile does not build offline: {why[:300]}")
    proc = _podman(["image", "inspect", "--format", "{{.Config.WorkingDir}}", tag], 60)
    workdir = proc.stdout.strip()
    if proc.returncode != 0 or not workdir.startswith("/"):
        raise HarborTaskError(task.name, f"cannot read the WORKDIR of {tag}")
    return tag, workdir


def gold_patch(task: HarborTask, image: str, workdir: str) -> str | None:
    """Run ``solution/solve.sh`` in a fresh network-less container and take its diff (None: no solution)."""
    solution = task.path / "solution"
    if not solution.is_dir():
        return None
    from legorl.sandbox.base import SandboxSpec
    from legorl.sandbox.podman import PodmanBackend

    box = PodmanBackend(api="cli").create(SandboxSpec(image=image, workdir=workdir, labels={"role": "harbor-solve"}))
    try:
        box.put_dir(str(solution), "/solution")
        res = box.exec(["bash", "/solution/solve.sh"], timeout=SOLVE_TIMEOUT_S, workdir=workdir)
        if res.exit_code != 0 or res.timed_out:
            tail = res.output.strip().splitlines()[-1:] or [""]
            raise HarborTaskError(task.name, f"solution/solve.sh failed (exit {res.exit_code}"
                                  f"{', timed out' if res.timed_out else ''}): {tail[0][:300]}")
        patch = box.patch(path=workdir)
    finally:
        box.remove()
    if not patch.strip():
        raise HarborTaskError(task.name, "solution/solve.sh changed nothing in the WORKDIR")
    return patch


def to_row(task: HarborTask, log: Callable[[str], None] = lambda _s: None) -> TaskRow:
    """Build the task's image, record its gold patch, and make its row."""
    try:
        hidden = pack_dir(task.path / "tests", "tests")
    except (ValueError, OSError) as exc:
        raise HarborTaskError(task.name, str(exc)) from None
    image, workdir = build_image(task, log)
    metadata = _table(task.config, "metadata")
    return TaskRow(
        instance_id=task.name, repo=f"harbor/{task.name}", problem_statement=task.instruction,
        patch=gold_patch(task, image, workdir), FAIL_TO_PASS=[TEST_SCRIPT], image=image,
        test_command=task.test_command, grader=HARBOR, hidden_tests=hidden, workdir=workdir,
        test_timeout=task.verifier_timeout, version=str(metadata["version"]) if "version" in metadata else None)


# --------------------------------------------------------------------------- importing


def import_harbor(root: str | os.PathLike[str], tasks_dir: str | os.PathLike[str],
                  instance_ids: list[str] | None = None, limit: int | None = None,
                  log: Callable[[str], None] = lambda _s: None) -> HarborImportResult:
    """Import every Harbor task under ``root``; a bad task is an entry of ``errors``, not the end."""
    dirs = task_dirs(Path(root))
    if instance_ids is not None:
        unknown = set(instance_ids) - {d.name for d in dirs}
        if unknown:
            raise LegorlError(f"{root}: no harbor task {sorted(unknown)[0]!r}")
        dirs = [d for d in dirs if d.name in set(instance_ids)]
    if limit is not None:
        dirs = dirs[:limit]
    result = HarborImportResult(source=str(root))
    existing = {t.instance_id: t for t in shards.read_rows(tasks_dir, Kind.TASKS)}
    fresh: list[TaskRow] = []
    for path in dirs:
        try:
            row = to_row(read_task(path), log)
        except HarborTaskError as exc:
            result.errors.append(str(exc))
            continue
        except LegorlError as exc:  # a sandbox that would not start, say: still this task's problem
            result.errors.append(str(HarborTaskError(path.name, str(exc).splitlines()[0] if str(exc) else "failed")))
            continue
        if existing.get(row.instance_id) == row:
            result.unchanged.append(row.instance_id)
        else:
            fresh.append(row)
            result.written.append(row.instance_id)
    written = shards.write(tasks_dir, Kind.TASKS, fresh)
    result.path = str(written) if written else None
    return result
