"""The CPU learning demo's loop: N steps of rollout → grade → train → reload, through the real stages.

``examples/cpu-demo/learn.py`` is its command line.

1. ``tasks``: a family of tiny one-file repair tasks (:mod:`legorl.demo.taskgen`) written as
   SWE-bench rows + a git bundle, imported with the tasks stage;
2. ``model``: a ~5 M-parameter Qwen3 built offline (:func:`legorl.models.init_model`) and warmed up
   on the ``simple`` driver's conversation format (:mod:`legorl.demo.sft`) on *other* generated
   tasks, briefly, so that some attempts succeed and most do not;
3. each step, through the online loop :mod:`legorl.flows.online` (the same loop as ``legorl loop``):
   the rollout stage (the ``simple`` harness against the in-process proxy and embedded engine, a
   fresh podman sandbox per trial, K samples per task) → the grade stage (hidden tests in fresh
   containers) → the train stage (GRPO on the captured tokens) → the engine loads the new
   checkpoint. Every shard stays in the one run directory, with its ``step``;
4. ``report.md`` / ``report.json`` / ``reward.png`` in the run directory: reward over steps.

Rerunning with the same ``--run`` resumes: finished steps are skipped by the stages themselves.
"""

from __future__ import annotations

import json
import shutil
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from legorl import metric_keys as mk
from legorl import shards
from legorl.paths import RunDir
from legorl.schemas import Kind

HARNESS = "simple"
# The trainer's figures each step's record keeps (report.json).
REPORTED_METRICS = (mk.LOSS, mk.ZERO_VARIANCE_SHARE, mk.ENTROPY, mk.GRAD_NORM, mk.LOGPROB_PEARSON, mk.MISMATCH_KL,
                    mk.IS_ESS)


@dataclass
class DemoConfig:
    run: Path
    seed: int = 0
    # Defaults = the setting measured in examples/cpu-demo/README.md.
    steps: int = 8
    tasks: int = 6  # tasks rolled out every step
    samples: int = 6  # attempts per task per step (the GRPO group size)
    warmup_steps: int = 150  # format warm-up (SFT) steps
    warmup_tasks: int = 2000
    warmup_lr: float = 3e-3
    warmup_wrong: float = 0.75  # share of warm-up demonstrations that reverse the edit (the starting solve rate)
    lr: float = 2e-4  # 5e-4 broke the format in 2 of 3 seeds (README)
    num_iterations: int = 2
    loss: str = "grpo"
    temperature: float = 1.0
    rollout_concurrency: int = 4
    grade_concurrency: int = 2
    model: Path | None = None  # a warmed-up model to start from (skips init + warm-up)
    model_size: str = "tiny"
    threads: int = 1  # torch intra-op threads: the other core runs podman (sandboxes, grading)


@dataclass
class StepRecord:
    step: int
    trials: int
    graded: int
    mean_reward: float
    solve_rate: float
    infra: int
    rollout_s: float
    grade_s: float
    train_s: float
    reload_s: float
    train_metrics: dict[str, float] = field(default_factory=dict)


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def prepare_tasks(cfg: DemoConfig) -> None:
    from legorl.demo.taskgen import write_task_set
    from legorl.stages.tasks import import_stage

    run = RunDir.at(cfg.run)
    if shards.part_files(run.tasks):
        return
    # Task seed 1000+seed: never the warm-up's tasks (those come from seed 10_000+seed).
    source = write_task_set(cfg.run / "taskset", cfg.tasks, seed=1000 + cfg.seed)
    import_stage(str(source), run.tasks)
    log(f"tasks: {cfg.tasks} imported from {source}")


def prepare_model(cfg: DemoConfig) -> tuple[Path, dict[str, Any]]:
    from legorl.demo.sft import train_format
    from legorl.demo.taskgen import generate
    from legorl.models import init_model

    out = cfg.run / "model"
    info_path = out / "legorl_model.json"
    if (out / "config.json").exists() and info_path.exists() and "demo_sft" in json.loads(info_path.read_text()):
        return out, json.loads(info_path.read_text())
    if cfg.model is not None:
        shutil.copytree(cfg.model, out, dirs_exist_ok=True)
        return out, json.loads(info_path.read_text()) if info_path.exists() else {}
    t0 = time.perf_counter()
    tmp = cfg.run / "model.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    init_model(tmp, size=cfg.model_size, seed=cfg.seed)
    stats = train_format(tmp, generate(cfg.warmup_tasks, 10_000 + cfg.seed), steps=cfg.warmup_steps,
                         lr=cfg.warmup_lr, wrong_fraction=cfg.warmup_wrong, seed=cfg.seed)
    tmp.rename(out)
    log(f"model: built and warmed up in {time.perf_counter() - t0:.0f} s (format loss {stats['last_loss']:.3f})")
    return out, json.loads(info_path.read_text())


