"""Config dataclasses as command-line options: each option's type, default and help live once, on its field.

A component's config is a dataclass whose CLI-facing fields carry ``metadata={"help": ...}`` (TRL's
``*Config`` pattern); optional metadata: ``"aliases"`` (more option names beside
``--field-name``, as transformers' ``HfArgumentParser`` reads them) and ``"parse"`` (a function from
the command-line string to the field's value; list fields are comma-separated without one). A command declares which configs it takes::

    @app.command("rollout")
    @with_configs(cfg=ConfigOptions(RolloutConfig))
    def rollout_command(cfg: RolloutConfig, model: ModelOption = None) -> None: ...

and :func:`with_configs` gives the command one option per field and calls it with the config
built from them (its ``__post_init__`` validates; a :class:`~legorl.core.errors.ConfigError` is the
one-line error the user sees). Composed commands (``legorl loop``) take several configs; a
``prefix`` keeps their options apart (``--grade-timeout``).

Every such command also reads ``--config FILE`` (YAML or TOML), one flat key per option, named as the
option is (``max_turns: 30``, ``grade_test_timeout: 5``; dashes or underscores), its own options
(``model``, ``json``) included: the file's values become the options' defaults in click
(``default_map``), so an option given on the command line beats the file, which beats the field's
default, and a required option the file gives is given. Each value is checked as the option checks it
(its type, its ``parse`` function, then the config's ``__post_init__``); an error names the file and
the key. ``--print-config`` writes every option's value as such a file (a value ``parse`` read as the
text it reads back: ``str``) and exits; fed back with ``--config`` it gives the same configs.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import re
import sys
import types
import typing
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

import typer

from legorl.cli.config_files import (
    Format,
    Setting,
    dump_config,
    file_format,
    own_setting,
    read_config,
    sequence_type,
    shown,
)
from legorl.core.errors import ConfigError, LegorlError

HELP, ALIASES, PARSE = "help", "aliases", "parse"
FILE_PARAMS = ("config_file", "print_config", "print_format")  # the options with_configs adds for config files
PANEL = "Config file"
_LOADED = "legorl.config"  # ctx.meta: (path, {parameter: the value as the file wrote it})


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

    def resolve(self, values: dict[str, Any]) -> dict[str, Any]:
        """Each exposed field's value from the parsed options (consumed from ``values``)."""
        out = {}
        for f in self.fields():
            value = values.pop(self.param_name(f))
            parse = f.metadata.get(PARSE)
            if _cli_default(f) is not inspect.Parameter.empty and value == _cli_default(f):
                out[f.name] = _field_default(f)  # untouched: the field's own default, not its text
                continue
            if parse is not None and isinstance(value, str):
                value = parse(value)
            elif (sequence := sequence_type(_hint(self.cls, f))) is not None and isinstance(value, str):
                value = sequence(v.strip() for v in value.split(",") if v.strip())
            out[f.name] = value
        return out

    def build(self, values: dict[str, Any]) -> Any:
        """The config from the parsed options (consumed from ``values``) and ``defaults``."""
        return (self.factory or self.cls)(**{**self.defaults, **self.resolve(values)})

    def settings(self) -> list[Setting]:
        """What a config file may set: one key per exposed field, named as its option is."""
        out = []
        for f in self.fields():
            first, *aliases = self.flags(f)
            out.append(Setting(self.param_name(f), _hint(self.cls, f), (first.split("/")[0], *aliases),
                               _field_default(f), f.metadata.get(PARSE)))
        return out

    def names(self, f: dataclasses.Field[Any]) -> set[str]:
        """How the config's own errors name a field: ``--test-timeout``, its aliases, ``test_timeout``."""
        aliases = f.metadata.get(ALIASES) or []
        return {f.name, "--" + f.name.replace("_", "-"), *([aliases] if isinstance(aliases, str) else aliases)}


def _hint(cls: type, f: dataclasses.Field[Any]) -> Any:
    """The field's type, resolved alone (``get_type_hints`` would resolve every field's, and a
    config may name heavy types under ``TYPE_CHECKING`` that the command line never needs)."""
    if not isinstance(f.type, str):
        return f.type
    owner = next(c for c in cls.__mro__ if f.name in getattr(c, "__annotations__", {}))
    return eval(f.type, vars(sys.modules[owner.__module__]))


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
    if f.metadata.get(PARSE) is not None or sequence_type(base) is not None:
        base = str  # parsed from its command-line text by ConfigOptions.build
    elif not (base in (int, float, str, bool, Path) or typing.get_origin(base) is Literal):
        raise TypeError(f"{f.name}: a CLI option needs a 'parse' function for type {hint!r}")
    option = typer.Option(*flags, help=f.metadata[HELP])
    return Annotated[base | None if optional else base, option]


