"""The CPU learning demo: a policy learning through the real stages, measured on held-out tasks.

``examples/cpu-demo/learn.py`` is its command line and ``make demo`` runs it. In one run directory:

1. ``tasks``: a family of tiny one-file repair tasks (:mod:`legorl.demo.taskgen`) written as
   SWE-bench rows + a git bundle: a training set (task seed ``1000 + seed``) and a held-out set
   (task seed ``5000 + seed``, never trained on);
2. ``model``: a ~5 M-parameter Qwen3 built offline (:func:`legorl.models.init_model`) and warmed up
   on the harness's exact conversation (:mod:`legorl.demo.sft`) on *other* generated tasks;
3. ``eval`` before: ``legorl eval``'s flow (:func:`legorl.flows.evaluate.evaluate`) on the held-out
   set, greedy, one attempt per task: pass@1 with its 95 % Wilson interval;
4. the online loop (:func:`legorl.flows.online.run_online`, the same loop as ``legorl loop``): each
   step the rollout stage (the harness against the in-process proxy and embedded engine, a fresh
   podman sandbox per trial) → the grade stage (hidden tests in fresh containers) → the train stage
   (GRPO on the captured tokens) → the engine loads the new checkpoint;
5. ``eval`` after, on the same held-out set with the last checkpoint;
6. ``summary.json`` (keys in ``README.md``), ``reward.png``, ``report.md`` and the static dashboard.

Rerunning with the same ``--run`` resumes: finished work is skipped by the stages themselves.
"""

from __future__ import annotations

import json
import resource
import shutil
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from legorl.core import metric_keys as mk
from legorl.core import shards
from legorl.core.paths import Checkpoints, RunDir
from legorl.core.schemas import Kind

# The trainer's figures each step's record keeps.
REPORTED_METRICS = (mk.LOSS, mk.ZERO_VARIANCE_SHARE, mk.ENTROPY, mk.GRAD_NORM, mk.LOGPROB_PEARSON, mk.MISMATCH_KL,
                    mk.IS_ESS, mk.SKIPPED, mk.TRIALS_SKIPPED)
SUMMARY_VERSION = 1
HERE = Path(__file__).resolve().parent
MINI_SWE_AGENT_CONFIG = HERE / "mini-swe-agent.yaml"


@dataclass
class DemoConfig:
    run: Path
    seed: int = 0
    harness: str = "mini-swe-agent"  # unmodified, driven by harness_config; or simple (legorl's driver)
    harness_config: Path | None = None  # default for mini-swe-agent: mini-swe-agent.yaml here
    # Defaults = the setting measured in examples/cpu-demo/README.md.
    steps: int = 12
    tasks: int = 8  # tasks rolled out every step
    samples: int = 4  # attempts per task per step (the GRPO group size)
    heldout: int = 48  # held-out tasks evaluated before and after (one greedy attempt each)
    warmup_steps: int = 150  # format warm-up (SFT) steps
    warmup_tasks: int = 2000
    warmup_lr: float = 3e-3
    warmup_confused: int = 4  # (kind, operator) cells the demonstrator gets wrong at warmup_wrong (chosen by seed)
    warmup_wrong: float = 0.65  # how often it writes the wrong operator in those cells
    lr: float = 2e-4
    num_iterations: int = 2
    loss: str = "grpo"
    temperature: float = 1.0
    max_turns: int = 2
    max_tokens: int = 96  # per call: a demo command is ~60 tokens; a degenerate sample stops here
    rollout_concurrency: int = 4
    grade_concurrency: int = 2
    model: Path | None = None  # a warmed-up model to start from (skips init + warm-up)
    model_size: str = "tiny"
    threads: int = 1  # torch intra-op threads: the other core runs podman (sandboxes, grading)
    dashboard: bool = True  # export the static dashboard at the end
    max_staleness: int = 0  # the loop's --max-staleness: 1 overlaps step S+1's rollout with step S's training


    def __post_init__(self) -> None:
        if self.harness == "mini-swe-agent" and self.harness_config is None:
            self.harness_config = MINI_SWE_AGENT_CONFIG

    def agent_format(self) -> Any:
        """The conversation the harness holds, for the warm-up (:class:`legorl.demo.sft.AgentFormat`)."""
        from legorl.core.errors import ConfigError
        from legorl.demo.sft import SIMPLE, mini_swe_agent_format

        if self.harness == "simple":
            return SIMPLE
        if self.harness == "mini-swe-agent":
            assert self.harness_config is not None
            return mini_swe_agent_format(self.harness_config)
        raise ConfigError(f"--harness {self.harness}: the demo's warm-up knows simple and mini-swe-agent")


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


