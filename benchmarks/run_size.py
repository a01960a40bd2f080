"""Run size, measured: what each reader of a run costs as the run grows from 10^3 to 10^5 trials.

A synthetic run per size (tasks, rollouts with token segments, calls and a conversation shaped like
the CPU demo's, grades with tests and a log, train metrics per step; 32 trials per step), written
the way the stages write it (``ShardWriter``, batched), then compacted (``legorl shards compact``).
Each operation runs in a forked child, so its peak memory (max RSS) is its own:

- *write*: every row through ``ShardWriter`` (rollouts, grades, metrics);
- *compact*: :func:`legorl.core.shards.compaction.compact_run` (it also writes the merged parts' summaries,
  :mod:`legorl.monitor.summaries`);
- *inspect*: ``legorl inspect`` of the run directory (:func:`legorl.monitor.inspect.inspect_path`
  and the health summary the command prints with it);
- *overview (summaries)*: the dashboard's overview of the run from a fresh reader, the parts'
  summaries present (as compaction or an earlier reader left them);
- *overview (cold)*: the same with every summary removed first: the reader summarises every trial
  from its rows, and stores the summaries;
- *detail*: one trial's detail in a dashboard whose overview is already loaded (a click);
- *export*: the static dashboard (every trial's detail);
- *train load*: ``load_step`` of the last step (what ``legorl train`` reads).

``--layout per-row`` writes one part file per row and skips compaction: the layout before
issue #30, for the ratio. ``--demo-finish`` times instead what ``make demo`` does after its last
held-out eval (``examples/cpu-demo/demo_loop.py``: ``summary.json``, ``report.md`` with its plot, the
static dashboard) on each run. Prints a table and, with ``--markdown``, the same table as markdown.

    .venv/bin/python benchmarks/run_size.py [--sizes 1000,10000,100000] [--layout batched|per-row] [--repeat N] [--markdown]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pickle
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from legorl.core import shards
from legorl.core.paths import RunDir
from legorl.core.schemas import (
    Call,
    GradeRow,
    GradeStatus,
    Kind,
    MetricRow,
    Outcome,
    Segment,
    SegmentReason,
    TaskRow,
    TestResult,
    Timings,
    TrialRow,
)

TRIALS_PER_STEP = 32
HARNESSES = ("mini-swe-agent", "opencode")
OPS = ("write", "compact", "inspect", "overview (summaries)", "overview (cold)", "detail", "export", "train load",
       "demo finish")
CHANGES_THE_RUN = ("write", "compact", "overview (cold)", "demo finish")  # timed once, even with --repeat


def _conversation(task: str, turns: int) -> str:
    msgs: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a helpful coding agent working in /testbed."},
        {"role": "user", "content": f"Fix the issue in {task}: `separability_matrix` is wrong for nested models. " * 3},
    ]
    for t in range(turns):
        args = {"command": f"cd /testbed && grep -rn separability src | head -{t + 5}"}
        msgs.append({"role": "assistant", "content": "<think>Next I look at the code.</think>",
                     "tool_calls": [{"id": f"call_{t}", "type": "function",
                                     "function": {"name": "bash", "arguments": json.dumps(args)}}]})
        msgs.append({"role": "tool", "tool_call_id": f"call_{t}", "name": "bash",
                     "content": "src/core.py:12: def separability_matrix(transform):\n" * 4})
    return json.dumps(msgs)


def make_trial(task: str, harness: str, step: int, sample: int, rng: np.random.Generator) -> TrialRow:
    turns = int(rng.integers(3, 8))
    prompt = rng.integers(20, 120, turns)
    completion = rng.integers(10, 60, turns)
    mask = np.concatenate([np.r_[np.zeros(p, np.int8), np.ones(c, np.int8)] for p, c in zip(prompt, completion, strict=True)])
    ids = rng.integers(100, 150_000, mask.size).astype(np.int32)
    logprobs = np.where(mask == 1, -rng.exponential(0.5, mask.size), 0.0).astype(np.float32)
    calls, pos = [], 0
    for t in range(turns):
        pos += int(prompt[t] + completion[t])
        calls.append(Call(index=t, api="openai", stream=False, segment=0, started_at=1000.0 + t, latency_s=0.3,
                          prompt_tokens=pos - int(completion[t]), new_prompt_tokens=int(prompt[t]),
                          completion_tokens=int(completion[t]), finish_reason="tool_calls", policy_version=step))
    return TrialRow.new(
        task, harness, step, sample, outcome=Outcome.SUBMITTED, model="tiny-qwen3",
        patch="diff --git a/src/core.py b/src/core.py\n--- a/src/core.py\n+++ b/src/core.py\n@@ -1 +1 @@\n-    = 1\n+    = right\n",
        segments=[Segment(ids, mask, logprobs, reason=SegmentReason.MAIN)], calls=calls,
        messages=_conversation(task, turns),
        timings=Timings(sandbox_s=0.5, agent_s=3.0, model_s=2.0, patch_s=0.1, total_s=3.7),
        started_at=1000.0, finished_at=1003.7,
    )


def make_grade(trial: TrialRow, resolved: bool) -> GradeRow:
    tests = [TestResult(f"tests/test_core.py::test_{i}", "FAIL_TO_PASS" if i == 0 else "PASS_TO_PASS",
                        "PASSED" if resolved or i else "FAILED", bool(resolved or i)) for i in range(3)]
    return GradeRow(trial.trial_id, trial.task_id, GradeStatus.GRADED, harness=trial.harness, step=trial.step,
                    reward=float(resolved), resolved=resolved, resolution="FULL" if resolved else "NO",
                    tests=tests, apply_method="git apply", duration_s=2.5,
                    log="============================= test session starts ==============================\n"
                        + "tests/test_core.py ...\n" * 20)


def write_run(run: Path, trials: int, rows_per_part: int, seed: int = 0) -> None:
    """A synthetic run of ``trials`` trials (32 per step: 8 tasks x 2 harnesses x 2 samples)."""
    rd = RunDir.at(run)
    rng = np.random.default_rng(seed)
    tasks = [f"org__repo{i % 50}-{1000 + i}" for i in range(max(8, trials // TRIALS_PER_STEP // 4))]
    shards.write(rd.tasks, Kind.TASKS, [TaskRow(instance_id=t, repo=f"org/repo{i % 50}") for i, t in enumerate(tasks)])
    steps = trials // TRIALS_PER_STEP
    writers = [shards.ShardWriter(rd.rollouts, Kind.ROLLOUTS, rows_per_file=rows_per_part, max_seconds=math.inf),
               shards.ShardWriter(rd.grades, Kind.GRADES, rows_per_file=rows_per_part, max_seconds=math.inf)]
    with writers[0] as rollouts, writers[1] as grades:
        for step in range(steps):
            chosen = [tasks[(step * 8 + i) % len(tasks)] for i in range(8)]
            for task in chosen:
                for harness in HARNESSES:
                    for sample in range(TRIALS_PER_STEP // 16):
                        trial = make_trial(task, harness, step, sample, rng)
                        rollouts.add(trial)
                        grades.add(make_grade(trial, bool(rng.random() < 0.3)))
            rollouts.flush()  # a stage's end: every step's rows are on disk
            grades.flush()
    shards.write(rd.metrics, Kind.METRICS, [MetricRow(step=s, key=k, value=float(rng.random()), stage="train")
                                            for s in range(steps) for k in ("loss", "reward_mean", "grad_norm")])


def in_child(fn: Callable[[], Any]) -> tuple[float, float, Any, float]:
    """Run ``fn`` in a forked child: (seconds, peak RSS in MB, its result, its CPU seconds: on a
    shared machine the steadier figure)."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child
        os.close(read_end)
        code = 0
        try:
            start = time.perf_counter()
            result = fn()
            payload = pickle.dumps((time.perf_counter() - start, result))
        except BaseException as exc:
            payload, code = pickle.dumps((float("nan"), {"error": f"{type(exc).__name__}: {exc}"})), 1
        with os.fdopen(write_end, "wb") as out:
            out.write(payload)
        os._exit(code)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as handle:
        data = handle.read()
    _, _, usage = os.wait4(pid, 0)
    seconds, result = pickle.loads(data)
    return seconds, usage.ru_maxrss / 1024, result, usage.ru_utime + usage.ru_stime


