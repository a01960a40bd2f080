"""Dashboard endpoints, static export and CLI (the browser tests are in test_dashboard_browser.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from monitor_runs import make_run, write_step
from starlette.testclient import TestClient
from typer.testing import CliRunner

from legorl.cli.app import app as cli_app
from legorl.core import metric_keys as mk
from legorl.core.schemas import trial_is_infra
from legorl.monitor import report
from legorl.monitor.dashboard.data import overview
from legorl.monitor.dashboard.export import export
from legorl.monitor.dashboard.server import create_app
from legorl.monitor.health import health_summary
from legorl.monitor.loading import RunReader


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("dash")
    main = make_run(root / "main", steps=2)
    other = make_run(root / "other", steps=2, harnesses=("opencode",), seed=5)
    report.write_report(main, report.build_report(main, baseline=other))
    return main, other


def test_overview_has_data_for_every_panel(runs: tuple[Path, Path]) -> None:
    client = TestClient(create_app(list(runs)))
    assert [r["name"] for r in client.get("/api/runs").json()] == ["main", "other"]
    ov = client.get("/api/overview?run=0").json()
    assert ov["counts"]["trials"] == 64
    assert ov["reward"]["all"]["steps"] == [0, 1]
    assert sum(sum(v) for v in ov["outcomes"]["categories"].values()) == 64
    assert "infra: rollout" in ov["outcomes"]["categories"]
    assert ov["groups"]["steps"] == [0, 1] and ov["groups"]["all_failed"][0] >= 2  # sympy is never solved
    assert list(ov["fidelity"]) == list(mk.FIDELITY_PANEL) and ov["fidelity_help"] == mk.FIDELITY_PANEL
    assert ov["zero_variance_metric"]["all"]["steps"] == [0, 1]
    assert set(ov["behaviour"]["self_verification_rate"]) == {"all", "mini-swe-agent", "openhands"}
    assert len(ov["grid"]["tasks"]) == 4 and ov["grid"]["steps"] == [0, 1]
    # sparse: one [task, step, solve rate, attempts] per attempted pair, as the trials table counts them
    scored = [t for t in ov["trials"] if t["resolved"] is not None and not t["category"].startswith("infra")]
    expected = {}
    for t in scored:
        solved, n = expected.get((t["task_id"], t["step"]), (0, 0))
        expected[(t["task_id"], t["step"])] = (solved + bool(t["resolved"]), n + 1)
    grid = ov["grid"]
    assert {(grid["tasks"][i], grid["steps"][j]): (n, rate) for i, j, rate, n in grid["cells"]} == {
        key: (n, pytest.approx(solved / n, abs=1e-3)) for key, (solved, n) in expected.items()}
    assert ov["eval"]["baseline"]["run"] == "other"
    assert len(ov["trials"]) == 64
    assert client.get("/api/overview?run=1").json()["counts"]["trials"] == 32
    assert client.get("/api/overview?run=5").status_code == 400


def test_figures_a_snapshot_keeps_are_those_of_a_fresh_one(runs: tuple[Path, Path]) -> None:
    """The health summary and the overview share the figures they derive from one snapshot (computed
    once): neither changes them for the other, and the infra rule cached per trial is the core's."""
    snap = RunReader(runs[0]).snapshot()
    health_summary(snap)
    first = overview(snap)
    assert overview(snap) == first == overview(RunReader(runs[0]).snapshot())
    infra = {tid for tid, t in snap.trials.items() if trial_is_infra(t.infra_failure, snap.grades.get(tid))}
    assert infra and {tid for tid, t in snap.trials.items() if snap.is_infra(t)} == infra


def test_trial_detail(runs: tuple[Path, Path]) -> None:
    client = TestClient(create_app(list(runs)))
    ov = client.get("/api/overview?run=0").json()
    row = next(t for t in ov["trials"] if t["harness"] == "mini-swe-agent" and t["self_verifying"] and t["forks"])
    d = client.get("/api/trial", params={"run": 0, "id": row["trial_id"]}).json()
    assert d["trial_id"] == row["trial_id"] and d["patch"].startswith("diff --git")
    assert [s["reason"] for s in d["segments"]] == ["main", "rewrite"]
    assert sum(s["model_tokens"] for s in d["segments"]) == row["model_tokens"]
    # every call is matched to its sampled span, and the span length is its completion tokens
    for c in d["calls"]:
        assert c["span"][1] - c["span"][0] == c["completion_tokens"]
        assert c["mean_logprob"] <= 0
    tool_calls = [tc for m in d["messages"] for tc in m.get("tool_calls", [])]
    assert ["edit"] in [tc["legorl_actions"] for tc in tool_calls]
    assert d["grade"]["tests"][0]["kind"] == "FAIL_TO_PASS"
    missing = client.get("/api/trial", params={"run": 0, "id": "nope"})
    assert missing.status_code == 404 and "no trial" in missing.json()["error"]


def test_fingerprint_changes_only_when_shards_land(tmp_path: Path) -> None:
    run = make_run(tmp_path / "run", steps=1, harnesses=("mini-swe-agent",))
    client = TestClient(create_app([run]))
    fp = client.get("/api/fingerprint").json()["fingerprints"]
    body = client.get("/api/overview").content
    assert client.get("/api/fingerprint").json()["fingerprints"] == fp
    assert client.get("/api/overview").content == body
    write_step(run, 1, harnesses=("mini-swe-agent",))
    assert client.get("/api/fingerprint").json()["fingerprints"] != fp
    assert json.loads(client.get("/api/overview").content)["counts"]["steps"] == [0, 1]


def test_page_and_offline_plotly(runs: tuple[Path, Path]) -> None:
    client = TestClient(create_app(list(runs), poll_ms=500))
    page = client.get("/").text
    assert 'src="plotly.min.js"' in page and "LEGORL_CONFIG" in page and "cdn" not in page.lower()
    js = client.get("/plotly.min.js")
    assert js.status_code == 200 and len(js.content) > 1_000_000 and b"plotly" in js.content[:2000].lower()
    assert client.get("/app.js").status_code == 200 and client.get("/app.css").status_code == 200


def test_export_writes_a_static_copy(runs: tuple[Path, Path], tmp_path: Path) -> None:
    out = tmp_path / "share"
    counts = export(list(runs), out)
    assert counts == {"runs": 2, "trials": 96}
    for name in ("index.html", "app.js", "app.css", "plotly.min.js", "data.js", "data/runs.json", "data/overview-0.json"):
        assert (out / name).is_file(), name
    assert '<script src="data.js"></script>' in (out / "index.html").read_text()
    assert len(list((out / "data" / "trials").glob("*.js"))) == 96
    assert str(runs[0]) not in (out / "data.js").read_text()  # no local paths in a shared copy
    export(list(runs), out)  # re-export replaces the folder
    assert len(list((out / "data" / "trials").glob("*.json"))) == 96


def test_cli_export_and_bad_run(runs: tuple[Path, Path], tmp_path: Path) -> None:
    cli = CliRunner()
    result = cli.invoke(cli_app, ["dashboard", str(runs[0]), "--compare", str(runs[1]), "--export", str(tmp_path / "x")])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "x" / "index.html").is_file()
    result = cli.invoke(cli_app, ["dashboard", str(tmp_path / "missing")])
    assert result.exit_code == 1 and "does not exist" in result.output
