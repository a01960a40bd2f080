"""TRL's GRPO trainer, minus generation, plus segments.

:class:`SegmentGRPOTrainer` subclasses ``trl.GRPOTrainer`` and changes only where the batch comes
from and how its forward runs. TRL's loop, losses (``_compute_loss``: grpo, dr_grpo, dapo,
sequence-level GSPO), clipping, logging, checkpointing and reporters are used as they are:

- the train dataloader yields generation batches of whole groups (:mod:`.batching`), each repeated
  for TRL's ``num_iterations x steps_per_generation`` micro-steps, the same in every process;
- generating nothing, ``_micro_batches`` counts the batch's normalisers, leaves out trials whose
  advantage is 0 (``skip_zero_advantage``) and cuts the rest into micro-batches, each into one share
  per process (:func:`~.batching.micro_batch_plan`); ``_score`` makes this process's rows TRL's
  inputs (:mod:`.scoring`), recomputes their old logprobs (:mod:`.recompute`; routing replayed for
  MoE, :mod:`.replay`), folds the importance weights into per-token advantages and records the
  health figures over every process's rows (:mod:`.health`);
- ``_compute_loss`` is TRL's, run inside the routing-replay context; with ``padding_free`` (the
  default) the logprobs it asks for come from one packed forward with the LM head only at sampled
  positions and fork prefixes computed once (:mod:`.logprobs`, :mod:`.packing`).

Advantages are computed before training, per group over the whole step (:mod:`.advantages`), so
how a batch is cut into micro-batches or shared between processes never changes them
(docs/training-at-scale.md). The private TRL hooks overridden: :data:`TRL_PRIVATE_HOOKS`
(docs/trainer.md: what a TRL upgrade re-checks).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset
from torch.utils.data import DataLoader
from transformers.trainer_callback import PrinterCallback
from trl import GRPOTrainer
from trl.models.utils import disable_gradient_checkpointing
from trl.trainer.utils import identity

from legorl.core import metric_keys as mk
from legorl.core.errors import LegorlError
from legorl.training import scoring
from legorl.training.attention import packed_attention
from legorl.training.batching import BatchTotals, GroupBatchSampler, micro_batch_plan, pad
from legorl.training.checkpoint import CarryOptimizer
from legorl.training.config import TrainConfig
from legorl.training.data import StepData, TrainSequence
from legorl.training.distributed import sum_across
from legorl.training.health import HealthRecorder, no_values
from legorl.training.logprobs import sampled_logps
from legorl.training.memory import map_large_blocks
from legorl.training.metrics import MetricsRecorder, harness_split
from legorl.training.packing import Packed
from legorl.training.recompute import old_logps
from legorl.training.replay import RoutingWatch, replay_setting, routed
from legorl.training.tiling import token_tiles

# The private GRPOTrainer methods overridden here, each with why TRL's public surface does not do
# (docs/trainer.md: what a TRL upgrade re-checks; tests/test_trl_hooks.py fails on a rename).
TRL_PRIVATE_HOOKS: dict[str, str] = {
    "_prepare_inputs": "TRL cuts a batch into equal shuffled slices; ours are whole trials, one share per process",
    "_generate_and_score_completions": "TRL's one-batch scoring entry point: stored segments scored, nothing generated",
    "_get_per_token_logps_and_entropies": "the packed, padding-free forward with the LM head at sampled tokens only",
    "_compute_loss": "TRL's loss inside the packed-attention, tiling and routing contexts, held through backward",
}
# GRPOTrainer's private state read or written here: its micro-step count and buffered batches (the
# buffering ``_prepare_inputs`` replaces), and its metric lists (legorl's figures join TRL's logs).
TRL_PRIVATE_STATE = ("_step", "_buffered_inputs", "_metrics")

_SKIP_LOG_KEYS = ("epoch", "total_flos", "train_runtime", "train_samples_per_second", "train_steps_per_second",
                  "train_loss", "num_tokens", "step_time")  # TRL's log keys not worth a metrics row


def stored_reward(prompts: Any = None, completions: Any = None, **kwargs: Any) -> list[float | None]:
    """TRL requires a reward source; ours are the grades shards, so this is never called."""
    raise RuntimeError("SegmentGRPOTrainer never scores completions: rewards come from the grades shards")


@dataclass(frozen=True)
class _NextForward:
    """What the next ``_get_per_token_logps_and_entropies`` call, made by TRL's ``_compute_loss``, scores
    packed (``packed``, ``score_mask``: TRL's ``completion_mask * tool_mask``) and whose old logprobs
    its result gives (``fold_into``: the micro-batch, when they come from its own training forward)."""

    packed: Packed | None
    score_mask: torch.Tensor | None
    fold_into: dict[str, Any] | None


class SegmentGRPOTrainer(GRPOTrainer):
    _buffered_inputs: Any

    def __init__(
        self,
        model: Any,
        processing_class: Any,
        args: TrainConfig,
        data: StepData,
        batches: list[list[int]],
        carry_state_from: Path | None = None,
        callbacks: list[Any] | None = None,
    ):
        self.step_data = data
        self.batches = batches
        self.train_config = args  # ``self.args``, typed: legorl's fields live on TRL's config
        self.recorder = MetricsRecorder()
        self.trained_tokens = 0  # segment tokens trained on (a shared fork prefix counts once per fork)
        self.forward_tokens = 0  # positions the training forwards ran (packed: shared prefixes once)
        self.padding_tokens = 0  # of which padding
        self._next: _NextForward | None = None  # set only while TRL's _compute_loss runs (_intercept)
        self._held: ExitStack | None = None  # contexts that must outlive the forward (recompute in backward)
        self._generated_at: int | None = None  # the micro-step whose generation batch is buffered
        self._own_keys: set[str] = set()
        dataset = Dataset.from_dict({"seq": list(range(len(data.sequences)))})
        super().__init__(
            model=model, reward_funcs=stored_reward, args=args, train_dataset=dataset,
            processing_class=processing_class, callbacks=callbacks,
        )
        if carry_state_from is not None:  # a new step carries the previous step's optimizer and LR schedule
            self.add_callback(CarryOptimizer(self, carry_state_from))
        self.pad_id = scoring.pad_token_id(processing_class)
        has_routing = any(s.routed_experts is not None for s in data.sequences)
        self.uses_routing, self.replay = replay_setting(self.accelerator.unwrap_model(self.model), has_routing,
                                                        args.routing_replay)
        self.health = HealthRecorder(self.accelerator, args, data.step, routing=self.uses_routing, replay=self.replay,
                                     record=self._record)
        # Logs go to the metrics shards and TRL's reporters; keep stdout clean for `--json`.
        self.remove_callback(PrinterCallback)
        if args.gradient_checkpointing:  # memory over compute: freed activations leave the process (memory.py)
            map_large_blocks()

    # ------------------------------------------------------------------ data: whole groups, no generation

    def get_train_dataloader(self) -> DataLoader:
        """Every process iterates the same generation batches (whole groups): each then trains its own
        share of every micro-batch (:meth:`_micro_batches`). Not ``accelerator.prepare``d, which would
        hand different batches (other groups, other normalisers) to different processes."""
        sampler = GroupBatchSampler(self.batches, repeat=self.num_iterations * self.steps_per_generation)
        dataset: Any = self.train_dataset
        return DataLoader(dataset, batch_sampler=sampler, collate_fn=identity, num_workers=0)

    def _prepare_inputs(self, generation_batch: Any) -> dict[str, Any]:
        """TRL's buffering (one scored batch reused for ``num_iterations`` updates), cut into this
        process's micro-batches. Idempotent within a micro-step (:meth:`training_step` looks first)."""
        model: Any = self.model
        if not model.training:
            raise LegorlError("SegmentGRPOTrainer trains only; evaluate with `legorl eval`")
        generate_every = self.steps_per_generation * self.num_iterations
        due = self._step % generate_every == 0 and self._generated_at != self._step
        if due or self._buffered_inputs is None:
            self._buffered_inputs = self._micro_batches([int(row["seq"]) for row in generation_batch])
            self._generated_at = self._step
        inputs: dict[str, Any] = self._buffered_inputs[self._step % len(self._buffered_inputs)]
        return inputs

    @property
    def steps_per_generation(self) -> int:
        steps = self.train_config.steps_per_generation
        assert steps is not None  # GRPOConfig.__post_init__ derives it
        return steps

    def _micro_batches(self, rows: list[int]) -> list[dict[str, Any]]:
        """This process's ``steps_per_generation`` micro-batches of the generation batch ``rows``.

        The normalisers are counted over the whole batch (:class:`BatchTotals`); then trials whose
        advantage is 0 are left out (``skip_zero_advantage``: they add nothing to the loss but its
        denominators), the rest is cut by :func:`micro_batch_plan` and only this process's rows are
        scored. A share left empty is a no-op micro-batch; one empty on every process does not run."""
        cfg = self.train_config
        seqs = [self.step_data.sequences[i] for i in rows]
        totals = BatchTotals.of(seqs)
        if cfg.skip_zero_advantage:
            seqs = [s for s in seqs if s.advantage != 0.0]
        if not seqs:
            raise LegorlError("a generation batch with nothing to train on reached the trainer (the stage drops those)")
        # Seeded by the update count, so a resumed run cuts the same micro-batches.
        generator = torch.Generator().manual_seed(cfg.seed * 1_000_003 + self.state.global_step)
        plan = micro_batch_plan(seqs, self.steps_per_generation, self.accelerator.num_processes, generator,
                                keep_trials_together=cfg.share_prefixes, by_tokens=cfg.max_tokens_per_micro_batch is not None)
        shares = [micro[self.accelerator.process_index] for micro in plan]
        from_forward = self.scores_in_training_forward
        scored = self._score([seqs[i] for share in shares for i in share], totals, seqs, from_forward=from_forward)
        if from_forward:
            self.health.pend(harness_split(s.harness for s in seqs), seqs)
        return scoring.pieces(scored, plan, self.accelerator.process_index, totals, seqs[0], self.accelerator.device,
                              per_row_loss=cfg.trl_loss_type in ("grpo", "dr_grpo"), routing=self.replay)

    @property
    def scores_in_training_forward(self) -> bool:
        """Old logprobs from each micro-batch's own training forward: every micro-batch is trained once
        (``num_iterations == 1``) before the update, so the policy that trains it is the old policy."""
        return self.train_config.score_in_training_forward and self.num_iterations == 1 and not self.uses_routing

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        """TRL's hook, for one process: the whole batch ``inputs`` scored as one micro-batch."""
        seqs = [self.step_data.sequences[int(row["seq"])] for row in inputs]
        return self._score(seqs, BatchTotals.of(seqs), seqs)

    def _score(
        self, seqs: list[TrainSequence], totals: BatchTotals, batch: list[TrainSequence], *, from_forward: bool = False,
    ) -> dict[str, Any]:
        """``seqs`` (this process's rows) padded into TRL's inputs, their old logprobs recomputed (routing
        replayed for MoE), the importance weights and trial weighting folded into per-token advantages;
        the health figures recorded over ``batch``, every process's rows (gathered). ``from_forward``:
        no recompute; the training forward folds them in (:meth:`_fold`) and the figures come after
        the batch's last micro-step."""
        device = self.accelerator.device
        cfg = self.train_config
        harnesses = harness_split(s.harness for s in batch)
        if not seqs:
            if not from_forward:
                self.health.record(no_values(device), harnesses, RoutingWatch(), batch)
            return {}
        padded = pad(seqs, self.pad_id)
        routing = padded.routing.to(device) if padded.routing is not None and self.uses_routing else None
        keys = scoring.fork_keys(seqs, cfg.share_prefixes).to(device)
        inputs = scoring.trl_inputs(padded, keys, totals, routing if self.replay else None, device)
        mask, rollout_logps, versions = inputs["tool_mask"], padded.rollout_logps.to(device), padded.versions.to(device)
        advantage = scoring.trial_advantages(seqs, totals, cfg, device)
        harness_ids = torch.tensor([float(harnesses.index(s.harness)) if harnesses else 0.0 for s in seqs],
                                   device=device)
        if from_forward:
            inputs.update({"trial_advantages": advantage, "rollout_logps": rollout_logps, "harness_ids": harness_ids,
                           "token_versions": versions, scoring.FROM_FORWARD: True})
            return inputs
        model: Any = self.model
        checkpointing: Any = self.args.gradient_checkpointing_kwargs
        with torch.no_grad(), disable_gradient_checkpointing(model, checkpointing):
            old, watch = self.score(padded.input_ids.to(device), padded.attention_mask.to(device),
                                    padded.completion_ids.shape[1], routing, padded.completion_mask.to(device) * mask, keys)
        advantages, values = scoring.fold_weights(old, rollout_logps, mask, advantage, versions, harness_ids, cfg)
        inputs.update({"advantages": advantages, "old_per_token_logps": old})
        self.health.record(values, harnesses, watch, batch)
        return inputs

    def _fold(self, inputs: dict[str, Any], logps: torch.Tensor) -> None:
        """A micro-batch's old logprobs are its training forward's, detached: TRL then uses them as
        ``old_per_token_logps`` (ratio 1); the per-token advantages are made from them here, before
        TRL's loss reads them, and their figures kept for the end of the batch."""
        inputs["advantages"], values = scoring.fold_weights(
            logps.detach(), inputs["rollout_logps"], inputs["tool_mask"], inputs["trial_advantages"],
            inputs["token_versions"], inputs["harness_ids"], self.train_config, trained_rows_only=True,
        )
        self.health.add(values)

    def _flush_health(self) -> None:
        """After a generation batch's last micro-step: the figures of the old logprobs its forwards gave."""
        if self._step % self.steps_per_generation == 0:
            self.health.flush()

    # ------------------------------------------------------------------ forwards: packed, routing replayed

    def score(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int, routing: torch.Tensor | None,
        score_mask: torch.Tensor | None = None, fork_keys: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, RoutingWatch]:
        """The old logprobs of the last ``logits_to_keep`` positions, in chunks (:mod:`.recompute`)."""
        def padded(ids: torch.Tensor, mask: torch.Tensor, keep: int) -> torch.Tensor:
            return self._get_per_token_logps_and_entropies(self.model, ids, mask, keep)[0]

        return old_logps(
            self.accelerator.unwrap_model(self.model), input_ids, attention_mask, logits_to_keep, routing, score_mask,
            fork_keys, self.train_config, temperature=self.temperature, padded_forward=padded,
            routing_context=self.routing_context, autocast=self.accelerator.autocast,
        )

    def routing_context(
        self, routing: torch.Tensor | None, watch: RoutingWatch | None = None
    ) -> AbstractContextManager[None]:
        """Replay ``routing`` in the forwards inside (when replay is on), else only watch it (:mod:`.replay`)."""
        if routing is None or not self.uses_routing:
            return nullcontext()
        return routed(self.accelerator.unwrap_model(self.model), routing, replay=self.replay, watch=watch)

    def _get_per_token_logps_and_entropies(
        self, model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int,
        batch_size: int | None = None, compute_entropy: bool = False, compute_aux_loss: bool = False, **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """TRL's, unless ``_compute_loss`` packed the batch: then only the sampled positions are scored."""
        nxt = self._next
        if nxt is None or nxt.packed is None:
            logps, entropies, aux = super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy, compute_aux_loss,
                **kwargs,
            )
        else:
            if nxt.packed.rows != input_ids.shape[0]:
                raise LegorlError(f"packed {nxt.packed.rows} rows but asked to score {input_ids.shape[0]}")
            assert nxt.score_mask is not None
            with self.accelerator.autocast():
                scored = sampled_logps(
                    self.accelerator.unwrap_model(model), nxt.packed, input_ids[:, -logits_to_keep:],
                    nxt.score_mask, temperature=self.temperature, compute_entropy=compute_entropy,
                    compute_aux_loss=compute_aux_loss, cast_lm_head_to_fp32=self.train_config.cast_lm_head_to_fp32,
                    forward_through=model,  # the DDP wrapper under accelerate launch: it syncs the gradients
                )
            logps, entropies, aux = scored.logps, scored.entropies, scored.aux_loss
        if nxt is not None and nxt.fold_into is not None:
            self._fold(nxt.fold_into, logps)
        return logps, entropies, aux

    # ------------------------------------------------------------------ the loss: TRL's, under replay

    def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> torch.Tensor:
        """TRL's, with the routing replay and packed attention held open through the backward pass
        (gradient checkpointing re-runs the forward there); a micro-batch no process trains in does
        no forward and no backward (never the last of an update, where DDP synchronises)."""
        model.train()  # what Trainer.training_step does first; the look ahead needs it too
        if self._prepare_inputs(inputs).get(scoring.NO_WORK):
            self._step += 1  # TRL's micro-step count, as its training_step would
            self._flush_health()
            return torch.zeros((), device=self.accelerator.device)
        with self._hold_through_backward():
            loss: torch.Tensor = super().training_step(model, inputs, num_items_in_batch)
        self._flush_health()
        return loss

    def _compute_loss(self, model: Any, inputs: dict[str, Any]) -> torch.Tensor:
        prompt_mask, completion_mask = inputs["prompt_mask"], inputs["completion_mask"]
        trained = inputs["tool_mask"].sum(-1) > 0  # not the rows that only pad a piece (pad_rows)
        self.trained_tokens += int(completion_mask[trained].sum()) + int(prompt_mask[trained].sum())
        routing = inputs.get("routed_experts")
        packed = None
        with ExitStack() as local:
            held = self._held if self._held is not None else local
            if self.train_config.padding_free:
                input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
                attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
                keys = inputs.get("fork_keys")
                if keys is None:
                    keys = torch.full((input_ids.shape[0],), -1, dtype=torch.long)
                packed = scoring.pack_rows(input_ids, attention_mask, keys, routing)
                self.forward_tokens += packed.length
                routing = packed.routing
                held.enter_context(packed_attention(self.accelerator.unwrap_model(model)))
                if self.args.gradient_checkpointing:  # memory over compute: layers in token tiles (tiling.py)
                    held.enter_context(token_tiles(self.accelerator.unwrap_model(model)))
            else:
                self.forward_tokens += int(completion_mask.numel()) + int(prompt_mask.numel())
                self.padding_tokens += int((completion_mask == 0).sum())
            held.enter_context(self.routing_context(routing))
            score_mask = None if packed is None else completion_mask * inputs["tool_mask"]
            with self._intercept(_NextForward(packed, score_mask, inputs if inputs.get(scoring.FROM_FORWARD) else None)):
                loss: torch.Tensor = super()._compute_loss(model, inputs)
        return loss

    # The two places state waits on the trainer for a later call, each for the length of one TRL call
    # (docs/trainer.md): TRL's methods pass it no way to hand these on.

    @contextmanager
    def _hold_through_backward(self) -> Iterator[None]:
        """Contexts ``_compute_loss`` enters stay open until TRL's ``training_step`` has run the backward
        pass (gradient checkpointing re-runs the forward there)."""
        with ExitStack() as held:
            self._held = held
            try:
                yield
            finally:
                self._held = None

    @contextmanager
    def _intercept(self, next_forward: _NextForward) -> Iterator[None]:
        """TRL's ``_compute_loss`` asks ``_get_per_token_logps_and_entropies`` for logprobs passing
        tensors only: what that call scores packed, and which micro-batch its logprobs are the old ones
        of, wait here for it."""
        self._next = next_forward
        try:
            yield
        finally:
            self._next = None

    # ------------------------------------------------------------------ metrics

    def work_counts(self) -> tuple[int, int, int]:
        """Trained, forwarded and padding tokens so far, summed over the processes."""
        counts = sum_across(self.accelerator, [float(self.trained_tokens), float(self.forward_tokens),
                                               float(self.padding_tokens)])
        return int(counts[0]), int(counts[1]), int(counts[2])

    def _record(self, values: dict[str, float], harness: str | None = None) -> None:
        for key, value in values.items():
            self.recorder.add(key, value, harness)
            name = key if harness is None else f"{key}/{harness}"
            self._own_keys.add(name)
            self._metrics["train"][name].append(value)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        super().log(logs, start_time)  # TRL merges its metrics into ``logs`` and sends them to the reporters
        for key, value in logs.items():
            if key in self._own_keys or key in _SKIP_LOG_KEYS or not isinstance(value, int | float):
                continue
            if isinstance(value, float) and math.isnan(value):
                continue
            self.recorder.add(key, float(value))
            if key == mk.TRL_CLIP_RATIO:
                self.recorder.add(mk.CLIP_FRACTION, float(value))