def with_configs(**configs: ConfigOptions) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Give a command one option per documented field of each config, and ``--config FILE`` /
    ``--print-config``; call it with the configs built.

    Each keyword names the command's parameter that receives the built config. The wrapper keeps the
    command as its ``command`` attribute and calls it through there (a test can stand in for it).
    """

    def decorate(command: Callable[..., Any]) -> Callable[..., Any]:
        own = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY)
               for name, p in inspect.signature(command, eval_str=True).parameters.items() if name not in configs]
        generated = [p for spec in configs.values() for p in spec.parameters()]
        settings = [s for spec in configs.values() for s in spec.settings()] + [own_setting(p) for p in own]
        for what, names in (("options", [p.name for p in own + generated] + [*FILE_PARAMS, "cli_context"]),
                            ("config file keys", [s.key for s in settings])):
            clashes = {n for n in names if names.count(n) > 1}
            if clashes:
                raise TypeError(f"{command.__name__}: {what} defined twice: {', '.join(sorted(clashes))}")

        def load(ctx: typer.Context, path: Path | None) -> Path | None:
            if path is not None and not ctx.resilient_parsing:
                given = read_config(path, settings, ctx.command_path)
                # click takes each value as a default of its option: the command line beats it, and a
                # required option it gives is no longer missing
                ctx.default_map = {**(ctx.default_map or {}),
                                   **{p: value for p, (_, value) in given.items() if value is not None}}
                ctx.meta[_LOADED] = (path, {p: raw for p, (raw, _) in given.items()})
            return path

        file_options = [
            inspect.Parameter("config_file", inspect.Parameter.KEYWORD_ONLY, default=None, annotation=Annotated[
                Path | None, typer.Option("--config", is_eager=True, callback=load, rich_help_panel=PANEL, help=(
                    "Read options from this YAML or TOML file, one key per option as the option is named "
                    "(max_turns: 30); options given on the command line override it."))]),
            inspect.Parameter("print_config", inspect.Parameter.KEYWORD_ONLY, default=False, annotation=Annotated[
                bool, typer.Option("--print-config", rich_help_panel=PANEL, help=(
                    "Print every option's value (default, --config file or command line) as a config file "
                    "and exit without running."))]),
            inspect.Parameter("print_format", inspect.Parameter.KEYWORD_ONLY, default=None, annotation=Annotated[
                Format | None, typer.Option("--print-format", rich_help_panel=PANEL, help=(
                    "Format of --print-config (default: the --config file's, else yaml)."))]),
            inspect.Parameter("cli_context", inspect.Parameter.KEYWORD_ONLY, annotation=typer.Context),
        ]

        @functools.wraps(command)
        def run(**values: Any) -> Any:
            ctx: typer.Context = values.pop("cli_context")
            path, printing, fmt = (values.pop(p) for p in FILE_PARAMS)
            from_file = _values_from_file(ctx, values)
            if printing:
                shown = {**{k: v for spec in configs.values() for k, v in _resolved(spec, values).items()},
                         **{p.name: values[p.name] for p in own}}
                chosen = [(s, shown[s.param]) for s in settings
                          if _source(ctx, s.param) != "ENVIRONMENT"]
                typer.echo(dump_config(chosen, fmt or (file_format(path) if path else "yaml"), ctx.command_path), nl=False)
                return None
            built = {}
            for name, spec in configs.items():
                try:
                    built[name] = spec.build(values)
                except LegorlError as exc:
                    raise _blame(exc, spec, from_file, path) from None
            return run.command(**values, **built)  # type: ignore[attr-defined]

        run.__signature__ = inspect.Signature(generated + own + file_options)  # type: ignore[attr-defined]
        run.__annotations__ = {p.name: p.annotation for p in generated + own + file_options}
        del run.__wrapped__  # typer must see the generated signature, not the command's own
        run.command = command  # type: ignore[attr-defined]
        return run

    return decorate


def _source(ctx: typer.Context, param: str) -> str:
    """Where click took a parameter's value from: COMMANDLINE, ENVIRONMENT, DEFAULT_MAP (here: the config
    file) or DEFAULT (by name: typer may bring its own copy of click)."""
    source = ctx.get_parameter_source(param)
    return source.name if source is not None else "DEFAULT"


def _values_from_file(ctx: typer.Context, values: dict[str, Any]) -> dict[str, Any]:
    """The config file's values the command line left standing, by parameter (``values`` gets its nulls,
    which click's defaults cannot carry)."""
    path_raw = ctx.meta.get(_LOADED)
    if path_raw is None:
        return {}
    standing = {}
    for param, value in path_raw[1].items():
        source = _source(ctx, param)
        if source == "DEFAULT_MAP" or (value is None and source == "DEFAULT"):
            standing[param] = value
            if value is None:
                values[param] = None
    return standing


def _resolved(spec: ConfigOptions, values: dict[str, Any]) -> dict[str, Any]:
    """Each exposed field's value by its parameter, as :meth:`ConfigOptions.build` would take it."""
    fields = spec.resolve(dict(values))
    return {spec.param_name(f): fields[f.name] for f in spec.fields()}


def _blame(exc: LegorlError, spec: ConfigOptions, from_file: dict[str, Any], path: Path | None) -> LegorlError:
    """The config's own error, naming the file's keys it is about (those its message names, else all of
    this config's): the option it names may never have been typed."""
    mine = {f: from_file[spec.param_name(f)] for f in spec.fields() if spec.param_name(f) in from_file}
    if not mine:
        return exc
    text = str(exc)
    named = {f: v for f, v in mine.items()
             if any(re.search(rf"(?<![\w-]){re.escape(n)}(?![\w-])", text) for n in spec.names(f))}
    given = ", ".join(f"{spec.param_name(f)}: {shown(v)}" for f, v in (named or mine).items())
    return ConfigError(f"{text} ({path} sets {given})")
