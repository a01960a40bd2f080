"""Plug-ins by dotted path: ``package.module:Name`` or ``package.module.Name`` names an object to import.

Harnesses (``--harness``) and engines (:func:`legorl.engines.make_engine`) accept one wherever they
accept a registered name; each checks that what it found is what it needs (:func:`missing_members`).
Every failure is one line that names the spec.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from typing import Any

from legorl.core.errors import ConfigError


def is_dotted_path(spec: str) -> bool:
    """Whether ``spec`` names an object by import path rather than by a registered name."""
    return ":" in spec or "." in spec


def load_object(spec: str, what: str) -> Any:
    """The object ``spec`` names; ``what`` (e.g. ``"harness"``) goes into the error messages."""
    module_name, colon, attr_path = spec.partition(":")
    if not colon:
        module_name, _, attr_path = spec.rpartition(".")
    if not module_name or not attr_path:
        raise ConfigError(f"{what} {spec!r}: write package.module:Name (or package.module.Name)")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and (module_name == exc.name or module_name.startswith(exc.name + ".")):
            raise ConfigError(f"{what} {spec!r}: no module named {exc.name!r} (is it installed, or on PYTHONPATH?)") from None
        raise ConfigError(f"{what} {spec!r}: importing {module_name} failed: {exc}") from exc
    except Exception as exc:  # the plug-in's own import-time failure, reported as one line
        raise ConfigError(f"{what} {spec!r}: importing {module_name} failed: {type(exc).__name__}: {exc}") from exc
    obj: Any = module
    for part in attr_path.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ConfigError(f"{what} {spec!r}: {module_name} has no attribute {attr_path!r}") from None
    return obj


def missing_members(obj: object, attributes: Iterable[str], methods: Iterable[str]) -> list[str]:
    """The members a protocol needs that ``obj`` lacks: ``attributes`` must exist, ``methods`` be callable."""
    missing = [name for name in attributes if not hasattr(obj, name)]
    missing += [f"{name}()" for name in methods if not callable(getattr(obj, name, None))]
    return missing
