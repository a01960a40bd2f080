"""Which policy sampled which token, and how stale a trial is for the step that trains it.

Every captured call records ``policy_version``: the weights that sampled it, 0 = the initial model
and +1 per weight load (:mod:`legorl.engines.watched`). The online loop keeps versions aligned with
training steps: checkpoint ``step-S`` is version S + 1, so the policy that trains step S (loaded
from ``step-(S-1)``) is version S, and a call of a step-S trial sampled by version v lags S - v
versions behind it. A synchronous loop's calls all lag 0; an overlapped one (``--max-staleness K``,
:mod:`legorl.flows.online`) has lags 0..K, and a trial in flight across a weight load spans two
versions (so can a segment: its tokens are versioned per call).

A call's sampled tokens are ``segments[call.segment].token_ids[prompt_tokens : prompt_tokens +
completion_tokens]`` (the proxy's capture invariant, :mod:`legorl.proxy.sessions`); prompt tokens
have no version. Calls without a version (old shards, an engine this process does not load, a
budget stop) are unknown and never judged stale.

Everything here is a pure function of a trial row (a :class:`~legorl.core.schemas.TrialRow` or its
dict, as shards read it), so the trainer, the loop and the monitor agree on one definition.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal

from legorl.core.errors import ConfigError, LegorlError

# What a trial over the bound gets: left out, its stale tokens without loss, or trained as it is (its
# importance weights, e.g. --is-mode mask, then the only correction: docs/off-policy.md)
StaleTokens = Literal["drop_trial", "mask", "keep"]
STALE_TOKENS: tuple[str, ...] = ("drop_trial", "mask", "keep")

# Metric keys of the loop's per-step staleness figures (RUN/train/metrics, stage "loop"). Kept here,
# beside their definition; each LAG_* prefix is followed by the lag ("staleness/trials_lag/1").
TRIALS_AT_LAG: Final = "staleness/trials_lag/"  # share of the step's trials whose oldest call lags by it
TOKENS_AT_LAG: Final = "staleness/tokens_lag/"  # share of the step's sampled tokens sampled at that lag
MAX_LAG: Final = "staleness/max_lag"
TRIALS_UNVERSIONED: Final = "staleness/trials_unversioned"  # trials with no versioned call (counted apart)
TRIALS_STALE: Final = "staleness/trials_stale"  # trials with a call older than the bound
TRIALS_DROPPED: Final = "staleness/trials_dropped"  # of those, left out of training (drop_trial)
TOKENS_MASKED: Final = "staleness/tokens_masked"  # sampled tokens given no loss (mask)
METRICS_STAGE: Final = "loop"  # the ``stage`` column of these rows

UNKNOWN_VERSION: Final = -1  # a token's version in numeric arrays where it is None (versions are >= 0)


@dataclass(frozen=True)
class Staleness:
    """The bound a step's trials are held to: calls at most ``max_staleness`` versions behind the step."""

    max_staleness: int = 0
    stale_tokens: StaleTokens = "drop_trial"

    def __post_init__(self) -> None:
        if self.max_staleness < 0:
            raise ConfigError(f"--max-staleness must be >= 0 (got {self.max_staleness})")
        if self.stale_tokens not in STALE_TOKENS:
            raise ConfigError(f"--stale-tokens {self.stale_tokens!r}: choose one of {', '.join(STALE_TOKENS)}")


def _get(obj: Any, name: str) -> Any:
    return obj.get(name) if isinstance(obj, Mapping) else getattr(obj, name)


def _sampled_calls(row: Any) -> Iterable[Any]:
    """The calls that sampled tokens (a budget stop samples none)."""
    return (c for c in _get(row, "calls") or [] if not _get(c, "budget_stop") and (_get(c, "completion_tokens") or 0) > 0)


def call_versions(row: Any) -> list[int | None]:
    """The policy version of each call of ``row`` that sampled tokens, in call order (None: unknown)."""
    return [_get(c, "policy_version") for c in _sampled_calls(row)]


