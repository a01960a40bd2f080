"""`legorl eval` end to end: real podman sandboxes, the real mini-swe-agent, the real proxy, grading
in fresh containers, on tasks of the shipped set.

- A scripted engine (fixed completions replayed through the real proxy, reached with ``--proxy``)
  fixes one task and botches another, so the expected numbers are known: pass@1 = 0.5. The
  exported SWE-bench predictions, graded by ``legorl grade --predictions``, grade exactly as the
  eval's own grades; a rerun runs nothing and rewrites the same bytes.
- The embedded tiny model (random weights) drives one trial with tight limits: the plumbing,
  not the score.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from rollout_support import SHIPPED, scripted, solving_script, tool_call

from legorl.core import shards
from legorl.core.schemas import Kind, TaskRow

pytestmark = [pytest.mark.podman, pytest.mark.harness, pytest.mark.slow]

FIXED = "webcolors__compare-1fec7a64"  # the scripted policy applies the gold patch
BOTCHED = "semver__boolop-06aa655f"  # the scripted policy appends a comment to a source file


def _import(run: Path, ids: list[str]) -> dict[str, TaskRow]:
    from legorl.tasks.importer import import_tasks

    import_tasks(str(SHIPPED), run / "tasks", instance_ids=ids)
    return {t.instance_id: t for t in shards.read_rows(run / "tasks", Kind.TASKS)}


def _legorl(*args: str, timeout: float = 600) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, "-m", "legorl.cli", *args, "--json"], capture_output=True, text=True,
                          timeout=timeout, env=os.environ | {"COLUMNS": "200"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return dict(json.loads(proc.stdout))


def _function(name: str) -> str:
    return name.split("::")[-1].partition("[")[0]


def _grades(folder: Path) -> dict[str, tuple[Any, ...]]:
    """Per instance: everything grading decided (status, reward, resolution, each test's result), and
    the functions of the canaries its first run mutated."""
    out = {}
    for g in shards.read_rows(folder, Kind.GRADES):
        tests = sorted((t.name, t.kind, t.status, t.passed) for t in g.tests)
        canaries = frozenset(_function(c.rsplit(": ", 1)[0]) for c in g.canaries)
        out[g.task_id] = (g.status, g.reward, g.resolved, g.resolution, g.infra_failure, tuple(tests), canaries)
    return out


def _same_verdicts(a: dict[str, tuple[Any, ...]], b: dict[str, tuple[Any, ...]]) -> bool:
    """The same verdicts, the canaries' own tests left out: a failing grade's row has no real status for
    the canaries its only run mutated, and which half the first run mutates is a coin per grade."""
    def strip(grades: dict[str, tuple[Any, ...]], task: str) -> tuple[Any, ...]:
        skip = a[task][6] | b[task][6] if task in a and task in b else frozenset()
        return (*grades[task][:5], tuple(t for t in grades[task][5] if _function(t[0]) not in skip))
    return a.keys() == b.keys() and all(strip(a, t) == strip(b, t) for t in a)


def test_scripted_eval_report_predictions_grade_identically_and_rerun_is_identical(
        tiny_model: Path, base_image: str, tmp_path: Path) -> None:
    from legorl.engines.scripted import ScriptedEngine
    from legorl.proxy.server import ProxyServer

    run = tmp_path / "run"
    tasks = _import(run, [FIXED, BOTCHED])
    fix = solving_script("mini-swe-agent", tasks[FIXED])
    botch = [tool_call("bash", {"command": "cd /testbed && printf '\\n# eval\\n' >> \"$(git ls-files '*.py' | head -1)\""}),
             fix[-1]]

    def complete(call: object) -> str:
        text = str(getattr(call, "prompt_text", ""))
        return scripted(fix if "webcolors: " in text else botch)(call)

    engine = ScriptedEngine(str(tiny_model), complete, max_context=32768)
    args = ["eval", "--run", str(run), "--harness", "mini-swe-agent", "--max-turns", "4", "--timeout", "180",
            "--concurrency", "2", "--retries", "1"]
    with ProxyServer(engine, str(tiny_model)) as server:
        result = _legorl(*args, "--proxy", server.base_url)
        report = result["report"]
        assert result["rollout"]["ran"] == 2 and result["grade"]["graded"] == 2
        assert report["trials"] == 2 and report["infra_failures"] == 0 and report["pending"] == 0
        assert report["overall"]["pass_at"] == {"1": 0.5}
        assert report["by_repo"]["pypi/webcolors"]["pass_at"] == {"1": 1.0}
        assert report["by_repo"]["pypi/semver"]["pass_at"] == {"1": 0.0}
        assert report["settings"]["temperature"] == 0.0  # one sample: greedy
        eval_grades = _grades(run / "eval" / "grades")
        assert eval_grades[FIXED][:3] == ("graded", 1.0, True)
        assert eval_grades[BOTCHED][:3] == ("graded", 0.0, False)
        assert not shards.part_files(run / "rollouts") and not shards.part_files(run / "grades")

        preds_path = run / "eval" / "predictions.jsonl"
        preds = [json.loads(line) for line in preds_path.read_text().splitlines()]
        assert [p["instance_id"] for p in preds] == sorted([FIXED, BOTCHED])
        assert all(p["model_name_or_path"] == "scripted" and p["model_patch"] for p in preds)
        graded = _legorl("grade", "--predictions", str(preds_path), "--tasks", str(run / "eval" / "tasks"),
                         "--out", str(tmp_path / "prediction-grades"))
        assert graded["graded"] == 2
        assert _same_verdicts(_grades(tmp_path / "prediction-grades"), eval_grades)

        before = {p.name: p.read_bytes() for p in (run / "eval").glob("*.*")}
        again = _legorl(*args, "--proxy", server.base_url)
        assert again["rollout"]["ran"] == 0 and again["grade"]["graded"] == 0
        assert {p.name: p.read_bytes() for p in (run / "eval").glob("*.*")} == before
        assert len(engine.calls) == 4  # two turns per trial, none on the rerun


def test_tiny_model_eval_end_to_end(tiny_model: Path, base_image: str, tmp_path: Path) -> None:
    run = tmp_path / "tiny"
    _import(run, [BOTCHED])
    result = _legorl("eval", "--run", str(run), "--harness", "mini-swe-agent", "--model", str(tiny_model),
                     "--max-turns", "2", "--max-tokens", "24", "--timeout", "120", "--ks", "1")
    report = result["report"]
    assert report["trials"] == 1 and report["harnesses"] == ["mini-swe-agent"]
    assert report["models"] == [tiny_model.name]
    row = report["overall"]
    assert row["attempts"] + row["infra_failures"] + row["pending"] == 1
    assert row["infra_failures"] == 0, result["rollout"]
    assert row["pass_at"]["1"] == 0.0  # random weights do not fix bugs
    trials = shards.read_rows(run / "eval" / "rollouts", Kind.ROLLOUTS)
    assert len(trials) == 1 and trials[0].segments and trials[0].calls
    assert 1 <= len(trials[0].calls) <= 2
    assert len(shards.read_rows(run / "eval" / "grades", Kind.GRADES)) == 1
    assert not shards.part_files(run / "rollouts")  # eval data never lands in the training folders
    preds = [json.loads(line) for line in (run / "eval" / "predictions.jsonl").read_text().splitlines()]
    assert [(p["instance_id"], p["model_name_or_path"]) for p in preds] == [(BOTCHED, tiny_model.name)]
    md = (run / "eval" / "report.md").read_text()
    assert "| harness | mini-swe-agent |" in md
