"""What the chaos tests share: real `legorl` commands in their own process group, SIGKILLed at
seeded random points, and the invariants every stage keeps afterwards (read back through
`legorl inspect --json`, the shards and podman's labels).

Figures (faults injected, rows lost, duplicates, containers leaked, resumes, wall time) go to
``tests/artifacts/reliability/chaos.json``, one entry per stage, merged with what earlier test
sessions wrote there.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

ROOT = Path(__file__).resolve().parents[2]
LEGORL = str(Path(sys.executable).parent / "legorl")
SHIPPED_TASKS = ROOT / "examples" / "tasks" / "tasks.parquet"
FIGURES = ROOT / "tests" / "artifacts" / "reliability" / "chaos.json"


# --------------------------------------------------------------------------- commands


def command_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The commands' environment: one intra-op thread (two fighting on two shared cores make the
    tiny embedded model ~10x slower), this folder importable for the plug-in harnesses."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parent), **(extra or {})}


def legorl(*args: str, timeout: float = 600, check: bool = True,
           env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run one `legorl` command to its end."""
    done = subprocess.run([LEGORL, *args], capture_output=True, text=True, timeout=timeout, env=command_env(env))
    if check and done.returncode != 0:
        raise AssertionError(f"legorl {' '.join(args)} exited {done.returncode}:\n{done.stderr[-3000:]}")
    return done


def start(*args: str, stdout: Any = subprocess.DEVNULL, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """Start `legorl ...` as the leader of its own process group (so a kill takes all of it); its
    stderr goes to a file (a pipe nobody reads would fill and stall it): :func:`stderr_of`."""
    err = tempfile.TemporaryFile()  # noqa: SIM115 (lives as long as the command; read by stderr_of)
    proc = subprocess.Popen([LEGORL, *args], stdout=stdout, stderr=err, text=True, start_new_session=True,
                            env=command_env(env))
    _stderr[proc.pid] = err
    return proc


_stderr: dict[int, IO[bytes]] = {}


def stderr_of(proc: subprocess.Popen[str]) -> str:
    """What a command started by :func:`start` has written to stderr so far."""
    err = _stderr.get(proc.pid)
    if err is None:
        return ""
    err.seek(0)
    return err.read().decode(errors="replace")


def kill_group(proc: subprocess.Popen[str]) -> None:
    """SIGKILL the command's whole process group, as an OOM killer or a lost node would."""
    with suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)


def kill_at(proc: subprocess.Popen[str], ready: Callable[[], bool], delay_s: float, limit_s: float = 300) -> bool:
    """Wait until ``ready()`` (or the command's end), then ``delay_s`` more, then SIGKILL the group.

    True when the kill landed (the command was still running), False when it had finished first.
    """
    deadline = time.monotonic() + limit_s
    while not ready() and proc.poll() is None:
        assert time.monotonic() < deadline, "the command never reached its kill point"
        time.sleep(0.01)
    end = time.monotonic() + delay_s
    while time.monotonic() < end and proc.poll() is None:
        time.sleep(0.02)
    if proc.poll() is not None:
        assert proc.returncode == 0, f"exited {proc.returncode} before its kill: {stderr_of(proc)[-3000:]}"
        return False
    kill_group(proc)
    return True


def parts(folder: Path) -> int:
    """Committed part files in a dataset folder."""
    return len(list(folder.glob("part-*.parquet"))) if folder.is_dir() else 0


def has_parts(folder: Path, n: int) -> Callable[[], bool]:
    """A kill point: ``folder`` holds at least ``n`` committed part files."""
    return lambda: parts(folder) >= n


# --------------------------------------------------------------------------- invariants


def inspect(run: Path) -> dict[str, Any]:
    report: dict[str, Any] = json.loads(legorl("inspect", "--json", str(run)).stdout)
    return report


