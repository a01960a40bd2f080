"""Behaviour analytics on hand-made trajectories."""

from __future__ import annotations

import json
from typing import Any

import pytest
from monitor_runs import assistant, call, tool

from legorl.core.schemas import Call, Outcome, Segment, SegmentReason, TrialRow
from legorl.monitor.behaviour import Action, classify_call, trial_behaviour
from legorl.monitor.behaviour_summary import aggregate, summarize


def trial(messages: list[dict[str, Any]], *, segments: list[Segment] | None = None, calls: list[Call] | None = None,
          harness: str = "h", step: int = 0, sample: int = 0, **kw: Any) -> TrialRow:
    kw.setdefault("outcome", Outcome.SUBMITTED)
    return TrialRow.new("t1", harness, step, sample, messages=json.dumps(messages), segments=segments or [],
                        calls=calls or [], **kw)


def conv(*steps: tuple[str, dict[str, Any]], final: str | None = None) -> list[dict[str, Any]]:
    """A conversation: system, user, then one assistant tool call + tool result per step."""
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "sys"}, {"role": "user", "content": "fix it"}]
    for i, (name, args) in enumerate(steps):
        msgs.append(assistant("", call(name, args, f"c{i}")))
        msgs.append(tool(f"c{i}", "ok", name))
    if final is not None:
        msgs.append(assistant(final))
    return msgs


def bash(command: str) -> tuple[str, dict[str, Any]]:
    return ("bash", {"command": command})


# --------------------------------------------------------------------------- the rule table

@pytest.mark.parametrize(
    ("tool_name", "args", "actions", "paths"),
    [
        ("bash", {"command": "sed -i 's/a/b/' src/x.py"}, {Action.EDIT}, ("src/x.py",)),
        ("bash", {"command": "cat > /testbed/x.py <<'EOF'\nprint(1)\nEOF"}, {Action.EDIT}, ("/testbed/x.py",)),
        ("bash", {"command": "cat <<'EOF' > x.py\nprint(1)\nEOF"}, {Action.EDIT}, ("x.py",)),
        ("bash", {"command": "echo 'x = 1' >> conf.py"}, {Action.EDIT}, ("conf.py",)),
        ("bash", {"command": "printf 'a' | tee out.txt"}, {Action.EDIT}, ("out.txt",)),
        ("bash", {"command": "git apply fix.diff"}, {Action.EDIT}, ()),
        ("bash", {"command": "cat src/x.py"}, {Action.READ}, ("src/x.py",)),
        ("bash", {"command": "cat -n src/x.py | head -50"}, {Action.READ}, ("src/x.py",)),
        ("bash", {"command": "sed -n '10,20p' src/x.py"}, {Action.READ}, ("src/x.py",)),
        ("bash", {"command": "git diff"}, {Action.READ}, ()),
        ("bash", {"command": "python -m pytest tests/test_x.py -q"}, {Action.TEST}, ()),
        ("bash", {"command": "cd /testbed && pytest -x"}, {Action.TEST}, ()),
        ("bash", {"command": "python reproduce_issue.py"}, {Action.TEST}, ()),
        ("bash", {"command": "./runtests.py model_fields"}, {Action.TEST}, ()),
        ("bash", {"command": "grep -rn foo src/ | head"}, set(), ()),
        ("bash", {"command": "ls -la 2>/dev/null"}, set(), ()),
        ("bash", {"command": "echo hi 2>&1"}, set(), ()),
        ("bash", {"command": "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"}, {Action.SUBMIT}, ()),
        ("terminal", {"command": "sed -i -e 's/x/y/' a.py && python -m pytest"}, {Action.EDIT, Action.TEST}, ("a.py",)),
        ("Bash", {"command": "pytest -q"}, {Action.TEST}, ()),
        ("str_replace_based_edit_tool", {"command": "str_replace", "path": "/a.py"}, {Action.EDIT}, ("/a.py",)),
        ("str_replace_based_edit_tool", {"command": "view", "path": "/a.py"}, {Action.READ}, ("/a.py",)),
        ("file_editor", {"command": "create", "path": "/b.py", "file_text": "x"}, {Action.EDIT}, ("/b.py",)),
        ("edit", {"filePath": "/c.py", "oldString": "a", "newString": "b"}, {Action.EDIT}, ("/c.py",)),
        ("Edit", {"file_path": "/c.py", "old_string": "a", "new_string": "b"}, {Action.EDIT}, ("/c.py",)),
        ("write", {"filePath": "/d.py", "content": "x"}, {Action.EDIT}, ("/d.py",)),
        ("Read", {"file_path": "/c.py"}, {Action.READ}, ("/c.py",)),
        ("view", {"path": "/c.py"}, {Action.READ}, ("/c.py",)),
        ("finish", {"message": "done"}, {Action.SUBMIT}, ()),
        ("think", {"thought": "sed -i everything"}, set(), ()),
        ("glob", {"pattern": "**/*.py"}, set(), ()),
    ],
)
def test_classify_call(tool_name: str, args: dict[str, Any], actions: set[Action], paths: tuple[str, ...]) -> None:
    event = classify_call(tool_name, json.dumps(args))
    assert set(event.actions) == actions
    assert event.paths == paths