@dataclass
class HeldOut:
    """One held-out evaluation: pass@1 over ``tasks`` greedy attempts, with its 95 % interval."""

    step: int
    tasks: int
    resolved: int
    pass_at_1: float | None
    interval: list[float] | None
    infra_failures: int
    seconds: float


def log(message: str) -> None:
    from legorl.cli.common import log_line

    log_line(message)


# --------------------------------------------------------------------------- inputs


def prepare_tasks(cfg: DemoConfig) -> Path:
    """Import the training set into ``RUN/tasks``; write the held-out set; return its tasks folder."""
    from legorl.demo.taskgen import write_task_set
    from legorl.stages.tasks import import_stage

    run = RunDir.at(cfg.run)
    if not shards.part_files(run.tasks):
        source = write_task_set(cfg.run / "taskset", cfg.tasks, seed=1000 + cfg.seed)
        import_stage(str(source), run.tasks)
        log(f"tasks: {cfg.tasks} training tasks (task seed {1000 + cfg.seed})")
    heldout = cfg.run / "heldout" / "tasks"
    if not shards.part_files(heldout):
        source = write_task_set(cfg.run / "heldout" / "taskset", cfg.heldout, seed=5000 + cfg.seed)
        import_stage(str(source), heldout)
        log(f"tasks: {cfg.heldout} held-out tasks (task seed {5000 + cfg.seed}), never trained on")
    return heldout


def prepare_model(cfg: DemoConfig) -> Path:
    """The warmed-up initial policy in ``RUN/model`` (built, or copied from ``cfg.model``)."""
    from legorl.cli.progress import StageBar
    from legorl.demo.sft import Confusion, train_format
    from legorl.demo.taskgen import generate
    from legorl.models import init_model

    out = cfg.run / "model"
    info_path = out / "legorl_model.json"
    if (out / "config.json").exists() and info_path.exists() and "demo_sft" in json.loads(info_path.read_text()):
        return out
    if cfg.model is not None:
        shutil.copytree(cfg.model, out, dirs_exist_ok=True)
        return out
    t0 = time.perf_counter()
    tmp = cfg.run / "model.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    init_model(tmp, size=cfg.model_size, seed=cfg.seed)
    bar: StageBar[float] = StageBar("warm-up", lambda loss: f"loss {loss:.3f}", transient=True)
    with bar:
        bar.on_start(cfg.warmup_steps, 0)
        # Warm-up tasks come from seed 10_000 + seed: never a training or held-out task.
        stats = train_format(tmp, generate(cfg.warmup_tasks, 10_000 + cfg.seed), steps=cfg.warmup_steps,
                             lr=cfg.warmup_lr, seed=cfg.seed, progress=lambda _, loss: bar.on_done(loss),
                             confusion=Confusion.pick(cfg.warmup_confused, cfg.warmup_wrong, cfg.seed),
                             fmt=cfg.agent_format())
    tmp.rename(out)
    log(f"model: built and warmed up in {time.perf_counter() - t0:.0f} s (format loss {stats['last_loss']:.3f})")
    return out


# --------------------------------------------------------------------------- the held-out eval


def held_out(cfg: DemoConfig, tasks: Path, model: Path, tokenizer: Path, step: int) -> HeldOut:
    """``legorl eval`` on the held-out tasks: one greedy attempt per task, at policy ``step``."""
    from legorl.cli.progress import Outcomes, StageBar, graded
    from legorl.flows.evaluate import evaluate
    from legorl.flows.evaluation import EvalSettings
    from legorl.flows.policy import PolicySpec
    from legorl.grading.grader import GradeOptions

    t0 = time.perf_counter()
    settings = EvalSettings(run=cfg.run, tasks=tasks, step=step, samples=1, ks=[1], harnesses=[cfg.harness],
                            harness_config=cfg.harness_config, max_turns=cfg.max_turns, max_tokens=cfg.max_tokens, timeout_s=180.0, concurrency=cfg.rollout_concurrency,
                            grade=GradeOptions(concurrency=cfg.grade_concurrency, test_timeout=60.0))
    policy = PolicySpec(model=model, tokenizer=tokenizer, engine_name="demo-policy", max_context=2048)
    outcomes = Outcomes()
    with StageBar(f"held-out eval, step {step}", outcomes.add, transient=True) as trials, \
            StageBar(f"held-out grade, step {step}", graded, transient=True) as grades:
        result = evaluate(settings, policy, rollout=trials, grade=grades)
    overall = result.report["overall"]
    return HeldOut(step=step, tasks=overall["tasks"], resolved=overall["resolved"],
                   pass_at_1=overall["pass_at"].get("1"), interval=overall["pass_at_1_interval"],
                   infra_failures=overall["infra_failures"], seconds=round(time.perf_counter() - t0, 1))


