"""The CPU learning demo over seeds: held-out pass@1 before → after per seed, the mean gain against
the seeds' spread, time per seed, and one plot with every seed's training-reward curve.

    python examples/cpu-demo/summarize.py runs/demo-seeds/s0 runs/demo-seeds/s1 ... --out runs/demo-seeds

Reads each run's ``summary.json`` (written by ``learn.py``); writes ``results.md``, ``results.json``
and ``reward.png`` into ``--out``. The bar (issue #13): every seed gains at least +0.15 held-out
pass@1 and the mean gain is at least 3x the seeds' standard deviation.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from demo_loop import plot

MIN_GAIN = 0.15
SPREAD_FACTOR = 3.0


def _interval(h: dict[str, Any]) -> str:
    if h["pass_at_1"] is None or h["interval"] is None:
        return "-"
    return f"{h['pass_at_1']:.3f} [{h['interval'][0]:.2f}, {h['interval'][1]:.2f}]"


def table(seeds: list[dict[str, Any]]) -> tuple[list[str], dict[str, Any]]:
    lines = ["| seed | held-out tasks | pass@1 before [95% CI] | pass@1 after [95% CI] | gain | trials/step "
             "| loop min | wall min | CPU min |",
             "| ---: | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for s in seeds:
        h = s["heldout"]
        gain = "-" if h["gain"] is None else f"{h['gain']:+.3f}"
        lines.append(f"| {s['seed']} | {h['before']['tasks']} | {_interval(h['before'])} | {_interval(h['after'])} "
                     f"| {gain} | {s['trials_per_step']} | {s['loop_s'] / 60:.1f} | {s['wall_s'] / 60:.1f} "
                     f"| {s['cpu_s'] / 60:.1f} |")
    gains = [s["heldout"]["gain"] for s in seeds if s["heldout"]["gain"] is not None]
    verdict: dict[str, Any] = {"seeds": len(seeds), "gains": gains}
    if gains:
        mean = statistics.fmean(gains)
        std = statistics.stdev(gains) if len(gains) > 1 else 0.0
        met = len(gains) == len(seeds) and min(gains) >= MIN_GAIN and mean >= SPREAD_FACTOR * std
        verdict |= {"mean_gain": round(mean, 4), "std_gain": round(std, 4), "min_gain": round(min(gains), 4),
                    "bar_met": met}
        lines += ["", f"mean gain {mean:+.3f}, std {std:.3f}, smallest gain {min(gains):+.3f}; bar (every gain "
                      f">= {MIN_GAIN} and mean >= {SPREAD_FACTOR:g}x std): {'met' if met else 'NOT met'}"]
    return lines, verdict


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", type=Path, nargs="+")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    seeds = []
    for run in args.runs:
        path = run / "summary.json"
        if not path.is_file():
            raise SystemExit(f"{path}: missing (did `learn.py --run {run}` finish?)")
        seeds.append(json.loads(path.read_text()))
    lines, verdict = table(seeds)
    rewards = ["", "Training reward by step (mean over the step's trials):", "",
               "| step | " + " | ".join(f"seed {s['seed']}" for s in seeds) + " |",
               "| ---: |" + " ---: |" * len(seeds)]
    for i in range(max(len(s["rewards"]) for s in seeds)):
        cells = [f"{s['rewards'][i]:.3f}" if i < len(s["rewards"]) else "" for s in seeds]
        rewards.append(f"| {i} | " + " | ".join(cells) + " |")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.md").write_text("\n".join(lines + rewards) + "\n")
    (args.out / "results.json").write_text(json.dumps({"verdict": verdict, "seeds": seeds}, indent=2) + "\n")
    plot([(f"seed {s['seed']}", s["rewards"]) for s in seeds], args.out / "reward.png")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
