"""pass@k with the unbiased estimator, and pass@k tables per harness and per repository.

For a problem attempted ``n`` times with ``c`` correct attempts, Chen et al. (2021) estimate the
chance that at least one of ``k`` attempts drawn without replacement is correct as
``1 - C(n-c, k) / C(n, k)``, computed as the product ``1 - prod_{i=n-c+1}^{n} (1 - k/i)`` so that no
huge binomial coefficient is ever formed. A table averages it over problems that have at least
``k`` attempts. An attempt lost to an infrastructure failure that no retry recovered counts as
an incorrect attempt (in ``n``, never in ``c``) and is also counted apart: a policy must not look
better by landing its hard tasks in infrastructure failures. Attempts not yet graded are left out.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k for ``n`` attempts with ``c`` correct (Chen et al. 2021, numerically stable)."""
    if n < 0 or c < 0 or k < 1:
        raise ValueError(f"pass_at_k needs n >= 0, c >= 0, k >= 1 (got n={n}, c={c}, k={k})")
    if c > n:
        raise ValueError(f"pass_at_k: c={c} correct out of n={n} attempts")
    if k > n:
        raise ValueError(f"pass_at_k: k={k} exceeds the n={n} attempts")
    if n - c < k:
        return 1.0
    product = 1.0
    for i in range(n - c + 1, n + 1):
        product *= 1.0 - k / i
    return 1.0 - product


def wilson_interval(successes: int, n: int, z: float = 1.96) -> tuple[float, float] | None:
    """The Wilson score interval (95 % for z = 1.96) of a rate of ``successes`` out of ``n`` trials."""
    if n <= 0:
        return None
    if not 0 <= successes <= n:
        raise ValueError(f"wilson_interval: {successes} successes out of {n}")
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


@dataclass
class Problem:
    """The attempts at one task by one harness."""

    task_id: str
    harness: str
    repo: str
    n: int = 0  # graded attempts, unrecovered infrastructure failures included (as incorrect)
    c: int = 0  # of which resolved
    infra: int = 0
    pending: int = 0  # not graded yet


@dataclass
class PassKRow:
    """pass@k over a set of problems."""

    tasks: int = 0
    attempts: int = 0
    resolved: int = 0
    infra_failures: int = 0
    pending: int = 0
    pass_at: dict[int, float | None] = field(default_factory=dict)
    tasks_counted: dict[int, int] = field(default_factory=dict)  # problems with n >= k

    @property
    def pass_at_1_interval(self) -> tuple[float, float] | None:
        """95 % Wilson interval of pass@1 over the graded attempts (exact for one attempt per task;
        with several, attempts at one task are treated as independent, which narrows it a little)."""
        return wilson_interval(self.resolved, self.attempts)

    def to_dict(self) -> dict[str, Any]:
        interval = self.pass_at_1_interval
        return {
            "tasks": self.tasks,
            "attempts": self.attempts,
            "resolved": self.resolved,
            "infra_failures": self.infra_failures,
            "pending": self.pending,
            "pass_at": {str(k): _round(v) for k, v in sorted(self.pass_at.items())},
            "tasks_counted": {str(k): v for k, v in sorted(self.tasks_counted.items())},
            "pass_at_1_interval": None if interval is None else [_round(interval[0]), _round(interval[1])],
        }


def _round(v: float | None) -> float | None:
    return None if v is None else round(v, 6)


def summarize(problems: Sequence[Problem], ks: Sequence[int]) -> PassKRow:
    """Mean pass@k over ``problems`` for each k (problems with fewer than k attempts are skipped)."""
    row = PassKRow(
        tasks=len(problems),
        attempts=sum(p.n for p in problems),
        resolved=sum(p.c for p in problems),
        infra_failures=sum(p.infra for p in problems),
        pending=sum(p.pending for p in problems),
    )
    for k in ks:
        values = [pass_at_k(p.n, p.c, k) for p in problems if p.n >= k]
        row.pass_at[k] = sum(values) / len(values) if values else None
        row.tasks_counted[k] = len(values)
    return row


def default_ks(problems: Iterable[Problem]) -> list[int]:
    """1, the powers of two up to the largest attempt count, and that count itself."""
    n_max = max((p.n for p in problems), default=1)
    ks = {1, max(1, n_max)}
    k = 2
    while k < n_max:
        ks.add(k)
        k *= 2
    return sorted(ks)


def tables(problems: Sequence[Problem], ks: Sequence[int]) -> dict[str, Any]:
    """Overall, per-harness and per-repository pass@k (per-harness and per-repo keys sorted)."""
    by_harness: dict[str, list[Problem]] = defaultdict(list)
    by_repo: dict[str, list[Problem]] = defaultdict(list)
    for p in problems:
        by_harness[p.harness].append(p)
        by_repo[p.repo].append(p)
    return {
        "ks": list(ks),
        "overall": summarize(problems, ks).to_dict(),
        "by_harness": {h: summarize(ps, ks).to_dict() for h, ps in sorted(by_harness.items())},
        "by_repo": {r: summarize(ps, ks).to_dict() for r, ps in sorted(by_repo.items())},
    }
