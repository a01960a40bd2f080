"""Rollout and grade shards for the training tests, sampled from a real tiny model.

Each trial's segment is ``prompt, turn 1 (sampled), tool output, turn 2 (sampled)``, sampled in
fp32 with a KV-cache decode loop (temperature 1, no top-k/top-p), so the recorded logprobs are
those of the distribution that was sampled. For MoE models the experts each position was routed
to when it was first processed are recorded too (the last sampled token is never processed, so
its routing is -1: the router's own choice).

Also what several training tests share: a spec set (:data:`TWO_GROUPS_ONE_FORK`), the trainer the
stage builds on a step's first batch (:func:`first_batch_trainer`) and the plain-forward logprobs the
trainer's figures are checked against (:func:`token_logps`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest
import torch

from legorl.core import shards
from legorl.core.paths import RunDir
from legorl.core.schemas import Call, GradeRow, Kind, Outcome, Segment, TrialRow
from legorl.routing import capture_routing, routing_shape

if TYPE_CHECKING:
    from legorl.training.config import TrainConfig
    from legorl.training.data import StepData

TOOL_TEXT = "\n<tool_response>\nOK: 3 passed\n</tool_response>\n"


@dataclass
class TrialSpec:
    task: str
    sample: int
    reward: float | None
    infra_failure: bool = False  # rollout-side infrastructure failure
    grade_infra_error: bool = False
    harness: str = "mini"
    segments: int = 1  # >1: the same tokens split at the tool call into a fork segment
    versions: tuple[int, int] | None = None  # policy version of each turn's call; None: no calls recorded


# Two groups; one trial of t1 is split into two segments (a fork) to exercise trial weighting.
TWO_GROUPS_ONE_FORK = [
    TrialSpec("t1", 0, 1.0, segments=2),
    TrialSpec("t1", 1, 0.0),
    TrialSpec("t1", 2, 0.0),
    TrialSpec("t1", 3, 1.0),
    TrialSpec("t2", 0, 0.0),
    TrialSpec("t2", 1, 0.5),
    TrialSpec("t2", 2, 1.0),
]


def token_logps(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """log p(ids[t] | ids[:t]) for t >= 1 (0 at t = 0), float64, from a plain forward (with gradient
    unless called under ``torch.no_grad()``): the reference the trainer's figures are checked against."""
    logits = model(input_ids=torch.tensor([ids])).logits[0].double()
    lp = torch.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    return torch.cat([torch.zeros(1, dtype=torch.float64), lp])


@torch.no_grad()
def _forward(model: torch.nn.Module, ids: list[int], past: object | None) -> tuple[torch.Tensor, object, np.ndarray]:
    with capture_routing(model) as cap:
        out = model(input_ids=torch.tensor([ids]), past_key_values=past, use_cache=True)
    return out.logits[0, -1].float(), out.past_key_values, cap.take()


@torch.no_grad()
def sample_segment(
    model: torch.nn.Module, prompt: list[int], tool: list[int], turns: tuple[int, int], gen: torch.Generator
) -> tuple[list[int], list[int], list[float], np.ndarray | None]:
    """Token ids, loss mask, logprobs and routing [T, layers, k] (or None) of one two-turn segment."""
    ids, mask, logps = list(prompt), [0] * len(prompt), [0.0] * len(prompt)
    rows: list[np.ndarray] = []
    past = None
    feed = list(prompt)  # tokens the model has not processed yet
    for turn, n in enumerate(turns):
        if turn == 1:
            ids += tool
            mask += [0] * len(tool)
            logps += [0.0] * len(tool)
            feed += tool
        for _ in range(n):
            logits, past, routing = _forward(model, feed, past)
            rows.append(routing)
            logp = torch.log_softmax(logits, -1)
            token = int(torch.multinomial(logp.exp(), 1, generator=gen))
            ids.append(token)
            mask.append(1)
            logps.append(float(logp[token]))
            feed = [token]
    shape = routing_shape(model)
    if shape is None:
        return ids, mask, logps, None
    routing = np.concatenate([*rows, np.full((1, *shape), -1, dtype=np.int16)], axis=0)
    assert routing.shape[0] == len(ids)
    return ids, mask, logps, routing


