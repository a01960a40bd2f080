"""The shard schemas: the single source of truth for what stages write and read.

Four dataset kinds meet on disk — ``tasks``, ``rollouts`` (one row per trial), ``grades`` (one row
per graded trial) and ``metrics`` (long format). Each has an Arrow schema, a typed row class and a
stable key. Bump :data:`SCHEMA_VERSION` when a field changes meaning; adding a nullable field is
backward compatible (older files read with it null).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, ClassVar, Self

import pyarrow as pa

SCHEMA_VERSION = 1


class Kind(StrEnum):
    TASKS = "tasks"
    ROLLOUTS = "rollouts"
    GRADES = "grades"
    METRICS = "metrics"


class Outcome(StrEnum):
    """How a trial ended. Only ``INFRA_ERROR`` is an infrastructure failure."""

    SUBMITTED = "submitted"
    NO_SUBMISSION = "no_submission"  # the agent stopped (gave up, finished) without submitting
    MAX_TURNS = "max_turns"
    BUDGET = "budget"  # token or other proxy budget exhausted
    CONTEXT_OVERFLOW = "context_overflow"
    TIMEOUT = "timeout"
    HARNESS_CRASH = "harness_crash"
    INFRA_ERROR = "infra_error"  # sandbox or engine failed, or the harness could not start


class BudgetStop(StrEnum):
    """Why the proxy ended an episode (``Call.budget_stop``, and the session's): a budget ran out."""

    MAX_TURNS = "max_turns"
    MAX_TOTAL_TOKENS = "max_total_tokens"
    MAX_WALL_TIME = "max_wall_time"
    CONTEXT_OVERFLOW = "context_overflow"


#: The trial outcome of each budget stop.
BUDGET_STOP_OUTCOMES: dict[BudgetStop, Outcome] = {
    BudgetStop.MAX_TURNS: Outcome.MAX_TURNS,
    BudgetStop.MAX_TOTAL_TOKENS: Outcome.BUDGET,
    BudgetStop.MAX_WALL_TIME: Outcome.TIMEOUT,
    BudgetStop.CONTEXT_OVERFLOW: Outcome.CONTEXT_OVERFLOW,
}


def budget_outcome(reason: str) -> Outcome:
    """The outcome of a trial the proxy budget-stopped for ``reason`` (one it does not know: BUDGET)."""
    try:
        return BUDGET_STOP_OUTCOMES[BudgetStop(reason)]
    except ValueError:
        return Outcome.BUDGET


class SegmentReason(StrEnum):
    """Why a training sequence exists."""

    MAIN = "main"
    REWRITE = "rewrite"  # the harness rewrote its history (compaction, edits, injected reminders)
    SUBAGENT = "subagent"
    AUXILIARY = "auxiliary"  # e.g. title generation: kept for audit, usually not trained on


class GradeStatus(StrEnum):
    GRADED = "graded"
    EMPTY_PATCH = "empty_patch"
    PATCH_APPLY_FAILED = "patch_apply_failed"
    TEST_TIMEOUT = "test_timeout"
    TESTS_ERRORED = "tests_errored"  # the test run broke after the patch went in (crash, kill, no report)
    SUSPICIOUS = "suspicious"  # the tests passed, but the patch's code reaches into the test runner
    INFRA_ERROR = "infra_error"


class Resolution(StrEnum):
    FULL = "FULL"
    PARTIAL = "PARTIAL"
    NO = "NO"


# --------------------------------------------------------------------------- arrow schemas

SEGMENT_TYPE = pa.struct(
    [
        pa.field("token_ids", pa.list_(pa.int32()), nullable=False),
        # 1 only on tokens the policy sampled; prompt and tool output tokens are 0.
        pa.field("loss_mask", pa.list_(pa.int8()), nullable=False),
        # logprob of each token under the distribution it was sampled from (0.0 where mask is 0).
        pa.field("logprobs", pa.list_(pa.float32()), nullable=False),
        # experts each token was routed to, flattened row-major from [tokens, layers, top_k].
        pa.field("routed_experts", pa.list_(pa.int16())),
        pa.field("routing_layers", pa.int32()),
        pa.field("routing_top_k", pa.int32()),
        pa.field("reason", pa.string(), nullable=False),
        pa.field("parent", pa.int32()),  # index of the segment this one forked from
    ]
)

CALL_TYPE = pa.struct(
    [
        pa.field("index", pa.int32()),
        pa.field("api", pa.string()),  # "openai" | "anthropic"
        pa.field("stream", pa.bool_()),
        pa.field("segment", pa.int32()),
        pa.field("started_at", pa.float64()),
        pa.field("latency_s", pa.float64()),
        pa.field("ttft_s", pa.float64()),
        pa.field("prompt_tokens", pa.int32()),
        pa.field("new_prompt_tokens", pa.int32()),
        pa.field("completion_tokens", pa.int32()),
        pa.field("finish_reason", pa.string()),
        pa.field("parse_error", pa.string()),
        pa.field("budget_stop", pa.string()),  # a BudgetStop
        # The distribution the call sampled from, after the proxy's overrides (null for a budget stop,
        # which samples nothing, and in shards written before they were recorded). temperature 0 is
        # greedy (its logprobs are those at temperature 1); top_k 0 = off.
        pa.field("temperature", pa.float64()),
        pa.field("top_p", pa.float64()),
        pa.field("top_k", pa.int64()),
    ]
)

TIMINGS_TYPE = pa.struct(
    [
        pa.field("sandbox_s", pa.float64()),
        pa.field("agent_s", pa.float64()),
        pa.field("model_s", pa.float64()),
        pa.field("patch_s", pa.float64()),
        pa.field("total_s", pa.float64()),
    ]
)

TEST_RESULT_TYPE = pa.struct(
    [
        pa.field("name", pa.string()),
        pa.field("kind", pa.string()),  # FAIL_TO_PASS | PASS_TO_PASS
        pa.field("status", pa.string()),  # PASSED FAILED ERROR SKIPPED XFAIL MISSING
        pa.field("passed", pa.bool_()),
    ]
)

_str = pa.string()
_strings = pa.list_(pa.string())

TASKS_SCHEMA = pa.schema(
    [
        pa.field("instance_id", _str, nullable=False),
        pa.field("repo", _str),
        pa.field("base_commit", _str),
        pa.field("patch", _str),
        pa.field("test_patch", _str),
        pa.field("problem_statement", _str),
        pa.field("hints_text", _str),
        pa.field("created_at", _str),
        pa.field("version", _str),
        pa.field("FAIL_TO_PASS", _strings),
        pa.field("PASS_TO_PASS", _strings),
        pa.field("environment_setup_commit", _str),
        pa.field("image", _str),
        pa.field("repo_source", _str),  # absolute path of a git bundle or directory
        pa.field("repo_ref", _str),
        pa.field("test_command", _str),
        pa.field("log_parser", _str),
        # JSON object: every test's status when the gold patch is graded (the reference a trial must reach)
        pa.field("gold_statuses", _str),
    ]
)

ROLLOUTS_SCHEMA = pa.schema(
    [
        pa.field("trial_id", _str, nullable=False),
        pa.field("task_id", _str, nullable=False),
        pa.field("harness", _str, nullable=False),
        pa.field("step", pa.int32(), nullable=False),
        pa.field("sample_index", pa.int32(), nullable=False),
        pa.field("group_id", _str, nullable=False),
        pa.field("model", _str),
        pa.field("outcome", _str, nullable=False),
        pa.field("infra_failure", pa.bool_(), nullable=False),
        pa.field("error", _str),
        pa.field("exit_code", pa.int32()),
        pa.field("attempts", pa.int32()),
        pa.field("patch", _str),
        pa.field("segments", pa.list_(SEGMENT_TYPE)),
        pa.field("calls", pa.list_(CALL_TYPE)),
        pa.field("messages", _str),  # JSON: the conversation as the harness last sent it
        pa.field("timings", TIMINGS_TYPE),
        pa.field("started_at", pa.float64()),
        pa.field("finished_at", pa.float64()),
    ]
)

GRADES_SCHEMA = pa.schema(
    [
        pa.field("trial_id", _str, nullable=False),
        pa.field("task_id", _str, nullable=False),
        pa.field("harness", _str),
        pa.field("step", pa.int32()),
        pa.field("reward", pa.float64()),  # null when grading itself failed
        pa.field("resolved", pa.bool_()),
        pa.field("resolution", _str),
        pa.field("status", _str, nullable=False),
        pa.field("infra_failure", pa.bool_(), nullable=False),
        pa.field("error", _str),
        pa.field("tests", pa.list_(TEST_RESULT_TYPE)),
        pa.field("dropped_paths", _strings),
        pa.field("apply_method", _str),
        # lines the patch added that reach into the test runner or the interpreter ("path:line: why: code")
        pa.field("suspicious", _strings),
        # the control run (the gold or empty patch, same conditions) behind an infra / tests_errored verdict
        pa.field("control", _str),
        pa.field("duration_s", pa.float64()),
        pa.field("log", _str),
    ]
)

METRICS_SCHEMA = pa.schema(
    [
        pa.field("step", pa.int64(), nullable=False),
        pa.field("key", _str, nullable=False),
        pa.field("value", pa.float64()),
        pa.field("harness", _str),
        pa.field("stage", _str),
        pa.field("time", pa.float64()),
    ]
)

SCHEMAS: dict[Kind, pa.Schema] = {
    Kind.TASKS: TASKS_SCHEMA,
    Kind.ROLLOUTS: ROLLOUTS_SCHEMA,
    Kind.GRADES: GRADES_SCHEMA,
    Kind.METRICS: METRICS_SCHEMA,
}

# The column (or columns) that make a row's stable key.
KEY_COLUMNS: dict[Kind, tuple[str, ...]] = {
    Kind.TASKS: ("instance_id",),
    Kind.ROLLOUTS: ("trial_id",),
    Kind.GRADES: ("trial_id",),
    Kind.METRICS: ("step", "key", "harness", "stage"),
}

# Allowed values of enum-like string columns, checked on read.
ENUM_COLUMNS: dict[Kind, dict[str, frozenset[str]]] = {
    Kind.ROLLOUTS: {"outcome": frozenset(Outcome)},
    Kind.GRADES: {"status": frozenset(GradeStatus)},
}


def trial_key(task_id: str, harness: str, step: int, sample_index: int) -> str:
    """A trial's stable key: the same attempt always gets the same id, so stages resume."""
    return f"{task_id}/{harness}/step{step}/sample{sample_index}"


def group_key(task_id: str, step: int) -> str:
    """Attempts at the same task with the same policy step form a group (for advantages)."""
    return f"{task_id}/step{step}"


# --------------------------------------------------------------------------- row classes


_FIELD_NAMES: dict[type, tuple[str, ...]] = {}


def _field_names(cls: type) -> tuple[str, ...]:
    names = _FIELD_NAMES.get(cls)
    if names is None:
        names = _FIELD_NAMES[cls] = tuple(f.name for f in dataclasses.fields(cls))
    return names


class _Row:
    """Shared conversion for row classes: shallow ``to_dict`` (nested rows too) and ``from_dict``."""

    __slots__ = ()
    _nested: ClassVar[dict[str, type]] = {}

    def to_dict(self) -> dict[str, Any]:
        out = {name: getattr(self, name) for name in _field_names(type(self))}
        for name in self._nested:  # rows inside rows become dicts too
            value = out[name]
            if isinstance(value, _Row):
                out[name] = value.to_dict()
            elif isinstance(value, list):
                out[name] = [v.to_dict() if isinstance(v, _Row) else v for v in value]
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Self:
        names = _field_names(cls)
        kwargs: dict[str, Any] = {}
        for name, value in data.items():
            if name not in names:
                continue
            nested = cls._nested.get(name)
            if nested is not None and value is not None:
                if isinstance(value, list):
                    value = [nested.from_dict(v) for v in value]  # type: ignore[attr-defined]
                else:
                    value = nested.from_dict(value)  # type: ignore[attr-defined]
            kwargs[name] = value
        return cls(**kwargs)


@dataclass(slots=True)
class Segment(_Row):
    token_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    reason: str = SegmentReason.MAIN
    parent: int | None = None
    routed_experts: list[int] | None = None
    routing_layers: int | None = None
    routing_top_k: int | None = None


@dataclass(slots=True)
class Call(_Row):
    index: int
    api: str
    stream: bool
    segment: int
    started_at: float = 0.0
    latency_s: float = 0.0
    ttft_s: float | None = None
    prompt_tokens: int = 0
    new_prompt_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: str | None = None
    parse_error: str | None = None
    budget_stop: str | None = None
    temperature: float | None = None  # sampling that shaped the call's distribution (see CALL_TYPE)
    top_p: float | None = None
    top_k: int | None = None


@dataclass(slots=True)
class Timings(_Row):
    sandbox_s: float | None = None
    agent_s: float | None = None
    model_s: float | None = None
    patch_s: float | None = None
    total_s: float | None = None


@dataclass(slots=True)
class TaskRow(_Row):
    instance_id: str
    repo: str | None = None
    base_commit: str | None = None
    patch: str | None = None
    test_patch: str | None = None
    problem_statement: str | None = None
    hints_text: str | None = None
    created_at: str | None = None
    version: str | None = None
    FAIL_TO_PASS: list[str] = field(default_factory=list)
    PASS_TO_PASS: list[str] = field(default_factory=list)
    environment_setup_commit: str | None = None
    image: str | None = None
    repo_source: str | None = None
    repo_ref: str | None = None
    test_command: str | None = None
    log_parser: str | None = None
    gold_statuses: str | None = None

    def gold_status_map(self) -> dict[str, str] | None:
        """``gold_statuses`` as a dict (None when the task has no recorded reference)."""
        if not self.gold_statuses:
            return None
        data = json.loads(self.gold_statuses)
        return {str(k): str(v) for k, v in data.items()}


@dataclass(slots=True)
class TrialRow(_Row):
    _nested: ClassVar[dict[str, type]] = {"segments": Segment, "calls": Call, "timings": Timings}

    trial_id: str
    task_id: str
    harness: str
    step: int
    sample_index: int
    group_id: str
    outcome: str
    infra_failure: bool = False
    model: str | None = None
    error: str | None = None
    exit_code: int | None = None
    attempts: int = 1
    patch: str | None = None
    segments: list[Segment] = field(default_factory=list)
    calls: list[Call] = field(default_factory=list)
    messages: str | None = None
    timings: Timings = field(default_factory=Timings)
    started_at: float | None = None
    finished_at: float | None = None

    @classmethod
    def new(cls, task_id: str, harness: str, step: int, sample_index: int, **kwargs: Any) -> TrialRow:
        """A trial row with its key and group derived from what identifies the attempt."""
        return cls(
            trial_id=trial_key(task_id, harness, step, sample_index),
            task_id=task_id,
            harness=harness,
            step=step,
            sample_index=sample_index,
            group_id=group_key(task_id, step),
            **kwargs,
        )

    def conversation(self) -> list[dict[str, Any]]:
        return json.loads(self.messages) if self.messages else []


@dataclass(slots=True)
class TestResult(_Row):
    __test__ = False  # not a pytest test class

    name: str
    kind: str
    status: str
    passed: bool


@dataclass(slots=True)
class GradeRow(_Row):
    _nested: ClassVar[dict[str, type]] = {"tests": TestResult}

    trial_id: str
    task_id: str
    status: str
    infra_failure: bool = False
    harness: str | None = None
    step: int | None = None
    reward: float | None = None
    resolved: bool | None = None
    resolution: str | None = None
    error: str | None = None
    tests: list[TestResult] = field(default_factory=list)
    dropped_paths: list[str] = field(default_factory=list)
    apply_method: str | None = None
    suspicious: list[str] = field(default_factory=list)
    control: str | None = None
    duration_s: float | None = None
    log: str | None = None


@dataclass(slots=True)
class MetricRow(_Row):
    step: int
    key: str
    value: float | None
    harness: str | None = None
    stage: str | None = None
    time: float | None = None


ROW_CLASSES: dict[Kind, type[_Row]] = {
    Kind.TASKS: TaskRow,
    Kind.ROLLOUTS: TrialRow,
    Kind.GRADES: GradeRow,
    Kind.METRICS: MetricRow,
}
