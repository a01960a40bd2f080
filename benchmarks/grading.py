"""Grading wall time and throughput: legorl vs the official SWE-bench harness, same tasks, same
concurrency, same podman.

    .venv/bin/python benchmarks/grading.py [--tasks N] [--concurrency C] [--repeats R] [--against no-canaries]

``--against no-canaries`` compares legorl with itself, its canary run off (``GradeOptions.canaries``):
what checking every pass costs. The gold patch passes every task, so this is the cost for a batch of
passes; a failing grade has no canary run.

Both grade the gold patch of the same N shipped tasks (examples/tasks), C at a time, R times each,
alternating which goes first (the host is shared: the load average is printed next to each run).

- SWE-bench (``swebench.harness.run_evaluation.run_instances``, in-process) talks Docker; it runs
  here through ``podman system service``'s Docker-compatible socket. Its per-instance images are
  built first, untimed (FROM legorl's base image, the task's testbed COPY'd to /testbed), as a
  SWE-bench user would pull them. Two adjustments from ``notes/tasks.md`` give it its best case:
  a ``docker`` shim makes its ``docker stop --time=15`` immediate (its containers run
  ``tail -f /dev/null`` as PID 1, which ignores SIGTERM), and its containers are created with
  ``network_mode="none"`` (the socket would give them a bridge network). The third adjustment
  (mapping podman's "image not known" for image *builds*) is not needed: nothing is built
  through the socket.
- legorl grades through ``legorl.stages.grade.grade_stage``: a fresh container per grade (one
  ``podman run --rm -i``), the testbed built from the task's bundle (the one-commit repository and
  its tar are cached on the host after the first use, as SWE-bench's images are built once).

Prints per-run wall seconds with the load average, then min / median wall, throughput and the
ratio (legorl throughput / SWE-bench throughput): of the medians, of the best runs, and per repeat
(each repeat runs the two back to back, the figure least sensitive to a shared host's load).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow.parquet as pq

from legorl.core.schemas import TaskRow

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "examples" / "tasks" / "tasks.parquet"


def load_tasks(n: int) -> list[TaskRow]:
    tasks = []
    for row in pq.read_table(SHIPPED).to_pylist():
        task = TaskRow.from_dict(row)
        task.repo_source = str((SHIPPED.parent / (task.repo_source or "")).resolve())
        tasks.append(task)
    tasks.sort(key=lambda t: t.instance_id)
    by_repo: dict[str, list[TaskRow]] = {}
    for t in tasks:
        by_repo.setdefault(t.repo or "", []).append(t)
    picked: list[TaskRow] = []  # round-robin over the libraries
    while len(picked) < n and any(by_repo.values()):
        for repo in sorted(by_repo):
            if by_repo[repo] and len(picked) < n:
                picked.append(by_repo[repo].pop(0))
    return picked


def eval_script(task: TaskRow) -> str:
    """A SWE-bench eval script: reset the test files, apply test_patch, run between the markers."""
    import shlex

    from legorl.grading.container import DEFAULT_PYTEST, hidden_test_files
    from legorl.grading.patches import touched_paths

    files = " ".join(touched_paths(task.test_patch))
    tests = " ".join(shlex.quote(f) for f in hidden_test_files(task.test_patch))
    command = (task.test_command or DEFAULT_PYTEST).replace("{test_files}", tests)
    return "\n".join([
        "#!/bin/bash", "set -uxo pipefail", "cd /testbed",
        f"git checkout HEAD -- {files}",
        "git apply -v - <<'EOF_114329324912'", (task.test_patch or "").rstrip("\n"), "EOF_114329324912",
        ": '>>>>> Start Test Output'", command, ": '>>>>> End Test Output'",
        f"git checkout HEAD -- {files}",
    ]) + "\n"


def build_instance_images(tasks: list[TaskRow], base: str) -> dict[str, str]:
    from legorl.sandbox.host import run_podman
    from legorl.sandbox.testbed import prepare_repo

    images = {}
    for task in tasks:
        repo, _ = prepare_repo(task.repo_source or "", task.base_commit or "")
        name = f"localhost/legorl-bench-sweb:{task.instance_id.lower().replace('__', '-')}"
        with tempfile.TemporaryDirectory() as ctx:
            shutil.copytree(repo, Path(ctx) / "testbed", symlinks=True)
            (Path(ctx) / "Containerfile").write_text(f"FROM {base}\nCOPY testbed /testbed\nWORKDIR /testbed\n")
            run_podman(["build", "-q", "-t", name, ctx], timeout=600)
        images[task.instance_id] = name
    return images


def start_socket(workdir: Path) -> tuple[subprocess.Popen[bytes], str]:
    from legorl.sandbox.host import podman_env, podman_path

    sock = workdir / "podman.sock"
    proc = subprocess.Popen([podman_path(), "system", "service", "--time=0", f"unix://{sock}"], env=podman_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(100):
        if sock.exists():
            break
        time.sleep(0.1)
    return proc, f"unix://{sock}"


def docker_shim(workdir: Path) -> Path:
    """A `docker` first on PATH that stops containers at once (SWE-bench's stop waits 15 s)."""
    real = shutil.which("docker")
    if real is None:
        raise SystemExit("the docker CLI is needed (SWE-bench shells out to it to stop containers)")
    shim = workdir / "bin"
    shim.mkdir()
    (shim / "docker").write_text(
        "#!/bin/bash\nargs=()\nfor a in \"$@\"; do case \"$a\" in --time=*) args+=(--time=0);; *) args+=(\"$a\");; esac; done\n"
        f"exec {real} \"${{args[@]}}\"\n")
    (shim / "docker").chmod(0o755)
    return shim


def run_swebench(tasks: list[TaskRow], images: dict[str, str], concurrency: int, workdir: Path,
                 run_id: str = "bench") -> tuple[float, dict[str, bool]]:
    import docker.models.containers as containers
    from swebench.harness import run_evaluation

    original = containers.ContainerCollection.create

    def create(self, *args, **kwargs):
        kwargs["network_mode"] = "none"
        return original(self, *args, **kwargs)

    containers.ContainerCollection.create = create
    instances = [{
        "instance_id": t.instance_id, "repo": t.repo, "version": t.version or "1", "base_commit": t.base_commit,
        "patch": t.patch, "test_patch": t.test_patch, "FAIL_TO_PASS": t.FAIL_TO_PASS, "PASS_TO_PASS": t.PASS_TO_PASS,
        "image": images[t.instance_id], "eval_script": eval_script(t), "log_parser": "parse_log_pytest",
        "eval_type": "pass_and_fail",
    } for t in tasks]
    predictions = {t.instance_id: {"instance_id": t.instance_id, "model_patch": t.patch, "model_name_or_path": "gold"}
                   for t in tasks}
    cwd = os.getcwd()
    os.chdir(workdir)
    try:
        start = time.monotonic()
        run_evaluation.run_instances(predictions, instances, concurrency, run_id, timeout=600)
        wall = time.monotonic() - start
    finally:
        os.chdir(cwd)
        containers.ContainerCollection.create = original
    resolved = {}
    for t in tasks:
        report = workdir / "logs" / "run_evaluation" / run_id / "gold" / t.instance_id / "report.json"
        resolved[t.instance_id] = bool(report.exists() and json.loads(report.read_text())[t.instance_id]["resolved"])
    return wall, resolved


def run_legorl(tasks: list[TaskRow], concurrency: int, workdir: Path, run_id: str = "run",
               canaries: bool = True) -> tuple[float, dict[str, bool]]:
    from legorl.core import shards
    from legorl.core.schemas import Kind
    from legorl.grading.grader import GradeOptions
    from legorl.stages.grade import gold_jobs, grade_stage

    tasks_dir = workdir / run_id / "tasks"
    shards.write(tasks_dir, Kind.TASKS, tasks)
    # warm the host-side testbed cache, as SWE-bench's images are built before its clock starts
    from legorl.sandbox.testbed import prepare_repo

    for t in tasks:
        prepare_repo(t.repo_source or "", t.base_commit or "")
    if canaries:  # found once per task and cached on disk, as the gold reference is
        from legorl.grading.grader import Grader

        grader = Grader(GradeOptions(test_timeout=600))
        for t in tasks:
            grader.canaries.of(t, grader.canaries.seed(t))
    start = time.monotonic()
    summary = grade_stage(tasks_dir, workdir / run_id / "grades", gold_jobs({t.instance_id: t for t in tasks}),
                          GradeOptions(concurrency=concurrency, test_timeout=600, canaries=canaries))
    wall = time.monotonic() - start
    return wall, {r.task_id: bool(r.resolved) for r in summary.rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", type=int, default=6)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--against", choices=("swebench", "no-canaries"), default="swebench")
    args = parser.parse_args()

    from legorl.sandbox.host import base_image, podman_env, require_image

    base = base_image()
    require_image(base)
    tasks = load_tasks(args.tasks)
    workdir = Path(tempfile.mkdtemp(prefix="legorl-bench-grading-"))
    server = None
    other = args.against
    walls: dict[str, list[float]] = {other: [], "legorl": []}
    verdicts: dict[str, dict[str, bool]] = {}
    try:
        if other == "swebench":
            print(f"{len(tasks)} tasks, concurrency {args.concurrency}; building SWE-bench instance images (untimed)...",
                  flush=True)
            images = build_instance_images(tasks, base)
            server, socket = start_socket(workdir)
            os.environ.update({"DOCKER_HOST": socket, "CONTAINERS_CONF": podman_env()["CONTAINERS_CONF"]})
            os.environ["PATH"] = f"{docker_shim(workdir)}:{os.environ['PATH']}"
        for rep in range(args.repeats):
            order = [other, "legorl"] if rep % 2 == 0 else ["legorl", other]
            for name in order:
                load = os.getloadavg()[0]
                if name == "swebench":
                    wall, ok = run_swebench(tasks, images, args.concurrency, workdir, run_id=f"bench{rep}")
                else:
                    wall, ok = run_legorl(tasks, args.concurrency, workdir, run_id=f"{name}{rep}",
                                          canaries=name == "legorl")
                walls[name].append(wall)
                if verdicts.setdefault(name, ok) != ok:
                    print(f"{name}: verdicts changed between repeats: {ok}", file=sys.stderr)
                print(f"  repeat {rep + 1}: {name:11} {wall:6.1f} s  ({sum(ok.values())}/{len(ok)} resolved, "
                      f"load {load:.1f})", flush=True)
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=30)
        shutil.rmtree(workdir, ignore_errors=True)
    n = len(tasks)
    print(f"{'':12} {'min s':>8} {'median s':>9} {'s/task':>8} {'tasks/min':>10} {'resolved':>9}")
    for name in (other, "legorl"):
        best, med = min(walls[name]), statistics.median(walls[name])
        print(f"{name:12} {best:8.1f} {med:9.1f} {med / n:8.2f} {60 * n / med:10.1f} "
              f"{sum(verdicts[name].values()):>5}/{n}")
    ratio_med = statistics.median(walls[other]) / statistics.median(walls["legorl"])
    ratio_min = min(walls[other]) / min(walls["legorl"])
    # each repeat runs the two back to back, so a repeat's own ratio is the least load-sensitive
    paired = sorted(s / legorl for s, legorl in zip(walls[other], walls["legorl"], strict=True))
    print(f"ratio (legorl throughput / {other} throughput): {ratio_med:.2f}x median, {ratio_min:.2f}x best; "
          f"per repeat {', '.join(f'{r:.2f}' for r in paired)} (median {statistics.median(paired):.2f}x)")
    if verdicts[other] != verdicts["legorl"]:
        print(f"verdicts differ: {other} {verdicts[other]} legorl {verdicts['legorl']}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