def datasets(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {d["name"]: d for d in report["datasets"]}


def assert_clean(report: dict[str, Any], known_duplicates: tuple[str, ...] = (),
                 known_temp_files: tuple[str, ...] = ()) -> None:
    """Every dataset readable, no key twice, no temp file left next to the committed parts.

    ``known_duplicates`` / ``known_temp_files``: datasets where those are a known defect with a
    (strict xfail) test of its own.
    """
    assert report["errors"] == [], report["errors"]
    for d in report["datasets"]:
        if d["name"] not in known_duplicates:
            assert d["duplicate_keys"] == 0, (d["name"], d["duplicate_keys"])
        if d["name"] not in known_temp_files:
            assert d["temp_files"] == 0, (d["name"], d["temp_files"])


def containers(*labels: str) -> list[str]:
    """Containers (running or not) carrying ``legorl.run=<label>`` for any of ``labels``."""
    from legorl.sandbox.host import run_podman

    names: list[str] = []
    for label in labels:
        out = run_podman(["ps", "-a", "--filter", f"label=legorl.run={label}", "--format", "{{.Names}}"]).stdout
        names += out.decode().split()
    return names


def import_tasks(run: Path, limit: int) -> list[str]:
    """The first ``limit`` shipped tasks into ``run/tasks``; their instance ids."""
    legorl("tasks", "import", str(SHIPPED_TASKS), "--run", str(run), "--limit", str(limit))
    from legorl.core import shards
    from legorl.core.schemas import Kind

    return sorted(t.instance_id for t in shards.read_rows(run / "tasks", Kind.TASKS))


def assert_own_task(run: Path) -> None:
    """Each trial's captured conversation carries its own task's problem statement, no other's."""
    from legorl.core import shards
    from legorl.core.schemas import Kind

    statements = {t.instance_id: t.problem_statement or "" for t in shards.read_rows(run / "tasks", Kind.TASKS)}
    assert len(set(statements.values())) == len(statements), "tasks must differ for this check to mean anything"
    for row in shards.read_rows(run / "rollouts", Kind.ROLLOUTS):
        if row.infra_failure:
            assert not row.segments and row.messages is None, row.trial_id
            continue
        text = json.dumps(json.loads(row.messages or "[]"), ensure_ascii=False)
        mine = json.dumps(statements[row.task_id], ensure_ascii=False)[1:-1]
        assert mine in text, f"{row.trial_id}: its messages lack its own task"
        others = [t for t, s in statements.items() if t != row.task_id and json.dumps(s)[1:-1] in text]
        assert not others, f"{row.trial_id}: its messages hold other tasks' statements {others}"


# --------------------------------------------------------------------------- figures


@dataclass
class StageFigures:
    """What one chaos test did to one stage and what it found afterwards."""

    stage: str
    seeds: list[int] = field(default_factory=list)
    faults_injected: int = 0  # kills (or other faults) that landed while the stage ran
    resumes: int = 0  # reruns after a fault
    rows_expected: int = 0
    rows_lost: int = 0
    duplicates: int = 0
    containers_leaked: int = 0
    wall_s: float = 0.0
    notes: list[str] = field(default_factory=list)


class Figures:
    """Collects :class:`StageFigures` for the session and merges them into ``FIGURES`` at its end."""

    def __init__(self, profile: str):
        self.profile = profile
        self.stages: dict[str, StageFigures] = {}

    @contextmanager
    def stage(self, name: str, seed: int | None = None) -> Iterator[StageFigures]:
        fig = self.stages.setdefault(name, StageFigures(name))
        if seed is not None:
            fig.seeds.append(seed)
        started = time.monotonic()
        try:
            yield fig
        except BaseException as exc:
            fig.notes.append(f"the test failed here: {type(exc).__name__}: {str(exc)[:200]}")
            raise
        finally:
            fig.wall_s = round(fig.wall_s + time.monotonic() - started, 1)

    def save(self, path: Path = FIGURES) -> None:
        if not self.stages:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            data = {}
        profiles = data.setdefault("profiles", {})
        entry = profiles.setdefault(self.profile, {})
        entry.setdefault("stages", {}).update({k: asdict(v) for k, v in self.stages.items()})
        stages = entry["stages"].values()
        entry["totals"] = {key: sum(s[key] for s in stages)
                           for key in ("faults_injected", "resumes", "rows_expected", "rows_lost", "duplicates",
                                       "containers_leaked")}
        entry["recorded_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
        os.replace(tmp, path)


def rng(stage: str, seed: int) -> random.Random:
    """The seeded source of one test's kill points."""
    return random.Random(f"{stage}:{seed}")