# --------------------------------------------------------------------------- the loop


def step_rewards(run: RunDir, step: int) -> tuple[int, int, list[float], int]:
    """(trials, graded, rewards, infra failures) of ``step`` from the shards."""
    trials = shards.read(run.rollouts, Kind.ROLLOUTS, columns=["step", "infra_failure"]).table.to_pylist()
    mine = {t["trial_id"]: t for t in trials if t["step"] == step}
    grades = shards.read(run.grades, Kind.GRADES, columns=["reward", "infra_failure"]).table.to_pylist()
    rewards = [g["reward"] for g in grades if g["trial_id"] in mine and g["reward"] is not None and not g["infra_failure"]]
    infra = sum(t["infra_failure"] for t in mine.values()) + sum(
        1 for g in grades if g["trial_id"] in mine and (g["infra_failure"] or g["reward"] is None))
    return len(mine), len(rewards), rewards, infra


def run_loop(cfg: DemoConfig, model_dir: Path, on_record: Any = None) -> list[StepRecord]:
    from legorl.cli.common import console
    from legorl.flows.online import OnlineConfig, OnlineStep, run_online
    from legorl.grading.grader import GradeOptions
    from legorl.stages.rollout import RolloutConfig
    from legorl.training.config import TrainConfig

    run = RunDir.at(cfg.run)
    online = OnlineConfig(
        rollout=RolloutConfig(run=cfg.run, harnesses=[cfg.harness], harness_config=cfg.harness_config,
                              samples=cfg.samples, max_tokens=cfg.max_tokens,
                              concurrency=cfg.rollout_concurrency, timeout_s=180.0, max_turns=cfg.max_turns,
                              temperature=cfg.temperature),
        train=TrainConfig(loss=cfg.loss, learning_rate=cfg.lr, num_iterations=cfg.num_iterations,  # type: ignore[arg-type]
                          temperature=cfg.temperature, seed=cfg.seed),
        model=model_dir, steps=cfg.steps, grade=GradeOptions(concurrency=cfg.grade_concurrency, test_timeout=60.0),
        engine_name="demo-policy", max_context=2048, max_staleness=cfg.max_staleness,
    )
    records: list[StepRecord] = []

    def record(step: OnlineStep) -> None:
        trials, n_graded, rewards, infra = step_rewards(run, step.step)
        r = StepRecord(
            step=step.step, trials=trials, graded=n_graded,
            mean_reward=statistics.fmean(rewards) if rewards else 0.0,
            solve_rate=sum(x >= 1.0 for x in rewards) / len(rewards) if rewards else 0.0,
            infra=infra, rollout_s=step.rollout_s, grade_s=step.grade_s, train_s=step.train_s,
            reload_s=step.reload_s,
            train_metrics={k: step.metrics[k] for k in REPORTED_METRICS if k in step.metrics},
        )
        records.append(r)
        log(f"step {r.step}: reward {r.mean_reward:.3f} over {n_graded} trial(s) ({infra} infra); "
            f"rollout {r.rollout_s:.0f} s, grade {r.grade_s:.0f} s, train {r.train_s:.0f} s")
        if on_record is not None:
            on_record(records)

    def phase(step: int, name: str) -> Any:
        return console.status(f"step {step}/{cfg.steps - 1}: {name} …")

    run_online(online, on_step=record, phase=phase)
    return records


def run_demo(cfg: DemoConfig) -> dict[str, Any]:
    """The whole demo; returns (and writes) ``RUN/summary.json``."""
    import torch

    torch.set_num_threads(cfg.threads)
    started = time.perf_counter()
    cfg.run.mkdir(parents=True, exist_ok=True)
    heldout_tasks = prepare_tasks(cfg)
    t0 = time.perf_counter()
    model_dir = prepare_model(cfg)
    warmup_s = time.perf_counter() - t0
    before = held_out(cfg, heldout_tasks, model_dir, model_dir, step=0)
    log(f"held-out before: {_rate(before)}")
    t0 = time.perf_counter()
    records = run_loop(cfg, model_dir, on_record=lambda rs: write_report(cfg, rs))
    loop_s = time.perf_counter() - t0
    latest = Checkpoints(RunDir.at(cfg.run).checkpoints).latest() or model_dir
    after = held_out(cfg, heldout_tasks, latest, model_dir, step=cfg.steps)
    log(f"held-out after:  {_rate(after)}")
    summary = write_summary(cfg, records, before, after, wall_s=time.perf_counter() - started, warmup_s=warmup_s,
                            loop_s=loop_s)
    write_report(cfg, records)
    if cfg.dashboard:
        export_dashboard(cfg.run)
    return summary


