"""Scale-out, measured: trials per minute of the rollout stage against executor (local threads vs
Ray tasks on a Ray started here) and concurrency, and the per-job overhead each executor adds.

    .venv/bin/python benchmarks/scale.py [--trials 6] [--concurrency 1,2] [--jobs 200] [--quick]

Two measurements:

- *dispatch*: a job that does nothing, ``--jobs`` times: the executor's own cost per job (thread
  pool vs a Ray task and its result coming back), nothing else;
- *rollout*: ``--trials`` real trials (podman sandbox, the ``simple`` harness, the real proxy in
  this process over HTTP, a scripted policy: one bash call, then an answer) per executor and
  concurrency, in a fresh run directory each; trials/minute, mean trial time, and the wall time
  per trial beyond what the trials themselves took at that concurrency (the executor's and the
  stage's overhead).

Prints a table and the ratios Ray / local (< 1: Ray is slower). Ray's own start-up is timed apart
and not counted. Needs podman and the base image (`legorl setup`), and Ray (the ``ray`` extra).
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from legorl.executors import Executor, ExecutorName, LocalExecutor, RayExecutor, Work

ROOT = Path(__file__).resolve().parents[1]
TASKS = ROOT / "examples" / "tasks" / "tasks.parquet"
MODEL_DIR = "test-models"


class Nothing(Work[int, int]):
    """A job that returns at once: what is left is the executor's cost."""

    def runner(self) -> Callable[[int, int], int]:
        return lambda job, lost: job

    def lost(self, job: int, error: str, attempts: int) -> int | None:
        raise RuntimeError(f"job {job} lost: {error}")


def dispatch(executor: Executor, jobs: int, concurrency: int) -> float:
    """Seconds per job of ``executor`` on jobs that do nothing (after one warm-up round)."""
    list(executor.map(Nothing(), range(concurrency), concurrency))
    start = time.perf_counter()
    out = list(executor.map(Nothing(), range(jobs), concurrency))
    assert sorted(out) == list(range(jobs))
    return (time.perf_counter() - start) / jobs


def _policy(call: object) -> str:
    """The simple harness's conversation: one bash call, then a final answer."""
    text = str(getattr(call, "prompt_text", ""))
    if text.count("<|im_start|>assistant") > 1:
        return "DONE"
    return '<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call>'


def rollout(proxy_url: str, executor: ExecutorName, concurrency: int, trials: int, workdir: Path) -> dict[str, Any]:
    from legorl import shards
    from legorl.proxy.clients import RemoteProxy
    from legorl.schemas import Kind
    from legorl.stages.rollout import RolloutConfig, rollout_stage
    from legorl.tasks.importer import import_tasks

    run = Path(tempfile.mkdtemp(prefix=f"scale-{executor}-c{concurrency}-", dir=workdir))
    import_tasks(str(TASKS), run / "tasks", limit=1)  # every trial on one task: the harness, not the repo, varies
    cfg = RolloutConfig(run=run, harnesses=["simple"], samples=trials, concurrency=concurrency, max_turns=3,
                        timeout_s=180, retries=0, executor=executor)
    with RemoteProxy(proxy_url) as proxy:
        summary = rollout_stage(cfg, proxy)
    rows = shards.read_rows(run / "rollouts", Kind.ROLLOUTS)
    assert len(rows) == trials and not any(r.infra_failure for r in rows), [r.error for r in rows]
    mean_trial = statistics.fmean(r.timings.total_s or 0.0 for r in rows)
    ideal = mean_trial * trials / concurrency  # the wall time if the trials were all there was
    return {"executor": executor, "concurrency": concurrency, "trials": trials, "wall_s": summary.wall_s,
            "trials_per_min": 60 * trials / summary.wall_s, "mean_trial_s": mean_trial,
            "overhead_per_trial_s": (summary.wall_s - ideal) / trials}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=6)
    parser.add_argument("--concurrency", default="1,2")
    parser.add_argument("--jobs", type=int, default=200)
    parser.add_argument("--quick", action="store_true", help="4 trials, concurrency 2, 50 dispatch jobs")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.trials, args.concurrency, args.jobs = 4, "2", 50
    levels = [int(c) for c in args.concurrency.split(",")]

    import ray

    from legorl.engines.scripted import ScriptedEngine
    from legorl.models import MODEL_RECIPE_VERSION, init_model
    from legorl.paths import cache_dir
    from legorl.proxy.server import ProxyServer
    from legorl.sandbox.host import base_image, require_image

    require_image(base_image())
    model = cache_dir() / MODEL_DIR / f"dense-v{MODEL_RECIPE_VERSION}"
    if not (model / "config.json").exists():
        init_model(model, moe=False, size="tiny", seed=0)
    t0 = time.perf_counter()
    ray.init(num_cpus=max(levels), include_dashboard=False, log_to_driver=False, logging_level=logging.WARNING)
    ray_start = time.perf_counter() - t0
    results: dict[str, Any] = {"ray_start_s": ray_start, "dispatch_s": {}, "rollout": []}
    try:
        for c in levels:
            results["dispatch_s"][c] = {"local": dispatch(LocalExecutor(), args.jobs, c),
                                        "ray": dispatch(RayExecutor(), args.jobs, c)}
        engine = ScriptedEngine(str(model), _policy, max_context=32768)
        with ProxyServer(engine, str(model)) as server, tempfile.TemporaryDirectory(prefix="legorl-scale-") as tmp:
            for c in levels:
                for executor in ("local", "ray"):
                    results["rollout"].append(rollout(server.base_url, executor, c, args.trials, Path(tmp)))
    finally:
        ray.shutdown()
    if args.json:
        print(json.dumps(results, indent=2))
        return
    print(f"Ray start (not counted): {ray_start:.1f} s")
    print(f"{'dispatch, per job':<28}{'local ms':>10}{'ray ms':>10}{'ray/local':>11}")
    for c, d in results["dispatch_s"].items():
        print(f"{'  concurrency ' + str(c):<28}{d['local'] * 1e3:>10.2f}{d['ray'] * 1e3:>10.2f}"
              f"{d['ray'] / d['local']:>11.1f}")
    print(f"{'rollout':<14}{'conc':>5}{'trials/min':>12}{'trial s':>9}{'overhead s/trial':>18}")
    for r in results["rollout"]:
        print(f"{'  ' + r['executor']:<14}{r['concurrency']:>5}{r['trials_per_min']:>12.1f}{r['mean_trial_s']:>9.2f}"
              f"{r['overhead_per_trial_s']:>18.2f}")
    for c in levels:
        local, remote = (next(r for r in results["rollout"] if r["executor"] == e and r["concurrency"] == c)
                         for e in ("local", "ray"))
        print(f"ratio ray/local trials per minute at concurrency {c}: "
              f"{remote['trials_per_min'] / local['trials_per_min']:.2f}")


if __name__ == "__main__":
    main()
