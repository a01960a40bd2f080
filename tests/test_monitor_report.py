"""Eval report, predictions export, health summary and the incremental run reader."""

from __future__ import annotations

import io
import json
import random
from pathlib import Path

import pytest
from monitor_runs import make_grade, make_run, make_trial, write_step
from rich.console import Console

from legorl.core import metric_keys as mk
from legorl.core import shards
from legorl.core.errors import LegorlError
from legorl.core.paths import RunDir
from legorl.core.schemas import Kind, MetricRow
from legorl.monitor import health, report
from legorl.monitor.loading import RunReader, repo_from_instance_id
from legorl.monitor.passk import pass_at_k


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_run(tmp_path_factory.mktemp("monitor") / "run", steps=2)


def _text(renderable: object) -> str:
    out = io.StringIO()
    Console(file=out, width=200, color_system=None).print(renderable)
    return out.getvalue()


def test_report_pass_at_k_matches_the_grades(run: Path) -> None:
    rep = report.build_report(run)
    assert rep["steps"] == [1]
    rd = RunDir.at(run)
    trials = {t.trial_id: t for t in shards.read_rows(rd.rollouts, Kind.ROLLOUTS) if t.step == 1}
    grades = {g.trial_id: g for g in shards.read_rows(rd.grades, Kind.GRADES) if g.trial_id in trials}
    # recompute by hand: per (task, harness), n = graded attempts with unrecovered infrastructure
    # failures counted as failed ones, c = resolved; ungraded attempts are left out
    per: dict[tuple[str, str], list[bool]] = {}
    infra = 0
    for tid, t in trials.items():
        g = grades.get(tid)
        if t.infra_failure or (g is not None and g.infra_failure):
            infra += 1
            per.setdefault((t.task_id, t.harness), []).append(False)
        elif g is not None:
            per.setdefault((t.task_id, t.harness), []).append(bool(g.resolved))
    for k in rep["ks"]:
        values = [pass_at_k(len(v), sum(v), k) for v in per.values() if len(v) >= k]
        assert rep["overall"]["pass_at"][str(k)] == pytest.approx(sum(values) / len(values), abs=1e-6)
    assert rep["infra_failures"] == infra > 0
    assert rep["overall"]["infra_failures"] == infra
    assert rep["overall"]["attempts"] == sum(len(v) for v in per.values())
    assert set(rep["by_repo"]) == {"astropy/astropy", "django/django", "psf/requests", "sympy/sympy"}
    assert rep["by_repo"]["sympy/sympy"]["pass_at"]["1"] == 0.0  # never solved in the fixture
    assert set(rep["by_harness"]) == {"mini-swe-agent", "openhands"}
    outcomes = rep["outcomes"]["mini-swe-agent"]
    assert outcomes["infra: rollout"] == 1 and sum(outcomes.values()) == 16


def test_report_is_deterministic(run: Path, tmp_path: Path) -> None:
    first = report.build_report(run, baseline=run)
    json_path, md_path = report.write_report(run, first)
    a = (json_path.read_bytes(), md_path.read_bytes())
    second = report.build_report(run, baseline=run)  # fresh readers, same run
    report.write_report(run, second)
    assert (json_path.read_bytes(), md_path.read_bytes()) == a
    assert _text(report.render(first)) == _text(report.render(second))
    json_path.unlink()
    md_path.unlink()


def test_report_baseline_side_by_side(run: Path, tmp_path: Path) -> None:
    base = make_run(tmp_path / "base", steps=1, harnesses=("mini-swe-agent",), seed=3)
    rep = report.build_report(run, baseline=base)
    assert rep["baseline"]["run"] == "base" and rep["baseline"]["steps"] == [0]
    md = report.to_markdown(rep)
    assert "baseline pass@1" in md and "Δ pass@1 (pts)" in md
    row = next(line for line in md.splitlines() if line.startswith("| harness | mini-swe-agent |"))
    ours = rep["by_harness"]["mini-swe-agent"]["pass_at"]["1"]
    theirs = rep["baseline"]["by_harness"]["mini-swe-agent"]["pass_at"]["1"]
    assert f"{100 * (ours - theirs):+.1f}" in row
    text = _text(report.render(rep))
    assert "vs base" in text and "base pass@1" in text


def test_report_step_selection_and_errors(run: Path, tmp_path: Path) -> None:
    assert report.build_report(run, steps=[0, 1])["steps"] == [0, 1]
    with pytest.raises(LegorlError, match="no rollouts at step 7"):
        report.build_report(run, steps=[7])
    (tmp_path / "empty").mkdir()
    with pytest.raises(LegorlError, match="no rollouts"):
        report.build_report(tmp_path / "empty")


