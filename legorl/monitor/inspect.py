"""``legorl inspect``: what a run directory (or one dataset folder) holds.

The JSON form is for scripts; its keys are stable:

``{"path": str, "datasets": [{"name", "kind", "path", "files", "rows", "schema_versions",
"commands", "duplicate_keys", "temp_files", "breakdown"}], "errors": [str]}``, plus ``"health"``
(``legorl.monitor.health.health_summary``) when the path is a run directory holding trials.

``breakdown`` depends on the kind: tasks ``{"repos": {repo: n}, "flaky_tests": {instance_id: {"count": n,
"names": [test]}}}`` (the tests the task check left out for changing status between runs of one patch;
only tasks that have any); rollouts ``{"outcomes",
"harnesses", "steps", "infra_failures", "sampled_tokens", "segments", "fork_costs"}`` (``fork_costs``: over the
trials, ``{"segment_tokens_per_sampled", "shared_share", "heaviest": [{"trial_id", "segments",
"segment_tokens_per_sampled", "shared_share"}]}``, the three trials of most segment tokens per sampled token
among those with several segments: ``legorl.trials.costs.fork_cost``), plus ``"staleness": {"lag L": share
of trials}`` when calls record their policy version (``legorl.trials.provenance.lag_shares``); grades ``{"statuses",
"resolved", "reward_mean", "infra_failures", "suspicious"}``; rollouts and grades add ``"fingerprint_mixes":
[line]`` when their rows' fingerprints disagree (``legorl.trials.fingerprints.mixes``: two harness versions or configs,
two images or grader versions for one task...); metrics ``{"steps", "keys", "last": {key: value}}``.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from legorl.core import shards
from legorl.core.errors import ShardError
from legorl.core.paths import RUN_DATASETS, RunDir
from legorl.core.schemas import Kind
from legorl.trials import fingerprints
from legorl.trials.costs import ForkCost, fork_cost


def detect_kind(folder: Path) -> Kind | None:
    """The kind of a dataset folder, from its first part file's metadata."""
    for f in shards.part_files(folder):
        info = shards.file_info(f)
        if info.kind in set(Kind):
            return Kind(info.kind)
        raise ShardError(f, "not a legorl shard (no legorl metadata)")
    return None


# The columns each kind's breakdown reads (the key columns come with them): not the conversations,
# patches, test logs or problem statements.
# Of the nested columns, the fields they count (``segments.loss_mask``): not a segment's logprobs or routing,
# nor its token ids, read only for the trials of several segments (:func:`_fork_costs`).
COLUMNS: dict[Kind, list[str]] = {
    Kind.TASKS: ["repo", "flaky_tests"],
    Kind.ROLLOUTS: ["outcome", "harness", "step", "infra_failure", "segments.loss_mask",
                    "calls.policy_version", "calls.budget_stop", "calls.completion_tokens",
                    *(f"fingerprint.{field}" for field in fingerprints.TRIAL_FIELDS)],
    Kind.GRADES: ["task_id", "status", "resolved", "reward", "infra_failure", "suspicious",
                  *(f"fingerprint.{field}" for field in fingerprints.GRADE_FIELDS)],
    Kind.METRICS: ["value"],
}


def _counts(values: list[Any]) -> dict[str, int]:
    return {str(k): v for k, v in sorted(Counter(values).items(), key=lambda kv: str(kv[0]))}


def _breakdown(dataset: shards.Dataset, folder: Path) -> dict[str, Any]:
    t = dataset.table
    if dataset.kind == Kind.TASKS:
        return {"repos": _counts(t.column("repo").to_pylist()), "flaky_tests": _flaky(t)}
    if dataset.kind == Kind.ROLLOUTS:
        segments = t.column("segments")
        flat = pc.list_flatten(segments)
        sampled = 0
        if len(flat):
            sampled = int(pc.sum(pc.list_flatten(flat.combine_chunks().field("loss_mask"))).as_py() or 0)
        return {
            "outcomes": _counts(t.column("outcome").to_pylist()),
            "harnesses": _counts(t.column("harness").to_pylist()),
            "steps": _counts(t.column("step").to_pylist()),
            "infra_failures": int(pc.sum(t.column("infra_failure")).as_py() or 0),
            "sampled_tokens": sampled,
            "segments": len(flat),
            "fork_costs": _fork_costs(t, folder),
            **_staleness(t),
            **_mixes(trials=t.select(["harness", "step", "fingerprint"]).to_pylist()),
        }
    if dataset.kind == Kind.GRADES:
        reward = pc.mean(t.column("reward")).as_py() if t.num_rows else None
        return {
            "statuses": _counts(t.column("status").to_pylist()),
            "resolved": int(pc.sum(pc.fill_null(t.column("resolved"), False)).as_py() or 0),
            "reward_mean": reward,
            "infra_failures": int(pc.sum(t.column("infra_failure")).as_py() or 0),
            # grades whose patch added code that reaches into the test runner (whatever they scored)
            "suspicious": int(pc.sum(pc.greater(pc.fill_null(pc.list_value_length(t.column("suspicious")), 0), 0))
                              .as_py() or 0),
            **_mixes(grades=t.select(["task_id", "fingerprint"]).to_pylist()),
        }
    steps = sorted(set(t.column("step").to_pylist()))
    last: dict[str, Any] = {}
    if steps:
        latest = t.filter(pc.equal(t.column("step"), steps[-1]))
        for key, harness, value in zip(
            latest.column("key").to_pylist(), latest.column("harness").to_pylist(), latest.column("value").to_pylist(),
            strict=True,
        ):
            last[key if harness is None else f"{key}[{harness}]"] = value
    return {"steps": len(steps), "keys": len(set(t.column("key").to_pylist())), "last": dict(sorted(last.items()))}


