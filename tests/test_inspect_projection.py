"""`legorl inspect` reads only the columns its breakdowns summarise: the same summary as a read of
whole rows, on the monitor tests' realistic run and on the run-size benchmark's synthetic one."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from monitor_runs import make_run

from legorl.core import shards
from legorl.core.schemas import Kind
from legorl.monitor import inspect
from legorl.trials import costs, provenance

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import run_size


def _whole_rows_summary(path: Path) -> dict[str, object]:
    """What inspect said before it projected columns: every dataset read whole."""
    out = inspect.inspect_path(path)
    for d in out["datasets"]:
        dataset = shards.read(d["path"], Kind(d["kind"]))
        d["breakdown"] = inspect._breakdown(dataset, Path(d["path"]))
        d["rows"], d["duplicate_keys"] = dataset.table.num_rows, dataset.duplicates
    return out


@pytest.mark.parametrize("build", ["monitor run", "run-size benchmark"])
def test_inspect_reads_columns_and_says_the_same(tmp_path: Path, build: str, monkeypatch: pytest.MonkeyPatch) -> None:
    run = tmp_path / "run"
    if build == "monitor run":
        make_run(run, steps=3)
        shards.write(run / "rollouts", Kind.ROLLOUTS, shards.read_rows(run / "rollouts", Kind.ROLLOUTS)[:3])  # duplicates
        rng = np.random.default_rng(1)
        stale = [run_size.make_trial("org__stale-1", "opencode", 4, i, rng) for i in range(3)]
        stale[0].calls[0].policy_version = 1  # lags 3 behind
        stale[1].calls[0].policy_version, stale[1].calls[1].policy_version = None, 2
        stale[2].calls[0].policy_version, stale[2].calls[0].budget_stop = 0, "max_tokens"  # sampled nothing: not counted
        shards.write(run / "rollouts", Kind.ROLLOUTS, stale)
    else:
        run_size.write_run(run, 96, rows_per_part=40)
    expected = _whole_rows_summary(run)
    assert {d["name"] for d in expected["datasets"]} >= {"tasks", "rollouts", "grades", "train/metrics"}
    read: list[list[str] | None] = []
    original = shards.read

    def spy(path: object, kind: Kind, columns: list[str] | None = None, where: object = None) -> shards.Dataset:
        read.append(columns)
        return original(path, kind, columns, where)  # type: ignore[arg-type]

    monkeypatch.setattr(shards, "read", spy)
    assert inspect.inspect_path(run) == expected
    # the column-wise figures against their row-by-row definitions
    rows = shards.read_rows(run / "rollouts", Kind.ROLLOUTS)
    [rollouts] = [d["breakdown"] for d in expected["datasets"] if d["name"] == "rollouts"]
    shares = provenance.lag_shares(rows)
    assert rollouts.get("staleness") == ({f"lag {k}": v for k, v in shares.items()} if shares else None)
    per_trial = [(r.trial_id, costs.segments_fork_cost(r.segments)) for r in rows]
    total = costs.ForkCost(*(sum(getattr(c, f) for _, c in per_trial)
                             for f in ("segments", "segment_tokens", "sampled_tokens", "shared_tokens")))
    assert rollouts["fork_costs"]["segment_tokens_per_sampled"] == total.tokens_per_sampled
    assert rollouts["fork_costs"]["shared_share"] == total.shared_share
    heaviest = sorted((c for c in per_trial if c[1].segments > 1), key=lambda c: -(c[1].tokens_per_sampled or 0.0))
    assert [h["trial_id"] for h in rollouts["fork_costs"]["heaviest"]] == [t for t, _ in heaviest[:3]]
    assert read and all(c is not None and "messages" not in c and "log" not in c for c in read)
