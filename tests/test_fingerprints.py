"""Fingerprints and cost per trial (legorl.trials.fingerprints, legorl.trials.costs): on the rows a real rollout and
grade write (real podman, real mini-swe-agent, the real proxy on a scripted engine), a run whose
rows mix harness configs flagged by ``legorl inspect``, the model revision of the real tiny model,
and the cost figures of ``legorl eval``'s report and the dashboard against a hand count of the calls."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import uuid
from pathlib import Path

import pytest
from monitor_runs import HARNESSES, make_run, write_step
from rollout_support import import_one, scripted, solving_script
from starlette.testclient import TestClient
from typer.testing import CliRunner

import legorl
from legorl.cli.app import app as cli_app
from legorl.core import digests, shards
from legorl.core.errors import LegorlError
from legorl.core.schemas import Kind, TaskRow, TrialRow
from legorl.engines.scripted import ScriptedEngine
from legorl.flows import evaluation
from legorl.grading import fingerprint as grade_fingerprints
from legorl.grading.grader import GRADER_VERSION, GradeOptions
from legorl.monitor import report as monitor_report
from legorl.monitor.dashboard.server import create_app
from legorl.monitor.health import health_summary
from legorl.monitor.inspect import inspect_path
from legorl.proxy.clients import InProcessProxy
from legorl.stages.grade import grade_stage, rollout_jobs
from legorl.stages.rollout import RolloutConfig, rollout_stage
from legorl.trials import costs, fingerprints

ROOT = Path(__file__).resolve().parents[1]
MINI_CONFIG = ROOT / "examples" / "cpu-demo" / "mini-swe-agent.yaml"


def _rollout(tiny_model: Path, run: Path, step: int, **kw: object) -> list[TrialRow]:
    task = shards.read_rows(run / "tasks", Kind.TASKS)[0]
    engine = ScriptedEngine(str(tiny_model), scripted(solving_script("mini-swe-agent", task)), max_context=32768)
    opts: dict[str, object] = {"harnesses": ["mini-swe-agent"], "timeout_s": 240.0, "max_turns": 4,
                               "retries": 1, "backoff_s": 0.1, "step": step} | kw
    with InProcessProxy(engine, str(tiny_model)) as proxy:
        rollout_stage(RolloutConfig(run=run, **opts), proxy)  # type: ignore[arg-type]
    return [r for r in shards.read_rows(run / "rollouts", Kind.ROLLOUTS) if r.step == step]


def _image_id(image: str) -> str:
    from legorl.sandbox.host import run_podman

    return run_podman(["image", "inspect", "--format", "{{.Id}}", image]).stdout.decode().strip()


@pytest.mark.podman
@pytest.mark.harness
@pytest.mark.slow
def test_real_rows_carry_fingerprints_and_costs_and_a_mixed_run_is_flagged(
        tiny_model: Path, base_image: str, tmp_path: Path) -> None:
    assert MINI_CONFIG.is_file()
    run = tmp_path / f"run-{uuid.uuid4().hex[:12]}"
    import_one(run, tmp_path)
    t0 = time.monotonic()
    [row] = _rollout(tiny_model, run, step=0)
    wall = time.monotonic() - t0
    assert row.outcome == "submitted" and row.attempts == 1, (row.outcome, row.error)

    # the fingerprint: what really produced the row
    fp = row.fingerprint
    assert fp is not None and fp.harness == "mini-swe-agent"
    assert fp.harness_version == "2.4.6"  # the pinned install legorl made
    assert fp.legorl_version == legorl.__version__
    assert fp.model_revision == "served:scripted"  # a scripted engine has no model directory to hash
    assert fp.harness_config is not None and fp.harness_config.startswith("sha256:")

    # the cost: consistent with the calls, the segments and the timings
    cost = row.cost
    assert cost is not None and len(row.calls) >= 2
    sampled_in_segments = sum(sum(s.loss_mask) for s in row.segments)
    assert cost.sampled_tokens == sum(c.completion_tokens for c in row.calls) == sampled_in_segments
    assert cost.prompt_tokens == sum(c.prompt_tokens for c in row.calls)
    assert cost.cached_tokens == sum(c.prompt_tokens - c.new_prompt_tokens for c in row.calls)
    assert 0 < cost.cached_tokens < cost.prompt_tokens  # the second call reused the first's history
    assert cost.engine_s == pytest.approx(row.timings.model_s, abs=0.01)
    assert cost.retries == 0
    assert cost.sandbox_s is not None and row.timings.total_s is not None
    assert (row.timings.agent_s or 0) < cost.sandbox_s <= row.timings.total_s + 0.01 < wall

    # the grade's fingerprint: the image podman really has, the command and the grader's version
    jobs, infra = rollout_jobs(run / "rollouts")
    [grade] = grade_stage(run / "tasks", run / "grades", jobs, GradeOptions(concurrency=1)).rows
    assert grade.reward == 1.0 and infra == 0
    gfp = grade.fingerprint
    assert gfp is not None and gfp.image
    assert gfp.image_digest == "sha256:" + _image_id(gfp.image).removeprefix("sha256:")
    assert gfp.test_command and "pytest" in gfp.test_command
    assert gfp.grader_version is not None and gfp.grader_version.startswith(f"{legorl.__version__}+g{GRADER_VERSION}.")

    assert inspect_path(run)["datasets"][1]["breakdown"].get("fingerprint_mixes") is None
    assert health_summary(run)["fingerprint_mixes"] == []

    # the same harness with another config file, in the same run: flagged
    [other] = _rollout(tiny_model, run, step=1, harness_config=MINI_CONFIG)
    assert other.fingerprint is not None and other.cost is not None
    assert other.fingerprint.harness_config != fp.harness_config
    assert other.fingerprint.harness_version == fp.harness_version
    rollouts = next(d for d in inspect_path(run)["datasets"] if d["name"] == "rollouts")
    [line] = rollouts["breakdown"]["fingerprint_mixes"]
    assert line.startswith("harness mini-swe-agent: 2 harness configs (")
    health = health_summary(run)
    assert health["fingerprint_mixes"] == [line]
    assert f"rows mix fingerprints: {line}" in health["warnings"]
    result = CliRunner().invoke(cli_app, ["inspect", str(run), "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    assert f"rows mix fingerprints: {line}" in out["health"]["warnings"]
    assert out["health"]["fingerprint_mixes"] == [line]


def test_model_revision_hashes_the_model_directory_once(tiny_model: Path, tmp_path: Path) -> None:
    from legorl.engines.embedded import EmbeddedEngine

    with InProcessProxy(EmbeddedEngine(tiny_model), str(tiny_model)) as proxy:
        revision = fingerprints.proxy_model_revision(proxy)
    assert revision == fingerprints.model_revision(tiny_model) and revision.startswith("sha256:")
    before = digests._file_digest.cache_info()
    for _ in range(50):  # what 50 trials cost: no file is read again
        assert fingerprints.model_revision(tiny_model) == revision
    after = digests._file_digest.cache_info()
    assert after.misses == before.misses and after.hits > before.hits
    # another checkpoint: another revision (one changed byte in the config)
    copy = tmp_path / "model"
    shutil.copytree(tiny_model, copy)
    assert fingerprints.model_revision(copy) == revision  # the same bytes, the same revision
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "legorl_test": 1}))
    assert fingerprints.model_revision(copy) != revision
    (tmp_path / "empty").mkdir()
    with pytest.raises(LegorlError, match="no files to fingerprint"):
        fingerprints.model_revision(tmp_path / "empty")


def test_a_harness_config_digest_follows_the_file_and_the_options(tmp_path: Path) -> None:
    yaml = tmp_path / "mini.yaml"
    shutil.copy(MINI_CONFIG, yaml)
    base = RolloutConfig(run=tmp_path, harnesses=["mini-swe-agent"], harness_config=yaml)
    digest = fingerprints.harness_config(base)
    assert fingerprints.harness_config(RolloutConfig(run=tmp_path, harnesses=["mini-swe-agent"],
                                                     harness_config=yaml)) == digest
    assert fingerprints.harness_config(RolloutConfig(run=tmp_path, harnesses=["mini-swe-agent"], harness_config=yaml,
                                                     max_turns=7)) != digest
    assert fingerprints.harness_config(RolloutConfig(run=tmp_path, harnesses=["mini-swe-agent"])) != digest
    time.sleep(0.01)
    yaml.write_text(yaml.read_text() + "\n# edited\n")
    assert fingerprints.harness_config(base) != digest


def test_grade_mixes_are_named_per_task_and_unknown_values_never_mix() -> None:
    def g(task: str, **fp: str | None) -> dict[str, object]:
        return {"task_id": task, "fingerprint": {"image": "img", "image_digest": "sha256:a", "test_command": "pytest",
                                                 "grader_version": "0.1.0+g2.x", **fp}}

    rows = [g("t1"), g("t1", image_digest="sha256:b"), g("t2"), g("t2", image_digest=None), g("t3"),
            g("t3", grader_version="0.1.0+g3.y"), {"task_id": "t4", "fingerprint": None}]
    assert fingerprints.mixes(grades=rows) == ["task t1: 2 images (sha256:a, sha256:b)",
                                               "task t3: 2 grader versions (0.1.0+g2.x, 0.1.0+g3.y)"]
    trials = [{"harness": "opencode", "step": 0, "fingerprint": {"harness_version": v, "model_revision": "m"}}
              for v in ("1.0", "1.1", None)]
    assert fingerprints.mixes(trials=trials) == ["harness opencode: 2 harness versions (1.0, 1.1)"]


def _hand_costs(rows: list[TrialRow], step: int, harness: str) -> dict[str, float]:
    rows = [r for r in rows if r.step == step and r.harness == harness]
    prompt = sum(c.prompt_tokens for r in rows for c in r.calls)
    return {"trials": len(rows), "prompt": prompt, "sampled": sum(c.completion_tokens for r in rows for c in r.calls),
            "cached": prompt - sum(c.new_prompt_tokens for r in rows for c in r.calls),
            "engine": sum(c.latency_s for r in rows for c in r.calls)}


def test_eval_report_and_dashboard_show_cost_per_step_and_harness(tmp_path: Path) -> None:
    run = make_run(tmp_path / "run", steps=1)
    evaluation.mirror_tasks(run / "tasks", run / "eval" / "tasks")
    trials, _ = write_step(run / "eval", 1, samples=2)
    settings = evaluation.EvalSettings(run=run, harnesses=list(HARNESSES[:2]), samples=2, step=1)
    report, _ = evaluation.build_eval_report(settings)
    by = {(c["step"], c["harness"]): c for c in report["cost"]}
    assert set(by) == {(1, HARNESSES[0]), (1, HARNESSES[1]), (1, costs.ALL)}
    for harness in HARNESSES[:2]:
        hand, row = _hand_costs(trials, 1, harness), by[(1, harness)]
        assert row["trials"] == hand["trials"] and row["prompt_tokens"] == hand["prompt"]
        assert row["sampled_tokens"] == hand["sampled"] and row["cached_tokens"] == hand["cached"]
        assert row["engine_s"] == pytest.approx(hand["engine"], abs=0.01)
        assert row["cached_share"] == pytest.approx(hand["cached"] / hand["prompt"], abs=1e-4)
        assert row["sandbox_s"] is None  # these rows predate the field: not measured, never made up
    assert by[(1, costs.ALL)]["trials"] == len(trials)
    markdown = monitor_report.to_markdown(report)
    assert "## Cost per trial" in markdown
    assert f"| 1 | {HARNESSES[0]} | {by[(1, HARNESSES[0])]['trials']} |" in markdown

    ov = TestClient(create_app([run])).get("/api/overview?run=0").json()
    train_trials = shards.read_rows(run / "rollouts", Kind.ROLLOUTS)
    cost = {(c["step"], c["harness"]): c for c in ov["cost"]}
    hand = _hand_costs(train_trials, 0, HARNESSES[0])
    assert cost[(0, HARNESSES[0])]["sampled_tokens"] == hand["sampled"]
    assert cost[(0, HARNESSES[0])]["sampled_tokens_per_trial"] == pytest.approx(hand["sampled"] / hand["trials"],
                                                                                abs=1e-3)
    detail = TestClient(create_app([run])).get("/api/trial", params={"run": 0, "id": train_trials[0].trial_id}).json()
    assert detail["cost"]["prompt_tokens"] == sum(c.prompt_tokens for c in train_trials[0].calls)
    assert detail["fingerprint"] is None  # a row written before fingerprints


def test_the_dashboard_page_has_the_cost_panel() -> None:
    static = ROOT / "legorl" / "monitor" / "dashboard" / "static"
    assert 'id="panel-cost"' in (static / "index.html").read_text()
    assert "renderCost" in (static / "app.js").read_text()
    if shutil.which("node"):  # the script at least parses
        subprocess.run(["node", "--check", str(static / "app.js")], check=True, timeout=60)


def test_harness_versions_come_from_what_is_installed() -> None:
    from legorl.harnesses.install import installed

    mini = installed("mini-swe-agent")
    assert fingerprints.harness_version("mini-swe-agent") == (mini.version if mini else None)
    assert fingerprints.harness_version("simple") == legorl.__version__  # legorl's own harness
    assert fingerprints.harness_version("external") is None  # a session an outside harness opened
    assert fingerprints.trial_fingerprint("external").harness_config is None


def test_rows_of_lost_trials_and_grades_say_what_would_have_made_them(tmp_path: Path) -> None:
    from legorl.stages.grade import Grading, Job
    from legorl.stages.rollout import RemoteTrials
    from legorl.trials.lifecycle import TrialJob

    cfg = RolloutConfig(run=tmp_path / "run", harnesses=["simple"], retries=1, executor="ray")
    task = TaskRow(instance_id="t-1", test_command="pytest -x", image="localhost/none-such:1")
    row = RemoteTrials(cfg, "policy", "http://127.0.0.1:9", None).lost(TrialJob(task, "simple", 0), "lost", 2)
    assert row is not None and row.fingerprint is not None and row.cost is not None
    assert row.fingerprint.harness_config == fingerprints.harness_config(cfg)
    assert row.fingerprint.model_revision is None  # the driver does not know what the worker's proxy served
    assert (row.cost.retries, row.cost.prompt_tokens, row.cost.sandbox_s) == (1, 0, None)
    item = (task, Job("t-1/simple/step0/sample0", "t-1", "diff", "simple", 0))
    grade = Grading(GradeOptions()).lost(item, "lost", 3)
    assert grade is not None and grade.fingerprint is not None
    assert (grade.fingerprint.image, grade.fingerprint.test_command) == ("localhost/none-such:1", "pytest -x")
    assert grade.fingerprint.image_digest is None  # podman has no such image
    assert grade.fingerprint.grader_version == grade_fingerprints.grader_version()
