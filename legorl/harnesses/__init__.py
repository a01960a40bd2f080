"""Coding-agent harness adapters: each runs one unmodified harness against a proxy session.

A harness is named by its registered name (:data:`HARNESSES`) or, as a plug-in, by dotted path
(``mypkg.agents:MyHarness`` or ``mypkg.agents.MyHarness``): a subclass of :class:`BaseHarness`
(:class:`ProcessHarness` for a harness that is its own program), or any class or object with what
the :class:`Harness` protocol asks for. A trial's ``harness`` column holds the name as given.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any, ClassVar

from legorl.core.errors import ConfigError, LegorlError
from legorl.core.plugins import is_dotted_path, load_object, missing_members
from legorl.harnesses.aider import Aider
from legorl.harnesses.base import BaseHarness, End, Harness, HarnessRun, ProcessHarness, TrialSpec
from legorl.harnesses.claude_code import ClaudeCode
from legorl.harnesses.codex import Codex
from legorl.harnesses.install import Installation
from legorl.harnesses.mini_swe_agent import MiniSweAgent
from legorl.harnesses.opencode import OpenCode
from legorl.harnesses.openhands import OpenHands
from legorl.harnesses.pi import Pi
from legorl.harnesses.qwen_code import QwenCode
from legorl.harnesses.simple import SimpleHarness
from legorl.harnesses.terminus import Terminus2
from legorl.sandbox.base import Sandbox

# The real harnesses (``all``), then legorl's own minimal driver for tiny demo models.
REAL: tuple[type[BaseHarness], ...] = (MiniSweAgent, OpenHands, Terminus2, OpenCode, ClaudeCode, Codex, QwenCode, Pi, Aider)
_ALL: list[type[BaseHarness]] = [*REAL, SimpleHarness]
#: Adapters by name; a plug-in joins under its dotted path the first time it is resolved.
HARNESSES: dict[str, type[BaseHarness]] = {cls.name: cls for cls in _ALL}


def harness_class(name: str) -> type[BaseHarness]:
    """The adapter class for harness ``name``: a registered name or a plug-in's dotted path."""
    cls = HARNESSES.get(name)
    if cls is None:
        if not is_dotted_path(name):
            raise LegorlError(f"unknown harness '{name}' (known: {', '.join(HARNESSES)}; "
                              "or a plug-in as package.module:Class)")
        cls = HARNESSES[name] = _plugin_class(name)
    return cls


def get(name: str) -> BaseHarness:
    """The adapter for harness ``name`` (its install is resolved on first use)."""
    return harness_class(name)()


def parse_names(spec: str) -> list[str]:
    """``"a,b"`` or ``"all"`` (the real harnesses) → harness names, each checked."""
    names = [cls.name for cls in REAL] if spec.strip() == "all" else [n.strip() for n in spec.split(",") if n.strip()]
    if not names:
        raise LegorlError("--harness: give at least one harness name")
    for name in names:
        try:
            harness_class(name)
        except LegorlError as exc:
            raise LegorlError(f"--harness: {exc}") from None
    return names


class ProtocolHarness(BaseHarness):
    """A plug-in that satisfies :class:`Harness` without deriving from :class:`BaseHarness`, adapted
    to it (one subclass per plug-in, made by :func:`harness_class`)."""

    needs_install = False
    target: ClassVar[Any]  # the plug-in: a class (instantiated per adapter) or a ready object

    def __init__(self, install: Installation | None = None) -> None:
        super().__init__(install)
        target = type(self).target
        self.impl: Harness = target() if isinstance(target, type) else target

    def mounts(self, trial_dir: Path) -> list[tuple[str, str, bool]]:
        return list(self.impl.mounts(trial_dir))

    def run(self, trial: TrialSpec, sandbox: Sandbox, trial_dir: Path) -> HarnessRun:
        return self.impl.run(trial, sandbox, trial_dir)


def _plugin_class(spec: str) -> type[BaseHarness]:
    obj = load_object(spec, "harness")
    where = f"harness {spec!r}"
    if isinstance(obj, type) and issubclass(obj, BaseHarness):
        if inspect.isabstract(obj):
            raise ConfigError(f"{where}: {obj.__name__} is abstract (it does not write "
                              f"{', '.join(sorted(obj.__abstractmethods__))})")
        _check_identity(where, obj)
        if obj.needs_install:
            raise ConfigError(f"{where}: needs_install is True, but legorl installs only its own harnesses "
                              "(set needs_install = False and launch your own program)")
        return obj
    missing = missing_members(obj, ("name", "in_container"), ("mounts", "run"))
    if missing:
        kind = "class" if isinstance(obj, type) else type(obj).__name__
        raise ConfigError(f"{where}: not a harness: the {kind} lacks {', '.join(missing)} (subclass "
                          "legorl.harnesses.BaseHarness, or give what the legorl.harnesses.Harness protocol asks for)")
    _check_identity(where, obj)
    adapter = type(f"ProtocolHarness[{spec}]", (ProtocolHarness,),
                   {"name": obj.name, "in_container": obj.in_container, "target": obj})
    return adapter


def _check_identity(where: str, obj: Any) -> None:
    if not isinstance(getattr(obj, "name", None), str) or not obj.name:
        raise ConfigError(f"{where}: name must be a non-empty string (got {getattr(obj, 'name', None)!r})")
    if not isinstance(getattr(obj, "in_container", None), bool):
        raise ConfigError(f"{where}: in_container must be True or False (got {getattr(obj, 'in_container', None)!r})")


__all__ = ["HARNESSES", "BaseHarness", "End", "Harness", "HarnessRun", "ProcessHarness", "ProtocolHarness",
           "TrialSpec", "get", "harness_class", "parse_names"]
