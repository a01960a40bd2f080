"""The CPU learning demo (``make demo``): warm-up → held-out eval → online loop through the real
stages → held-out eval, then ``RUN/summary.json``, ``reward.png``, ``report.md``, the static
dashboard and a summary table.

    python examples/cpu-demo/learn.py --run runs/demo --seed 0

Every field of :class:`demo_loop.DemoConfig` is a flag (``--steps``, ``--lr``, ``--harness``, ...).
Rerunning with the same ``--run`` resumes.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import fields
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from demo_loop import DemoConfig, log, run_demo, summary_table


def parse(argv: list[str] | None = None) -> DemoConfig:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", type=Path, required=True)
    defaults = DemoConfig(run=Path("."))
    for f in fields(DemoConfig):
        if f.name == "run":
            continue
        value = getattr(defaults, f.name)
        flag = "--" + f.name.replace("_", "-")
        if isinstance(value, bool):
            ap.add_argument(flag, action=argparse.BooleanOptionalAction, default=value)
        else:
            ap.add_argument(flag, type=type(value) if value is not None else Path, default=value)
    return DemoConfig(**vars(ap.parse_args(argv)))


def main() -> None:
    from legorl.cli.common import console

    cfg = parse()
    summary = run_demo(cfg)
    console.print(summary_table(summary))
    log(f"summary: {cfg.run / 'summary.json'}   plot: {cfg.run / 'reward.png'}   "
        f"dashboard: {cfg.run / 'dashboard' / 'index.html'}")


if __name__ == "__main__":
    main()
