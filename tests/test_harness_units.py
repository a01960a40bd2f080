"""Harness mechanics that need no container: outcomes, URLs, process-group kills, installs, the CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from legorl.core.errors import LegorlError
from legorl.core.schemas import Outcome
from legorl.harnesses import HARNESSES, parse_names
from legorl.harnesses.base import (
    End,
    HarnessRun,
    Launch,
    ProxyView,
    classify,
    json_lines,
    run_on_host,
)
from legorl.harnesses.install import RECIPES, find_python, installed, recipe

LEGORL = str(Path(sys.executable).parent / "legorl")


def _run(end: End, exit_code: int | None = 0, timed_out: bool = False) -> HarnessRun:
    return HarnessRun(end, None, exit_code, timed_out, 1.0, Path("/dev/null"))


@pytest.mark.parametrize(
    ("run", "proxy", "alive", "patch", "want"),
    [
        # the agent can kill its own container: its outcome, unless the policy never spoke
        (_run(End.SUBMITTED), ProxyView(calls=3), False, "p", Outcome.HARNESS_CRASH),
        (_run(End.CRASHED, None), ProxyView(calls=0), False, None, Outcome.INFRA_ERROR),
        (_run(End.CRASHED, 1), ProxyView(calls=2, engine_error="boom"), True, None, Outcome.INFRA_ERROR),
        (_run(End.SUBMITTED), ProxyView(calls=2, engine_error="boom"), False, "p", Outcome.INFRA_ERROR),
        (_run(End.UNKNOWN, None, timed_out=True), ProxyView(calls=9), True, "p", Outcome.TIMEOUT),
        (_run(End.FINISHED), ProxyView(calls=5, budget_stop="max_turns"), True, "p", Outcome.MAX_TURNS),
        (_run(End.FINISHED), ProxyView(calls=5, budget_stop="context_overflow"), True, "", Outcome.CONTEXT_OVERFLOW),
        (_run(End.FINISHED), ProxyView(calls=5, budget_stop="max_total_tokens"), True, "", Outcome.BUDGET),
        # the proxy's graceful wall-clock stop is the trial's timeout (the hard kill is further out)
        (_run(End.FINISHED), ProxyView(calls=5, budget_stop="max_wall_time"), True, "p", Outcome.TIMEOUT),
        (_run(End.FINISHED), ProxyView(calls=5, budget_stop="max_gpu_hours"), True, "p", Outcome.BUDGET),  # a newer proxy's
        # a harness's claim of an API error the proxy did not record is the harness's (the agent's)
        (_run(End.API_ERROR, 1), ProxyView(calls=1), True, None, Outcome.HARNESS_CRASH),
        (_run(End.CRASHED, 1), ProxyView(calls=0), True, None, Outcome.INFRA_ERROR),  # never reached the model
        (_run(End.SUBMITTED, 0), ProxyView(calls=0), True, "p", Outcome.INFRA_ERROR),  # no policy output at all
        (_run(End.UNKNOWN, None, timed_out=True), ProxyView(calls=0), True, None, Outcome.INFRA_ERROR),
        (_run(End.CRASHED, 1), ProxyView(calls=2), True, None, Outcome.HARNESS_CRASH),
        (_run(End.FINISHED), ProxyView(calls=2), True, "diff", Outcome.SUBMITTED),
        (_run(End.FINISHED), ProxyView(calls=2), True, "", Outcome.NO_SUBMISSION),
        (_run(End.SUBMITTED), ProxyView(calls=2), True, "", Outcome.SUBMITTED),
        (_run(End.GAVE_UP, 0), ProxyView(calls=3), True, None, Outcome.NO_SUBMISSION),
        (_run(End.MAX_TURNS), ProxyView(calls=3), True, None, Outcome.MAX_TURNS),
        (_run(End.UNKNOWN, 0), ProxyView(calls=3), True, None, Outcome.NO_SUBMISSION),
        (_run(End.UNKNOWN, 2), ProxyView(calls=3), True, None, Outcome.HARNESS_CRASH),
    ],
)
def test_classify(run: HarnessRun, proxy: ProxyView, alive: bool, patch: str | None, want: Outcome) -> None:
    outcome, _ = classify(run, proxy, alive, patch)
    assert outcome == want


def test_every_budget_stop_has_its_outcome() -> None:
    from legorl.core.schemas import BUDGET_STOP_OUTCOMES, BudgetStop
    from legorl.proxy.budgets import Budgets

    assert set(BUDGET_STOP_OUTCOMES) == set(BudgetStop)
    # what the proxy records is one of them
    budgets = Budgets(max_turns=1, max_total_tokens=1, max_wall_s=1.0)
    stops = [budgets.check_before_call(1, 0, time.time()), budgets.check_before_call(0, 1, time.time()),
             budgets.check_before_call(0, 0, 0.0)]
    assert stops == [BudgetStop.MAX_TURNS, BudgetStop.MAX_TOTAL_TOKENS, BudgetStop.MAX_WALL_TIME]


def test_adapters_are_abstract_until_they_write_their_hooks() -> None:
    from legorl.harnesses import HARNESSES, BaseHarness, ProcessHarness
    from legorl.harnesses.simple import SimpleHarness

    class Half(ProcessHarness):
        name = "half"
        in_container = False

        def launch(self, trial, paths, sandbox):  # type: ignore[no-untyped-def]
            raise AssertionError("never launched")

    for abstract in (BaseHarness, ProcessHarness, Half):
        with pytest.raises(TypeError, match="abstract"):
            abstract()  # type: ignore[abstract]
    assert issubclass(SimpleHarness, BaseHarness) and not issubclass(SimpleHarness, ProcessHarness)
    for cls in HARNESSES.values():
        cls()  # every registered adapter is complete


def test_json_lines_skips_noise(tmp_path: Path) -> None:
    log = tmp_path / "log"
    log.write_text('starting\n{"type": "a"}\n{broken\n[1]\n  {"type": "b"}\n')
    assert [e["type"] for e in json_lines(log)] == ["a", "b"]
    (tmp_path / "link").symlink_to(log)
    assert json_lines(tmp_path / "link") == []  # never follows a link planted in the trial folder


@pytest.mark.parametrize("content", ["", "{not json", "[1, 2]", '{"status": ' * 5000, None])
def test_garbled_or_missing_results_are_the_harness_crash(content: str | None, tmp_path: Path) -> None:
    from legorl.harnesses.base import ProcResult, TrialPaths
    from legorl.harnesses.mini_swe_agent import MiniSweAgent
    from legorl.harnesses.openhands import OpenHands

    if content is not None:
        (tmp_path / "result.json").write_text(content)
    paths, proc = TrialPaths(tmp_path, str(tmp_path)), ProcResult(1, False, 1.0, "boom")
    for harness in (MiniSweAgent(), OpenHands()):
        assert harness.read_end(paths, proc)[0] is End.CRASHED


def test_host_timeout_kills_the_whole_process_group(tmp_path: Path) -> None:
    marker = tmp_path / "child.pid"
    script = f"sleep 300 & echo $! > {marker}; wait"
    start = time.monotonic()
    res = run_on_host(Launch(["sh", "-c", script], dict(os.environ)), 1.0, tmp_path / "log", tmp_path)
    assert res.timed_out and time.monotonic() - start < 10
    child = int(marker.read_text())
    time.sleep(0.2)
    state = Path(f"/proc/{child}/stat")
    assert not state.exists() or state.read_text().split()[2] == "Z"  # gone (or a reaped-soon zombie)


def test_harness_names() -> None:
    assert set(RECIPES) == {"mini-swe-agent", "openhands", "terminus-2", "opencode", "claude-code", "codex",
                            "qwen-code", "pi", "aider"}
    assert set(RECIPES) <= set(HARNESSES)
    assert parse_names("all") == list(RECIPES)
    assert parse_names("opencode, mini-swe-agent") == ["opencode", "mini-swe-agent"]
    with pytest.raises(LegorlError, match="unknown harness 'swe-agent'"):
        parse_names("swe-agent")
    with pytest.raises(LegorlError):
        recipe("nope")


def test_recipes_are_pinned() -> None:
    for r in RECIPES.values():
        assert r.version and all(("==" in p or "@" in p or p.startswith("litellm")) for p in r.packages)
        assert any(r.version in p for p in r.packages)


def test_find_python() -> None:
    exe = find_python((3, 11))
    assert subprocess.run([exe, "-c", "import sys; assert sys.version_info >= (3, 11)"]).returncode == 0
    with pytest.raises(LegorlError, match="--python"):
        find_python((3, 12), explicit="/bin/true")


@pytest.mark.heavy
def test_harness_list_json() -> None:
    proc = subprocess.run([LEGORL, "harness", "list", "--json"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    rows = {r["name"]: r for r in json.loads(proc.stdout)}
    assert set(rows) == set(RECIPES)
    for name, row in rows.items():
        assert row["version"] == RECIPES[name].version
        assert row["installed"] == (installed(name) is not None)
        if row["installed"]:
            assert row["works"], row


@pytest.mark.heavy
def test_rollout_cli_needs_one_engine(tmp_path: Path) -> None:
    proc = subprocess.run([LEGORL, "rollout", "--run", str(tmp_path), "--harness", "opencode"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "exactly one of --model" in proc.stderr
    proc = subprocess.run([LEGORL, "rollout", "--run", str(tmp_path), "--harness", "nope", "--proxy", "http://x"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "unknown harness 'nope'" in proc.stderr
