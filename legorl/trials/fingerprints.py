"""What produced each row, and what each trial cost.

A trial row's :class:`~legorl.core.schemas.TrialFingerprint` names the harness, its installed version, a
digest of its effective config (the ``--harness-config`` file's bytes and the trial options the
harness is given), legorl's version and the model revision (a digest of the model directory's files
as the engine loaded them; the weights the loop loads later are each call's ``policy_version``,
:mod:`legorl.trials.provenance`). A grade row's :class:`~legorl.core.schemas.GradeFingerprint` names the image
and podman's id of it, the hidden-test command as run and the grader's version. :func:`mixes` says
where a run's rows disagree — two harness versions or configs for one harness, two model revisions
in one step, two images or grader versions for one task — for ``legorl inspect``.

Hashing is cached per process: a model directory is hashed once per (path, file sizes and mtimes),
an image inspected once per name, the grading code once.
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
import os
from collections import defaultdict
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from legorl import __version__ as LEGORL_VERSION
from legorl.core.digests import digest, file_digest
from legorl.core.errors import LegorlError
from legorl.core.schemas import TrialFingerprint


def _get(obj: Any, name: str) -> Any:
    return obj.get(name) if isinstance(obj, Mapping) else getattr(obj, name, None)


# --------------------------------------------------------------------------- trials


def harness_version(name: str) -> str | None:
    """The installed version of harness ``name``: its install's (legorl's installs are pinned; None
    until it is installed), a plug-in's distribution's, legorl's for its built-in ones; None for a
    name legorl cannot resolve."""
    from legorl.harnesses.install import RECIPES, installed

    if name in RECIPES:  # a small marker file, read each time: an install can complete mid-run
        found = installed(name)
        return found.version if found is not None else None
    return _package_version(name)


@functools.cache
def _package_version(name: str) -> str | None:
    from legorl.harnesses import harness_class

    try:
        cls = harness_class(name)
    except LegorlError:
        return None
    top = cls.__module__.split(".")[0] if ":" not in name else name.split(":")[0].split(".")[0]
    if top == "legorl":
        return LEGORL_VERSION
    for dist in importlib.metadata.packages_distributions().get(top, []):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def harness_config(cfg: Any, context_tokens: int | None = None) -> str:
    """The digest of a harness's effective config: its config file's bytes (``--harness-config``;
    none = the adapter's own, which the harness and legorl versions pin) and the options each trial
    hands it (:class:`~legorl.harnesses.base.TrialSpec`'s limits and sampling)."""
    path = getattr(cfg, "harness_config", None)
    options = {name: getattr(cfg, name, None) for name in ("max_turns", "max_tokens", "temperature", "timeout_s")}
    effective = {"config_file": file_digest(Path(path)) if path is not None else None,
                 "options": options, "context_tokens": context_tokens}
    return digest(json.dumps(effective, sort_keys=True).encode())


def model_revision(model_dir: Path) -> str:
    """The digest of a model directory's files (weights, tokenizer, configs; names and bytes),
    each file hashed once per process while its size and mtime stay the same."""
    files = sorted(p for p in Path(model_dir).iterdir() if p.is_file() and not p.name.startswith("."))
    if not files:
        raise LegorlError(f"{model_dir}: no files to fingerprint (not a model directory)")
    listing = "\n".join(f"{p.name} {file_digest(p)}" for p in files)
    return digest(listing.encode())


def proxy_model_revision(proxy: Any) -> str | None:
    """The revision of the model ``proxy`` serves: its engine's model directory's digest when this
    process loaded it, else ``served:<name>`` (an external proxy or engine); None without a proxy."""
    if proxy is None:
        return None
    engine = getattr(proxy, "engine", None)
    inner = getattr(engine, "inner", engine)  # a WatchedEngine wraps the engine
    for attr in ("model_dir", "model"):
        value = getattr(inner, attr, None)
        if isinstance(value, str | os.PathLike) and Path(value).is_dir():
            return model_revision(Path(value))
    return f"served:{proxy.model}"


def trial_fingerprint(harness: str, cfg: Any = None, proxy: Any = None) -> TrialFingerprint:
    """A trial's fingerprint: run with ``cfg`` (:class:`~legorl.trials.lifecycle.TrialOptions`; None: unknown,
    as for sessions an external harness opened) against ``proxy`` (None: unknown)."""
    return TrialFingerprint(
        harness=harness, harness_version=harness_version(harness),
        harness_config=None if cfg is None else harness_config(cfg, getattr(proxy, "context_tokens", None)),
        legorl_version=LEGORL_VERSION, model_revision=proxy_model_revision(proxy),
    )


# --------------------------------------------------------------------------- a run's rows


def _distinct(rows: Iterable[Mapping[str, Any]], group: str, field: str) -> dict[Any, list[str]]:
    """Per value of ``group``, the distinct known values of the fingerprint's ``field``."""
    seen: dict[Any, set[str]] = defaultdict(set)
    for row in rows:
        fp = row.get("fingerprint")
        value = fp.get(field) if isinstance(fp, Mapping) else None
        if value is not None:
            seen[row.get(group)].add(str(value))
    return {g: sorted(v) for g, v in sorted(seen.items(), key=lambda kv: str(kv[0])) if len(v) > 1}


def _short(values: list[str]) -> str:
    shown = [v if len(v) <= 24 else v[:23] + "…" for v in values[:3]]
    return ", ".join(shown) + (f" +{len(values) - 3}" if len(values) > 3 else "")


# (what the rows are grouped by, its label, the fingerprint field, what a mix of it means)
TRIAL_CHECKS: tuple[tuple[str, str, str, str], ...] = (
    ("harness", "harness", "harness_version", "harness versions"),
    ("harness", "harness", "harness_config", "harness configs"),
    ("step", "step", "model_revision", "model revisions"),
    ("step", "step", "legorl_version", "legorl versions"),
)
GRADE_CHECKS: tuple[tuple[str, str, str, str], ...] = (
    ("task_id", "task", "image_digest", "images"),
    ("task_id", "task", "grader_version", "grader versions"),
    ("task_id", "task", "test_command", "test commands"),
)


TRIAL_FIELDS = tuple(dict.fromkeys(field for _, _, field, _ in TRIAL_CHECKS))
GRADE_FIELDS = tuple(dict.fromkeys(field for _, _, field, _ in GRADE_CHECKS))


def mixes(trials: Iterable[Mapping[str, Any]] = (), grades: Iterable[Mapping[str, Any]] = ()) -> list[str]:
    """One line per place the rows' fingerprints disagree (rows as dicts; unknown values are skipped),
    e.g. ``harness mini-swe-agent: 2 harness configs (sha256:…, sha256:…)``."""
    out: list[str] = []
    for rows, checks in ((list(trials), TRIAL_CHECKS), (list(grades), GRADE_CHECKS)):
        for group, label, field, what in checks:
            for key, values in _distinct(rows, group, field).items():
                out.append(f"{label} {key}: {len(values)} {what} ({_short(values)})")
    return out


def run_mixes(root: Path) -> list[str]:
    """:func:`mixes` of a run directory's trials and grades (``rollouts/``, ``grades/``), and of its
    eval's, prefixed by the dataset's name; reads only the fingerprint fields it compares, and
    compares them column by column."""
    from legorl.core import shards
    from legorl.core.schemas import Kind

    out: list[str] = []
    for prefix in ("", "eval/"):
        for name, kind, groups, checks, fields in (
            ("rollouts", Kind.ROLLOUTS, ["harness", "step"], TRIAL_CHECKS, TRIAL_FIELDS),
            ("grades", Kind.GRADES, ["task_id"], GRADE_CHECKS, GRADE_FIELDS),
        ):
            table = shards.read(root / f"{prefix}{name}", kind, columns=[*groups, *(f"fingerprint.{f}" for f in fields)]).table
            out += [f"{prefix}{line}" for line in _table_mixes(table, checks)]
    return out


def _table_mixes(table: Any, checks: tuple[tuple[str, str, str, str], ...]) -> list[str]:
    """:func:`mixes` of one dataset's table (its group columns and ``fingerprint``), grouped by Arrow."""
    import pyarrow as pa
    import pyarrow.compute as pc

    fingerprint = table.column("fingerprint").combine_chunks()
    out: list[str] = []
    for group, label, field, what in checks:
        values = pc.struct_field(fingerprint, field) if len(fingerprint) else pa.array([], pa.string())
        known = pa.table({"group": table.column(group), "value": pc.cast(values, pa.string())}).filter(pc.is_valid(values))
        distinct = known.group_by("group").aggregate([("value", "distinct")])
        found = {g: sorted(v) for g, v in zip(distinct.column("group").to_pylist(),
                                              distinct.column("value_distinct").to_pylist(), strict=True) if len(v) > 1}
        for key, seen in sorted(found.items(), key=lambda kv: str(kv[0])):
            out.append(f"{label} {key}: {len(seen)} {what} ({_short(seen)})")
    return out
