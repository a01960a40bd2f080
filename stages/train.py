"""The train stage: ``rollouts/`` + ``grades/`` of one policy step -> a checkpoint and ``train/metrics/``.

Checkpoints (layout: :class:`legorl.core.paths.Checkpoints`): ``train/checkpoints/step-<S>`` is the
policy after training on the rollouts of step S, i.e. the policy that samples step S+1. It is a
Hugging Face model folder (weights, config, tokenizer) plus the trainer's state (optimizer, LR
schedule, RNG, ``trainer_state.json``) and ``legorl_train.json`` (what went in, the step's
metrics); ``train/checkpoints/latest`` names the newest one.

Resume (``resume=True``): an interrupted step continues from its last saved update (TRL saves one
at every generation-batch boundary under ``step-<S>.partial/``), which reproduces the
uninterrupted run exactly; otherwise training starts from ``latest`` and carries its optimizer
and LR schedule into the new step. Without ``resume`` the step starts from ``model_dir`` with a
fresh optimizer.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from legorl.core import metric_keys as mk
from legorl.core.errors import LegorlError
from legorl.core.paths import INFO_FILE, Checkpoints, RunDir
from legorl.training.advantages import group_advantages
from legorl.training.batching import make_batches, token_micro_batches
from legorl.training.checkpoint import commit, publish_metrics, save_trainer, stage
from legorl.training.config import TrainConfig
from legorl.training.data import StepData, load_step
from legorl.training.metrics import MetricsRecorder, harness_split
from legorl.training.sampling import StepSampling, step_sampling
from legorl.training.weighting import segment_scales
from legorl.trials.provenance import Staleness

log = logging.getLogger(__name__)


@dataclass
class TrainResult:
    step: int
    checkpoint: Path
    updates: int
    trials: int
    sequences: int
    dropped: dict[str, int]
    metrics: dict[str, float] = field(default_factory=dict)
    started_from: str = ""
    already_done: bool = False
    skipped: str | None = None  # why the step made no update (metric_keys.SKIP_*), None when it trained
    main_process: bool = True  # False in the other processes of an `accelerate launch` (they report nothing)

    def to_dict(self) -> dict[str, Any]:
        return {
            "step": self.step, "checkpoint": str(self.checkpoint), "updates": self.updates, "trials": self.trials,
            "sequences": self.sequences, "dropped": self.dropped, "metrics": self.metrics,
            "started_from": self.started_from, "already_done": self.already_done, "skipped": self.skipped,
        }


def train_step(
    run_dir: str | os.PathLike[str], model_dir: str | os.PathLike[str], step: int | None, config: TrainConfig,
    *, resume: bool = False,
) -> Path:
    """Train on the rollouts of ``step`` (None: the latest) and return the new checkpoint's path.

    The entry point of the online loop: rollout -> grade -> ``train_step`` -> engine loads the path.
    """
    return run_train(run_dir, model_dir, step, config, resume=resume).checkpoint


def latest_checkpoint(checkpoints: Path) -> Path | None:
    """``Checkpoints(checkpoints).latest()``, kept here for the callers that import it from this module."""
    return Checkpoints(checkpoints).latest()


def prepare(data: StepData, config: TrainConfig) -> MetricsRecorder:
    """Set advantages and segment weights on ``data``; return the step-level metrics."""
    advantages, stats = group_advantages(
        [t.reward for t in data.trials], [t.group_id for t in data.trials], config.reward_scale
    )
    for trial, advantage in zip(data.trials, advantages, strict=True):
        trial.advantage = float(advantage)
        for i in trial.sequences:
            data.sequences[i].advantage = float(advantage)
    for seq, scale in zip(data.sequences, segment_scales(data, config.loss, config.weighting), strict=True):
        seq.scale = scale

    recorder = MetricsRecorder()
    recorder.update({
        mk.GROUPS_COUNT: stats.groups,
        mk.ZERO_VARIANCE_SHARE: stats.zero_variance_share,
        mk.TRIALS_COUNT: len(data.trials),
        mk.TRIALS_DROPPED_INFRA: data.dropped["rollout_infra_failure"] + data.dropped["grade_infra_error"],
        mk.SEGMENTS_COUNT: len(data.sequences),
        mk.TOKENS_SAMPLED: sum(s.n_sampled for s in data.sequences),
        mk.TOKENS_TOTAL: sum(len(s) for s in data.sequences),
    })
    for harness in [None, *harness_split(t.harness for t in data.trials)]:
        trials = [t for t in data.trials if harness is None or t.harness == harness]
        recorder.update({
            mk.REWARD_MEAN: sum(t.reward for t in trials) / len(trials),
            mk.SOLVE_RATE: sum(t.resolved for t in trials) / len(trials),
        }, harness)
    return recorder


def run_train(
    run_dir: str | os.PathLike[str],
    model_dir: str | os.PathLike[str],
    step: int | None = None,
    config: TrainConfig | None = None,
    *,
    resume: bool = False,
    out: str | os.PathLike[str] | None = None,
    callbacks: Sequence[Any] = (),
    staleness: Staleness | None = None,
) -> TrainResult:
    """:func:`train_step` with everything a caller may want to report.

    Under ``accelerate launch`` every process runs this: each trains its share of every micro-batch
    (:mod:`legorl.training.trainer`) and only the main process writes the checkpoint and the metrics."""
    config = config or TrainConfig()
    processes = _processes(config)
    run = RunDir.at(run_dir)
    checkpoints = Checkpoints(Path(out) if out is not None else run.checkpoints)
    data = load_step(run, step, config.reasons, staleness)
    final, partial = checkpoints.step(data.step), checkpoints.partial(data.step)

    if (final / "config.json").exists():
        if not resume:
            raise LegorlError(f"{final} exists: step {data.step} is trained already (--resume skips it, --out trains elsewhere)")
        info = json.loads((final / INFO_FILE).read_text()) if (final / INFO_FILE).exists() else {}
        if processes.is_main_process:
            publish_metrics(final, run.metrics, data.step)  # a kill between the commit and the publish
        processes.wait_for_everyone()
        return TrainResult(data.step, final, info.get("updates", 0), len(data.trials), len(data.sequences),
                           dict(data.dropped), info.get("metrics", {}), info.get("started_from", ""), already_done=True,
                           skipped=info.get("skipped"), main_process=processes.is_main_process)

    sampling = step_sampling(data, config.temperature)  # refuses what the trainer cannot score exactly
    init_from, carry, resume_ckpt = Path(model_dir), None, None
    partial_saves = checkpoints.partial_saves(data.step)
    latest = checkpoints.latest()
    if resume and partial_saves:
        resume_ckpt = partial_saves[-1]
        init = json.loads((partial / Checkpoints.INIT_FILE).read_text())
        init_from = Path(init["init_from"])
        carry = Path(init["carry"]) if init.get("carry") else None
    elif resume and latest is not None:
        init_from, carry = latest, latest
    if not (init_from / "config.json").exists():
        raise LegorlError(f"{init_from}: not a model folder (no config.json)")

    recorder = prepare(data, config)
    batches = make_batches(data, config.groups_per_batch, seed=config.seed + data.step)
    if config.skip_zero_advantage:
        batches = [b for b in batches if any(data.sequences[i].advantage != 0.0 for i in b)]
        skipped = {t.trial_id for t in data.trials if t.advantage == 0.0}
        recorder.add(mk.TRIALS_SKIPPED, float(len(skipped)))
    if not batches:
        return _commit_skipped(run, checkpoints, data, init_from, config, sampling, recorder, processes)
    recorder.add(mk.SKIPPED, 0.0)

    processes.wait_for_everyone()  # every process has read the partial saves before the main one changes them
    if processes.is_main_process:
        if resume_ckpt is None and partial.exists():
            shutil.rmtree(partial)  # a stale, unfinished attempt that is not being resumed
        partial.mkdir(parents=True, exist_ok=True)
        (partial / Checkpoints.INIT_FILE).write_text(
            json.dumps({"init_from": str(init_from), "carry": str(carry) if carry else None})
        )
    processes.wait_for_everyone()
    # A resumed step's optimizer comes with its partial save; a new one carries the previous step's.
    carry = None if resume_ckpt else carry
    trainer = _build_trainer(init_from, partial, data, batches, config, carry, list(callbacks), sampling=sampling)

    started = time.perf_counter()
    trainer.train(resume_from_checkpoint=str(resume_ckpt) if resume_ckpt else None)
    wall = time.perf_counter() - started
    state = trainer.state
    if state.global_step < state.max_steps:
        raise LegorlError(
            f"training of step {data.step} stopped after {state.global_step} of {state.max_steps} updates; "
            "run again with --resume to continue it"
        )

    recorder.merge(trainer.recorder)
    trained, forwarded, padding = trainer.work_counts()
    recorder.update({
        mk.PERF_TOKENS_PER_S: trained / wall if wall > 0 else 0.0,
        mk.PERF_PADDING_WASTE: padding / max(forwarded, 1),
        mk.PERF_WALL_S: wall,
        mk.UPDATES: float(state.global_step),
    })
    started_from = str(resume_ckpt or init_from)
    summary = recorder.summary()

    tmp = checkpoints.staging(data.step)
    accelerator = trainer.accelerator
    if accelerator.is_main_process:
        stage(checkpoints, data.step)
    accelerator.wait_for_everyone()
    save_trainer(trainer, tmp)  # every process: gathering the weights may be collective
    if accelerator.is_main_process:
        commit(checkpoints, tmp, final, data.step, recorder, {
            "step": data.step, "run": str(run.root), "started_from": started_from, "updates": state.global_step,
            "trials": len(data.trials), "sequences": len(data.sequences), "dropped": dict(data.dropped),
            "config": config.to_dict(), "sampling": sampling.to_dict(), "metrics": summary,
            "processes": accelerator.num_processes,
        }, run.metrics)
        shutil.rmtree(partial, ignore_errors=True)
    accelerator.wait_for_everyone()
    return TrainResult(data.step, final, state.global_step, len(data.trials), len(data.sequences),
                       dict(data.dropped), summary, started_from, main_process=accelerator.is_main_process)


def _commit_skipped(
    run: RunDir, checkpoints: Checkpoints, data: StepData, init_from: Path, config: TrainConfig,
    sampling: StepSampling, recorder: MetricsRecorder, processes: Any,
) -> TrainResult:
    """A step with nothing to learn from (every trial's advantage is 0): no model is loaded, nothing
    runs; its checkpoint is the policy it started from, file for file (with its optimizer and LR
    schedule, for the next step to carry on), and its metrics say it was skipped and why."""
    reason = mk.SKIP_ZERO_ADVANTAGE
    log.info("step %d: skipped (%s): all %d trials in %d groups have advantage 0", data.step, reason,
             len(data.trials), len(data.groups()))
    recorder.update({mk.SKIPPED: 1.0, mk.SKIPPED_BECAUSE + reason: 1.0, mk.UPDATES: 0.0})
    summary = recorder.summary()
    final = checkpoints.step(data.step)
    if processes.is_main_process:
        tmp = stage(checkpoints, data.step, copy_of=init_from)
        commit(checkpoints, tmp, final, data.step, recorder, {
            "step": data.step, "run": str(run.root), "started_from": str(init_from), "updates": 0,
            "trials": len(data.trials), "sequences": len(data.sequences), "dropped": dict(data.dropped),
            "config": config.to_dict(), "sampling": sampling.to_dict(), "metrics": summary, "skipped": reason,
        }, run.metrics)
        shutil.rmtree(checkpoints.partial(data.step), ignore_errors=True)
    processes.wait_for_everyone()
    return TrainResult(data.step, final, 0, len(data.trials), len(data.sequences), dict(data.dropped), summary,
                       str(init_from), skipped=reason, main_process=processes.is_main_process)


def _processes(config: TrainConfig) -> Any:
    """accelerate's view of this run's processes (one, unless under ``accelerate launch``)."""
    from accelerate import PartialState

    _ = config.device  # TrainingArguments sets the process group up (CPU: gloo) on first use
    return PartialState()


def _build_trainer(
    init_from: Path, output_dir: Path, data: StepData, batches: list[list[int]], config: TrainConfig,
    carry: Path | None, callbacks: list[Any], *, sampling: StepSampling | None = None,
) -> Any:
    import warnings

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from legorl.training.trainer import SegmentGRPOTrainer

    # TRL 1.16 still passes transformers 5's renamed gradient_checkpointing options: not ours to fix.
    warnings.filterwarnings("ignore", message=r".*gradient_checkpointing.* is deprecated", category=FutureWarning)
    sampling = sampling or step_sampling(data, config.temperature)
    dtype = torch.bfloat16 if config.bf16 else torch.float32
    model = AutoModelForCausalLM.from_pretrained(init_from, dtype=dtype)
    tokenizer = AutoTokenizer.from_pretrained(init_from)
    budget = config.max_tokens_per_micro_batch
    args = dataclasses.replace(
        config,
        micro_batches=token_micro_batches(data, batches, budget) if budget else config.micro_batches,
        output_dir=str(output_dir),
        temperature=sampling.logprob_temperature,  # the rollouts' (sampling.py), never assumed
        max_completion_length=config.max_completion_length or max(len(s) for s in data.sequences),
    )
    return SegmentGRPOTrainer(
        model=model, processing_class=tokenizer, args=args, data=data, batches=batches,
        carry_state_from=carry, callbacks=callbacks or None,
    )
