"""Config files for the commands :func:`legorl.cli.options.with_configs` builds: one flat key per option
(YAML or TOML), each value checked as its option checks it, and the options written back as such a file."""

from __future__ import annotations

import contextlib
import difflib
import enum
import inspect
import json
import math
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import typer

from legorl.core.errors import ConfigError, LegorlError

Format = Literal["yaml", "toml"]
FORMATS: dict[str, Format] = {".yaml": "yaml", ".yml": "yaml", ".toml": "toml"}


def sequence_type(hint: Any) -> type | None:
    """``list`` or ``tuple`` for a (possibly optional) list/tuple field: given as "a,b" on the CLI."""
    for candidate in (hint, *typing.get_args(hint)):
        if typing.get_origin(candidate) in (list, tuple):
            return typing.get_origin(candidate)
    return None



@dataclass(frozen=True)
class Setting:
    """One option as a config file gives it: its key is the option's name, ``max_turns`` (or ``max-turns``)."""

    param: str  # the command's parameter (and click's name for it)
    hint: Any  # the value's type
    flags: tuple[str, ...]  # the option's names on the command line, its own first
    default: Any  # inspect.Parameter.empty: required
    parse: Callable[[str], Any] | None = None
    repeated: bool = False  # a command's own list option, given once per item (``--compare a --compare b``)

    @property
    def key(self) -> str:
        return self.flags[0].removeprefix("--").replace("-", "_") if self.flags else self.param


def own_setting(p: inspect.Parameter) -> Setting:
    """A command's own option (``--model``, ``--json``) as a config file gives it."""
    hint, info, default = p.annotation, p.default, p.default
    decls: tuple[str, ...] = ()
    if typing.get_origin(hint) is Annotated:
        hint, info = typing.get_args(hint)[0], typing.get_args(hint)[1]
        if isinstance(info, typer.models.OptionInfo) and info.default is not ...:
            decls = (str(info.default),)  # typer.Option("--json") in Annotated: a name, not a default
    elif isinstance(info, typer.models.ParameterInfo):
        default = info.default
    decls += tuple(getattr(info, "param_decls", None) or ())
    if isinstance(info, typer.models.ArgumentInfo):
        flags: tuple[str, ...] = ()
    else:
        flags = tuple(d.split("/")[0] for d in decls if d.startswith("--")) or ("--" + p.name.replace("_", "-"),)
    if default is ... or default is inspect.Parameter.empty:
        default = inspect.Parameter.empty
    return Setting(p.name, hint, flags, default, repeated=sequence_type(hint) is not None)


def file_format(path: Path) -> Format:
    fmt = FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise ConfigError(f"{path}: a config file is YAML (.yaml, .yml) or TOML (.toml)")
    return fmt


