"""What `legorl tasks build` is asked for: how many tasks per library, how hard to mine, how often to check."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

CHECK_RUNS = 3  # runs of each patch in the task check (a test flaky at 50% under both slips past 1 check in 16)


@dataclass
class BuildOptions:
    per_library: int = 8  # tasks to keep per library
    attempts: int = 60  # mutations to try per library at most
    concurrency: int = 2
    timeout: float = 60.0  # per test-suite run while mining
    seed: int = 0
    image: str | None = None
    check_runs: int = CHECK_RUNS  # runs of the gold and the empty patch per task in the check (flaky tests)
    log: Callable[[str], None] = field(default=lambda s: None)
