"""The sampling distribution of a step's rollouts: decided here, once, for the whole step.

Importance weights compare the trainer's logprobs with the rollout's, so the trainer must score
tokens under the distribution they were drawn from. The proxy records it on every call
(``Call.temperature`` / ``top_p`` / ``top_k``, after its overrides and the greedy rule; null for a
budget stop), and :func:`step_sampling` reads it from the calls that built the step's trained
segments (:attr:`legorl.training.data.Trial.sampling`):

- one temperature across those calls: the trainer uses it. ``TrainConfig.temperature``
  (``legorl train --temperature``) is only a check then: a different value is refused, never used;
- calls of one step at different temperatures, or any call sampled with top-p < 1 or top-k > 0:
  refused, naming a trial and the values. The trainer's recompute (TRL's fused LM head) divides the
  logits by one temperature and normalises over the whole vocabulary; it cannot reproduce a
  truncated distribution, and one step is scored at one temperature;
- no call records its sampling (shards written before the proxy recorded it, rows without calls):
  ``TrainConfig.temperature`` (default 1.0), said in a log line. Calls without a record in a step
  whose other calls have one are taken to match them (also logged).

Temperature 0 is greedy: the engines record the sampled token's logprob under the same processing
at temperature 1 (legorl/engines/sampling.py; vLLM's processed logprobs do the same), so the
recompute runs at 1 (:attr:`StepSampling.logprob_temperature`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from legorl.core.errors import LegorlError
from legorl.engines.config import DEFAULT_TEMPERATURE, logprob_temperature, sampled_temperature

log = logging.getLogger("legorl.train")


@dataclass(frozen=True)
class CallSampling:
    """What one recorded call says about its sampling (all None: not recorded)."""

    call: int
    temperature: float | None
    top_p: float | None
    top_k: int | None

    @classmethod
    def from_call(cls, call: dict[str, Any]) -> CallSampling:
        return cls(int(call["index"]), call.get("temperature"), call.get("top_p"), call.get("top_k"))

    @property
    def recorded(self) -> bool:
        return self.temperature is not None or self.top_p is not None or self.top_k is not None


@dataclass(frozen=True)
class StepSampling:
    """The sampling the step's rollouts used, and where that was learned."""

    temperature: float  # 0 = greedy
    source: str  # "shards" | "config" (no call recorded it; TrainConfig.temperature) | "default" (1.0)
    recorded_calls: int = 0
    unrecorded_calls: int = 0

    @property
    def logprob_temperature(self) -> float:
        """The temperature the trainer scores tokens at: the sampling one, 1 for greedy calls."""
        return logprob_temperature(self.temperature)

    def to_dict(self) -> dict[str, Any]:
        return {
            "temperature": self.temperature, "source": self.source, "top_p": 1.0, "top_k": 0,
            "logprob_temperature": self.logprob_temperature,
            "recorded_calls": self.recorded_calls, "unrecorded_calls": self.unrecorded_calls,
        }


def _same(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)


class _Trial(Protocol):  # what step_sampling reads of a training.data.Trial (which imports this module)
    @property
    def trial_id(self) -> str: ...
    @property
    def sampling(self) -> Sequence[CallSampling]: ...


class _Step(Protocol):  # ... and of a training.data.StepData
    @property
    def step(self) -> int: ...
    @property
    def trials(self) -> Sequence[_Trial]: ...


def step_sampling(data: _Step, configured: float | None = None) -> StepSampling:
    """The sampling of ``data``'s trained calls, checked against ``configured`` (``--temperature``)."""
    first: tuple[str, CallSampling] | None = None
    recorded = unrecorded = 0
    for trial in data.trials:
        for s in trial.sampling:
            if not s.recorded:
                unrecorded += 1
                continue
            recorded += 1
            where = f"trial {trial.trial_id} call {s.call}"
            top_p = 1.0 if s.top_p is None else float(s.top_p)
            top_k = 0 if s.top_k is None else int(s.top_k)
            if top_p < 1.0 or top_k > 0:
                raise LegorlError(
                    f"step {data.step}: {where} was sampled with top_p={top_p:g}, top_k={top_k}: the trainer "
                    "scores tokens over the whole vocabulary (temperature only), so it cannot reproduce a "
                    "truncated distribution and its importance weights would be wrong; roll out with top_p 1 "
                    "and top_k 0 (serve-proxy --top-p 1, or a harness that sends neither)"
                )
            if s.temperature is None:
                raise LegorlError(f"step {data.step}: {where} records top_p/top_k but no temperature; "
                                  "refusing to guess the distribution it was sampled from")
            temperature = float(s.temperature)
            if first is None:
                first = (where, CallSampling(s.call, temperature, top_p, top_k))
            elif not _same(temperature, first[1].temperature or 0.0):
                raise LegorlError(
                    f"step {data.step}: {where} was sampled at temperature {temperature:g} but {first[0]} at "
                    f"{first[1].temperature:g}: one step is scored at one temperature, so the importance "
                    "weights of one of them would be wrong; roll the step out at a single temperature "
                    "(legorl rollout --temperature T)"
                )
    if first is None:
        value = DEFAULT_TEMPERATURE if configured is None else configured
        source = "default" if configured is None else "config"
        log.warning(
            "step %d: the rollouts record no sampling parameters (shards written before the proxy recorded "
            "them); training at the %s temperature %g", data.step,
            "default" if configured is None else "configured (--temperature)", value,
        )
        return StepSampling(sampled_temperature(value), source, 0, unrecorded)
    where, chosen = first
    temperature = chosen.temperature or 0.0
    if configured is not None and not _same(sampled_temperature(configured), temperature):
        raise LegorlError(
            f"step {data.step}: --temperature {configured:g} differs from the temperature the rollouts were "
            f"sampled at ({temperature:g}, recorded on every call, e.g. {where}); training at another temperature "
            "would make the importance weights wrong: drop --temperature to use the recorded one"
        )
    if unrecorded:
        log.warning("step %d: %d call(s) record no sampling parameters; taken to match the other %d (temperature %g)",
                    data.step, unrecorded, recorded, temperature)
    log.info("step %d: sampling temperature %g, recorded on %d call(s)", data.step, temperature, recorded)
    return StepSampling(temperature, "shards", recorded, unrecorded)
