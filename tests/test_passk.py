"""pass@k: the unbiased estimator against hand-computed and exact values, and the tables."""

from __future__ import annotations

from fractions import Fraction
from math import comb

import pytest
from hypothesis import given
from hypothesis import strategies as st

from legorl.monitor.passk import Problem, default_ks, pass_at_k, summarize, tables


@pytest.mark.parametrize(
    ("n", "c", "k", "expected"),
    [
        (5, 2, 2, 0.7),  # 1 - C(3,2)/C(5,2) = 1 - 3/10
        (10, 3, 1, 0.3),  # pass@1 is the plain success rate
        (6, 2, 3, 0.8),  # 1 - C(4,3)/C(6,3) = 1 - 4/20
        (4, 0, 2, 0.0),
        (4, 4, 1, 1.0),
        (5, 1, 5, 1.0),  # k = n: solved at least once
        (5, 1, 4, 0.8),  # 1 - C(4,4)/C(5,4) = 1 - 1/5
        (1, 0, 1, 0.0),
    ],
)
def test_pass_at_k_hand_computed(n: int, c: int, k: int, expected: float) -> None:
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def _exact(n: int, c: int, k: int) -> Fraction:
    return 1 - Fraction(comb(n - c, k), comb(n, k))


@given(st.integers(1, 40).flatmap(lambda n: st.tuples(st.just(n), st.integers(0, n), st.integers(1, n))))
def test_pass_at_k_matches_exact_binomials(case: tuple[int, int, int]) -> None:
    n, c, k = case
    assert pass_at_k(n, c, k) == pytest.approx(float(_exact(n, c, k)), abs=1e-12)


def test_pass_at_k_is_stable_where_binomials_overflow_floats() -> None:
    # C(2000, 1000) ~ 1e600 overflows a float; the product form does not.
    n, c, k = 2000, 3, 1000
    assert pass_at_k(n, c, k) == pytest.approx(float(_exact(n, c, k)), rel=1e-12)
    assert 0.0 < pass_at_k(2000, 1, 1) < 0.001


@pytest.mark.parametrize(("n", "c", "k"), [(3, 1, 4), (3, 4, 1), (3, 1, 0), (-1, 0, 1)])
def test_pass_at_k_rejects_impossible_inputs(n: int, c: int, k: int) -> None:
    with pytest.raises(ValueError):
        pass_at_k(n, c, k)


def test_summarize_skips_problems_with_too_few_attempts_and_counts_infra() -> None:
    problems = [
        Problem("a", "h", "r1", n=4, c=2, infra=1),  # pass@1 .5, pass@2 1-C(2,2)/C(4,2)=5/6, pass@4 1
        Problem("b", "h", "r1", n=4, c=0),
        Problem("c", "h", "r2", n=2, c=1, pending=2),  # no pass@4
    ]
    row = summarize(problems, [1, 2, 4])
    assert row.tasks == 3 and row.attempts == 10 and row.resolved == 3
    assert row.infra_failures == 1 and row.pending == 2
    assert row.pass_at[1] == pytest.approx((0.5 + 0 + 0.5) / 3)
    assert row.pass_at[2] == pytest.approx((5 / 6 + 0 + 1) / 3)
    assert row.pass_at[4] == pytest.approx((1 + 0) / 2)
    assert row.tasks_counted == {1: 3, 2: 3, 4: 2}


def test_tables_split_by_harness_and_repo() -> None:
    problems = [Problem("a", "x", "r1", n=2, c=2), Problem("a", "y", "r1", n=2, c=0), Problem("b", "x", "r2", n=2, c=1)]
    out = tables(problems, [1])
    assert out["by_harness"]["x"]["pass_at"]["1"] == pytest.approx(0.75)
    assert out["by_harness"]["y"]["pass_at"]["1"] == 0.0
    assert out["by_repo"]["r1"]["pass_at"]["1"] == pytest.approx(0.5)
    assert out["overall"]["pass_at"]["1"] == pytest.approx(0.5)
    assert list(out["by_harness"]) == ["x", "y"]


def test_default_ks() -> None:
    assert default_ks([Problem("a", "h", "r", n=10)]) == [1, 2, 4, 8, 10]
    assert default_ks([Problem("a", "h", "r", n=1)]) == [1]
    assert default_ks([]) == [1]


def test_wilson_interval_matches_the_textbook_values() -> None:
    from legorl.monitor.passk import wilson_interval

    low, high = wilson_interval(6, 24) or (0.0, 0.0)  # 0.25 of 24: the demo's held-out size
    assert (round(low, 3), round(high, 3)) == (0.12, 0.449)
    assert wilson_interval(0, 10) == (0.0, pytest.approx(0.2775, abs=1e-4))
    assert wilson_interval(10, 10) == (pytest.approx(0.7225, abs=1e-4), 1.0)
    assert wilson_interval(0, 0) is None
    with pytest.raises(ValueError, match="3 successes out of 2"):
        wilson_interval(3, 2)


def test_report_rows_carry_the_pass_at_1_interval() -> None:
    from legorl.monitor.passk import Problem, summarize

    row = summarize([Problem("t1", "h", "r", n=1, c=1), Problem("t2", "h", "r", n=1, c=0)], [1]).to_dict()
    assert row["pass_at"]["1"] == 0.5
    low, high = row["pass_at_1_interval"]
    assert low < 0.5 < high and low >= 0.0 and high <= 1.0
    assert summarize([], [1]).to_dict()["pass_at_1_interval"] is None