def _rate(h: HeldOut) -> str:
    if h.pass_at_1 is None or h.interval is None:
        return "no graded attempt"
    return (f"pass@1 {h.pass_at_1:.3f} [{h.interval[0]:.2f}, {h.interval[1]:.2f}] "
            f"({h.resolved}/{h.tasks} tasks, {h.infra_failures} infra)")


# --------------------------------------------------------------------------- outputs


def cpu_seconds() -> float:
    """CPU time of this process and its waited-for children (the podman CLI calls, the harnesses)."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def write_summary(cfg: DemoConfig, records: list[StepRecord], before: HeldOut, after: HeldOut, *,
                  wall_s: float, warmup_s: float, loop_s: float) -> dict[str, Any]:
    gain = (after.pass_at_1 - before.pass_at_1
            if after.pass_at_1 is not None and before.pass_at_1 is not None else None)
    summary = {
        "summary_version": SUMMARY_VERSION,
        "seed": cfg.seed,
        "harness": cfg.harness,
        "heldout": {"before": asdict(before), "after": asdict(after),
                    "gain": None if gain is None else round(gain, 6)},
        "rewards": [round(r.mean_reward, 6) for r in records],
        "steps": [asdict(r) for r in records],
        "trials_per_step": cfg.tasks * cfg.samples,
        "wall_s": round(wall_s, 1), "warmup_s": round(warmup_s, 1), "loop_s": round(loop_s, 1),
        "cpu_s": round(cpu_seconds(), 1),
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(cfg).items()},
    }
    path = cfg.run / "summary.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(summary, indent=2) + "\n")
    tmp.replace(path)
    return summary


def write_report(cfg: DemoConfig, records: list[StepRecord]) -> None:
    lines = [f"# CPU learning demo — seed {cfg.seed}", "",
             "| step | trials | mean reward | solve rate | infra | rollout s | grade s | train s |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in records:
        lines.append(f"| {r.step} | {r.graded} | {r.mean_reward:.3f} | {r.solve_rate:.3f} | {r.infra} | "
                     f"{r.rollout_s:.0f} | {r.grade_s:.0f} | {r.train_s:.0f} |")
    (cfg.run / "report.md").write_text("\n".join(lines) + "\n")
    plot([(f"seed {cfg.seed}", [r.mean_reward for r in records])], cfg.run / "reward.png")


def export_dashboard(run: Path) -> Path | None:
    from legorl.monitor.dashboard.export import export

    out = run / "dashboard"
    try:
        export([run], out)
    except Exception as e:  # the numbers are already written; a dashboard failure must not hide them
        log(f"dashboard export failed: {e}")
        return None
    return out / "index.html"


def summary_table(summary: dict[str, Any]) -> Any:
    """The terminal's closing table (fits 80 columns)."""
    from rich.table import Table

    table = Table(title=f"legorl CPU demo — seed {summary['seed']}, harness {summary['harness']}",
                  title_justify="left", width=78)
    table.add_column("held-out (greedy, one attempt per task)")
    table.add_column("pass@1", justify="right")
    table.add_column("95% interval", justify="right")
    table.add_column("tasks", justify="right")
    for name in ("before", "after"):
        h = summary["heldout"][name]
        rate = "-" if h["pass_at_1"] is None else f"{h['pass_at_1']:.3f}"
        interval = "-" if h["interval"] is None else f"[{h['interval'][0]:.2f}, {h['interval'][1]:.2f}]"
        table.add_row(f"{name} (step {h['step']})", rate, interval, f"{h['resolved']}/{h['tasks']}")
    gain = summary["heldout"]["gain"]
    table.add_row("gain", "-" if gain is None else f"{gain:+.3f}", "", "")
    rewards = " ".join(f"{r:.2f}" for r in summary["rewards"])
    table.caption = (f"training reward by step: {rewards}\n"
                     f"wall {summary['wall_s'] / 60:.1f} min (loop {summary['loop_s'] / 60:.1f} min), "
                     f"CPU {summary['cpu_s'] / 60:.1f} min")
    table.caption_justify = "left"
    return table


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
