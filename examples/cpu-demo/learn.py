"""The CPU learning demo: N steps of rollout → grade → train → reload through legorl's real stages,
then a reward-over-steps report (``report.md``, ``report.json``, ``reward.png`` in the run directory).

    python examples/cpu-demo/learn.py --run runs/demo-s0 --seed 0 --steps 10

Every option of :class:`demo_loop.DemoConfig` is a flag (``--warmup-steps``, ``--lr``, ...).
Rerunning with the same ``--run`` resumes.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import asdict
from pathlib import Path

from demo_loop import DemoConfig, log, run_loop


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", type=Path, required=True)
    for name, value in asdict(DemoConfig(run=Path("."))).items():
        if name != "run":
            ap.add_argument("--" + name.replace("_", "-"), type=type(value) if value is not None else Path,
                            default=value)
    cfg = DemoConfig(**vars(ap.parse_args()))
    t0 = time.perf_counter()
    records = run_loop(cfg)
    log(f"done: {len(records)} step(s) in {(time.perf_counter() - t0) / 60:.1f} min; report: {cfg.run / 'report.md'}")


if __name__ == "__main__":
    main()
