"""Realistic run directories for the monitor and dashboard tests, written with ``legorl.core.shards``.

Trajectories follow the tool shapes of the real harnesses: mini-swe-agent's ``bash`` tool,
OpenHands' ``terminal``/``file_editor``/``finish``, OpenCode's ``read``/``edit``/``bash``. Each
trial's segments hold prompt chunks (loss_mask 0) and one sampled chunk (loss_mask 1, logprobs)
per model call, and its calls point at those segments, the way the proxy records them.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from legorl.core import metric_keys as mk
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

HARNESSES = ("mini-swe-agent", "openhands", "opencode")
TASKS = ("astropy__astropy-12907", "django__django-11099", "psf__requests-2317", "sympy__sympy-20590")


def call(name: str, args: dict[str, Any], cid: str) -> dict[str, Any]:
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


def assistant(content: str = "", *calls: dict[str, Any]) -> dict[str, Any]:
    msg: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        msg["tool_calls"] = list(calls)
    return msg


def tool(cid: str, output: str, name: str = "bash") -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": cid, "name": name, "content": output}


def _conversation(harness: str, task: str, kind: str) -> list[dict[str, Any]]:
    """A conversation of ``kind``: verify (edit, then test), noverify (edit, submit), text (no tools)."""
    msgs: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a helpful coding agent working in /testbed."},
        {"role": "user", "content": f"Fix the issue in {task}: calling `separability_matrix` on nested models is wrong."},
    ]
    if kind == "text":
        msgs.append(assistant("<think>The user wants a fix.</think>I think the fix is to change the matrix code."))
        msgs.append({"role": "user", "content": "Please use the tools to make the change."})
        msgs.append(assistant("The change should be made in core.py, replacing `= 1` with `= right`."))
        return msgs
    path = "/testbed/src/core.py"
    steps: list[tuple[str, dict[str, Any], str]]
    if harness == "mini-swe-agent":
        steps = [
            ("bash", {"command": "grep -rn separability /testbed/src | head"}, "src/core.py:12: def separability_matrix"),
            ("bash", {"command": f"cat {path}"}, "def _cstack(left, right):\n    cright[-right.shape[0]:, -right.shape[1]:] = 1\n"),
            ("bash", {"command": f"sed -i 's/= 1$/= right/' {path}"}, ""),
        ]
        if kind == "verify":
            steps.append(("bash", {"command": "cd /testbed && python -m pytest tests/test_core.py -q"}, "3 passed in 0.41s"))
        steps.append(("bash", {"command": "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && git diff"}, ""))
    elif harness == "openhands":
        steps = [
            ("file_editor", {"command": "view", "path": path}, "     1\tdef _cstack(left, right):"),
            ("file_editor", {"command": "str_replace", "path": path, "old_str": "= 1", "new_str": "= right"}, "edited"),
        ]
        if kind == "verify":
            steps.append(("file_editor", {"command": "view", "path": path, "view_range": [1, 20]}, "     2\t= right"))
        steps.append(("finish", {"message": "Fixed _cstack."}, ""))
    else:
        steps = [
            ("read", {"filePath": path}, "def _cstack(left, right):"),
            ("edit", {"filePath": path, "oldString": "= 1", "newString": "= right"}, "Edit applied."),
        ]
        if kind == "verify":
            steps.append(("bash", {"command": "pytest -q tests/test_core.py", "description": "run tests"}, "3 passed"))
    for i, (name, args, output) in enumerate(steps):
        cid = f"call_{i}"
        msgs.append(assistant("<think>Next I look at the code.</think>" if i == 0 else "", call(name, args, cid)))
        msgs.append(tool(cid, output, name))
    if harness == "opencode":
        msgs.append(assistant("I replaced the constant with `right` in `_cstack`; the tests pass."))
    return msgs


def make_trial(
    harness: str, task: str, step: int, sample: int, rng: random.Random, kind: str,
    infra: bool = False, fork: bool = False, parse_error: bool = False, budget: bool = False,
) -> TrialRow:
    if infra:
        return TrialRow.new(task, harness, step, sample, outcome=Outcome.INFRA_ERROR, infra_failure=True,
                            error="sandbox failed to start: podman exited 125", model="tiny-qwen3")
    msgs = _conversation(harness, task, kind)
    turns = sum(1 for m in msgs if m["role"] == "assistant")
    segments: list[Segment] = []
    calls: list[Call] = []
    seg_tokens: list[int] = []
    seg_mask: list[int] = []
    seg_lp: list[float] = []
    fork_at = turns // 2 if fork and turns > 1 else None
    mean_lp = -0.2 - 0.6 * rng.random()
    for t in range(turns):
        if fork_at is not None and t == fork_at:
            segments.append(Segment(seg_tokens, seg_mask, seg_lp, reason=SegmentReason.MAIN))
            seg_tokens, seg_mask, seg_lp = [], [], []
        prompt = rng.randint(40, 120) if t == 0 or t == fork_at else rng.randint(5, 40)
        completion = rng.randint(8, 60)
        seg_tokens += [rng.randrange(100, 30000) for _ in range(prompt + completion)]
        seg_mask += [0] * prompt + [1] * completion
        seg_lp += [0.0] * prompt + [min(0.0, rng.gauss(mean_lp, 0.5)) for _ in range(completion)]
        calls.append(Call(index=t, api="anthropic" if harness == "claude-code" else "openai", stream=harness == "opencode",
                          segment=len(segments), started_at=1000.0 + t, latency_s=0.2 + rng.random(),
                          prompt_tokens=len(seg_tokens) - completion, new_prompt_tokens=prompt,
                          completion_tokens=completion, finish_reason="tool_calls" if kind != "text" else "stop",
                          parse_error="invalid JSON in tool arguments" if parse_error and t == 1 else None,
                          budget_stop="max_tokens" if budget and t == turns - 1 else None))
    segments.append(Segment(seg_tokens, seg_mask, seg_lp,
                            reason=SegmentReason.REWRITE if fork_at is not None else SegmentReason.MAIN,
                            parent=0 if fork_at is not None else None))
    patch = None
    if kind != "text":
        patch = ("diff --git a/src/core.py b/src/core.py\n--- a/src/core.py\n+++ b/src/core.py\n"
                 "@@ -1,2 +1,2 @@\n def _cstack(left, right):\n-    cright[-right.shape[0]:, -right.shape[1]:] = 1\n"
                 "+    cright[-right.shape[0]:, -right.shape[1]:] = right\n")
    outcome = Outcome.BUDGET if budget else Outcome.SUBMITTED if kind != "text" else Outcome.NO_SUBMISSION
    return TrialRow.new(task, harness, step, sample, outcome=outcome, model="tiny-qwen3", patch=patch,
                        segments=segments, calls=calls, messages=json.dumps(msgs),
                        timings=Timings(sandbox_s=0.5, agent_s=3.0, model_s=2.0, patch_s=0.1, total_s=3.7),
                        started_at=1000.0, finished_at=1003.7)


def make_grade(trial: TrialRow, resolved: bool, infra: bool = False) -> GradeRow:
    if infra:
        return GradeRow(trial.trial_id, trial.task_id, GradeStatus.INFRA_ERROR, infra_failure=True,
                        harness=trial.harness, step=trial.step, error="test container exited 137")
    if not trial.patch:
        return GradeRow(trial.trial_id, trial.task_id, GradeStatus.EMPTY_PATCH, harness=trial.harness,
                        step=trial.step, reward=0.0, resolved=False, resolution="NO")
    tests = [
        TestResult("tests/test_core.py::test_nested", "FAIL_TO_PASS", "PASSED" if resolved else "FAILED", resolved),
        TestResult("tests/test_core.py::test_simple", "PASS_TO_PASS", "PASSED", True),
        TestResult("tests/test_core.py::test_custom", "PASS_TO_PASS", "PASSED", True),
    ]
    return GradeRow(trial.trial_id, trial.task_id, GradeStatus.GRADED, harness=trial.harness, step=trial.step,
                    reward=1.0 if resolved else 0.0, resolved=resolved, resolution="FULL" if resolved else "NO",
                    tests=tests, apply_method="git apply", duration_s=2.5,
                    log="============================= test session starts ==============================\n"
                        f"collected 3 items\n\ntests/test_core.py {'...' if resolved else 'F..'}\n")


def write_step(run: Path, step: int, harnesses: tuple[str, ...] = HARNESSES[:2], tasks: tuple[str, ...] = TASKS,
               samples: int = 4, seed: int = 0) -> tuple[list[TrialRow], list[GradeRow]]:
    """Write one policy step's rollouts, grades and train metrics; the solve rate rises with the step."""
    rd = RunDir.at(run)
    rng = random.Random(f"{seed}-{step}")
    trials: list[TrialRow] = []
    grades: list[GradeRow] = []
    for harness in harnesses:
        for ti, task in enumerate(tasks):
            for s in range(samples):
                roll = rng.random()
                kind = "text" if roll < max(0.05, 0.3 - 0.1 * step) else "verify" if roll < 0.7 else "noverify"
                infra = ti == 2 and s == 3
                trial = make_trial(harness, task, step, s, rng, kind, infra=infra, fork=(s == 1 and ti % 2 == 0),
                                   parse_error=(s == 2 and ti == 1), budget=(s == 3 and ti == 2 and step == 0))
                trials.append(trial)
                if infra:
                    continue
                p = {0: 0.9, 1: 0.5, 2: 0.25, 3: 0.0}[ti] + 0.1 * step  # task 3 never solved: zero variance
                resolved = kind == "verify" and rng.random() < p
                grades.append(make_grade(trial, resolved, infra=(ti == 1 and s == 0 and step == 1)))
    shards.write(rd.rollouts, Kind.ROLLOUTS, trials)
    shards.write(rd.grades, Kind.GRADES, grades)
    solved = [g.resolved for g in grades if not g.infra_failure]
    metrics = {  # under the trainer's keys (tests/test_monitor_contract.py checks them against a real run)
        mk.REWARD_MEAN: sum(bool(r) for r in solved) / max(1, len(solved)),
        mk.SOLVE_RATE: sum(bool(r) for r in solved) / max(1, len(solved)),
        mk.ZERO_VARIANCE_SHARE: 0.25 + 0.05 * step,
        mk.LOGPROB_PEARSON: 0.995 - 0.002 * step,
        mk.MISMATCH_KL: 0.0008 + 0.0002 * step,
        mk.IS_ESS: 0.97 - 0.01 * step,
        mk.CLIP_FRACTION: 0.01 + 0.005 * step,
        mk.ENTROPY: 1.2 - 0.1 * step,
        mk.GRAD_NORM: 0.8 + 0.1 * rng.random(),
        mk.LOSS: 0.05 - 0.01 * step,
    }
    shards.write(rd.metrics, Kind.METRICS,
                 [MetricRow(step, k, v, stage="train", time=1000.0 + step) for k, v in metrics.items()])
    return trials, grades


def make_run(run: Path, steps: int = 3, **kwargs: Any) -> Path:
    """A run directory with tasks and ``steps`` policy steps of rollouts, grades and metrics."""
    rd = RunDir.at(run)
    tasks = kwargs.get("tasks", TASKS)
    shards.write(rd.tasks, Kind.TASKS, [
        TaskRow(instance_id=t, repo=t.split("__")[0] + "/" + t.split("__")[1].rsplit("-", 1)[0],
                base_commit="0" * 40, problem_statement=f"Issue for {t}",
                FAIL_TO_PASS=["tests/test_core.py::test_nested"],
                PASS_TO_PASS=["tests/test_core.py::test_simple", "tests/test_core.py::test_custom"])
        for t in tasks
    ])
    for step in range(steps):
        write_step(run, step, **kwargs)
    return run