def read_config(path: Path, settings: list[Setting], command: str) -> dict[str, tuple[Any, Any]]:
    """The file's values by the command's parameter: each as written, and as its option takes it
    (:func:`_cli_value`, which checks it as the option would)."""
    import tomllib

    import yaml

    fmt = file_format(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read it ({getattr(exc, 'strerror', None) or exc})") from None
    try:
        data = tomllib.loads(text) if fmt == "toml" else yaml.safe_load(text)
    except (tomllib.TOMLDecodeError, yaml.YAMLError) as exc:
        raise ConfigError(f"{path}: not valid {fmt.upper()}: {' '.join(str(exc).split())}") from None
    if data is None:  # an empty YAML file
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of option names to values, got {shown(data)}")
    by_key = {s.key: s for s in settings}
    out: dict[str, tuple[Any, Any]] = {}
    for key, value in data.items():
        setting = by_key.get(str(key).replace("-", "_"))
        if setting is None:
            raise ConfigError(f"{path}: unknown key {key!r}: {_unknown(str(key), value, settings, command)}")
        if setting.param in out:
            raise ConfigError(f"{path}: {setting.key} is given twice")
        try:
            out[setting.param] = (value, _cli_value(value, setting))
        except (LegorlError, ValueError) as exc:  # a parse function's own error, as the option would say it
            raise ConfigError(f"{path}: {key}: {exc}") from None
    return out


def _unknown(key: str, value: Any, settings: list[Setting], command: str) -> str:
    """What to write instead of an unknown key."""
    flag = "--" + key.replace("_", "-")
    for s in settings:
        if flag in s.flags[1:]:
            return f"{flag} is the command-line alias of {s.flags[0]}; the file names it {s.key}"
    keys = [s.key for s in settings]
    if isinstance(value, dict):
        example = next((k for k in keys if k.startswith(key.replace("-", "_") + "_")), keys[0] if keys else "")
        return f"the file is flat, one key per option, without sections (e.g. {example})"
    close = difflib.get_close_matches(key.replace("-", "_"), keys, n=1)
    return f"did you mean {close[0]}?" if close else f"`{command} --print-config` writes every key it takes"


def _cli_value(value: Any, s: Setting) -> Any:
    """A file's value as the option takes it: the text of one that ``parse`` reads or that is a list
    ("a,b"), else the value itself; a LegorlError says what was expected."""
    base, optional = _optional(s.hint)
    if value is None:
        if optional:
            return None
        raise ConfigError(f"expected {_expected(base, s)}, got null (it cannot be unset)")
    if s.repeated:
        items = value if isinstance(value, list) else [value]
        if not all(_is_item(v) or isinstance(v, str) for v in items):
            raise ConfigError(f"expected {_expected(base, s)}, got {shown(value)}")
        return [str(v) for v in items]
    if s.parse is not None or sequence_type(base) is not None:
        if isinstance(value, list) and all(_is_item(v) for v in value):
            text = ",".join(str(v) for v in value)
        elif _is_item(value) or isinstance(value, str):
            text = str(value)
        else:
            raise ConfigError(f"expected {_expected(base, s)}, got {shown(value)}")
        if s.parse is not None:
            s.parse(text)
        return text
    if base is bool and isinstance(value, bool):
        return value
    if base is int and not isinstance(value, bool | float):
        with contextlib.suppress(TypeError, ValueError):
            return int(value)
    if base is float and not isinstance(value, bool):
        with contextlib.suppress(TypeError, ValueError):  # PyYAML reads 1e-6 (no dot) as text
            return float(value)
    textual = base in (str, Path) or typing.get_origin(base) is Literal
    if textual and isinstance(value, str) and (base in (str, Path) or value in typing.get_args(base)):
        return value
    if not textual and base not in (bool, int, float):
        return value  # another type a command's own option takes: click checks it
    # YAML reads an unquoted yes/on as true, 007 as 7
    quote = " (quote it)" if textual and isinstance(value, bool | int | float) else ""
    raise ConfigError(f"expected {_expected(base, s)}, got {shown(value)}{quote}")


def _optional(hint: Any) -> tuple[Any, bool]:
    """``(T, True)`` for ``T | None``, else ``(hint, False)``."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) < len(typing.get_args(hint)):
            return (args[0] if len(args) == 1 else hint), True
    return hint, False


def _is_item(value: Any) -> bool:
    """One item of a list an option takes as "a,b"."""
    return isinstance(value, str | int | float) and not isinstance(value, bool) and "," not in str(value)


def _expected(base: Any, s: Setting) -> str:
    if s.parse is not None and sequence_type(base) is None:
        return f"text as {s.flags[0] if s.flags else s.param} takes it"
    if sequence_type(base) is not None:
        return "a list (or comma-separated text)"
    if typing.get_origin(base) is Literal:
        return "one of " + ", ".join(str(a) for a in typing.get_args(base))
    return {bool: "true or false", int: "a whole number", float: "a number", str: "a string",
            Path: "a path (a string)"}.get(base, str(base))


def shown(value: Any) -> str:
    return json.dumps(value, default=str, ensure_ascii=False)


def _file_form(value: Any) -> Any:
    """A value as a config file writes it: a parsed one as the text its ``parse`` reads (``str``)."""
    if isinstance(value, enum.Enum):
        return _file_form(value.value)
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, list | tuple):
        return [_file_form(v) for v in value]
    return str(value)


def dump_config(chosen: list[tuple[Setting, Any]], fmt: Format, command: str) -> str:
    """The options as a config file that ``--config`` reads back to the same values."""
    header = f"# {command} --config FILE: one key per option; options on the command line override them\n"
    if fmt == "yaml":
        import yaml

        class Dumper(yaml.SafeDumper):  # one option per line, as on the command line: a list on its own line
            pass

        Dumper.add_representer(list, lambda d, v: d.represent_sequence("tag:yaml.org,2002:seq", v, flow_style=True))
        return header + yaml.dump({s.key: _file_form(v) for s, v in chosen}, Dumper=Dumper, sort_keys=False,
                                  default_flow_style=False, allow_unicode=True, width=1 << 16)
    lines = [header.rstrip("\n")]
    for s, value in chosen:
        if value is None:
            if s.default is not None:
                raise ConfigError(f"{s.key} is unset (null), which TOML cannot write and its default "
                                  f"({shown(_file_form(s.default))}) is not: print YAML (--print-format yaml)")
            lines.append(f"# {s.key}: unset")
        else:
            lines.append(f"{s.key} = {_toml(_file_form(value))}")
    return "\n".join(lines) + "\n"


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    # TOML's basic strings escape as JSON does, save DEL, which TOML refuses raw
    return json.dumps(str(value), ensure_ascii=False).replace("\x7f", "\\u007f")
