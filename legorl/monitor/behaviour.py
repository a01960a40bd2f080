"""Behaviour analytics: what the agent actually does, measured from trial rows.

Every figure is computed from one :class:`~legorl.core.schemas.TrialRow` (its conversation, calls and
segments) by :func:`trial_behaviour`, then averaged per policy step and harness by
:func:`aggregate` (:mod:`legorl.monitor.behaviour_summary`). Infrastructure failures are left out
of every average (and counted), since they say nothing about the policy.

What counts as editing, reading, testing and submitting is decided by one table, :data:`RULES`,
over the tool shapes the supported harnesses use: shell tools (``bash``, ``terminal``,
``execute_bash``, ...) whose command is matched by a regular expression, and structured tools
(``str_replace_based_edit_tool``, ``file_editor``, ``edit``, ``write``, ``read``, ``view``,
``finish``, ...). A trial is *self-verifying* when, after its last edit and before it submits, it
reads an edited file again (``cat``, ``sed -n``, ``git diff``, a ``view``/``read`` tool) or runs
tests.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any

from legorl.core.schemas import BUDGET_STOP_OUTCOMES, SegmentReason, TrialRow


class Action(StrEnum):
    EDIT = "edit"
    READ = "read"
    TEST = "test"
    SUBMIT = "submit"


@dataclass(frozen=True)
class Rule:
    """One detector: calls of ``tools`` whose argument ``args`` matches ``pattern`` are ``action``.

    ``pattern`` None matches any call of the tool. A named group ``path`` in the pattern, or one
    of :data:`PATH_ARGS` in the call's arguments, tells which file the action touched.
    """

    action: Action
    tools: frozenset[str]
    args: tuple[str, ...] = ()
    pattern: re.Pattern[str] | None = None


def _rule(action: Action, tools: Iterable[str], pattern: str | None = None, args: tuple[str, ...] = ()) -> Rule:
    compiled = re.compile(pattern, re.IGNORECASE | re.MULTILINE) if pattern is not None else None
    return Rule(action, frozenset(t.lower() for t in tools), args, compiled)


SHELL_TOOLS = ("bash", "terminal", "execute_bash", "shell", "run_command", "execute_command", "run_shell_command")
EDITOR_TOOLS = ("str_replace_based_edit_tool", "str_replace_editor", "file_editor", "text_editor")
COMMAND_ARGS = ("command", "cmd")
PATH_ARGS = ("path", "file_path", "filePath", "filename", "notebook_path")

_PATH = r"(?P<path>[^\s;&|<>'\"]+)"
_QUOTED_OR_WORD = r"(?:'[^']*'|\"[^\"]*\"|[^\s'\"]+)"

# The detector table. Order does not matter: a call gets every action whose rule matches it.
RULES: tuple[Rule, ...] = (
    # --- shell commands (mini-swe-agent's bash, OpenHands' terminal, Claude Code's Bash, ...)
    _rule(Action.EDIT, SHELL_TOOLS, rf"\bsed\s+(?:-\w*i\w*|--in-place)\S*(?:\s+-e)?(?:\s+{_QUOTED_OR_WORD}\s+{_PATH})?", COMMAND_ARGS),
    _rule(Action.EDIT, SHELL_TOOLS, rf"\bperl\s+-\w*i\w*\S*(?:\s+-e)?(?:\s+{_QUOTED_OR_WORD}\s+{_PATH})?", COMMAND_ARGS),
    _rule(Action.EDIT, SHELL_TOOLS, rf"\b(?:cat|echo|printf)\b[^|;&\n]*?(?<![0-9&>])>>?\s*(?!/dev/null){_PATH}", COMMAND_ARGS),
    _rule(Action.EDIT, SHELL_TOOLS, rf"\btee\s+(?:-a\s+)?{_PATH}", COMMAND_ARGS),
    _rule(Action.EDIT, SHELL_TOOLS, r"\bgit\s+apply\b|\bpatch\s+-p\d", COMMAND_ARGS),
    _rule(Action.READ, SHELL_TOOLS, rf"\b(?:cat|head|tail|nl|less|more|bat)\s+(?:-\S+\s+)*(?![<>-]){_PATH}(?![^\n;&|]*>)", COMMAND_ARGS),
    _rule(Action.READ, SHELL_TOOLS, rf"\bsed\s+-n\s+{_QUOTED_OR_WORD}\s+{_PATH}", COMMAND_ARGS),
    _rule(Action.READ, SHELL_TOOLS, r"\bgit\s+(?:diff|show)\b", COMMAND_ARGS),
    _rule(
        Action.TEST,
        SHELL_TOOLS,
        r"\bpytest\b|\bpython[\d.]*\s+-m\s+(?:pytest|unittest)\b|\btox\b|\bnox\b|manage\.py\s+test\b"
        r"|\bruntests\.py\b|\b(?:go|cargo|npm|yarn|pnpm)\s+test\b|\bmake\s+(?:test|check)\b"
        r"|\bpython[\d.]*\s+(?:\S+/)?(?:test|tests|repro|reproduce|check|verify)\w*\.py\b",
        COMMAND_ARGS,
    ),
    _rule(Action.SUBMIT, SHELL_TOOLS, r"COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT", COMMAND_ARGS),
    # --- structured editors with a sub-command (Anthropic's text editor, OpenHands' file_editor)
    _rule(Action.EDIT, EDITOR_TOOLS, r"^\s*(?:create|str_replace|insert|undo_edit|write)\s*$", ("command",)),
    _rule(Action.READ, EDITOR_TOOLS, r"^\s*view\s*$", ("command",)),
    # --- one-purpose tools (OpenCode, Claude Code, others)
    _rule(Action.EDIT, ("edit", "write", "multiedit", "apply_patch", "patch", "notebookedit", "create_file",
                        "edit_file", "write_file", "replace_in_file")),
    _rule(Action.READ, ("read", "view", "read_file", "open_file", "view_file")),
    _rule(Action.TEST, ("run_tests", "run_test")),
    _rule(Action.SUBMIT, ("finish", "submit", "task_complete", "attempt_completion")),
)

_SHELL = frozenset(SHELL_TOOLS)
_FENCE = re.compile(r"```(?:bash|sh|shell)?\s*\n(.*?)```", re.DOTALL)
_THINK = re.compile(r"<think>(.*?)(?:</think>|$)", re.DOTALL)


@dataclass(frozen=True)
class Event:
    """One classified tool call: which turn, which tool, which actions, which files."""

    turn: int
    tool: str
    actions: tuple[Action, ...]
    paths: tuple[str, ...] = ()


def _arguments(raw: Any) -> dict[str, Any]:
    if isinstance(raw, Mapping):
        return dict(raw)
    if isinstance(raw, str):
        try:
            parsed = json.loads(raw) if raw.strip() else {}
        except json.JSONDecodeError:
            return {"command": raw}  # unparsable arguments: match the raw text as a command
        return parsed if isinstance(parsed, dict) else {"command": raw}
    return {}


def classify_call(tool: str, arguments: Mapping[str, Any] | str, turn: int = 0) -> Event:
    """Classify one tool call by :data:`RULES`."""
    name = tool.lower()
    args = _arguments(arguments)
    actions: list[Action] = []
    paths: list[str] = []
    for arg_name in PATH_ARGS:
        value = args.get(arg_name)
        if isinstance(value, str) and value:
            paths.append(value)
    for rule in RULES:
        if name not in rule.tools:
            continue
        if rule.pattern is None:
            matched = True
        else:
            matched = False
            for arg_name in rule.args:
                text = args.get(arg_name)
                if not isinstance(text, str):
                    continue
                for match in rule.pattern.finditer(text):
                    matched = True
                    path = match.groupdict().get("path")
                    if path and name in _SHELL:
                        paths.append(path)
        if matched and rule.action not in actions:
            actions.append(rule.action)
    return Event(turn, tool, tuple(actions), tuple(dict.fromkeys(paths)))


def _same_file(a: str, b: str) -> bool:
    a, b = a.removeprefix("./").rstrip("/"), b.removeprefix("./").rstrip("/")
    return a == b or a.endswith("/" + b) or b.endswith("/" + a)


def self_verifies(events: Sequence[Event]) -> bool:
    """After the last edit (before the first submit), does the agent re-read an edited file or run tests?

    A read whose file is unknown (``git diff``), or an edit whose file is unknown, counts as a match.
    """
    until = next((i for i, e in enumerate(events) if Action.SUBMIT in e.actions), len(events))
    window = events[:until]
    last_edit = max((i for i, e in enumerate(window) if Action.EDIT in e.actions), default=None)
    if last_edit is None:
        return False
    edited: list[str] = []
    unknown_edit = False
    for e in window[: last_edit + 1]:
        if Action.EDIT in e.actions:
            edited.extend(e.paths)
            unknown_edit = unknown_edit or not e.paths
    for e in window[last_edit + 1 :]:
        if Action.TEST in e.actions:
            return True
        if Action.READ in e.actions:
            if unknown_edit or not e.paths:
                return True
            if any(_same_file(r, w) for r in e.paths for w in edited):
                return True
    return False


@dataclass(slots=True)
class TrialBehaviour:
    """Per-trial figures. Shares are None where their denominator is zero."""

    trial_id: str
    step: int
    harness: str
    infra_failure: bool
    turns: int
    assistant_turns: int
    model_tokens: int
    env_tokens: int
    tool_calls: int
    text_only_turns: int
    reasoning_chars: int
    response_chars: int
    edits: int
    reads: int
    test_runs: int
    submitted: bool
    self_verifying: bool
    forks: int
    parse_errors: int
    budget_stops: int
    events: list[Event] = field(default_factory=list)

    @property
    def edited(self) -> bool:
        return self.edits > 0

    @property
    def ran_tests(self) -> bool:
        return self.test_runs > 0


_BUDGET_OUTCOMES = frozenset(BUDGET_STOP_OUTCOMES.values())


def _text(content: Any) -> str:
    """Message content as text: a string, or the text parts of a content-part list."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, Mapping) and isinstance(p.get("text"), str))
    return ""


