"""Config dataclasses as command-line options: each option's type, default and help live once, on its field.

A component's config is a dataclass whose CLI-facing fields carry ``metadata={"help": ...}`` (TRL's
``*Config`` pattern); optional metadata: ``"aliases"`` (more option names beside
``--field-name``, as transformers' ``HfArgumentParser`` reads them) and ``"parse"`` (a function from
the command-line string to the field's value; list fields are comma-separated without one). A command declares which configs it takes::

    @app.command("rollout")
    @with_configs(cfg=ConfigOptions(RolloutConfig))
    def rollout_command(cfg: RolloutConfig, model: ModelOption = None) -> None: ...

and :func:`with_configs` gives the command one option per field and calls it with the config
built from them (its ``__post_init__`` validates; a :class:`~legorl.errors.ConfigError` is the
one-line error the user sees). Composed commands (``legorl loop``) take several configs; a
``prefix`` keeps their options apart (``--grade-timeout``).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import sys
import types
import typing
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

import typer

HELP, ALIASES, PARSE = "help", "aliases", "parse"


@dataclass(frozen=True)
class ConfigOptions:
    """Which fields of ``cls`` a command exposes (all with a help text, by default), and how."""

    cls: type
    only: Collection[str] | None = None  # just these fields (in the class's order)
    exclude: Collection[str] = ()
    prefix: str = ""  # prepended to every option name and parameter: "grade-" -> --grade-timeout
    defaults: Mapping[str, Any] = field(default_factory=dict)  # values of fields the command does not expose
    factory: Callable[..., Any] | None = None  # builds the config from the fields (default: ``cls``)

    def fields(self) -> list[dataclasses.Field[Any]]:
        out = []
        for f in dataclasses.fields(self.cls):
            if self.only is not None and f.name not in self.only:
                continue
            if f.name in self.exclude or HELP not in f.metadata or not f.init:
                continue
            out.append(f)
        if self.only is not None:
            missing = set(self.only) - {f.name for f in out}
            if missing:
                raise TypeError(f"{self.cls.__name__}: no documented field(s) {', '.join(sorted(missing))}")
        return out

    def param_name(self, f: dataclasses.Field[Any]) -> str:
        return self.prefix.replace("-", "_") + f.name

    def flags(self, f: dataclasses.Field[Any]) -> list[str]:
        """``--field-name`` first (``--field-name/--no-field-name`` for a bool, so one that defaults to
        on can be turned off), then the field's aliases; each with the prefix."""
        aliases = f.metadata.get(ALIASES) or []
        names = ["--" + f.name.replace("_", "-"), *([aliases] if isinstance(aliases, str) else aliases)]
        flags = ["--" + self.prefix + n.removeprefix("--") for n in names]
        if _hint(self.cls, f) is bool:
            flags[0] += "/--" + self.prefix + "no-" + flags[0].removeprefix("--" + self.prefix)
        return flags

    def parameters(self) -> list[inspect.Parameter]:
        params = []
        for f in self.fields():
            params.append(inspect.Parameter(
                self.param_name(f), inspect.Parameter.KEYWORD_ONLY,
                annotation=_option_type(f, _hint(self.cls, f), self.flags(f)),
                default=_cli_default(f),
            ))
        return params

    def build(self, values: dict[str, Any]) -> Any:
        """The config from the parsed options (consumed from ``values``) and ``defaults``."""
        kwargs = dict(self.defaults)
        for f in self.fields():
            value = values.pop(self.param_name(f))
            parse = f.metadata.get(PARSE)
            if _cli_default(f) is not inspect.Parameter.empty and value == _cli_default(f):
                kwargs[f.name] = _field_default(f)  # untouched: the field's own default, not its text
                continue
            if parse is not None and isinstance(value, str):
                value = parse(value)
            elif (sequence := _sequence_type(_hint(self.cls, f))) is not None and isinstance(value, str):
                value = sequence(v.strip() for v in value.split(",") if v.strip())
            kwargs[f.name] = value
        return (self.factory or self.cls)(**kwargs)


def _hint(cls: type, f: dataclasses.Field[Any]) -> Any:
    """The field's type, resolved alone (``get_type_hints`` would resolve every field's, and a
    config may name heavy types under ``TYPE_CHECKING`` that the command line never needs)."""
    if not isinstance(f.type, str):
        return f.type
    owner = next(c for c in cls.__mro__ if f.name in getattr(c, "__annotations__", {}))
    return eval(f.type, vars(sys.modules[owner.__module__]))


def _sequence_type(hint: Any) -> type | None:
    """``list`` or ``tuple`` for a (possibly optional) list/tuple field: given as "a,b" on the CLI."""
    for candidate in (hint, *typing.get_args(hint)):
        if typing.get_origin(candidate) in (list, tuple):
            return typing.get_origin(candidate)
    return None


def _field_default(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return inspect.Parameter.empty  # a required option


def _cli_default(f: dataclasses.Field[Any]) -> Any:
    default = _field_default(f)
    if isinstance(default, list | tuple):  # shown and given as "a,b"
        return ",".join(str(v) for v in default)
    return default


def _option_type(f: dataclasses.Field[Any], hint: Any, flags: list[str]) -> Any:
    """``Annotated[<type typer can parse>, typer.Option(flag, help=...)]`` for a field."""
    base, optional = hint, False
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        optional = len(args) < len(typing.get_args(hint))
        base = args[0] if len(args) == 1 else str
    if f.metadata.get(PARSE) is not None or _sequence_type(base) is not None:
        base = str  # parsed from its command-line text by ConfigOptions.build
    elif not (base in (int, float, str, bool, Path) or typing.get_origin(base) is Literal):
        raise TypeError(f"{f.name}: a CLI option needs a 'parse' function for type {hint!r}")
    option = typer.Option(*flags, help=f.metadata[HELP])
    return Annotated[base | None if optional else base, option]


def with_configs(**configs: ConfigOptions) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Give a command one option per documented field of each config; call it with the configs built.

    Each keyword names the command's parameter that receives the built config.
    """

    def decorate(command: Callable[..., Any]) -> Callable[..., Any]:
        own = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY)
               for name, p in inspect.signature(command, eval_str=True).parameters.items() if name not in configs]
        generated = [p for spec in configs.values() for p in spec.parameters()]
        names = [p.name for p in own + generated]
        clashes = {n for n in names if names.count(n) > 1}
        if clashes:
            raise TypeError(f"{command.__name__}: options defined twice: {', '.join(sorted(clashes))}")

        @functools.wraps(command)
        def run(**values: Any) -> Any:
            built = {name: spec.build(values) for name, spec in configs.items()}
            return command(**values, **built)

        run.__signature__ = inspect.Signature(generated + own)  # type: ignore[attr-defined]
        run.__annotations__ = {p.name: p.annotation for p in generated + own}
        del run.__wrapped__  # typer must see the generated signature, not the command's own
        return run

    return decorate
