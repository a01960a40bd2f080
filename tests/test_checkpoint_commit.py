"""A step's checkpoint is staged, then moved into place whole, with its metrics committed inside it."""

from __future__ import annotations

import json
from pathlib import Path

from legorl.core import shards
from legorl.core.paths import INFO_FILE, Checkpoints
from legorl.core.schemas import Kind
from legorl.training.checkpoint import OWN_STEP_FILES, commit, stage
from legorl.training.metrics import MetricsRecorder


def test_a_fresh_stage_replaces_a_stale_one(tmp_path: Path) -> None:
    checkpoints = Checkpoints(tmp_path / "ckpt")
    stale = stage(checkpoints, 2)
    (stale / "model.safetensors").write_text("half written by a killed run")
    tmp = stage(checkpoints, 2)
    assert tmp == checkpoints.staging(2) and tmp.is_dir() and not any(tmp.iterdir())


def test_a_copied_stage_leaves_out_what_belongs_to_the_source_step(tmp_path: Path) -> None:
    source = tmp_path / "ckpt" / "step-0"
    (source / "checkpoint-2").mkdir(parents=True)
    (source / Checkpoints.METRICS_DIR).mkdir()
    (source / "sub" / INFO_FILE).parent.mkdir()
    for name in ("config.json", "optimizer.pt", *[n for n in OWN_STEP_FILES if n != Checkpoints.METRICS_DIR]):
        (source / name).write_text(name)
    (source / "sub" / INFO_FILE).write_text("not the step's own: deeper")
    tmp = stage(Checkpoints(tmp_path / "ckpt"), 1, copy_of=source)
    assert sorted(p.name for p in tmp.iterdir()) == ["config.json", "optimizer.pt", "sub"]
    assert (tmp / "sub" / INFO_FILE).read_text() == "not the step's own: deeper"


def test_commit_moves_the_stage_into_place_points_latest_and_publishes_once(tmp_path: Path) -> None:
    checkpoints, metrics = Checkpoints(tmp_path / "ckpt"), tmp_path / "metrics"
    recorder = MetricsRecorder()
    recorder.update({"loss": 0.5, "entropy": 1.5})
    for step in (0, 1):
        tmp = stage(checkpoints, step)
        (tmp / "config.json").write_text("{}")
        commit(checkpoints, tmp, checkpoints.step(step), step, recorder, {"step": step}, metrics)
        assert not tmp.exists() and checkpoints.latest() == checkpoints.step(step)
        assert json.loads((checkpoints.step(step) / INFO_FILE).read_text()) == {"step": step}
    rows = shards.read(metrics, Kind.METRICS)
    assert rows.duplicates == 0
    assert sorted((r["step"], r["key"]) for r in rows.table.to_pylist()) == [
        (0, "entropy"), (0, "loss"), (1, "entropy"), (1, "loss")
    ]
