"""Coding-agent harness adapters: each runs one unmodified harness against a proxy session."""

from __future__ import annotations

from legorl.errors import LegorlError
from legorl.harnesses.base import BaseHarness, End, Harness, HarnessRun, TrialSpec
from legorl.harnesses.claude_code import ClaudeCode
from legorl.harnesses.mini_swe_agent import MiniSweAgent
from legorl.harnesses.opencode import OpenCode
from legorl.harnesses.openhands import OpenHands
from legorl.harnesses.simple import SimpleHarness

# The four real harnesses (``all``), then legorl's own minimal driver for tiny demo models.
REAL: tuple[type[BaseHarness], ...] = (MiniSweAgent, OpenHands, OpenCode, ClaudeCode)
_ALL: list[type[BaseHarness]] = [*REAL, SimpleHarness]
HARNESSES: dict[str, type[BaseHarness]] = {cls.name: cls for cls in _ALL}


def get(name: str) -> BaseHarness:
    """The adapter for harness ``name`` (its install is resolved on first use)."""
    try:
        return HARNESSES[name]()
    except KeyError:
        raise LegorlError(f"unknown harness '{name}' (known: {', '.join(HARNESSES)})") from None


def parse_names(spec: str) -> list[str]:
    """``"a,b"`` or ``"all"`` (the four real harnesses) → harness names, each checked."""
    names = [cls.name for cls in REAL] if spec.strip() == "all" else [n.strip() for n in spec.split(",") if n.strip()]
    if not names:
        raise LegorlError("--harness: give at least one harness name")
    for name in names:
        if name not in HARNESSES:
            raise LegorlError(f"--harness: unknown harness '{name}' (known: {', '.join(HARNESSES)})")
    return names


__all__ = ["HARNESSES", "BaseHarness", "End", "Harness", "HarnessRun", "TrialSpec", "get", "parse_names"]