def test_unparsable_arguments_are_matched_as_a_command() -> None:
    assert classify_call("bash", '{"command": "pytest -q"').actions == (Action.TEST,)


# --------------------------------------------------------------------------- self-verification

@pytest.mark.parametrize(
    ("steps", "verifies"),
    [
        # edits then re-reads the same file
        ([bash("sed -i 's/1/2/' /testbed/src/core.py"), bash("cat src/core.py")], True),
        # edits then runs the tests
        ([bash("sed -i 's/1/2/' src/core.py"), bash("python -m pytest tests -q")], True),
        # edits then reads another file only
        ([bash("sed -i 's/1/2/' src/core.py"), bash("cat README.md")], False),
        # reads, then edits, and never looks again
        ([bash("cat src/core.py"), bash("sed -i 's/1/2/' src/core.py")], False),
        # tests ran before the last edit only
        ([bash("sed -i 's/1/2/' a.py"), bash("pytest"), bash("sed -i 's/2/3/' b.py")], False),
        # verification after submitting does not count
        ([bash("sed -i 's/1/2/' a.py"), ("finish", {}), bash("cat a.py")], False),
        # git diff reviews every edit
        ([bash("sed -i 's/1/2/' a.py"), bash("git diff")], True),
        # structured editors
        ([("str_replace_based_edit_tool", {"command": "str_replace", "path": "/t/a.py"}),
          ("str_replace_based_edit_tool", {"command": "view", "path": "/t/a.py"})], True),
        ([("edit", {"filePath": "/t/a.py"}), ("read", {"filePath": "/t/b.py"})], False),
        ([("Edit", {"file_path": "/t/a.py"}), ("Read", {"file_path": "/t/a.py"})], True),
        # no edit at all: nothing to verify
        ([bash("cat a.py"), bash("pytest")], False),
    ],
)
def test_self_verification(steps: list[tuple[str, dict[str, Any]]], verifies: bool) -> None:
    b = trial_behaviour(trial(conv(*steps)))
    assert b.self_verifying is verifies


def test_text_only_trajectory() -> None:
    msgs = [{"role": "system", "content": "sys"}, {"role": "user", "content": "fix it"},
            assistant("I would change line 3."), {"role": "user", "content": "use the tools"}, assistant("Done, I think.")]
    b = trial_behaviour(trial(msgs))
    assert (b.assistant_turns, b.tool_calls, b.text_only_turns) == (2, 0, 2)
    s = summarize([b])
    assert s["text_only_turn_share"] == 1.0
    assert s["text_only_trial_share"] == 1.0
    assert s["tool_calls_per_turn"] == 0.0
    assert s["edit_rate"] == 0.0 and s["self_verification_rate"] is None


