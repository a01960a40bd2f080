"""The shard schemas: the single source of truth for what stages write and read.

Four dataset kinds meet on disk — ``tasks``, ``rollouts`` (one row per trial), ``grades`` (one row
per graded trial) and ``metrics`` (long format). Each has an Arrow schema, a typed row class and a
stable key (the Arrow schemas are written out in :mod:`legorl.core.arrow_schemas`). Bump
:data:`SCHEMA_VERSION` when a field changes meaning; adding a nullable field is
backward compatible (older files read with it null).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, ClassVar, Self

import pyarrow as pa

# The Arrow schemas (legorl.core.arrow_schemas), re-exported: stages take schemas and rows from here.
from legorl.core.arrow_schemas import CALL_TYPE as CALL_TYPE
from legorl.core.arrow_schemas import GRADES_SCHEMA as GRADES_SCHEMA
from legorl.core.arrow_schemas import METRICS_SCHEMA as METRICS_SCHEMA
from legorl.core.arrow_schemas import ROLLOUTS_SCHEMA as ROLLOUTS_SCHEMA
from legorl.core.arrow_schemas import SEGMENT_TYPE as SEGMENT_TYPE
from legorl.core.arrow_schemas import TASKS_SCHEMA as TASKS_SCHEMA
from legorl.core.arrow_schemas import TEST_RESULT_TYPE as TEST_RESULT_TYPE
from legorl.core.arrow_schemas import TIMINGS_TYPE as TIMINGS_TYPE

SCHEMA_VERSION = 1
HARBOR = "harbor"  # TaskRow.grader of a task its own tests/test.sh grades (None: SWE-style hidden tests)


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
    SUSPICIOUS = "suspicious"  # a Harbor task's test.sh passed, but the screen flags the patch's code
    TAMPERED = "tampered"  # the tests passed, and so did a canary: a test every honest patch fails
    VERIFIER_FAILED = "verifier_failed"  # the --verifier gave no reward for this patch (it does for the gold one)
    INFRA_ERROR = "infra_error"


class Resolution(StrEnum):
    FULL = "FULL"
    PARTIAL = "PARTIAL"
    NO = "NO"


# --------------------------------------------------------------------------- kinds

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
    policy_version: int | None = None  # the weights that sampled the call (see CALL_TYPE, legorl.trials.provenance)


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
    flaky_tests: str | None = None  # JSON: {test: {"gold": [status per run], "empty": [...]}} (see TASKS_SCHEMA)
    grader: str | None = None  # how the task is graded: None = SWE-style hidden tests, "harbor" = its tests/test.sh
    hidden_tests: str | None = None  # "harbor": base64 of a tar.gz of the task's tests/ (uploaded to /tests only to grade)
    workdir: str | None = None  # "harbor": the image's WORKDIR, the repository the patch is taken from (/testbed links to it)
    test_timeout: float | None = None  # seconds the task's own tests may run (Harbor's [verifier] timeout_sec)

    def gold_status_map(self) -> dict[str, str] | None:
        """``gold_statuses`` as a dict (None when the task has no recorded reference)."""
        if not self.gold_statuses:
            return None
        data = json.loads(self.gold_statuses)
        return {str(k): str(v) for k, v in data.items()}


@dataclass(slots=True)
class TrialFingerprint(_Row):
    """What produced a trial (see TRIAL_FINGERPRINT_TYPE; computed by :mod:`legorl.trials.fingerprints`)."""

    harness: str
    harness_version: str | None = None
    harness_config: str | None = None  # digest of the harness's effective config
    legorl_version: str | None = None
    model_revision: str | None = None


@dataclass(slots=True)
class TrialCost(_Row):
    """What a trial cost (see TRIAL_COST_TYPE; derived by :func:`legorl.trials.fingerprints.trial_cost`)."""

    sandbox_s: float | None = None
    engine_s: float = 0.0
    prompt_tokens: int = 0
    sampled_tokens: int = 0
    cached_tokens: int = 0
    retries: int = 0


@dataclass(slots=True)
class TrialRow(_Row):
    _nested: ClassVar[dict[str, type]] = {"segments": Segment, "calls": Call, "timings": Timings,
                                             "fingerprint": TrialFingerprint, "cost": TrialCost}

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
    fingerprint: TrialFingerprint | None = None  # null in shards written before it was recorded
    cost: TrialCost | None = None

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
class GradeFingerprint(_Row):
    """What produced a grade (see GRADE_FINGERPRINT_TYPE; computed by :mod:`legorl.trials.fingerprints`)."""

    image: str | None = None
    image_digest: str | None = None
    test_command: str | None = None
    grader_version: str | None = None


@dataclass(slots=True)
class GradeRow(_Row):
    _nested: ClassVar[dict[str, type]] = {"tests": TestResult, "fingerprint": GradeFingerprint}

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
    canaries: list[str] = field(default_factory=list)
    control: str | None = None
    confirmed: bool | None = None  # --confirm: did a fresh rerun reproduce the pass (see GRADES_SCHEMA)
    verifier: str | None = None  # the --verifier that gave the reward (see GRADES_SCHEMA)
    tests_reward: float | None = None
    verifier_reasons: list[str] = field(default_factory=list)
    duration_s: float | None = None
    log: str | None = None
    fingerprint: GradeFingerprint | None = None  # null in shards written before it was recorded


def grade_is_infra(infra_failure: bool | None, status: str | None, reward: float | None) -> bool:
    """Whether a grade decided nothing: the grader's infrastructure failure (its flag or its status),
    or no reward. Such a trial is left out of rewards, training and pass rates, and graded again."""
    return bool(infra_failure) or status == GradeStatus.INFRA_ERROR or reward is None


def trial_is_infra(rollout_infra: bool | None, grade: GradeRow | Any | None) -> bool:
    """Whether a trial is an infrastructure failure: its rollout's flag, or a grade that decided
    nothing (:func:`grade_is_infra`; ``grade``: a row or anything with its fields). An ungraded trial
    (``grade`` None) is not one: it is pending."""
    if rollout_infra:
        return True
    return grade is not None and grade_is_infra(grade.infra_failure, grade.status, grade.reward)


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