def token_versions(row: Any) -> list[list[int | None]]:
    """Per segment, per token: the version that sampled it (None for prompt tokens and unknown calls).

    Refuses a row whose calls do not point at sampled tokens of their segment (a corrupt shard)."""
    segments = _get(row, "segments") or []
    out: list[list[int | None]] = [[None] * len(_get(s, "token_ids")) for s in segments]
    for call in _sampled_calls(row):
        index, start = _get(call, "segment"), _get(call, "prompt_tokens") or 0
        end = start + _get(call, "completion_tokens")
        if index is None or not 0 <= index < len(segments) or end > len(out[index]):
            raise LegorlError(f"trial {_get(row, 'trial_id')}: call {_get(call, 'index')} points at tokens "
                              f"{start}:{end} of segment {index}, which the row does not hold")
        mask = _get(segments[index], "loss_mask")
        if not all(mask[start:end]):
            raise LegorlError(f"trial {_get(row, 'trial_id')}: call {_get(call, 'index')}'s tokens {start}:{end} "
                              f"of segment {index} are not all sampled (loss mask 0)")
        out[index][start:end] = [_get(call, "policy_version")] * (end - start)
    return out


def lags(row: Any, step: int | None = None) -> list[int]:
    """How many versions each versioned sampled call lags behind ``step`` (default: the row's own)."""
    at = _get(row, "step") if step is None else step
    return [at - v for v in call_versions(row) if v is not None]


def token_lags(row: Any, step: int | None = None) -> Counter[int]:
    """How many sampled tokens of ``row`` lag by each number of versions behind ``step`` (default: the
    row's own); tokens of unknown version are not counted. Counted from the calls (a call's sampled
    tokens are its ``completion_tokens``), so it needs no segments."""
    at = _get(row, "step") if step is None else step
    found: Counter[int] = Counter()
    for call in _sampled_calls(row):
        if (version := _get(call, "policy_version")) is not None:
            found[at - version] += _get(call, "completion_tokens")
    return found


def trial_lag(row: Any, step: int | None = None) -> int | None:
    """The lag of the trial's oldest versioned call (None: no call of it is versioned)."""
    found = lags(row, step)
    return max(found) if found else None


def is_stale(row: Any, step: int, max_staleness: int) -> bool:
    """Whether any sampled call of ``row`` comes from a version older than ``step - max_staleness``."""
    lag = trial_lag(row, step)
    return lag is not None and lag > max_staleness


def segment_loss_masks(row: Any, step: int, max_staleness: int) -> list[list[int]]:
    """Each segment's loss mask with the tokens of versions older than ``step - max_staleness`` set to 0
    (``--stale-tokens mask``: the trial keeps its fresh tokens and its place in its group)."""
    masks = []
    for segment, versions in zip(_get(row, "segments") or [], token_versions(row), strict=True):
        masks.append([0 if v is not None and step - v > max_staleness else int(m)
                      for m, v in zip(_get(segment, "loss_mask"), versions, strict=True)])
    return masks


def staleness_metrics(rows: Iterable[Any], step: int, bound: Staleness) -> dict[str, float]:
    """The step's staleness figures: share of trials and of sampled tokens per lag, the largest lag, how
    many trials are stale and what the bound did with them (dropped, or their stale tokens masked)."""
    trial_lags: Counter[int] = Counter()
    tokens_at: Counter[int] = Counter()
    unversioned = stale = 0
    for row in rows:
        lag = trial_lag(row, step)
        if lag is None:
            unversioned += 1
            continue
        trial_lags[lag] += 1
        tokens_at.update(token_lags(row, step))
        stale += lag > bound.max_staleness
    trials, tokens = sum(trial_lags.values()), sum(tokens_at.values())
    masked = sum(n for lag, n in tokens_at.items() if lag > bound.max_staleness)
    out: dict[str, float] = {TRIALS_AT_LAG + str(k): n / trials for k, n in sorted(trial_lags.items())}
    out |= {TOKENS_AT_LAG + str(k): n / tokens for k, n in sorted(tokens_at.items())}
    out |= {
        MAX_LAG: float(max(trial_lags, default=0)),
        TRIALS_UNVERSIONED: float(unversioned),
        TRIALS_STALE: float(stale),
        TRIALS_DROPPED: float(stale if bound.stale_tokens == "drop_trial" else 0),
        TOKENS_MASKED: float(masked if bound.stale_tokens == "mask" else 0),
    }
    return out


def lag_shares(rows: Iterable[Any]) -> dict[str, float]:
    """Share of trials per lag behind their own step, over the rows with a versioned call ({} if none):
    what ``legorl inspect`` shows of a rollouts dataset."""
    found = Counter(lag for row in rows if (lag := trial_lag(row)) is not None)
    total = sum(found.values())
    return {str(k): round(n / total, 6) for k, n in sorted(found.items())}