def operations(run: Path, trials: int, rows_per_part: int, compact: bool, out: Path) -> dict[str, Callable[[], Any]]:
    from legorl.monitor.dashboard.export import export
    from legorl.monitor.dashboard.server import RunSet
    from legorl.monitor.inspect import inspect_path
    from legorl.training.data import load_step

    last_step = trials // TRIALS_PER_STEP - 1

    def compact_it() -> Any:
        if not compact:
            return None
        from legorl.core.shards.compaction import compact_run
        from legorl.monitor.summaries import merge

        return sum(r.replaced for r in compact_run(run, on_merge=merge))

    def inspect_run() -> Any:  # what `legorl inspect` does (cli/inspect_cmd.py)
        from legorl.monitor.health import health_summary
        from legorl.monitor.inspect import run_mixes

        summary = inspect_path(run)
        return len(summary["datasets"]), health_summary(run, mixes=run_mixes(summary))["trials"]

    def overview_cold() -> Any:
        shutil.rmtree(run / "rollouts" / ".summaries", ignore_errors=True)
        return len(RunSet([run]).overview_json(0))

    def detail() -> Any:
        runs = RunSet([run])
        runs.overview_json(0)
        trial_id = next(t for t in runs.readers[0].snapshot().trials if t.endswith(f"step{last_step // 2}/sample1"))
        start = time.perf_counter()
        runs.trial(0, trial_id)
        return round(time.perf_counter() - start, 4)  # the click alone

    return {
        "write": lambda: write_run(run, trials, rows_per_part),
        "compact": compact_it,
        "inspect": inspect_run,
        "overview (summaries)": lambda: len(RunSet([run]).overview_json(0)),
        "overview (cold)": overview_cold,
        "detail": detail,
        "export": lambda: export([run], out)["trials"],
        "train load": lambda: len(load_step(RunDir.at(run), last_step).trials),
    }


