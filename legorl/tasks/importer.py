"""Import SWE-bench-schema task rows into a run's ``tasks/`` shards.

Sources: a Hugging Face dataset id (loaded with ``datasets`` when the Hub is reachable), or a local
``.parquet``, ``.jsonl`` or ``.json`` file. The columns are SWE-bench Verified's
(``instance_id, repo, base_commit, patch, test_patch, problem_statement, hints_text, created_at,
version, FAIL_TO_PASS, PASS_TO_PASS, environment_setup_commit``; the test lists as JSON strings or
lists) plus legorl's optional ones:

- ``image``: the container image (default: the base image of ``legorl setup``);
- ``repo_source``: a git bundle or a directory (relative to the source file) from which
  ``/testbed`` is built at ``base_commit`` (or ``repo_ref``); without it the image must already
  hold the repository at ``/testbed``;
- ``test_command``: a shell command run in ``/testbed``; ``{test_files}`` in it becomes the test
  files ``test_patch`` touches (default: SWE-bench's pytest command on those files);
- ``log_parser``: how to read the output (default and only built-in: ``pytest``).

A row that does not fit stops the import with an error naming the row and the field; nothing is
written then.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import socket
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from legorl.core import shards
from legorl.core.errors import LegorlError
from legorl.core.jsonfiles import LONE_SURROGATE, json_lines, loads, read_utf8
from legorl.core.schemas import Kind, TaskRow
from legorl.grading.logparse import PARSERS
from legorl.grading.patches import split_patch

STRING_FIELDS = (
    "repo", "base_commit", "patch", "test_patch", "problem_statement", "hints_text", "created_at",
    "version", "environment_setup_commit", "image", "repo_source", "repo_ref", "test_command",
    "log_parser", "gold_statuses", "flaky_tests",
)
ALIASES = {"image_name": "image"}  # SWE-smith names its image column differently
LOCAL_SUFFIXES = (".parquet", ".jsonl", ".json")


class TaskImportError(LegorlError):
    def __init__(self, source: object, row: int, field_name: str | None, message: str, instance_id: str | None = None):
        where = f"{source}: row {row}"
        if instance_id:
            where += f" ({instance_id})"
        if field_name:
            where += f": field '{field_name}'"
        super().__init__(f"{where}: {message}")


# --------------------------------------------------------------------------- reading sources


def _read_json(path: Path) -> list[dict[str, Any]]:
    text = read_utf8(path)
    if path.suffix == ".json":
        try:
            data = loads(text)
        except ValueError:
            data = None  # maybe JSON lines under a .json name, as `datasets` also accepts
        if isinstance(data, list):
            return data
        if isinstance(data, dict):
            for key in ("rows", "data", "instances"):
                if isinstance(data.get(key), list):
                    return data[key]
            return [data]
    return json_lines(path, text, "line {line}: not valid JSON ({message})")


def _read_parquet(path: Path) -> list[dict[str, Any]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return pq.read_table(path).to_pylist()
    except (OSError, pa.ArrowException) as exc:
        raise LegorlError(f"{path}: not a readable Parquet file ({exc})") from exc


def _hub_reachable(timeout: float = 5.0) -> bool:
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    host = endpoint.split("://", 1)[-1].split("/", 1)[0]
    port = 443 if endpoint.startswith("https") else 80
    if ":" in host:
        host, port_text = host.rsplit(":", 1)
        port = int(port_text)
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError:
        return False
    return True


def _read_hub(dataset_id: str, split: str) -> list[dict[str, Any]]:
    """A dataset from the Hub (or the local ``datasets`` cache when HF_HUB_OFFLINE is set)."""
    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes")
    if not offline and not _hub_reachable():
        raise LegorlError(
            f"{dataset_id!r} is not a local file and the Hugging Face Hub is unreachable: "
            "pass a local .parquet/.jsonl/.json file instead"
        )
    import datasets

    try:
        ds = datasets.load_dataset(dataset_id, split=split)
    except Exception as exc:  # datasets raises many types; all mean "could not load"
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        hint = " (offline: HF_HUB_OFFLINE is set and it is not in the local cache)" if offline else ""
        raise LegorlError(f"cannot load dataset {dataset_id!r} split {split!r}{hint}: {first}") from exc
    return [dict(r) for r in ds]


def read_source(source: str, split: str = "test") -> tuple[list[dict[str, Any]], Path]:
    """Raw rows of ``source`` and the folder relative ``repo_source`` paths resolve against."""
    path = Path(source).expanduser()
    if path.exists():
        if path.is_dir():
            raise LegorlError(f"{source}: is a directory; pass a .parquet, .jsonl or .json file")
        if path.suffix == ".parquet":
            return _read_parquet(path), path.resolve().parent
        if path.suffix in (".jsonl", ".json"):
            return _read_json(path), path.resolve().parent
        raise LegorlError(f"{source}: unknown file type (expected one of {', '.join(LOCAL_SUFFIXES)})")
    if path.suffix in LOCAL_SUFFIXES or source.startswith((".", "/", "~")):
        raise LegorlError(f"{source}: no such file")
    return _read_hub(source, split), Path.cwd()


# --------------------------------------------------------------------------- normalising rows


def _test_list(value: Any) -> list[str] | str:
    """A test list from a list, a JSON-encoded list, or None; a string error message otherwise."""
    if value is None:
        return []
    if isinstance(value, str):
        if not value.strip():
            return []
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            return "not a JSON list of test names"
    if hasattr(value, "tolist"):  # numpy arrays from pandas-made Parquet
        value = value.tolist()
    if not isinstance(value, list | tuple):
        return f"expected a list of test names, got {type(value).__name__}"
    bad = [v for v in value if not isinstance(v, str) or not v]
    if bad:
        return f"holds a non-string or empty test name: {bad[0]!r}"
    return list(value)


def _string(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, dt.datetime | dt.date):
        return value.isoformat()
    if hasattr(value, "isoformat"):  # pandas Timestamp
        return str(value.isoformat())
    if isinstance(value, int | float) and not isinstance(value, bool):
        return str(value)
    raise TypeError(type(value).__name__)


def normalize(raw: Mapping[str, Any], index: int, base_dir: Path, source: object = "<rows>") -> TaskRow:
    """One source row as a :class:`TaskRow`; :class:`TaskImportError` names what does not fit."""
    if not isinstance(raw, Mapping):
        raise TaskImportError(source, index, None, f"expected an object, got {type(raw).__name__}")
    data = dict(raw)
    for alias, name in ALIASES.items():
        if data.get(name) is None and data.get(alias) is not None:
            data[name] = data[alias]
    iid = data.get("instance_id")
    if not isinstance(iid, str) or not iid.strip():
        raise TaskImportError(source, index, "instance_id", "missing or empty")

    def err(name: str | None, message: str) -> TaskImportError:
        return TaskImportError(source, index, name, message, iid)

    if LONE_SURROGATE.search(iid):
        raise TaskImportError(source, index, "instance_id", "holds a lone UTF-16 surrogate (not valid Unicode)")
    values: dict[str, Any] = {"instance_id": iid}
    for name in STRING_FIELDS:
        try:
            values[name] = _string(data.get(name))
        except TypeError as exc:
            raise err(name, f"expected a string, got {exc}") from None
    for name in ("FAIL_TO_PASS", "PASS_TO_PASS"):
        tests = _test_list(data.get(name))
        if isinstance(tests, str):
            raise err(name, tests)
        values[name] = tests
    for name, value in values.items():  # JSON's \ud800 escapes can spell them; no shard can hold one
        if any(LONE_SURROGATE.search(v) for v in (value if isinstance(value, list) else [value]) if v):
            raise err(name, "holds a lone UTF-16 surrogate (not valid Unicode)")
    if not values["FAIL_TO_PASS"]:
        raise err("FAIL_TO_PASS", "empty: a task needs at least one test that the fix makes pass")
    overlap = set(values["FAIL_TO_PASS"]) & set(values["PASS_TO_PASS"])
    if overlap:
        raise err("PASS_TO_PASS", f"also lists FAIL_TO_PASS test {sorted(overlap)[0]!r}")
    for name in ("patch", "test_patch"):
        text = values[name]
        if text and text.strip() and not split_patch(text):
            raise err(name, "not a unified diff")
    if not (values["test_patch"] or "").strip() and not values["test_command"]:
        raise err("test_patch", "empty, and no test_command says which tests to run")
    if values["test_command"] is not None and not values["test_command"].strip():
        raise err("test_command", "empty")
    if values["log_parser"] and values["log_parser"] not in PARSERS:
        raise err("log_parser", f"unknown parser {values['log_parser']!r} (known: {', '.join(sorted(PARSERS))})")
    if values["gold_statuses"]:
        try:
            statuses = json.loads(values["gold_statuses"])
        except json.JSONDecodeError as exc:
            raise err("gold_statuses", f"not JSON ({exc.msg})") from None
        if not isinstance(statuses, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                     for k, v in statuses.items()):
            raise err("gold_statuses", "expected a JSON object of test id -> status")
    if values["flaky_tests"]:  # the task check's record (legorl.tasks.builder.flaky_tests)
        try:
            flaky = json.loads(values["flaky_tests"])
        except json.JSONDecodeError as exc:
            raise err("flaky_tests", f"not JSON ({exc.msg})") from None
        if not isinstance(flaky, dict) or not all(
                isinstance(seen, dict) and all(isinstance(s, list) and all(isinstance(x, str) for x in s)
                                               for s in seen.values()) for seen in flaky.values()):
            raise err("flaky_tests", "expected a JSON object of test id -> {patch: [status per run]}")
    if values["repo_source"]:
        src = Path(values["repo_source"]).expanduser()
        src = src if src.is_absolute() else base_dir / src
        if not src.exists():
            raise err("repo_source", f"{src} does not exist")
        values["repo_source"] = str(src.resolve())
        if not (values["base_commit"] or values["repo_ref"]):
            raise err("base_commit", "missing: a repo_source needs base_commit or repo_ref")
    return TaskRow(**values)


def normalize_all(rows: Iterable[Mapping[str, Any]], base_dir: Path, source: object) -> list[TaskRow]:
    out: list[TaskRow] = []
    seen: dict[str, int] = {}
    for index, raw in enumerate(rows):
        task = normalize(raw, index, base_dir, source)
        if task.instance_id in seen:
            raise TaskImportError(source, index, "instance_id", f"duplicate of row {seen[task.instance_id]}",
                                  task.instance_id)
        seen[task.instance_id] = index
        out.append(task)
    return out


# --------------------------------------------------------------------------- writing


@dataclass
class ImportResult:
    source: str
    written: list[str] = field(default_factory=list)  # new or changed
    unchanged: list[str] = field(default_factory=list)
    path: str | None = None


def import_tasks(
    source: str, tasks_dir: str | os.PathLike[str], split: str = "test", limit: int | None = None,
    instance_ids: Iterable[str] | None = None,
) -> ImportResult:
    """Validate every row of ``source`` and add the new or changed ones to ``tasks_dir``."""
    if limit is not None and limit < 0:  # a slice would silently drop rows from the end
        raise LegorlError(f"limit: must be >= 0, got {limit}")
    raw, base_dir = read_source(source, split)
    tasks = normalize_all(raw, base_dir, source)
    if instance_ids is not None:
        wanted = set(instance_ids)
        unknown = wanted - {t.instance_id for t in tasks}
        if unknown:
            raise LegorlError(f"{source}: no task {sorted(unknown)[0]!r}")
        tasks = [t for t in tasks if t.instance_id in wanted]
    if limit is not None:
        tasks = tasks[:limit]
    return add_tasks(tasks, tasks_dir, source)


def add_tasks(tasks: Iterable[TaskRow], tasks_dir: str | os.PathLike[str], source: str) -> ImportResult:
    """Add the new or changed ``tasks`` to ``tasks_dir`` (those already there unchanged are skipped)."""
    existing = {t.instance_id: t for t in shards.read_rows(tasks_dir, Kind.TASKS)}
    result = ImportResult(source=source)
    fresh = []
    for task in tasks:
        if existing.get(task.instance_id) == task:
            result.unchanged.append(task.instance_id)
        else:
            fresh.append(task)
            result.written.append(task.instance_id)
    written = shards.write(tasks_dir, Kind.TASKS, fresh)
    result.path = str(written) if written else None
    return result