def step_rewards(run: RunDir, step: int) -> tuple[int, int, list[float], int]:
    """(trials, graded, rewards, infra failures) of ``step`` from the shards."""
    trials = shards.read(run.rollouts, Kind.ROLLOUTS, columns=["step", "infra_failure"]).table.to_pylist()
    mine = {t["trial_id"]: t for t in trials if t["step"] == step}
    grades = shards.read(run.grades, Kind.GRADES, columns=["reward", "infra_failure"]).table.to_pylist()
    rewards = [g["reward"] for g in grades if g["trial_id"] in mine and g["reward"] is not None and not g["infra_failure"]]
    infra = sum(t["infra_failure"] for t in mine.values()) + sum(
        1 for g in grades if g["trial_id"] in mine and (g["infra_failure"] or g["reward"] is None))
    return len(mine), len(rewards), rewards, infra


def run_loop(cfg: DemoConfig) -> list[StepRecord]:
    import torch

    from legorl.flows.online import OnlineConfig, OnlineStep, run_online
    from legorl.grading.grader import GradeOptions
    from legorl.stages.rollout import RolloutConfig
    from legorl.training.config import TrainConfig

    torch.set_num_threads(cfg.threads)
    cfg.run.mkdir(parents=True, exist_ok=True)
    run = RunDir.at(cfg.run)
    prepare_tasks(cfg)
    model_dir, _ = prepare_model(cfg)
    online = OnlineConfig(
        rollout=RolloutConfig(run=cfg.run, harnesses=[HARNESS], samples=cfg.samples,
                              concurrency=cfg.rollout_concurrency, timeout_s=180.0, max_turns=3,
                              temperature=cfg.temperature),
        train=TrainConfig(loss=cfg.loss, learning_rate=cfg.lr, num_iterations=cfg.num_iterations,  # type: ignore[arg-type]
                          temperature=cfg.temperature, seed=cfg.seed),
        model=model_dir, steps=cfg.steps, grade=GradeOptions(concurrency=cfg.grade_concurrency, test_timeout=60.0),
        engine_name="demo-policy", max_context=2048,
    )
    records: list[StepRecord] = []

    def record(step: OnlineStep) -> None:
        trials, graded, rewards, infra = step_rewards(run, step.step)
        r = StepRecord(
            step=step.step, trials=trials, graded=graded,
            mean_reward=statistics.fmean(rewards) if rewards else 0.0,
            solve_rate=sum(r >= 1.0 for r in rewards) / len(rewards) if rewards else 0.0,
            infra=infra, rollout_s=step.rollout_s, grade_s=step.grade_s, train_s=step.train_s,
            reload_s=step.reload_s,
            train_metrics={k: step.metrics[k] for k in REPORTED_METRICS if k in step.metrics},
        )
        records.append(r)
        log(f"step {r.step}: reward {r.mean_reward:.3f} over {graded} graded trial(s) ({infra} infra); "
            f"rollout {r.rollout_s:.0f} s, grade {r.grade_s:.0f} s, train {r.train_s:.0f} s")
        write_report(cfg, records)

    run_online(online, on_step=record)
    return records


# --------------------------------------------------------------------------- the report


def write_report(cfg: DemoConfig, records: list[StepRecord]) -> None:
    out = {"config": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(cfg).items()},
           "steps": [asdict(r) for r in records]}
    (cfg.run / "report.json").write_text(json.dumps(out, indent=2))
    lines = [f"# CPU learning demo — seed {cfg.seed}", "",
             "| step | trials | mean reward | solve rate | infra | rollout s | grade s | train s |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in records:
        lines.append(f"| {r.step} | {r.graded} | {r.mean_reward:.3f} | {r.solve_rate:.3f} | {r.infra} | "
                     f"{r.rollout_s:.0f} | {r.grade_s:.0f} | {r.train_s:.0f} |")
    (cfg.run / "report.md").write_text("\n".join(lines) + "\n")
    plot([(f"seed {cfg.seed}", [r.mean_reward for r in records])], cfg.run / "reward.png")


def plot(series: list[tuple[str, list[float]]], path: Path) -> bool:
    """A reward-over-steps PNG (when matplotlib is installed)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for label, values in series:
        ax.plot(range(len(values)), values, marker="o", label=label)
    ax.set_xlabel("policy step")
    ax.set_ylabel("mean reward (hidden tests)")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True