def run_fixture(specs: Sequence[TrialSpec], model: str = "tiny_model", logprob_noise: float = 0.0) -> Any:
    """A module-scoped fixture: :func:`make_run` of ``specs`` in a temp folder, sampled from the
    model whose folder the fixture named ``model`` gives. Bind it to a module attribute: that is
    its name."""

    @pytest.fixture(scope="module")
    def sampled_run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> RunDir:
        model_dir: Path = request.getfixturevalue(model)
        folder = tmp_path_factory.mktemp(request.fixturename.removesuffix("_run"))
        return make_run(folder / "run", model_dir, specs, logprob_noise=logprob_noise)

    return sampled_run


def make_run(
    run_dir: Path,
    model_dir: Path,
    specs: Sequence[TrialSpec],
    step: int = 0,
    turns: tuple[int, int] = (6, 5),
    seed: int = 0,
    logprob_noise: float = 0.0,
    stale_logprob_noise: float = 0.0,
) -> RunDir:
    """Write rollouts (sampled from the model at ``model_dir``) and grades for ``specs``.

    A spec with ``versions`` records one call per turn, as the proxy does; ``stale_logprob_noise``
    perturbs the logprobs of the turns a version older than ``step`` sampled (a stale policy's)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tool = tokenizer.encode(TOOL_TEXT)
    run = RunDir.at(run_dir)
    trials, grades = [], []
    rng = np.random.default_rng(seed)
    for k, spec in enumerate(specs):
        gen = torch.Generator().manual_seed(seed * 1000 + k)
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": f"Fix task {spec.task}; attempt {spec.sample}."}],
            tokenize=False, add_generation_prompt=True,
        )
        prompt: list[int] = tokenizer.encode(text, add_special_tokens=False)
        ids, mask, logps, routing = sample_segment(model, prompt, tool, turns, gen)
        if logprob_noise:
            logps = [lp + float(rng.normal(0, logprob_noise)) if m else 0.0 for lp, m in zip(logps, mask, strict=True)]
        starts = (len(prompt), len(prompt) + turns[0] + len(tool))
        calls = []
        for turn, version in enumerate(spec.versions or ()):
            span = range(starts[turn], starts[turn] + turns[turn])
            if version < step and stale_logprob_noise:
                for i in span:
                    logps[i] += float(rng.normal(0, stale_logprob_noise))
            calls.append(Call(index=turn, api="openai", stream=False, segment=min(turn, spec.segments - 1),
                              prompt_tokens=span.start, completion_tokens=len(span), policy_version=version))
        segments = _segments(ids, mask, logps, routing, spec.segments, len(prompt) + turns[0])
        trial = TrialRow.new(
            spec.task, spec.harness, step, spec.sample,
            outcome=Outcome.INFRA_ERROR if spec.infra_failure else Outcome.SUBMITTED,
            infra_failure=spec.infra_failure, segments=segments, calls=calls, model=str(model_dir),
        )
        trials.append(trial)
        if spec.infra_failure:
            continue
        grades.append(GradeRow(
            trial_id=trial.trial_id, task_id=spec.task, harness=spec.harness, step=step,
            status="infra_error" if spec.grade_infra_error else "graded",
            infra_failure=spec.grade_infra_error,
            reward=None if spec.grade_infra_error else spec.reward,
            resolved=None if spec.grade_infra_error else bool(spec.reward and spec.reward > 0),
        ))
    shards.write(run.rollouts, Kind.ROLLOUTS, trials)
    shards.write(run.grades, Kind.GRADES, grades)
    return run


def _segments(
    ids: list[int], mask: list[int], logps: list[float], routing: np.ndarray | None, parts: int, cut: int
) -> list[Segment]:
    """One segment, or (parts=2) the same sampled tokens as two: ``[..turn 1]`` and a fork holding
    the whole sequence with only turn 2 sampled — same tokens, same contexts."""

    def seg(end: int, keep_from: int, reason: str) -> Segment:
        m = [v if i >= keep_from else 0 for i, v in enumerate(mask[:end])]
        lp = [v if m[i] else 0.0 for i, v in enumerate(logps[:end])]
        r = routing[:end] if routing is not None else None
        return Segment(
            token_ids=ids[:end], loss_mask=m, logprobs=lp, reason=reason,
            routed_experts=None if r is None else r.reshape(-1).tolist(),
            routing_layers=None if r is None else int(r.shape[1]),
            routing_top_k=None if r is None else int(r.shape[2]),
        )

    if parts == 1:
        return [seg(len(ids), 0, "main")]
    return [seg(cut, 0, "main"), seg(len(ids), cut, "rewrite")]


def first_batch_trainer(
    run: RunDir, model_dir: Path, out: Path, config: TrainConfig
) -> tuple[Any, StepData, list[int]]:
    """The trainer the train stage builds on ``run``'s step (prepared for ``config``) for its first batch
    (seed 0), its model in train mode; with the step's data and that batch."""
    from legorl.stages.train import _build_trainer, prepare
    from legorl.training.batching import make_batches
    from legorl.training.data import load_step

    data = load_step(run)
    prepare(data, config)
    batch = make_batches(data, None, seed=0)[0]
    trainer = _build_trainer(model_dir, out, data, [batch], config, None, [])
    trainer.model.train()
    return trainer, data, batch


