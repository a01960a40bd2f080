"""Per-session budgets the proxy enforces on behalf of harnesses that do not.

A budget that runs out is answered with a normal, text-only assistant reply (OpenAI
``finish_reason: "stop"``, Anthropic ``stop_reason: "end_turn"``) that ends the episode, never
with an HTTP error: harnesses retry errors (OpenCode forever) or start compaction loops on a
context-length 400. The reason is recorded on the call (``budget_stop``) and on the session.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from legorl.core.errors import ConfigError
from legorl.core.schemas import BudgetStop

# The reasons (``Call.budget_stop`` / ``SessionCapture.budget_stop``), typed as the plain strings
# those fields hold, for code that compares or keys by them.
MAX_TURNS: str = BudgetStop.MAX_TURNS
MAX_TOTAL_TOKENS: str = BudgetStop.MAX_TOTAL_TOKENS
MAX_WALL: str = BudgetStop.MAX_WALL_TIME
CONTEXT_OVERFLOW: str = BudgetStop.CONTEXT_OVERFLOW


@dataclass(frozen=True)
class Budgets:
    """Limits of one session. ``None`` means unlimited (the context is always limited)."""

    max_turns: int | None = field(default=None, metadata={"help": (
        "Model calls that generate, per session (budget-stopped calls do not count).")})
    max_total_tokens: int | None = field(default=None, metadata={"help": (
        "Tokens held across all of a session's segments (prompt + sampled).")})
    max_context: int | None = field(default=None, metadata={"help": (
        "Prompt + completion tokens of one call; defaults to (and is capped by) the engine's context.")})
    max_wall_s: float | None = field(default=None, metadata={"aliases": ["--max-wall"], "help": (
        "Seconds since the session was created.")})
    max_tokens_per_call: int | None = field(default=None, metadata={"help": (
        "Cap on a call's completion tokens, whatever the request asks.")})
    context_overflow: str = "reply"
    """``reply`` (default: a budget-stop reply) or ``error`` (an OpenAI/Anthropic 400)."""

    @classmethod
    def from_dict(cls, data: Any, where: str = "budgets", base: Budgets | None = None) -> Budgets:
        """Budgets from ``data``; a field it does not give (or gives as null) keeps ``base``'s value
        (the server's defaults, for a session created over HTTP), else the class default."""
        base = base if base is not None else cls()
        if data is None:
            return base
        if not isinstance(data, dict):
            raise ConfigError(f"{where}: expected an object")
        known = {f.name: f for f in fields(cls)}
        kwargs: dict[str, Any] = {}
        for key, value in data.items():
            if key not in known:
                raise ConfigError(f"{where}.{key}: unknown budget (known: {', '.join(known)})")
            if value is None:
                continue
            if key == "context_overflow":
                if value not in ("reply", "error"):
                    raise ConfigError(f"{where}.{key}: must be 'reply' or 'error'")
            elif key == "max_wall_s":
                if (isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value)
                        or value <= 0):  # NaN compares false with everything: it would never stop
                    raise ConfigError(f"{where}.{key}: must be a positive number")
            elif isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(f"{where}.{key}: must be a positive integer")
            kwargs[key] = value
        return replace(base, **kwargs)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def check_before_call(self, turns: int, total_tokens: int, created_at: float) -> str | None:
        """The budget that forbids another call, or None."""
        if self.max_turns is not None and turns >= self.max_turns:
            return BudgetStop.MAX_TURNS
        if self.max_total_tokens is not None and total_tokens >= self.max_total_tokens:
            return BudgetStop.MAX_TOTAL_TOKENS
        if self.max_wall_s is not None and time.time() - created_at >= self.max_wall_s:
            return BudgetStop.MAX_WALL_TIME
        return None


def stop_message(reason: str, budgets: Budgets) -> str:
    """The text of a budget-stop reply: plain, final, and saying why."""
    limits: dict[str, str] = {
        MAX_TURNS: f"the maximum number of turns ({budgets.max_turns})",
        MAX_TOTAL_TOKENS: f"the token budget ({budgets.max_total_tokens} tokens)",
        MAX_WALL: f"the time budget ({budgets.max_wall_s} s)",
        CONTEXT_OVERFLOW: "the model's context length",
    }
    what = limits.get(reason, reason)
    return f"I have reached {what} for this task and must stop here."