def analyse_conversation(messages: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Count turns, tool calls, text-only turns and reasoning, and classify every tool call."""
    assistant = 0
    tool_calls = 0
    text_only = 0
    reasoning = 0
    response = 0
    events: list[Event] = []
    for message in messages:
        if message.get("role") != "assistant":
            continue
        turn = assistant
        assistant += 1
        content = _text(message.get("content"))
        thinking = "".join(_THINK.findall(content))
        visible = _THINK.sub("", content)
        for key in ("reasoning_content", "reasoning", "thinking"):
            extra = message.get(key)
            if isinstance(extra, str):
                thinking += extra
        calls = message.get("tool_calls") or []
        args_chars = 0
        for call in calls:
            fn = call.get("function") or {}
            raw = fn.get("arguments", "")
            args_chars += len(raw) if isinstance(raw, str) else len(json.dumps(raw))
            events.append(classify_call(str(fn.get("name", "")), raw, turn))
        if not calls:
            # Text-mode harnesses put the command in a fenced block; classify it as a shell call,
            # but the turn still counts as text-only (no tool call was made).
            for block in _FENCE.findall(visible):
                event = classify_call("bash", {"command": block}, turn)
                if event.actions:
                    events.append(event)
            text_only += 1
        tool_calls += len(calls)
        reasoning += len(thinking)
        response += len(thinking) + len(visible) + args_chars
    return {
        "assistant_turns": assistant,
        "tool_calls": tool_calls,
        "text_only_turns": text_only,
        "reasoning_chars": reasoning,
        "response_chars": response,
        "events": events,
    }


def segment_token_counts(row: TrialRow) -> list[tuple[str, int, int]]:
    """``(reason, model tokens, environment tokens)`` per segment: loss_mask 1 vs 0."""
    out = []
    for seg in row.segments:
        sampled = int(sum(seg.loss_mask))
        out.append((str(seg.reason), sampled, len(seg.loss_mask) - sampled))
    return out


_FORK_REASONS = frozenset({SegmentReason.REWRITE, SegmentReason.SUBAGENT})


def trial_behaviour(row: TrialRow, token_counts: Sequence[tuple[str, int, int]] | None = None) -> TrialBehaviour:
    """All per-trial behaviour figures of one trial row.

    ``token_counts`` (from :func:`segment_token_counts`, or computed vectorised by a loader) saves
    walking the token lists again. Turns are the model calls outside auxiliary segments (the
    conversation may have been compacted); tool calls, text-only turns and reasoning are measured
    on the assistant messages of the conversation.
    """
    counts = list(token_counts) if token_counts is not None else segment_token_counts(row)
    conv = analyse_conversation(row.conversation())
    events: list[Event] = conv["events"]
    aux_segments = {i for i, (reason, _, _) in enumerate(counts) if reason == SegmentReason.AUXILIARY}
    calls = [c for c in row.calls if c.segment not in aux_segments]
    turns = len(calls) if row.calls else conv["assistant_turns"]
    return TrialBehaviour(
        trial_id=row.trial_id,
        step=row.step,
        harness=row.harness,
        infra_failure=bool(row.infra_failure),
        turns=turns,
        assistant_turns=conv["assistant_turns"],
        model_tokens=sum(m for _, m, _ in counts),
        env_tokens=sum(e for _, _, e in counts),
        tool_calls=conv["tool_calls"],
        text_only_turns=conv["text_only_turns"],
        reasoning_chars=conv["reasoning_chars"],
        response_chars=conv["response_chars"],
        edits=sum(Action.EDIT in e.actions for e in events),
        reads=sum(Action.READ in e.actions for e in events),
        test_runs=sum(Action.TEST in e.actions for e in events),
        submitted=any(Action.SUBMIT in e.actions for e in events) or row.outcome == "submitted",
        self_verifying=self_verifies(events),
        forks=sum(reason in _FORK_REASONS for reason, _, _ in counts),
        parse_errors=sum(1 for c in row.calls if c.parse_error),
        # the proxy's stops, else an outcome of the same kind the harness (its own turn limit) or the host reached
        budget_stops=sum(1 for c in row.calls if c.budget_stop) or int(row.outcome in _BUDGET_OUTCOMES),
        events=events,
    )


def behaviour_dict(t: TrialBehaviour) -> dict[str, Any]:
    """A trial's figures as plain JSON-able data (events included)."""
    data = asdict(t)
    data["events"] = [
        {"turn": e.turn, "tool": e.tool, "actions": [str(a) for a in e.actions], "paths": list(e.paths)}
        for e in t.events
    ]
    return data