def trained_run(run_dir: Path, model_dir: Path, logprob_noise: float = 0.0, is_cap: float = 2.0) -> RunDir:
    """A run trained one step by the real train stage: two groups over two harnesses, rollouts
    sampled from ``model_dir`` (logprobs perturbed by ``logprob_noise``), so ``train/metrics/`` holds
    what ``legorl train`` writes, per harness too."""
    from legorl.stages.train import run_train
    from legorl.training.config import TrainConfig

    specs = [TrialSpec("t1", i, r, harness="mini") for i, r in enumerate([1.0, 0.0])]
    specs += [TrialSpec("t2", i, r, harness="openhands") for i, r in enumerate([1.0, 0.0, 0.0])]
    run = make_run(run_dir, model_dir, specs, logprob_noise=logprob_noise)
    run_train(run.root, model_dir, None, TrainConfig(learning_rate=1e-4, is_cap=is_cap))
    return run


# A step of the overlapped loop (step 1, --max-staleness 1): each trial's first turn was sampled by
# version 0 (one behind), its second by version 0 or 1 (two trials straddle the weight load, one of
# them across a fork); one trial records no calls (an old shard: unknown versions).
STALE_SPECS = [
    TrialSpec("t1", 0, 1.0, versions=(0, 1)),
    TrialSpec("t1", 1, 0.0, versions=(0, 0)),
    TrialSpec("t1", 2, 0.0),
    TrialSpec("t2", 0, 1.0, versions=(0, 1), segments=2),
    TrialSpec("t2", 1, 0.0, versions=(0, 0)),
]


def stale_run(run_dir: Path, model_dir: Path, stale_logprob_noise: float = 2.0) -> RunDir:
    """:data:`STALE_SPECS` at step 1, the stale turns' logprobs perturbed (a stale policy is not the
    trainer's), trained one step by the real train stage: ``train/metrics/`` holds what `legorl train`
    writes for a step whose tokens span two versions."""
    from legorl.stages.train import run_train
    from legorl.training.config import TrainConfig

    run = make_run(run_dir, model_dir, STALE_SPECS, step=1, stale_logprob_noise=stale_logprob_noise)
    run_train(run.root, model_dir, None, TrainConfig(learning_rate=1e-4))
    return run
