"""What the dashboard's overview keeps of each rollout part, stored beside it
(:mod:`legorl.core.shards.summaries`): each trial's identity, outcome, behaviour figures, token lags,
patch and cost, without its tokens, its conversation or its behaviour events (each tool call
classified: only a trial's detail shows them, and it classifies them from the row it reads).

Summarising a trial (classifying every tool call of its conversation) costs milliseconds, so a cold
overview of a 10^5-trial run would take minutes; a part's summary is built once. Who builds them:
the first reader that finds a part without one (``RunReader``), and compaction through
:func:`merge` (the loop and ``legorl shards compact`` hand it over), which builds the merged part's
summary from those of the parts it replaces (rows without one are summarised from the rows it has
read anyway) before the merged part is renamed into place. The writers of part files do not
summarise: see ``docs/shards.md``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from legorl.core.schemas import Kind, TrialRow
from legorl.core.shards import summaries as shard_summaries
from legorl.core.shards.compaction import sort_columns
from legorl.core.shards.reading import dedupe, read_file
from legorl.monitor.behaviour import trial_behaviour
from legorl.trials import provenance
from legorl.trials.costs import cost_of

# Bump when the summary's columns or what they mean change: older summaries are then recomputed.
VERSION = 2  # 2: no behaviour events

# The rollout columns a summary copies, and those it is computed from (not the token ids or logprobs).
IDENTITY = ["trial_id", "task_id", "harness", "step", "sample_index", "group_id", "model", "outcome",
            "infra_failure", "error", "patch"]
SOURCE_COLUMNS = [*IDENTITY, "segments", "calls", "messages", "attempts", "cost"]
BEHAVIOUR_COUNTS = [
    "turns", "assistant_turns", "model_tokens", "env_tokens", "tool_calls", "text_only_turns",
    "reasoning_chars", "response_chars", "edits", "reads", "test_runs", "forks", "parse_errors", "budget_stops",
]
SCHEMA = pa.schema([
    pa.field("trial_id", pa.string(), nullable=False),
    pa.field("task_id", pa.string()),
    pa.field("harness", pa.string()),
    pa.field("step", pa.int64()),
    pa.field("sample_index", pa.int64()),
    pa.field("group_id", pa.string()),
    pa.field("model", pa.string()),
    pa.field("outcome", pa.string()),
    pa.field("infra_failure", pa.bool_()),
    pa.field("error", pa.string()),
    pa.field("patch", pa.string()),
    *(pa.field(name, pa.int64()) for name in BEHAVIOUR_COUNTS),
    pa.field("submitted", pa.bool_()),
    pa.field("self_verifying", pa.bool_()),
    pa.field("token_lags", pa.string()),  # JSON: [[lag, sampled tokens]]
    # the trial's cost (legorl.trials.costs.cost_of), as "cost_<field>"
    pa.field("cost_sandbox_s", pa.float64()),
    pa.field("cost_engine_s", pa.float64()),
    *(pa.field(f"cost_{name}", pa.int64()) for name in ("prompt_tokens", "sampled_tokens", "cached_tokens", "retries")),
])


def load(part: Path, key: tuple[int, str] | None = None) -> pa.Table | None:
    """The stored summary of ``part`` when it is valid (:func:`legorl.core.shards.summaries.load`), else None."""
    return shard_summaries.load(part, VERSION, SCHEMA, key)


def store(part: Path, summary: pa.Table, key: tuple[int, str] | None = None) -> bool:
    """Store ``summary`` as the summary of ``part`` (False when it cannot be written: a read-only run)."""
    return shard_summaries.store(part, summary, VERSION, SCHEMA, key)


path_of = shard_summaries.path_of


def build(table: pa.Table) -> pa.Table:
    """The summary of rollout rows (a table with at least :data:`SOURCE_COLUMNS`), row for row."""
    counts = _token_counts(table)
    light = table.select([c for c in SOURCE_COLUMNS if c != "segments"]).to_pylist()
    rows: list[dict[str, Any]] = []
    for data, seg_counts in zip(light, counts, strict=True):
        row = TrialRow.from_dict(data)
        b = trial_behaviour(row, seg_counts)
        rows.append({
            **{c: data[c] for c in IDENTITY},
            "infra_failure": bool(row.infra_failure),
            **{name: getattr(b, name) for name in BEHAVIOUR_COUNTS},
            "submitted": b.submitted, "self_verifying": b.self_verifying,
            "token_lags": json.dumps(sorted(provenance.token_lags(row).items())),
            **{f"cost_{name}": value for name, value in cost_of(row).to_dict().items()},
        })
    return pa.Table.from_pylist(rows, schema=SCHEMA)


def summarise(part: Path, table: pa.Table | None = None, write: bool = True, rebuild: bool = False) -> pa.Table:
    """The summary of one rollout part: the stored one when it is valid (and not ``rebuild``), else
    built (from ``table``, the part's rows when the caller has them, or read now) and, with
    ``write``, stored."""
    key = shard_summaries.part_key(part)
    summary = None if rebuild else load(part, key)
    if summary is None:
        summary = build(table if table is not None else read_file(part, Kind.ROLLOUTS, SOURCE_COLUMNS))
        if write:
            store(part, summary, key)
    return summary


def _token_counts(table: pa.Table) -> list[list[tuple[str, int, int]]]:
    """Per row, per segment: (reason, sampled tokens, other tokens), computed with numpy."""
    segments = table.column("segments").combine_chunks()
    out: list[list[tuple[str, int, int]]] = [[] for _ in range(table.num_rows)]
    if len(segments) == 0:
        return out
    parents = pc.list_parent_indices(segments).to_numpy()
    flat = pc.list_flatten(segments)
    if len(flat) == 0:
        return out
    masks = flat.field("loss_mask")
    lengths = pc.list_value_length(masks).to_numpy(zero_copy_only=False).astype(np.int64)
    values = pc.list_flatten(masks).to_numpy(zero_copy_only=False).astype(np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    running = np.concatenate([[0], np.cumsum(values)])
    sums = running[offsets[1:]] - running[offsets[:-1]]
    reasons = flat.field("reason").to_pylist()
    for i, row in enumerate(parents):
        out[int(row)].append((str(reasons[i]), int(sums[i]), int(lengths[i] - sums[i])))
    return out


def merge(kind: Kind, final: Path, tmp: Path, run: list[Path], tables: list[pa.Table]) -> None:
    """Compaction's hook (:data:`legorl.core.shards.compaction.OnMerge`): for a rollout dataset, store the
    summary of the merged part (written to ``tmp``, to be renamed to ``final``) from the replaced
    parts' summaries, each key's last; those missing built from the rows read for the merge. Rows it
    cannot summarise (a torn conversation) are left to the reader."""
    if kind != Kind.ROLLOUTS:
        return
    try:
        parts = [summarise(p, t, write=False) for p, t in zip(run, tables, strict=True)]
    except Exception:  # derived data: rows it cannot summarise are the reader's to report
        return
    summary, _ = dedupe(Kind.ROLLOUTS, pa.concat_tables(parts))
    summary = summary.sort_by([(c, "ascending") for c in sort_columns(Kind.ROLLOUTS)])  # row for row
    store(final, summary, key=shard_summaries.part_key(tmp))
