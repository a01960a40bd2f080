"""Read a run directory's shards into the small summaries every monitor view needs.

Part files never change once renamed into place, so :class:`RunReader` summarises each rollout
and grade part file once (behaviour, token counts, test counts) and keeps the result keyed by the
file's name, size and mtime; a refresh after new shards land only reads the new files. A rollout
part's summary is also stored beside it (:mod:`legorl.monitor.summaries`), so a fresh reader of a
large run reads the summaries, not the conversations.
:meth:`RunReader.fingerprint` lists the part files (no reads), which makes "did anything change?"
cheap enough to poll. Duplicate keys resolve as :func:`legorl.core.shards.read` does: the later file
wins. The snapshot remembers which file holds each trial's rollout and grade, so one trial's full
rows are read from those files alone, the rows of one step only (pushed down to the row groups).
"""

from __future__ import annotations

import gc
import json
import os
import re
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from hashlib import sha1
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from legorl.core import shards
from legorl.core.errors import LegorlError
from legorl.core.paths import RunDir
from legorl.core.schemas import GradeRow, Kind, MetricRow, TrialCost, TrialRow, trial_is_infra
from legorl.core.shards import Vanished
from legorl.monitor import summaries
from legorl.monitor.behaviour import TrialBehaviour

# Columns of grades we summarise (the test log can be large and is read only for one trial).
_GRADE_COLUMNS = [
    "task_id", "harness", "step", "reward", "resolved", "resolution", "status", "infra_failure", "error", "tests",
]


@dataclass(slots=True)  # slotted: a snapshot holds one per trial (10^5 and more)
class TrialInfo:
    """One rollout row, without its tokens and conversation."""

    trial_id: str
    task_id: str
    harness: str
    step: int
    sample_index: int
    group_id: str
    model: str | None
    outcome: str
    infra_failure: bool
    error: str | None
    patch: str | None
    behaviour: TrialBehaviour  # its figures, without its events (a trial's detail classifies them from its row)
    token_lags: dict[int, int]  # sampled tokens per lag behind the trial's step (legorl.trials.provenance.token_lags)
    file: Path
    cost: TrialCost = field(default_factory=TrialCost)  # legorl.trials.costs.cost_of

    @property
    def key(self) -> str:
        """A short, file-name-safe id for the trial (trial ids hold slashes)."""
        return sha1(self.trial_id.encode()).hexdigest()[:16]


@dataclass(slots=True)
class GradeInfo:
    trial_id: str
    task_id: str
    status: str
    infra_failure: bool
    reward: float | None
    resolved: bool | None
    resolution: str | None
    error: str | None
    tests_passed: int
    tests_total: int
    step: int | None = None
    file: Path | None = None


@dataclass
class Snapshot:
    """Everything the monitor views read from one run directory, at one fingerprint."""

    root: Path
    fingerprint: str
    trials: dict[str, TrialInfo] = field(default_factory=dict)
    grades: dict[str, GradeInfo] = field(default_factory=dict)
    metrics: list[MetricRow] = field(default_factory=list)
    repos: dict[str, str] = field(default_factory=dict)  # task id -> repository
    task_ids: list[str] = field(default_factory=list)
    eval_report: dict[str, Any] | None = None
    # figures derived from this snapshot, computed once (legorl.monitor.stats._once): a snapshot never changes
    derived: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def name(self) -> str:
        return self.root.resolve().name

    def repo_of(self, task_id: str) -> str:
        return self.repos.get(task_id) or repo_from_instance_id(task_id)

    def is_infra(self, trial: TrialInfo) -> bool:
        """:func:`legorl.core.schemas.trial_is_infra` of the trial and its grade (decided once per
        snapshot for every trial: the views ask it of each trial several times)."""
        infra = self.derived.get("infra")
        if infra is None:
            infra = self.derived["infra"] = {
                tid for tid, t in self.trials.items() if trial_is_infra(t.infra_failure, self.grades.get(tid))
            }
        return trial.trial_id in infra


_SWE_ID = re.compile(r"^(?P<owner>[^_]+(?:_[^_]+)*?)__(?P<name>.+)-\d+$")


def repo_from_instance_id(instance_id: str) -> str:
    """SWE-bench ids read ``owner__repo-NUMBER``; anything else has an unknown repository."""
    m = _SWE_ID.match(instance_id)
    return f"{m['owner']}/{m['name']}" if m else "unknown"


def summarise_rollout_file(path: Path) -> list[TrialInfo]:
    """One rollout part file's trials, from its stored summary (:mod:`legorl.monitor.summaries`), or
    summarised from its rows now (the summary is then stored for the next reader)."""
    try:
        summary = summaries.summarise(path)
        try:
            return trial_infos(summary, path)
        except (ValueError, KeyError, TypeError):  # a stored summary that is whole but not sense: rebuild it
            return trial_infos(summaries.summarise(path, rebuild=True), path)
    except FileNotFoundError as exc:
        raise Vanished(path, "part file vanished (replaced by a compaction)") from exc