def demo_finish(run: Path, trials: int) -> dict[str, Callable[[], Any]]:
    """What ``make demo`` runs after its last held-out eval, on ``run`` (the demo's own functions)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "cpu-demo"))
    import demo_loop

    cfg = demo_loop.DemoConfig(run=run)
    records = [demo_loop.StepRecord(step=s, trials=TRIALS_PER_STEP, graded=TRIALS_PER_STEP, mean_reward=0.3,
                                    solve_rate=0.3, infra=0, rollout_s=60.0, grade_s=30.0, train_s=20.0, reload_s=1.0)
               for s in range(trials // TRIALS_PER_STEP)]
    held = demo_loop.HeldOut(step=0, tasks=48, resolved=10, pass_at_1=10 / 48, interval=[0.1, 0.3],
                             infra_failures=0, seconds=60.0)

    def finish() -> Any:
        demo_loop.write_summary(cfg, records, held, held, wall_s=1.0, warmup_s=1.0, loop_s=1.0)
        demo_loop.write_report(cfg, records)
        return demo_loop.export_dashboard(run) is not None

    return {"demo finish": finish}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1000", help="comma-separated trial counts (default: 1000)")
    parser.add_argument("--layout", choices=("batched", "per-row"), default="batched")
    parser.add_argument("--rows-per-part", type=int, default=256, help="ShardWriter batch (batched layout)")
    parser.add_argument("--skip", default="", help="comma-separated operations to leave out (e.g. export)")
    parser.add_argument("--export-max", type=int, default=20_000,
                        help="leave the export out of larger runs (default 20000: it is linear, about 15 ms a trial)")
    parser.add_argument("--demo-finish", action="store_true", help="time make demo's finishing steps instead")
    parser.add_argument("--repeat", type=int, default=1,
                        help="time each reader this many times, each in a fresh child, and report the median "
                             "(on a shared machine: a single time is noisy)")
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--keep", type=Path, default=None,
                        help="write the runs here and keep them (with --skip write: measure the runs already there)")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    per_row = args.layout == "per-row"
    root = args.keep or Path(tempfile.mkdtemp(prefix="legorl-runsize-"))
    table: dict[int, dict[str, tuple[float, float, Any, float]]] = {}
    try:
        for n in sizes:
            run = root / f"run-{n}"
            if "write" not in skip:
                shutil.rmtree(run, ignore_errors=True)
            ops = operations(run, n, 1 if per_row else args.rows_per_part, not per_row, root / f"export-{n}")
            if args.demo_finish:
                ops = {"write": ops["write"], "compact": ops["compact"], **demo_finish(run, n)}
            table[n] = {}
            for name, fn in ops.items():
                if name in skip or (per_row and name == "compact") or (name == "export" and n > args.export_max):
                    continue
                times = sorted((in_child(fn) for _ in range(1 if name in CHANGES_THE_RUN else max(1, args.repeat))),
                               key=lambda t: t[0])
                table[n][name] = times[len(times) // 2]
                seconds, rss, result, cpu = table[n][name]
                print(f"  {n:>7} trials  {name:<10} {seconds:9.3f} s  {rss:8.0f} MB  {cpu:8.3f} s CPU  ({result})",
                      file=sys.stderr)
            files = sum(len(shards.part_files(run / d)) for d in ("rollouts", "grades"))
            print(f"  {n:>7} trials: {files} part files in rollouts/ and grades/", file=sys.stderr)
            shutil.rmtree(root / f"export-{n}", ignore_errors=True)
    finally:
        if args.keep is None:
            shutil.rmtree(root, ignore_errors=True)
    print_table(table, args.layout, args.markdown)


def print_table(table: dict[int, dict[str, tuple[float, float, Any, float]]], layout: str, markdown: bool) -> None:
    names = [o for o in OPS if any(o in row for row in table.values())]
    print(f"run size benchmark ({layout} layout): seconds / peak MB per operation")
    header = ["trials", *names]
    rows = [[f"{n}", *(_cell(row.get(o)) for o in names)] for n, row in table.items()]
    if markdown:
        print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
        for r in rows:
            print("| " + " | ".join(r) + " |")
    else:
        widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
        print("  ".join(h.rjust(w) for h, w in zip(header, widths, strict=True)))
        for r in rows:
            print("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)))
    sizes = sorted(table)
    if len(sizes) > 1:  # growth per 10x: ~10 is linear, ~1 is flat
        lo, hi = sizes[0], sizes[-1]
        growth = {o: table[hi][o][0] / table[lo][o][0] for o in names
                  if o in table[hi] and o in table[lo] and table[lo][o][0] > 0}
        print(f"time ratio {hi} / {lo} trials ({hi / lo:.0f}x the rows): "
              + ", ".join(f"{o} {g:.1f}x" for o, g in growth.items()))


def _cell(value: tuple[float, float, Any, float] | None) -> str:
    if value is None:
        return "—"
    seconds, rss, result, _ = value
    if isinstance(result, dict) and "error" in result:
        return "failed"
    if isinstance(result, float):  # the detail: the click alone (its process loaded the overview first)
        return f"{result:.2f} s"
    return f"{seconds:.2f} s / {rss:.0f} MB"


if __name__ == "__main__":
    main()