def _fork_costs(t: Any, folder: Path, heaviest: int = 3) -> dict[str, Any]:
    """Segment tokens per sampled token and the shared-prefix share, over the trials and for the heaviest.
    A trial of one segment shares nothing, so only the token ids of the trials of several are read
    (from ``folder``, the rows of those trials alone) and compared token by token."""
    per_row = pc.fill_null(pc.list_value_length(t.column("segments")), 0).to_numpy(zero_copy_only=False)
    flat = pc.list_flatten(t.column("segments"))
    mask_lists = pc.struct_field(flat, "loss_mask")
    lengths = pc.list_value_length(mask_lists).to_numpy(zero_copy_only=False)  # a segment's ids are as long
    masks = pc.list_flatten(mask_lists).to_numpy(zero_copy_only=False)
    ends = np.cumsum(lengths)
    starts = ends - lengths
    running = np.concatenate([[0], np.cumsum(masks, dtype=np.int64)])
    sampled = running[ends] - running[starts]  # per segment
    shared = 0
    forked: list[tuple[str, ForkCost]] = []
    first = np.concatenate([[0], np.cumsum(per_row)[:-1]]).astype(np.int64) if len(per_row) else per_row
    several = np.flatnonzero(per_row > 1)
    if len(several):
        trial_ids = t.column("trial_id").take(pa.array(several)).to_pylist()
        ids = _segment_ids(folder, trial_ids, sorted(set(t.column("step").take(pa.array(several)).to_pylist())))
        for trial_id, row in zip(trial_ids, several.tolist(), strict=True):
            segs = range(int(first[row]), int(first[row] + per_row[row]))
            cost = fork_cost(ids[trial_id], int(sum(int(sampled[k]) for k in segs)))
            shared += cost.shared_tokens
            forked.append((trial_id, cost))
    total = ForkCost(len(lengths), int(lengths.sum()), int(sampled.sum()), shared)
    forked.sort(key=lambda c: -(c[1].tokens_per_sampled or 0.0))
    return {"segment_tokens_per_sampled": total.tokens_per_sampled, "shared_share": total.shared_share,
            "heaviest": [{"trial_id": trial_id, "segments": c.segments, "segment_tokens_per_sampled": c.tokens_per_sampled,
                          "shared_share": c.shared_share} for trial_id, c in forked[:heaviest]]}


def _segment_ids(folder: Path, trial_ids: list[str], steps: list[int]) -> dict[str, list[np.ndarray]]:
    """The token ids of each segment of ``trial_ids`` (rows of ``steps``: row groups of other steps are
    not read), by trial id."""
    where = pc.field("step").isin(steps) & pc.field("trial_id").isin(trial_ids)
    table = shards.read(folder, Kind.ROLLOUTS, columns=["step", "segments.token_ids"], where=where).table
    segments = table.column("segments").combine_chunks()
    per_row = pc.fill_null(pc.list_value_length(segments), 0).to_numpy(zero_copy_only=False)
    ids = pc.struct_field(pc.list_flatten(segments), "token_ids")
    ends = np.cumsum(pc.fill_null(pc.list_value_length(ids), 0).to_numpy(zero_copy_only=False))
    values = pc.list_flatten(ids).to_numpy(zero_copy_only=False)
    bounds = list(zip(np.concatenate([[0], ends[:-1]]).tolist(), ends.tolist(), strict=True))
    out: dict[str, list[np.ndarray]] = {}
    first = 0
    for trial_id, n in zip(table.column("trial_id").to_pylist(), per_row.tolist(), strict=True):
        out[trial_id] = [values[a:b] for a, b in bounds[first:first + n]]
        first += n
    return out


