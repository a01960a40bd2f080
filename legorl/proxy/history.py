"""How a request's history is matched against what a segment holds: a harness's copy of a sampled
assistant turn, the same agent's system prompt up to volatile lines, the same tools.

Harnesses rewrite their history (notes: ../shared/notes/harnesses.md); these rules decide whether a
request extends a segment or forks a new one, and which agent a fork belongs to (:mod:`.sessions`)."""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Sequence
from typing import Any

Message = dict[str, Any]


def tools_key(tools: Sequence[dict[str, Any]] | None) -> str:
    return json.dumps(list(tools or []), sort_keys=True, ensure_ascii=False)


def tool_names(tools: Sequence[dict[str, Any]] | None) -> frozenset[str]:
    """The names of a request's tools (OpenAI ``function.name`` or a plain ``name``)."""
    return frozenset(str((t.get("function") or t).get("name")) for t in tools or [])


# A run of hex digits holding at least one decimal digit: numbers, dates, times, versions, hashes, ids.
_VOLATILE = re.compile(r"[0-9A-Fa-f]*[0-9][0-9A-Fa-f]*")
# Two prompts are still one agent's when only a few lines (at most VOLATILE_LINES on each side, at most
# VOLATILE_SHARE of their characters) differ beyond numbers and hashes: a per-call header or status line
# in a prompt of thousands of characters.
VOLATILE_LINES = 2
VOLATILE_SHARE = 0.05


def _prompt_lines(message: Message | None) -> tuple[str, list[str]]:
    if message is None:
        return "", []
    content = message.get("content")
    if isinstance(content, list):
        content = "\n".join(str(p.get("text", "")) if isinstance(p, dict) else str(p) for p in content)
    return str(message.get("role")), [_VOLATILE.sub("#", line) for line in str(content or "").splitlines()]


def same_prompt(a: Message | None, b: Message | None) -> bool:
    """Whether two first messages are one agent's prompt: the same role and lines, numbers and hashes
    aside, but for a few short lines (:data:`VOLATILE_LINES`, :data:`VOLATILE_SHARE`)."""
    if a == b:
        return True
    role_a, lines_a = _prompt_lines(a)
    role_b, lines_b = _prompt_lines(b)
    if role_a != role_b:
        return False
    if lines_a == lines_b:
        return True
    diff = Counter(lines_a)
    diff.subtract(Counter(lines_b))
    only_a = sum(n for n in diff.values() if n > 0)
    only_b = -sum(n for n in diff.values() if n < 0)
    changed = sum((len(line) + 1) * abs(n) for line, n in diff.items() if n)
    total = sum(len(line) + 1 for line in lines_a) + sum(len(line) + 1 for line in lines_b)
    return max(only_a, only_b) <= VOLATILE_LINES and changed <= VOLATILE_SHARE * total


def _calls_signature(msg: Message) -> list[tuple[Any, Any]]:
    out = []
    for tc in msg.get("tool_calls") or []:
        fn = tc.get("function") or {}
        try:
            args = json.loads(fn.get("arguments") or "{}")
        except (TypeError, ValueError):
            args = fn.get("arguments")
        out.append((fn.get("name"), args))
    return out


def same_assistant_turn(held: Message, incoming: Message) -> bool:
    """Whether ``incoming`` is the harness's copy of the sampled assistant turn ``held``.

    Tool-call ids are unique per reply, so equal ids decide the content (a harness may drop the text
    beside its calls); the calls' names and parsed arguments must still agree, or a client replaying
    a sampled id with other arguments would have the policy conditioned on a call it never saw sent.
    Otherwise content (whitespace-trimmed) and the calls' names and parsed arguments must agree.
    """
    if incoming.get("role") != "assistant":
        return False
    held_ids = [tc.get("id") for tc in held.get("tool_calls") or []]
    in_ids = [tc.get("id") for tc in incoming.get("tool_calls") or []]
    if held_ids and held_ids == in_ids:
        return _calls_signature(held) == _calls_signature(incoming)
    if (held.get("content") or "").strip() != (incoming.get("content") or "").strip():
        return False
    return _calls_signature(held) == _calls_signature(incoming)
