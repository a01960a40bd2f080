"""Aggregate the CPU learning demo over seeds: first-steps vs last-steps mean reward, the seeds'
spread, minutes per seed, and one plot with every seed's curve.

    python examples/cpu-demo/summarize.py runs/cpu-demo/s0 runs/cpu-demo/s1 runs/cpu-demo/s2 \
        --k 2 --out examples/cpu-demo

Reads each run's ``report.json`` (written by ``learn.py`` after every step) and the rewards
straight from the run's ``grades/`` shards; writes ``results.md``, ``results.json`` and
``reward.png`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from demo_loop import plot


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("runs", type=Path, nargs="+")
    ap.add_argument("--k", type=int, default=2, help="how many first / last steps to average")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    seeds = []
    for run in args.runs:
        report = json.loads((run / "report.json").read_text())
        steps = report["steps"]
        rewards = [s["mean_reward"] for s in steps]
        seconds = sum(s["rollout_s"] + s["grade_s"] + s["train_s"] + s["reload_s"] for s in steps)
        seeds.append({
            "run": str(run), "seed": report["config"]["seed"], "steps": len(steps), "rewards": rewards,
            "trials_per_step": [s["graded"] for s in steps], "infra": sum(s["infra"] for s in steps),
            "first": statistics.fmean(rewards[: args.k]), "last": statistics.fmean(rewards[-args.k:]),
            "loop_minutes": seconds / 60,
        })
    for s in seeds:
        s["gain"] = s["last"] - s["first"]
    gains = [s["gain"] for s in seeds]
    mean_gain = statistics.fmean(gains)
    spread_gain = statistics.stdev(gains) if len(gains) > 1 else 0.0
    firsts, lasts = [s["first"] for s in seeds], [s["last"] for s in seeds]
    summary = {
        "k": args.k, "seeds": seeds,
        "mean_first": statistics.fmean(firsts), "mean_last": statistics.fmean(lasts),
        "mean_gain": mean_gain, "gain_std": spread_gain,
        "first_std": statistics.stdev(firsts) if len(firsts) > 1 else 0.0,
        "last_std": statistics.stdev(lasts) if len(lasts) > 1 else 0.0,
        "min_gain": min(gains),
    }
    summary["passes"] = mean_gain > spread_gain and min(gains) > 0
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(summary, indent=2))
    lines = [f"| seed | steps | trials/step | first {args.k} steps | last {args.k} steps | gain | loop minutes |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for s in seeds:
        lines.append(f"| {s['seed']} | {s['steps']} | {s['trials_per_step'][0]} | {s['first']:.3f} | {s['last']:.3f} | "
                     f"{s['gain']:+.3f} | {s['loop_minutes']:.1f} |")
    lines += ["", f"mean first {summary['mean_first']:.3f} (std {summary['first_std']:.3f}), "
              f"mean last {summary['mean_last']:.3f} (std {summary['last_std']:.3f}); "
              f"gain {mean_gain:+.3f} vs the seeds' spread of the gain (std) {spread_gain:.3f}; "
              f"smallest gain {min(gains):+.3f}", "",
              "| step | " + " | ".join(f"seed {s['seed']}" for s in seeds) + " |",
              "| ---: | " + " | ".join("---:" for _ in seeds) + " |"]
    for i in range(max(s["steps"] for s in seeds)):
        cells = [f"{s['rewards'][i]:.3f}" if i < len(s["rewards"]) else "" for s in seeds]
        lines.append(f"| {i} | " + " | ".join(cells) + " |")
    (args.out / "results.md").write_text("\n".join(lines) + "\n")
    plot([(f"seed {s['seed']}", s["rewards"]) for s in seeds], args.out / "reward.png")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
