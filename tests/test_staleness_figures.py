"""Importance-weight figures per staleness level, and the dashboard's staleness panel.

The per-lag figures on a hand-built batch whose weights are known; a trial straddling a weight load
split token by token into its versions' buckets; the real train stage on such a step (the stale
turns' logprobs perturbed, so only their bucket loses effective sample size); the dashboard fed by
what that trainer and the loop's own staleness writer put in the run.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from train_support import stale_run

from legorl.core import metric_keys as mk
from legorl.core import shards
from legorl.core.paths import RunDir
from legorl.core.schemas import Kind
from legorl.training.batching import pad
from legorl.training.importance import importance_weights, value_versions, weight_stats, weight_stats_by_lag
from legorl.trials import provenance

CAP = 2.0
# Two rows at step 3, the first position of row 0 and the last of row 1 not sampled. Untruncated ratios
# per position, and the version that sampled each (-1: a call without a version).
MASK = [[0, 1, 1, 1], [1, 1, 1, 0]]
RATIOS = [[1.0, 1.0, 0.5, 3.0], [1.5, 1.0, 3.0, 1.0]]
VERSIONS = [[-1, 3, 3, 2], [3, 3, -1, -1]]


def _weights(level: str) -> dict[str, float]:
    mask = torch.tensor(MASK, dtype=torch.float32)
    rollout = torch.full((2, 4), -1.0, dtype=torch.float64)
    _, values, raw = importance_weights(rollout + torch.tensor(RATIOS, dtype=torch.float64).log(), rollout, mask,
                                        level, CAP)
    versions = value_versions(torch.tensor(VERSIONS), mask, level)
    return weight_stats_by_lag(values, raw, versions, step=3, cap=CAP)


def _ess(w: list[float]) -> float:
    return sum(w) ** 2 / (len(w) * sum(x * x for x in w))


def test_per_lag_figures_of_known_weights() -> None:
    # token level: lag 0 (version 3) holds weights 1, 0.5, 1.5, 1: ESS 4² / (4 * 4.5); lag 1 (version 2)
    # the one ratio 3, capped to 2; the other ratio-3 token, of unknown version, is in no bucket
    by_lag = _weights("token")
    assert by_lag == pytest.approx({
        "is/weight_mean/lag0": 1.0, "is/truncated_frac/lag0": 0.0, "is/ess/lag0": 16 / 18,
        "is/weight_mean/lag1": 2.0, "is/truncated_frac/lag1": 1.0, "is/ess/lag1": 1.0,
    })
    assert by_lag["is/ess/lag0"] == pytest.approx(_ess([1.0, 0.5, 1.5, 1.0]))
    # sequence level: one weight per row, counted at its oldest known token: row 0 (1 * 0.5 * 3 = 1.5) at
    # lag 1, row 1 (1.5 * 1 * 3 = 4.5, capped to 2) at lag 0
    assert _weights("sequence") == pytest.approx({
        "is/weight_mean/lag0": 2.0, "is/truncated_frac/lag0": 1.0, "is/ess/lag0": 1.0,
        "is/weight_mean/lag1": 1.5, "is/truncated_frac/lag1": 0.0, "is/ess/lag1": 1.0,
    })
    assert set(_weights("none")) == set(by_lag)  # every weight 1, still bucketed by lag
    unknown = torch.full((3,), float(provenance.UNKNOWN_VERSION))
    assert weight_stats_by_lag(torch.ones(3), torch.ones(3), unknown, step=3, cap=CAP) == {}  # old shards
    assert weight_stats(torch.tensor([2.0, 1.0]), torch.tensor([4.0, 1.0]), CAP).at_lag(2) == {
        "is/weight_mean/lag2": 1.5, "is/truncated_frac/lag2": 0.5, "is/ess/lag2": _ess([2.0, 1.0])}


@pytest.fixture(scope="module")
def stale(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> RunDir:
    return stale_run(tmp_path_factory.mktemp("stale") / "run", tiny_model)


def _written(run: RunDir) -> dict[str, float]:
    return {r.key: r.value for r in shards.read_rows(run.metrics, Kind.METRICS) if r.harness is None}


def test_a_trial_straddling_a_weight_load_splits_its_tokens_by_version(stale: RunDir) -> None:
    from legorl.training.data import load_step

    data = load_step(stale)
    by_trial = {t.trial_id: [data.sequences[i] for i in t.sequences] for t in data.trials}
    (straddling,) = by_trial["t1/mini/step1/sample0"]
    sampled = straddling.loss_mask > 0
    assert straddling.versions is not None
    assert straddling.versions[sampled].tolist() == [0] * 6 + [1] * 5  # turn 1 by version 0, turn 2 by 1
    assert (straddling.versions[~sampled] == provenance.UNKNOWN_VERSION).all()
    fork_main, fork_rewrite = by_trial["t2/mini/step1/sample0"]  # across a fork: one version per segment
    assert fork_main.versions is not None and fork_rewrite.versions is not None
    assert fork_main.versions[fork_main.loss_mask > 0].tolist() == [0] * 6
    assert fork_rewrite.versions[fork_rewrite.loss_mask > 0].tolist() == [1] * 5
    (unknown,) = by_trial["t1/mini/step1/sample2"]
    assert unknown.versions is None  # no call records a version

    padded = pad(data.sequences, pad_id=0)
    versions = value_versions(padded.versions, padded.loss_mask, "token")  # what the trainer buckets
    known = versions != provenance.UNKNOWN_VERSION
    assert torch.bincount((1 - versions[known]).long()).tolist() == [10, 34]  # lag 0: 2 turns of 5; lag 1: 4 of 6, 2 of 5
    assert int((~known).sum()) == 11  # the unversioned trial's tokens


def test_the_trainer_writes_figures_per_lag_and_only_the_stale_bucket_is_off(
    stale: RunDir, tiny_model: Path, tmp_path: Path
) -> None:
    from legorl.stages.train import run_train
    from legorl.training.config import TrainConfig

    written = _written(stale)
    per_lag = {k for k in written if any(k.startswith(p) for p in
                                          (mk.IS_WEIGHT_MEAN_AT_LAG, mk.IS_TRUNCATED_FRAC_AT_LAG, mk.IS_ESS_AT_LAG))}
    assert per_lag == {p + lag for p in (mk.IS_WEIGHT_MEAN_AT_LAG, mk.IS_TRUNCATED_FRAC_AT_LAG, mk.IS_ESS_AT_LAG)
                       for lag in ("0", "1")}
    print(f"\nESS: lag 0 {written[mk.IS_ESS_AT_LAG + '0']:.4f}, lag 1 {written[mk.IS_ESS_AT_LAG + '1']:.4f}, "
          f"all {written[mk.IS_ESS]:.4f}")
    # version 1 is the trainer's policy and its turns carry their fp32 logprobs: weights 1
    assert written[mk.IS_ESS_AT_LAG + "0"] == pytest.approx(1.0, abs=1e-5)
    assert written[mk.IS_WEIGHT_MEAN_AT_LAG + "0"] == pytest.approx(1.0, abs=1e-4)
    assert written[mk.IS_TRUNCATED_FRAC_AT_LAG + "0"] == 0.0
    # version 0's turns were perturbed: their weights spread and some hit the cap
    assert written[mk.IS_ESS_AT_LAG + "1"] < 0.9 and written[mk.IS_TRUNCATED_FRAC_AT_LAG + "1"] > 0
    # the whole batch is the buckets' 10 and 34 tokens and the unknown trial's 11 (fp32 too: weights 1)
    tokens = {"0": 10, "1": 34}
    mean = sum(n * written[mk.IS_WEIGHT_MEAN_AT_LAG + lag] for lag, n in tokens.items()) + 11 * 1.0
    assert written[mk.IS_WEIGHT_MEAN] == pytest.approx(mean / 55, abs=1e-5)
    truncated = written[mk.IS_TRUNCATED_FRAC_AT_LAG + "1"] * tokens["1"]
    assert math.isclose(truncated, round(truncated), abs_tol=1e-6)  # a share of the 34 lag-1 tokens
    assert written[mk.IS_TRUNCATED_FRAC] == pytest.approx(truncated / 55)

    # the separate scoring pass (two iterations) gives the same figures as the training forward's
    separate = run_train(stale.root, tiny_model, None, TrainConfig(learning_rate=1e-4, num_iterations=2),
                         out=tmp_path / "separate").metrics
    for key in per_lag:
        assert separate[key] == pytest.approx(written[key], rel=1e-5, abs=1e-7), key
    # sequence level: a segment counts at its oldest token. Only the fork's second segment (turn 2 by
    # version 1) is fresh; the 4 other versioned segments hold a version-0 turn; 1 segment is unknown
    sequence = run_train(stale.root, tiny_model, None, TrainConfig(learning_rate=1e-4, importance_sampling="sequence"),
                         out=tmp_path / "sequence").metrics
    assert {k for k in sequence if k.startswith(mk.IS_ESS_AT_LAG)} == {mk.IS_ESS_AT_LAG + "0", mk.IS_ESS_AT_LAG + "1"}
    assert sequence[mk.IS_WEIGHT_MEAN_AT_LAG + "0"] == pytest.approx(1.0, abs=1e-4)
    assert sequence[mk.IS_ESS_AT_LAG + "0"] == 1.0  # one weight
    mean = sequence[mk.IS_WEIGHT_MEAN_AT_LAG + "0"] + 4 * sequence[mk.IS_WEIGHT_MEAN_AT_LAG + "1"] + 1.0
    assert sequence[mk.IS_WEIGHT_MEAN] == pytest.approx(mean / 6, abs=1e-5)
    assert sequence[mk.IS_TRUNCATED_FRAC_AT_LAG + "1"] > 0
    assert sequence[mk.IS_TRUNCATED_FRAC] == pytest.approx(sequence[mk.IS_TRUNCATED_FRAC_AT_LAG + "1"] * 4 / 6)


def test_dashboard_staleness_panel_shows_what_the_loop_and_trainer_wrote(stale: RunDir) -> None:
    from legorl.flows.online import _staleness_figures, _write_staleness
    from legorl.monitor.dashboard.data import overview
    from legorl.monitor.loading import RunReader

    loop = _staleness_figures(stale, 1, provenance.Staleness(1))
    _write_staleness(stale, 1, loop)
    written = _written(stale)
    ov = overview(RunReader(stale.root).snapshot())
    panel = ov["staleness"]
    assert panel["steps"] == [1] and panel["tokens"] == [44]
    assert panel["shares"] == {"0": [round(10 / 44, 6)], "1": [round(34 / 44, 6)]}
    for lag, (share,) in panel["shares"].items():  # the rollouts' lags are the loop's figures
        assert share == pytest.approx(loop[provenance.TOKENS_AT_LAG + lag], abs=1e-6)
    assert panel["ess"] == {lag: {"steps": [1], "values": [written[mk.IS_ESS_AT_LAG + lag]]} for lag in ("0", "1")}
    assert not {mk.IS_ESS_AT_LAG + lag for lag in panel["ess"]} & set(ov["other_metrics"])


def test_dashboard_staleness_panel_is_empty_without_versions(tmp_path: Path) -> None:
    from monitor_runs import make_run

    from legorl.monitor.dashboard.data import overview
    from legorl.monitor.loading import RunReader

    ov = overview(RunReader(make_run(tmp_path / "run", steps=1)).snapshot())
    assert ov["staleness"] == {"steps": [], "tokens": [], "shares": {}, "ess": {}}
