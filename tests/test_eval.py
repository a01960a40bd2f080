"""`legorl eval`'s glue without containers: the eval view of a run, the trials a report covers,
infrastructure failures excluded and counted, the baseline, resume, byte-identical reports and the
predictions export. Eval data here is written with the shard library the way the stages write it;
the rollout and grade stages themselves run in tests/test_eval_podman.py."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
from monitor_runs import HARNESSES, TASKS, make_run, write_step

from legorl.core import shards
from legorl.core.errors import LegorlError
from legorl.core.schemas import Kind
from legorl.flows import evaluation
from legorl.monitor.passk import pass_at_k

PROXY = "http://127.0.0.1:9"  # never contacted: every trial is already done


def _settings(run: Path, **kw: object) -> evaluation.EvalSettings:
    opts: dict[str, object] = {"harnesses": list(HARNESSES[:2]), "samples": 4, "step": 1} | kw
    return evaluation.EvalSettings(run=run, **opts)  # type: ignore[arg-type]


def _eval_run(tmp_path: Path, name: str = "run", seed: int = 0, steps: tuple[int, ...] = (0, 1),
              samples: int = 4) -> Path:
    """RUN/tasks, training data in RUN/rollouts, and eval data in RUN/eval (tasks mirrored)."""
    run = make_run(tmp_path / name, steps=1, seed=seed + 100)  # training data: must never be counted
    evaluation.mirror_tasks(run / "tasks", run / "eval" / "tasks")
    for step in steps:
        write_step(run / "eval", step, samples=samples, seed=seed)
    return run


def _hand_pass_at(run: Path, step: int, k: int, harness: str | None = None) -> tuple[float, int]:
    """pass@k (unrecovered infrastructure failures as failed attempts) and the infra count, straight
    from the eval shards (not through the monitor)."""
    trials = [t for t in shards.read_rows(run / "eval" / "rollouts", Kind.ROLLOUTS) if t.step == step]
    grades = {g.trial_id: g for g in shards.read_rows(run / "eval" / "grades", Kind.GRADES)}
    per: dict[tuple[str, str], list[int]] = {}
    infra = 0
    for t in trials:
        if harness is not None and t.harness != harness:
            continue
        g = grades.get(t.trial_id)
        if t.infra_failure or (g is not None and g.infra_failure):
            infra += 1  # unrecovered: a failed attempt
            per.setdefault((t.task_id, t.harness), [0, 0])[0] += 1
        elif g is not None:
            nc = per.setdefault((t.task_id, t.harness), [0, 0])
            nc[0] += 1
            nc[1] += int(bool(g.resolved))
    values = [pass_at_k(n, c, k) for n, c in per.values() if n >= k]
    return sum(values) / len(values), infra


def test_report_covers_the_eval_data_only_and_counts_infra(tmp_path: Path) -> None:
    run = _eval_run(tmp_path)
    report, _ = evaluation.build_eval_report(_settings(run, ks=[1, 2, 4]))
    assert report["run"] == "run"  # the run's name, not "eval"
    assert report["steps"] == [1]
    assert report["trials"] == len(HARNESSES[:2]) * len(TASKS) * 4
    for k in (1, 2, 4):
        expected, infra = _hand_pass_at(run, 1, k)
        assert report["overall"]["pass_at"][str(k)] == pytest.approx(expected, abs=1e-6)
        assert report["infra_failures"] == infra > 0
        h_expected, _ = _hand_pass_at(run, 1, k, HARNESSES[0])
        assert report["by_harness"][HARNESSES[0]]["pass_at"][str(k)] == pytest.approx(h_expected, abs=1e-6)
    assert report["settings"]["samples"] == 4 and report["settings"]["temperature"] == 1.0
    # the training data (RUN/rollouts, another seed) would give other numbers: it was not read
    assert report["trials"] != 0 and set(report["by_repo"]) == {
        "astropy/astropy", "django/django", "psf/requests", "sympy/sympy"}


def test_report_is_restricted_to_the_planned_trials(tmp_path: Path) -> None:
    run = _eval_run(tmp_path)
    report, snap = evaluation.build_eval_report(_settings(run, samples=2, limit=2, harnesses=[HARNESSES[1]]))
    assert report["trials"] == 1 * 2 * 2
    assert report["harnesses"] == [HARNESSES[1]]
    assert sorted({t.task_id for t in snap.trials.values()}) == sorted(TASKS)[:2]
    assert {t.sample_index for t in snap.trials.values()} == {0, 1}
    with pytest.raises(LegorlError, match="none of this eval"):
        evaluation.build_eval_report(_settings(run, step=7))


def test_baseline_is_reported_on_the_same_tasks_and_harnesses(tmp_path: Path) -> None:
    run = _eval_run(tmp_path, "new", seed=1, steps=(1,))
    base = _eval_run(tmp_path, "old", seed=2, steps=(0, 1))
    report, _ = evaluation.build_eval_report(_settings(run, baseline=base, baseline_step=0, harnesses=[HARNESSES[0]]))
    b = report["baseline"]
    assert b["run"] == "old" and b["steps"] == [0] and b["harnesses"] == [HARNESSES[0]]
    expected, infra = _hand_pass_at(base, 0, 1, HARNESSES[0])
    assert b["overall"]["pass_at"]["1"] == pytest.approx(expected, abs=1e-6)
    assert b["infra_failures"] == infra
    assert b["ks"] == report["ks"]
    latest, _ = evaluation.build_eval_report(_settings(run, baseline=base, harnesses=[HARNESSES[0]]))
    assert latest["baseline"]["steps"] == [1]  # default: the baseline's latest eval step
    with pytest.raises(LegorlError, match="no eval rollouts"):
        evaluation.build_eval_report(_settings(run, baseline=tmp_path / "new" / "tasks"))


def test_mirror_tasks_copies_bytes_once_and_follows_changes(tmp_path: Path) -> None:
    run = make_run(tmp_path / "run", steps=0)
    dest = run / "eval" / "tasks"
    assert evaluation.mirror_tasks(run / "tasks", dest) is True
    assert [f.read_bytes() for f in shards.part_files(dest)] == [f.read_bytes() for f in shards.part_files(run / "tasks")]
    assert evaluation.mirror_tasks(run / "tasks", dest) is False  # rerun: untouched
    make_run(tmp_path / "other", steps=0, tasks=TASKS[:1])
    assert evaluation.mirror_tasks(tmp_path / "other" / "tasks", dest) is True
    assert [t.instance_id for t in shards.read_rows(dest, Kind.TASKS)] == [TASKS[0]]
    with pytest.raises(LegorlError, match="no tasks"):
        evaluation.mirror_tasks(tmp_path / "missing", dest)


def test_parse_ks_and_settings_errors() -> None:
    assert evaluation.parse_ks("5, 1,5") == [1, 5]
    assert evaluation.parse_ks(None) is None
    for bad in ("1,x", "0,2"):
        with pytest.raises(LegorlError, match="--ks"):
            evaluation.parse_ks(bad)
    s = evaluation.EvalSettings(run=Path("r"), harnesses=["mini-swe-agent"])
    assert s.temperature == 0.0  # one sample: greedy
    assert evaluation.EvalSettings(run=Path("r"), harnesses=["x"], samples=3).temperature == 1.0
    bad_options: list[dict[str, Any]] = [{"samples": 0}, {"limit": 0}, {"temperature": -1.0}, {"harnesses": []}]
    for kw in bad_options:
        with pytest.raises(LegorlError):
            opts: dict[str, Any] = {"run": Path("r"), "harnesses": ["x"]} | kw
            evaluation.EvalSettings(**opts).validate()


def _cli(*args: str) -> tuple[int, str, str]:
    import os
    import subprocess

    env = os.environ | {"COLUMNS": "200"}  # rich's table width off a terminal
    proc = subprocess.run([sys.executable, "-m", "legorl.cli", *args], capture_output=True, text=True, timeout=120,
                          env=env)
    return proc.returncode, proc.stdout, proc.stderr


@pytest.mark.heavy
def test_cli_rerun_resumes_and_gives_the_same_bytes(tmp_path: Path) -> None:
    """A finished eval: the command runs no trial and no grade (no engine, no containers), writes
    report.json/report.md/predictions, and a second run leaves them byte for byte the same."""
    run = _eval_run(tmp_path, steps=(0,), samples=3)
    base = _eval_run(tmp_path, "base", seed=5, steps=(0,), samples=3)
    args = ["eval", "--run", str(run), "--harness", ",".join(HARNESSES[:2]), "--proxy", PROXY,
            "--samples", "3", "--ks", "1,2", "--baseline", str(base), "--json"]
    code, out, err = _cli(*args)
    assert code == 0, err
    result = json.loads(out)
    assert result["rollout"]["ran"] == 0 and result["rollout"]["skipped"] == len(TASKS) * 2 * 3
    assert result["grade"]["graded"] == 0
    report = result["report"]
    assert report["ks"] == [1, 2] and report["baseline"]["run"] == "base"
    on_disk = (run / "eval" / "report.json").read_text()
    assert json.loads(on_disk) == report
    md = (run / "eval" / "report.md").read_text()
    assert "| overall | all |" in md and "baseline pass@1" in md
    files = sorted(p.name for p in (run / "eval").glob("predictions*.jsonl"))
    assert files == [f"predictions-{h}.jsonl" for h in sorted(HARNESSES[:2])]
    preds = [json.loads(line) for line in (run / "eval" / files[0]).read_text().splitlines()]
    assert [p["instance_id"] for p in preds] == sorted(TASKS)
    assert all(set(p) == {"instance_id", "model_name_or_path", "model_patch"} for p in preds)
    before = {p.name: p.read_bytes() for p in (run / "eval").glob("*.*")}
    code, _, err = _cli(*args[:-1])  # the human form this time: a table on stderr
    assert code == 0, err
    assert "pass@1" in err and "base pass@1" in err and "rollouts: 0 run" in err
    assert {p.name: p.read_bytes() for p in (run / "eval").glob("*.*")} == before


@pytest.mark.heavy
def test_cli_refuses_bad_input(tmp_path: Path) -> None:
    run = make_run(tmp_path / "run", steps=0)
    code, _, err = _cli("eval", "--run", str(run), "--harness", "mini-swe-agent")
    assert code == 1 and "exactly one of --model" in err
    code, _, err = _cli("eval", "--run", str(run), "--harness", "mini-swe-agent", "--proxy", PROXY, "--ks", "0")
    assert code == 1 and "--ks" in err
    code, _, err = _cli("eval", "--run", str(tmp_path / "empty"), "--harness", "mini-swe-agent", "--proxy", PROXY)
    assert code == 1 and "no tasks" in err
