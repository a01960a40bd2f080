"""A step's checkpoint: the trainer's state written, staged, committed, its metrics published once.

Layout: :class:`legorl.core.paths.Checkpoints`. A checkpoint is built in a staging folder and moved
into place with one ``os.replace``, so ``step-<S>`` either holds everything (weights, tokenizer,
optimizer, LR schedule, RNG, ``trainer_state.json``, ``legorl_train.json``, the step's metrics) or
does not exist. The metrics are committed inside it and published to ``RUN/train/metrics`` after.

transformers offers no public call that writes (or reads) a trainer's optimizer, LR schedule and RNG
state outside its own ``checkpoint-<N>`` saves; this module is the one place that calls its private
helpers for them (``_save_optimizer_and_scheduler``, ``_save_rng_state``,
``_load_optimizer_and_scheduler``: see docs/trainer.md).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from transformers import Trainer, TrainerCallback

from legorl.core import shards
from legorl.core.paths import INFO_FILE, Checkpoints
from legorl.core.schemas import Kind
from legorl.training.metrics import MetricsRecorder

# What a checkpoint holds about its own step, not copied into a skipped step's checkpoint.
OWN_STEP_FILES = (INFO_FILE, Checkpoints.METRICS_DIR, Checkpoints.INIT_FILE, "trainer_state.json")


def save_trainer(trainer: Trainer, folder: Path) -> None:
    """The model, tokenizer, optimizer, LR schedule and RNG state of ``trainer`` into ``folder``, and
    (main process) ``trainer_state.json``. Every process calls it: under FSDP / DeepSpeed gathering
    the weights is collective (each writes only what its rank should)."""
    trainer.save_model(str(folder))
    trainer._save_optimizer_and_scheduler(str(folder))
    trainer._save_rng_state(str(folder))
    trainer.accelerator.wait_for_everyone()
    if trainer.accelerator.is_main_process:
        trainer.state.save_to_json(str(folder / "trainer_state.json"))


class CarryOptimizer(TrainerCallback):
    """Start a step with the optimizer and LR schedule of the previous step's checkpoint ``folder``
    (loaded once the trainer has made them, before the first update)."""

    def __init__(self, trainer: Trainer, folder: Path):
        self.trainer, self.folder = trainer, folder

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.trainer._load_optimizer_and_scheduler(str(self.folder))


def stage(checkpoints: Checkpoints, step: int, copy_of: Path | None = None) -> Path:
    """A fresh staging folder for step ``step`` (main process only): empty, or the checkpoint
    ``copy_of`` file for file less what belongs to its own step (:data:`OWN_STEP_FILES`, TRL's
    ``checkpoint-*`` saves)."""
    checkpoints.root.mkdir(parents=True, exist_ok=True)
    tmp = checkpoints.staging(step)
    if tmp.exists():
        shutil.rmtree(tmp)
    if copy_of is None:
        tmp.mkdir(parents=True)
        return tmp
    shutil.copytree(copy_of, tmp, ignore=lambda folder, names: [
        n for n in names if os.fspath(folder) == os.fspath(copy_of)
        and (n in OWN_STEP_FILES or n.startswith("checkpoint-"))])
    return tmp


def commit(
    checkpoints: Checkpoints, tmp: Path, final: Path, step: int, recorder: MetricsRecorder, info: dict[str, Any],
    metrics: Path,
) -> None:
    """Write the step's metrics and info into the staged checkpoint ``tmp``, move it into place as
    ``final``, point ``latest`` at it and publish the metrics."""
    recorder.write(tmp / Checkpoints.METRICS_DIR, step)  # committed with the checkpoint, published after it
    (tmp / INFO_FILE).write_text(json.dumps(info, indent=2, sort_keys=True))
    os.replace(tmp, final)
    checkpoints.set_latest(final)
    publish_metrics(final, metrics, step)


def publish_metrics(checkpoint: Path, metrics: Path, step: int) -> None:
    """Add the step's metrics rows, committed inside its checkpoint, to ``RUN/train/metrics`` unless
    they are there already: written once whenever the stage is killed (a kill before the checkpoint
    is committed retrains the step and writes nothing twice; one after it publishes on the rerun)."""
    source = checkpoint / Checkpoints.METRICS_DIR
    if not shards.part_files(source):
        return  # a checkpoint from before metrics were committed with it
    if shards.part_files(metrics):
        steps = shards.read(metrics, Kind.METRICS, columns=["step"]).table.column("step").to_pylist()
        if step in steps:
            return
    shards.write(metrics, Kind.METRICS, shards.read_rows(source, Kind.METRICS))