def _flaky(t: Any) -> dict[str, Any]:
    """Per task with flaky tests (``TaskRow.flaky_tests``): how many and which."""
    out: dict[str, Any] = {}
    for iid, recorded in zip(t.column("instance_id").to_pylist(), t.column("flaky_tests").to_pylist(), strict=True):
        try:
            names = sorted(json.loads(recorded)) if recorded else []
        except (ValueError, TypeError):
            names = ["(unreadable flaky_tests)"]
        if names:
            out[iid] = {"count": len(names), "names": names}
    return dict(sorted(out.items()))


def _staleness(t: Any) -> dict[str, Any]:
    """``{"staleness": {"lag L": share of trials}}`` when calls record their policy version, else {}:
    :func:`legorl.trials.provenance.lag_shares` (a trial lags by its oldest versioned call that sampled tokens),
    computed column-wise."""
    calls = t.column("calls").combine_chunks()
    flat = pc.list_flatten(calls)
    if len(flat) == 0:
        return {}
    version = flat.field("policy_version")
    stopped = pc.fill_null(pc.greater(pc.utf8_length(flat.field("budget_stop")), 0), False)  # a budget stop's reason
    sampled = pc.and_(pc.invert(stopped), pc.greater(pc.fill_null(flat.field("completion_tokens"), 0), 0))
    keep = pc.and_(sampled, pc.is_valid(version))
    versions = pa.table({"row": pc.list_parent_indices(calls), "version": version}).filter(keep)
    oldest = versions.group_by("row").aggregate([("version", "min")])
    steps = pc.cast(t.column("step").combine_chunks().take(oldest.column("row")), pa.int64())
    found = Counter(pc.subtract(steps, pc.cast(oldest.column("version_min"), pa.int64())).to_pylist())
    total = sum(found.values())
    shares = {str(k): round(n / total, 6) for k, n in sorted(found.items())}
    return {"staleness": {f"lag {lag}": share for lag, share in shares.items()}} if shares else {}


def _mixes(**rows: Any) -> dict[str, Any]:
    """``{"fingerprint_mixes": [line]}`` where the rows' fingerprints disagree (legorl.trials.fingerprints), else {}."""
    found = fingerprints.mixes(**rows)
    return {"fingerprint_mixes": found} if found else {}


def summarize_dataset(name: str, folder: Path, kind: Kind) -> dict[str, Any]:
    dataset = shards.read(folder, kind, columns=COLUMNS[kind])
    infos = [shards.file_info(f) for f in dataset.files]
    return {
        "name": name,
        "kind": str(kind),
        "path": str(folder),
        "files": len(dataset.files),
        "rows": dataset.table.num_rows,
        "schema_versions": sorted({i.schema_version for i in infos if i.schema_version is not None}),
        "commands": sorted({i.command for i in infos if i.command})[:5],
        "duplicate_keys": dataset.duplicates,
        "temp_files": len(list(folder.glob(".part-*.tmp"))),
        "breakdown": _breakdown(dataset, folder),
    }


def run_mixes(summary: dict[str, Any]) -> list[str]:
    """:func:`legorl.trials.fingerprints.run_mixes` of the run :func:`inspect_path` summarised, from the
    datasets' ``fingerprint_mixes`` it counted (the rollouts are not read again)."""
    found = {d["name"]: d["breakdown"].get("fingerprint_mixes", []) for d in summary["datasets"]}
    return [f"{prefix}{line}" for prefix in ("", "eval/") for name in ("rollouts", "grades")
            for line in found.get(prefix + name, [])]


def inspect_path(path: Path) -> dict[str, Any]:
    """Summarise a run directory or a single dataset folder. Unreadable datasets are reported in
    ``errors`` (one line each, naming the file) rather than stopping the whole summary."""
    path = Path(path)
    if not path.exists():
        raise ShardError(path, "no such run directory or dataset folder")
    found: list[tuple[str, Path, Kind]] = []
    errors: list[str] = []
    if shards.part_files(path):
        try:
            kind = detect_kind(path)
        except ShardError as exc:
            errors.append(str(exc))
        else:
            if kind is not None:
                found.append((path.name, path, kind))
    else:
        run = RunDir.at(path)
        for name, kind in RUN_DATASETS:
            folder = run.root / name
            if shards.part_files(folder):
                found.append((name, folder, kind))
    datasets = []
    for name, folder, kind in found:
        try:
            datasets.append(summarize_dataset(name, folder, kind))
        except ShardError as exc:
            errors.append(str(exc))
    return {"path": str(path), "datasets": datasets, "errors": errors}
