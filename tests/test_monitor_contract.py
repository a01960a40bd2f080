"""Producer -> consumer: the health summary and the dashboard show what a real `legorl train` wrote.

The monitor's other tests use shards written by hand (tests/monitor_runs.py); here the metrics come
from the train stage itself, on rollouts sampled from the tiny model, so a key the trainer renames
and the monitor still looks up fails here instead of leaving the fidelity panel silently empty.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from train_support import trained_run

from legorl.core import metric_keys as mk
from legorl.core import shards
from legorl.core.paths import RunDir
from legorl.core.schemas import Kind
from legorl.monitor.dashboard.data import overview
from legorl.monitor.health import health_summary
from legorl.monitor.loading import RunReader

WARNED = {mk.LOGPROB_PEARSON: "correlate below 0.9", mk.MISMATCH_KL: "mismatch KL above",
          mk.IS_ESS: "effective sample size below"}


@pytest.fixture(scope="module")
def faithful(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> RunDir:
    """Rollout logprobs exactly as sampled (fp32): Pearson ~1, mismatch KL ~0, ESS ~1."""
    return trained_run(tmp_path_factory.mktemp("faithful") / "run", tiny_model)


@pytest.fixture(scope="module")
def mismatched(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> RunDir:
    """Rollout logprobs off by N(0, 3) (an engine that is not the trainer's model), weights barely capped."""
    return trained_run(tmp_path_factory.mktemp("mismatched") / "run", tiny_model, logprob_noise=3.0, is_cap=1e6)


def _written(run: RunDir) -> dict[tuple[str, str | None], float]:
    return {(r.key, r.harness): r.value for r in shards.read_rows(run.metrics, Kind.METRICS) if r.step == 0}


def test_health_summary_shows_what_the_trainer_wrote(faithful: RunDir) -> None:
    written = _written(faithful)
    summary = health_summary(faithful.root)
    assert list(summary["fidelity"]) == list(mk.FIDELITY_PANEL)  # every figure shown is one the trainer writes
    for key, entry in summary["fidelity"].items():
        assert entry == {"step": 0, "value": written[key, None]}, key
    assert summary["fidelity"][mk.LOGPROB_PEARSON]["value"] > 0.999
    assert summary["fidelity"][mk.MISMATCH_KL]["value"] < 1e-5
    assert summary["fidelity"][mk.IS_ESS]["value"] == pytest.approx(1.0, abs=1e-5)
    assert not [w for w in summary["warnings"] for text in WARNED.values() if text in w]


def test_health_warns_on_a_real_engine_mismatch(mismatched: RunDir) -> None:
    written = _written(mismatched)
    assert written[mk.LOGPROB_PEARSON, None] < 0.9 and written[mk.MISMATCH_KL, None] > 0.01
    assert written[mk.IS_ESS, None] < 0.5
    warnings = health_summary(mismatched.root)["warnings"]
    for key, text in WARNED.items():
        (line,) = [w for w in warnings if text in w]
        assert f"{key} = {written[key, None]:.3g} at step 0" in line


def test_dashboard_fidelity_panel_has_the_trainer_series(faithful: RunDir) -> None:
    written = _written(faithful)
    ov = overview(RunReader(faithful.root).snapshot())
    assert list(ov["fidelity"]) == list(mk.FIDELITY_PANEL)
    for key, per_harness in ov["fidelity"].items():
        assert per_harness["all"] == {"steps": [0], "values": [written[key, None]]}, key
    for harness in ("mini", "openhands"):  # the trainer splits fidelity per harness on a mixed batch
        assert ov["fidelity"][mk.LOGPROB_PEARSON][harness] == {
            "steps": [0], "values": [written[mk.LOGPROB_PEARSON, harness]]}
    assert ov["zero_variance_metric"]["all"] == {"steps": [0], "values": [written[mk.ZERO_VARIANCE_SHARE, None]]}
    assert not set(ov["fidelity"]) & set(ov["other_metrics"])


def test_inspect_reads_at_80_columns_in_a_pipe(faithful: RunDir) -> None:
    """`legorl inspect` piped (no TTY) at 80 columns: every line fits, no label is cut, the
    trainer's headline figures are there by their real keys."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "COLUMNS": "80", "TERM": "dumb"}
    out = subprocess.run([sys.executable, "-m", "legorl.cli", "inspect", str(faithful.root)], env=env,
                         capture_output=True, text=True, check=True)
    lines = (out.stdout + out.stderr).splitlines()
    assert all(len(line.rstrip()) <= 80 for line in lines), max(lines, key=len)
    text = "\n".join(lines)
    assert "…" not in text
    for key in (mk.LOGPROB_PEARSON, mk.MISMATCH_KL, mk.IS_ESS, mk.REWARD_MEAN):
        assert key in text, key
    assert len(lines) < 60  # one row per dataset, a few lines of breakdown each, the health panel