_COSTS = [f.name for f in fields(TrialCost)]
# TrialBehaviour's figures in the order of its fields (after trial_id, step, harness, infra_failure; not
# its events): each is a summary column (summaries.BEHAVIOUR_COUNTS, submitted, self_verifying)
_BEHAVIOUR_FIGURES = [f.name for f in fields(TrialBehaviour)][4:-1]


def trial_infos(summary: pa.Table, path: Path) -> list[TrialInfo]:
    """:class:`TrialInfo` of each row of a summary table, read column by column (each column one
    ``to_pylist``, the rows zipped: 10^5 trials are built in well under a second)."""
    def column(name: str) -> list[Any]:
        return summary.column(name).to_pylist()

    ids, steps, harnesses, infra = column("trial_id"), column("step"), column("harness"), column("infra_failure")
    figures = zip(*(column(name) for name in _BEHAVIOUR_FIGURES), strict=True)
    behaviours = [TrialBehaviour(tid, step, harness, failed, *figs)
                  for tid, step, harness, failed, figs in zip(ids, steps, harnesses, infra, figures, strict=True)]
    # one JSON document for the part's token lags ([[lag, tokens]] per trial), not one per trial
    lags = json.loads("[" + ",".join(column("token_lags")) + "]") if ids else []
    costs = [TrialCost(*c) for c in zip(*(column(f"cost_{name}") for name in _COSTS), strict=True)]
    return [
        TrialInfo(tid, task, harness, step, sample, group, model, outcome, failed, error, patch, behaviour,
                  {int(lag): int(n) for lag, n in trial_lags}, path, cost)
        for tid, task, harness, step, sample, group, model, outcome, failed, error, patch, behaviour, trial_lags, cost
        in zip(ids, column("task_id"), harnesses, steps, column("sample_index"), column("group_id"), column("model"),
               column("outcome"), infra, column("error"), column("patch"), behaviours, lags, costs, strict=True)
    ]


def _stamp(path: Path) -> tuple[str, int, int]:
    st = path.stat()
    return (path.name, st.st_size, st.st_mtime_ns)


class RunReader:
    """Reads a run directory incrementally; keep one per run for a long-lived view."""

    def __init__(self, root: str | os.PathLike[str]):
        self.run = RunDir.at(root)
        if not self.run.root.is_dir():
            raise LegorlError(f"{self.run.root}: run directory does not exist")
        self._rollout_cache: dict[tuple[str, int, int], list[TrialInfo]] = {}
        self._grade_cache: dict[tuple[str, int, int], list[GradeInfo]] = {}
        self._snapshot: Snapshot | None = None

    def _eval_report_path(self) -> Path:
        return self.run.eval / "report.json"

    def fingerprint(self) -> str:
        """A digest of the part-file listings (names, sizes, mtimes) and the eval report's stamp."""
        digest = sha1()
        for folder in (self.run.tasks, self.run.rollouts, self.run.grades, self.run.metrics):
            digest.update(str(folder).encode())
            for f in shards.part_files(folder):
                try:
                    digest.update(repr(_stamp(f)).encode())
                except FileNotFoundError:
                    continue
        report = self._eval_report_path()
        if report.exists():
            digest.update(repr(_stamp(report)).encode())
        return digest.hexdigest()[:16]

    def snapshot(self) -> Snapshot:
        """The run as it is now; returns the previous snapshot when nothing changed."""
        def read() -> Snapshot:
            fp = self.fingerprint()
            if self._snapshot is None or self._snapshot.fingerprint != fp:
                self._snapshot = self._read_snapshot(fp)
            return self._snapshot

        return _relisting(read)

    def _read_snapshot(self, fp: str) -> Snapshot:
        snap = Snapshot(root=self.run.root, fingerprint=fp)
        with _no_gc():
            for info in _summaries(self.run.rollouts, self._rollout_cache, summarise_rollout_file):
                snap.trials[info.trial_id] = info
            for grade in _summaries(self.run.grades, self._grade_cache, summarise_grade_file):
                snap.grades[grade.trial_id] = grade
        snap.metrics = shards.read_rows(self.run.metrics, Kind.METRICS)
        tasks = shards.read(self.run.tasks, Kind.TASKS, columns=["repo"]).table
        snap.task_ids = tasks.column("instance_id").to_pylist()
        snap.repos = {
            i: r for i, r in zip(snap.task_ids, tasks.column("repo").to_pylist(), strict=True) if r
        }
        report = self._eval_report_path()
        if report.exists():
            try:
                snap.eval_report = json.loads(report.read_text())
            except (OSError, json.JSONDecodeError) as exc:
                raise LegorlError(f"{report}: not a readable eval report ({exc})") from exc
        return snap

    def trial_row(self, trial_id: str) -> TrialRow:
        """The full rollout row of one trial (read from the file that holds its latest version)."""
        def read() -> TrialRow:
            info = self.snapshot().trials.get(trial_id)
            if info is None:
                raise LegorlError(f"{self.run.rollouts}: no trial {trial_id!r}")
            return TrialRow.from_dict(_rows_in(info.file, Kind.ROLLOUTS, [trial_id], info.step)[trial_id])

        return _relisting(read)

    def grade_row(self, trial_id: str) -> GradeRow | None:
        """The full grade row of one trial, test log included, or None when it is not graded."""
        def read() -> GradeRow | None:
            grade = self.snapshot().grades.get(trial_id)
            if grade is None or grade.file is None:
                return None
            return GradeRow.from_dict(_rows_in(grade.file, Kind.GRADES, [trial_id], grade.step)[trial_id])

        return _relisting(read)

    def step_rows(self, step: int) -> tuple[dict[str, TrialRow], dict[str, GradeRow]]:
        """The full rollout and grade rows of one step's trials, each file that holds them read once
        (for a bulk export; one trial's rows: :meth:`trial_row`, :meth:`grade_row`)."""
        def read() -> tuple[dict[str, TrialRow], dict[str, GradeRow]]:
            snap = self.snapshot()
            ids = [t.trial_id for t in snap.trials.values() if t.step == step]
            trials = _rows_by_file(((snap.trials[i].file, snap.trials[i].step, i) for i in ids), Kind.ROLLOUTS)
            graded = [snap.grades[i] for i in ids if i in snap.grades]
            grades = _rows_by_file(((g.file, g.step, g.trial_id) for g in graded if g.file), Kind.GRADES)
            return ({i: TrialRow.from_dict(d) for i, d in trials.items()},
                    {i: GradeRow.from_dict(d) for i, d in grades.items()})

        return _relisting(read)