def test_text_mode_fenced_command_is_classified_but_still_text_only() -> None:
    msgs = [{"role": "user", "content": "fix"}, assistant("THOUGHT: run tests\n```bash\npython -m pytest -q\n```")]
    b = trial_behaviour(trial(msgs))
    assert b.test_runs == 1 and b.text_only_turns == 1 and b.tool_calls == 0


def test_tool_calls_per_turn_and_test_running() -> None:
    msgs = conv(bash("ls"), bash("pytest -q"), final="done")
    msgs.insert(2, assistant("", call("bash", {"command": "cat a"}, "x1"), call("bash", {"command": "cat b"}, "x2")))
    b = trial_behaviour(trial(msgs))
    assert b.assistant_turns == 4 and b.tool_calls == 4 and b.text_only_turns == 1
    assert b.ran_tests and b.reads == 2
    assert summarize([b])["tool_calls_per_turn"] == 1.0


def test_reasoning_share_counts_tool_arguments_as_response() -> None:
    args = json.dumps({"command": "ls"})  # 17 characters
    msgs = [assistant("<think>abcdefghij</think>12345", call("bash", {"command": "ls"}, "c")),
            {**assistant("xyz"), "reasoning_content": "0123456789"}]
    b = trial_behaviour(trial(msgs))
    assert b.reasoning_chars == 20
    assert b.response_chars == 10 + 5 + len(args) + 10 + 3
    assert summarize([b])["reasoning_share"] == pytest.approx(20 / (28 + len(args)), abs=1e-6)


def test_tokens_forks_parse_errors_and_budget_stops() -> None:
    segments = [
        Segment([1, 2, 3, 4, 5], [0, 0, 1, 1, 1], [0, 0, -0.1, -0.2, -0.3]),
        Segment([6, 7, 8], [0, 1, 1], [0, -0.5, -0.5], reason=SegmentReason.REWRITE, parent=0),
        Segment([9, 10], [0, 1], [0, -1.0], reason=SegmentReason.SUBAGENT, parent=0),
        Segment([11, 12], [0, 1], [0, -1.0], reason=SegmentReason.AUXILIARY),
    ]
    calls = [Call(0, "openai", False, 0, completion_tokens=3), Call(1, "openai", False, 1, completion_tokens=2,
                                                                   parse_error="bad json"),
             Call(2, "openai", False, 2, completion_tokens=1, budget_stop="max_turns"),
             Call(3, "openai", False, 3, completion_tokens=1)]
    b = trial_behaviour(trial(conv(bash("ls")), segments=segments, calls=calls))
    assert (b.model_tokens, b.env_tokens) == (7, 5)
    assert b.forks == 2  # rewrite + subagent; auxiliary is not a fork
    assert b.turns == 3  # the auxiliary call (title generation) is not a turn
    assert b.parse_errors == 1 and b.budget_stops == 1
    # a harness that stops at its own turn limit (no proxy stop on any call) was cut off by a budget too
    for outcome, cut in (("max_turns", 1), ("timeout", 1), ("context_overflow", 1), ("submitted", 0)):
        own = trial_behaviour(trial(conv(bash("ls")), segments=segments, calls=calls[:2], outcome=outcome))
        assert own.budget_stops == cut, outcome


def test_aggregate_per_step_and_harness_excludes_infra() -> None:
    good = trial(conv(bash("sed -i 's/a/b/' x.py"), bash("pytest")), harness="a", sample=0)
    lazy = trial(conv(bash("sed -i 's/a/b/' x.py")), harness="a", sample=1)
    other = trial(conv(bash("ls")), harness="b", step=1)
    infra = TrialRow.new("t1", "a", 0, 2, outcome=Outcome.INFRA_ERROR, infra_failure=True)
    rows = aggregate(trial_behaviour(t) for t in (good, lazy, other, infra))
    keys = [(r["step"], r["harness"]) for r in rows]
    assert keys == [(0, "a"), (0, "all"), (1, "all"), (1, "b")]
    a = rows[0]
    assert a["trials"] == 2 and a["infra_excluded"] == 1
    assert a["edit_rate"] == 1.0 and a["self_verification_rate"] == 0.5 and a["test_run_rate"] == 0.5