def test_predictions_export_swebench_format(tmp_path: Path) -> None:
    run = make_run(tmp_path / "run", steps=1, harnesses=("mini-swe-agent",))
    path = report.export_predictions(run)
    assert path == run / "eval" / "predictions.jsonl"
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [p["instance_id"] for p in lines] == sorted({p["instance_id"] for p in lines})
    assert len(lines) == 4
    for p in lines:
        assert set(p) == {"instance_id", "model_name_or_path", "model_patch"}
        assert p["model_name_or_path"] == "tiny-qwen3"
    trials = {(t.task_id, t.sample_index): t for t in shards.read_rows(RunDir.at(run).rollouts, Kind.ROLLOUTS)}
    for p in lines:
        assert p["model_patch"] == (trials[(p["instance_id"], 0)].patch or "")
    assert path.read_bytes() == report.export_predictions(run).read_bytes()


def test_predictions_need_a_harness_when_there_are_several(run: Path) -> None:
    with pytest.raises(LegorlError, match="several harnesses"):
        report.export_predictions(run)
    out = report.export_predictions(run, harness="openhands", model_name="m", path=run / "eval" / "p-openhands.jsonl")
    assert out.name == "p-openhands.jsonl"
    assert {json.loads(line)["model_name_or_path"] for line in out.read_text().splitlines()} == {"m"}


def test_health_summary(run: Path) -> None:
    summary = health.health_summary(run)
    assert summary["trials"] == 64 and summary["steps"] == [0, 1] and summary["tasks"] == 4
    assert summary["infra_failures"] == 4 + 2  # per harness: one rollout failure per step, one grading failure at step 1
    assert summary["pending_grades"] == 0
    assert summary["fidelity"][mk.LOGPROB_PEARSON] == {"step": 1, "value": pytest.approx(0.993)}
    assert 0 <= summary["solve_rate"]["latest"] <= 1
    assert set(summary["behaviour_latest_step"]) >= {"text_only_turn_share", "self_verification_rate"}
    text = _text(health.health_renderable(summary))
    assert "legorl health" in text and mk.LOGPROB_PEARSON in text and "self_verification_rate" in text
    json.dumps(summary)  # plain data


def test_health_warns_on_text_only_collapse_and_bad_fidelity(tmp_path: Path) -> None:
    run = tmp_path / "run"
    rd = RunDir.at(run)
    trials = [make_trial("opencode", "psf__requests-1", 0, s, random.Random(s), "text") for s in range(4)]
    shards.write(rd.rollouts, Kind.ROLLOUTS, trials)
    shards.write(rd.grades, Kind.GRADES, [make_grade(t, False) for t in trials])
    shards.write(rd.metrics, Kind.METRICS, [MetricRow(0, mk.LOGPROB_PEARSON, 0.5), MetricRow(0, mk.IS_ESS, 0.2)])
    warnings = " | ".join(health.health_summary(run)["warnings"])
    assert "text-only" in warnings and "correlate below 0.9" in warnings and "effective sample size" in warnings
    assert "zero reward variance" in warnings  # one group, all failed


def test_reader_is_incremental_and_later_files_win(tmp_path: Path) -> None:
    run = make_run(tmp_path / "run", steps=1, harnesses=("mini-swe-agent",))
    reader = RunReader(run)
    first = reader.snapshot()
    assert reader.snapshot() is first  # nothing changed: the same snapshot, no reads
    cached = dict(reader._rollout_cache)
    write_step(run, 1, harnesses=("mini-swe-agent",))
    second = reader.snapshot()
    assert second.fingerprint != first.fingerprint and len(second.trials) == 2 * len(first.trials)
    assert all(reader._rollout_cache[k] is v for k, v in cached.items())  # old files not re-read
    # a rerun supersedes a trial: the later file wins
    old = next(t for t in second.trials.values() if t.infra_failure)
    redo = make_trial("mini-swe-agent", old.task_id, old.step, old.sample_index, random.Random(1), "verify")
    shards.write(RunDir.at(run).rollouts, Kind.ROLLOUTS, [redo])
    third = reader.snapshot()
    assert not third.trials[old.trial_id].infra_failure
    assert reader.trial_row(old.trial_id).patch == redo.patch


def test_repo_from_instance_id() -> None:
    assert repo_from_instance_id("django__django-11099") == "django/django"
    assert repo_from_instance_id("scikit-learn__scikit-learn-10297") == "scikit-learn/scikit-learn"
    assert repo_from_instance_id("local-task") == "unknown"
