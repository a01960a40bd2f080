"""Sessions of a harness legorl does not run (``legorl serve-proxy --run R``) as rollouts rows.

The proxy knows only what it served, so the row says what it can: harness ``external`` unless the
session's metadata names one, the outcome the proxy tells on its own (a budget stop, else no
submission), and the session's fingerprint and cost.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

from legorl.core import shards
from legorl.core.paths import RunDir
from legorl.core.schemas import Kind, TrialRow
from legorl.proxy.sessions import SessionCapture
from legorl.trials.costs import trial_cost
from legorl.trials.fingerprints import trial_fingerprint

log = logging.getLogger("legorl.proxy")


def session_row(capture: SessionCapture, **overrides: Any) -> TrialRow:
    """A rollouts row; ``overrides`` replace the session's metadata (task_id, harness, step, sample_index...)."""
    meta = {**capture.metadata, **overrides}
    task_id = str(meta.pop("task_id", None) or f"proxy/{capture.session_id}")
    harness = str(meta.pop("harness", None) or "external")
    step = int(meta.pop("step", 0) or 0)
    sample_index = int(meta.pop("sample_index", 0) or 0)
    meta.setdefault("outcome", capture.outcome())
    meta.setdefault("model", capture.model)
    meta.setdefault("started_at", capture.created_at)
    meta.setdefault("finished_at", time.time())
    meta.setdefault("fingerprint", trial_fingerprint(harness))  # an external harness: its config is unknown
    meta.setdefault("cost", trial_cost(capture.calls, int(meta.get("attempts") or 1), None))
    known = set(TrialRow.__dataclass_fields__)
    extra = {k: v for k, v in meta.items() if k in known}
    return TrialRow.new(
        task_id, harness, step, sample_index,
        segments=capture.segments, calls=capture.calls,
        messages=json.dumps(capture.messages, ensure_ascii=False), **extra,
    )


class ShardSink:
    """Writes finished sessions as ``rollouts`` rows into a run directory's ``proxy/`` (a proxy's ``on_finish``)."""

    def __init__(self, run_dir: str | Path):
        self.path = RunDir.at(run_dir).proxy_sessions

    def __call__(self, capture: SessionCapture) -> None:
        if not capture.calls:
            return
        try:
            shards.write(self.path, Kind.ROLLOUTS, [session_row(capture)])
        except Exception:  # never lose the server over a shard; say so loudly
            log.exception("could not write session %s to %s", capture.session_id, self.path)