@contextmanager
def _no_gc() -> Iterator[None]:
    """The cyclic garbage collector paused: building 10^5 trials' objects (none of them in a cycle)
    would otherwise run it over and over across everything built so far (a third of the time)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


_ATTEMPTS = 5  # listings of a run that a compaction may change under a reader
_T = TypeVar("_T")


def _relisting(read: Callable[[], _T]) -> _T:
    """``read()``, again (from a fresh listing) when a compaction replaced a part file it was reading."""
    for attempt in range(_ATTEMPTS):
        try:
            return read()
        except Vanished:
            if attempt == _ATTEMPTS - 1:
                raise
    raise AssertionError("unreachable")


def _summaries(folder: Path, cache: dict[tuple[str, int, int], list[Any]], summarise: Any) -> Iterable[Any]:
    """Each part file's summaries, in part order, from ``cache`` (by name, size, mtime) or read once."""
    live: set[tuple[str, int, int]] = set()
    for f in shards.part_files(folder):
        try:
            stamp = _stamp(f)
        except FileNotFoundError as exc:
            raise Vanished(f, "part file vanished (replaced by a compaction)") from exc
        live.add(stamp)
        if stamp not in cache:
            cache[stamp] = summarise(f)
        yield from cache[stamp]
    for stale in set(cache) - live:
        del cache[stale]


def _rows_by_file(wanted: Iterable[tuple[Path, int | None, str]], kind: Kind) -> dict[str, dict[str, Any]]:
    """The rows of the given (file, step, key)s as dicts by key, each file read once."""
    by_file: dict[tuple[Path, int | None], list[str]] = {}
    for path, step, key in wanted:
        by_file.setdefault((path, step), []).append(key)
    out: dict[str, dict[str, Any]] = {}
    for (path, step), keys in by_file.items():
        out.update(_rows_in(path, kind, keys, step))
    return out


def _rows_in(path: Path, kind: Kind, trial_ids: list[str], step: int | None) -> dict[str, dict[str, Any]]:
    """The rows of ``trial_ids`` (all at ``step``) in one part file, by id (the file's last row of
    each), read through the row groups that can hold them."""
    at_step = pc.field("step").is_null() if step is None else pc.field("step") == step
    where = at_step & pc.field("trial_id").isin(trial_ids)
    table = shards.read_file(path, kind, where=where)
    return {row["trial_id"]: row for row in table.to_pylist()}


def summarise_grade_file(path: Path) -> list[GradeInfo]:
    """Read one grade part file's light columns (not the test log) and summarise each row; the
    tests passed per row are counted with numpy."""
    table = shards.read_file(path, Kind.GRADES, columns=["trial_id", *_GRADE_COLUMNS])
    tests = table.column("tests").combine_chunks()
    rows = pc.list_parent_indices(tests).to_numpy()
    passed = pc.fill_null(pc.list_flatten(tests).field("passed"), False).to_numpy(zero_copy_only=False)
    passed_per_row = np.bincount(rows, weights=passed.astype(np.float64), minlength=table.num_rows).astype(int).tolist()
    total_per_row = pc.fill_null(pc.list_value_length(tests), 0).to_numpy().tolist()

    def column(name: str) -> list[Any]:
        return table.column(name).to_pylist()

    return [
        GradeInfo(trial_id, task_id, status, bool(infra), reward, resolved, resolution, error, passed, total, step, path)
        for trial_id, task_id, status, infra, reward, resolved, resolution, error, passed, total, step in zip(
            column("trial_id"), column("task_id"), column("status"), column("infra_failure"), column("reward"),
            column("resolved"), column("resolution"), column("error"), passed_per_row, total_per_row, column("step"),
            strict=True)
    ]
