"""TRL's GRPO trainer, minus generation, plus segments.

:class:`SegmentGRPOTrainer` subclasses ``trl.GRPOTrainer`` and changes only where the batch comes
from. TRL's loop, losses (``_compute_loss``: grpo, dr_grpo, dapo, sequence-level GSPO), clipping,
logging, checkpointing and reporters are used as they are:

- the train dataloader yields generation batches of whole groups (:mod:`.batching`), each
  repeated for TRL's ``num_iterations x steps_per_generation`` micro-steps, the same batches in
  every process of an ``accelerate launch``;
- generating nothing, ``_micro_batches`` counts the batch's normalisers, leaves out trials whose
  advantage is 0 (``skip_zero_advantage``), cuts the rest into micro-batches and each micro-batch
  into one share per process (:func:`~.batching.micro_batch_plan`); ``_score`` pads this process's
  rows, turns the loss mask into TRL's ``tool_mask``, recomputes their old logprobs (routing
  replayed for MoE), folds the importance weights against the rollout logprobs and the trial
  weighting into per-token advantages of shape (B, T), and records the health metrics over every
  process's rows (:mod:`.distributed`); a micro-batch no process trains in does not run;
- ``_compute_loss`` is TRL's, run inside the routing-replay context; with ``padding_free`` (the
  default) the per-token logprobs it asks for come from one packed, padding-free forward with the
  LM head only at sampled positions and fork prefixes computed once (:mod:`.logprobs`,
  :mod:`.packing`), the old logprobs from the same path without gradient, in token-bounded chunks.

Advantages are computed before training, per group over the whole step (:mod:`.advantages`), so
how a generation batch is cut into micro-batches, or shared between processes, never changes them
(docs/training-at-scale.md).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
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
from legorl.routing import capture_routing, replay_routing, routing_shape
from legorl.training.attention import packed_attention
from legorl.training.batching import BatchTotals, GroupBatchSampler, micro_batch_plan, pad, pad_rows, take
from legorl.training.config import TrainConfig
from legorl.training.data import StepData, TrainSequence
from legorl.training.distributed import gather_cat, sum_across
from legorl.training.importance import (
    SEGMENT_LEVELS,
    importance_weights,
    value_tokens,
    value_versions,
    weight_stats,
    weight_stats_by_lag,
)
from legorl.training.logprobs import sampled_logps
from legorl.training.memory import map_large_blocks
from legorl.training.metrics import MetricsRecorder, fidelity, harness_split
from legorl.training.packing import MIN_SHARED_PREFIX, Packed, pack, token_chunks
from legorl.training.tiling import tiled_mlp

# Keys of TRL/Trainer logs not worth a metrics row (run summaries, bookkeeping).
_SKIP_LOG_KEYS = ("epoch", "total_flos", "train_runtime", "train_samples_per_second", "train_steps_per_second",
                  "train_loss", "num_tokens", "step_time")

# Marks a micro-batch that no process trains in: it does not run (SegmentGRPOTrainer.training_step).
_NO_WORK = "legorl_no_work"
# Marks a micro-batch whose old logprobs come from its own training forward (score_in_training_forward).
_FROM_FORWARD = "legorl_old_from_forward"
_HEALTH_VALUES = ("old", "rollout", "harness", "weight", "raw", "version", "tokens")


def stored_reward(prompts: Any = None, completions: Any = None, **kwargs: Any) -> list[float | None]:
    """TRL requires a reward source; ours are the grades shards, so this is never called."""
    raise RuntimeError("SegmentGRPOTrainer never scores completions: rewards come from the grades shards")


@dataclass
class RoutingWatch:
    """Routing decisions the trainer's own router would make differently from the recorded ones."""

    flips: int = 0
    decisions: int = 0


@dataclass(frozen=True)
class _Scoring:
    """What the next ``_get_per_token_logps_and_entropies`` call scores, packed."""

    packed: Packed
    score_mask: torch.Tensor  # (B, C): TRL's ``completion_mask * tool_mask``


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
        self.carry_state_from = carry_state_from
        self.trained_tokens = 0  # segment tokens trained on (a shared fork prefix counts once per fork)
        self.forward_tokens = 0  # positions the training forwards ran (packed: shared prefixes once)
        self.padding_tokens = 0  # of which padding
        self._scoring: _Scoring | None = None
        self._held: ExitStack | None = None  # contexts that must outlive the forward (recompute in backward)
        self._generated_at: int | None = None  # the micro-step whose generation batch is buffered
        self._fold_into: dict[str, Any] | None = None  # the micro-batch whose forward gives its old logprobs
        self._health: tuple[list[str], list[TrainSequence]] | None = None  # harnesses, batch: figures pending
        self._health_values: dict[str, list[torch.Tensor]] = {name: [] for name in _HEALTH_VALUES}
        self._own_keys: set[str] = set()
        dataset = Dataset.from_dict({"seq": list(range(len(data.sequences)))})
        super().__init__(
            model=model, reward_funcs=stored_reward, args=args, train_dataset=dataset,
            processing_class=processing_class, callbacks=callbacks,
        )
        tokenizer = getattr(processing_class, "tokenizer", processing_class)
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        if pad_id is None:
            raise LegorlError("the tokenizer has neither a pad nor an eos token")
        self.pad_id = int(pad_id)
        self.routing_shape = routing_shape(self.accelerator.unwrap_model(self.model))
        has_routing = any(s.routed_experts is not None for s in data.sequences)
        if args.routing_replay == "on" and (self.routing_shape is None or not has_routing):
            raise LegorlError(
                "routing replay is on but "
                + ("the model is not MoE" if self.routing_shape is None else "the segments carry no routed_experts")
            )
        self.uses_routing = self.routing_shape is not None and has_routing
        self.replay = self.uses_routing and args.routing_replay != "off"
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
        chunks, ranks = self.steps_per_generation, self.accelerator.num_processes
        plan = micro_batch_plan(seqs, chunks, ranks, generator, keep_trials_together=cfg.share_prefixes,
                                by_tokens=cfg.max_tokens_per_micro_batch is not None)
        shares = [micro[self.accelerator.process_index] for micro in plan]
        from_forward = self.scores_in_training_forward
        scored = self._score([seqs[i] for share in shares for i in share], totals, seqs, from_forward=from_forward)
        if from_forward:
            self._health = (harness_split(s.harness for s in seqs), seqs)
        per_row_loss = cfg.trl_loss_type in ("grpo", "dr_grpo")
        pieces, start = [], 0
        for micro, share in zip(plan, shares, strict=True):
            # Every process's piece of a micro-batch has as many rows (TRL gathers per-row figures).
            height = max(1, *(len(s) for s in micro)) if ranks > 1 else len(share)
            if not share:
                pieces.append(pad_rows(self._no_op(seqs[0], totals, run=any(micro)), height))
                continue
            factor = height * chunks * ranks / totals.rows if per_row_loss else 1.0
            pieces.append(pad_rows(take(scored, list(range(start, start + len(share))), factor), height))
            start += len(share)
        return pieces

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
        """``seqs`` (this process's rows) padded, their old logprobs recomputed (routing replayed for
        MoE), the importance weights and trial weighting folded into per-token advantages; the health
        figures recorded over ``batch``, every process's rows (gathered). ``from_forward``: no
        recompute; the training forward folds them in (:meth:`_fold`) and the figures come after the
        batch's last micro-step."""
        device = self.accelerator.device
        cfg = self.train_config
        harnesses = harness_split(s.harness for s in batch)
        output: dict[str, Any] = {}
        watch = RoutingWatch()
        values = {name: torch.zeros(0, device=device) for name in _HEALTH_VALUES}
        if seqs:
            padded = pad(seqs, self.pad_id)
            input_ids = padded.input_ids.to(device)
            attention_mask = padded.attention_mask.to(device)
            logits_to_keep = padded.completion_ids.shape[1]
            routing = padded.routing.to(device) if padded.routing is not None and self.uses_routing else None
            model: Any = self.model
            checkpointing_kwargs: Any = self.args.gradient_checkpointing_kwargs
            mask = padded.loss_mask.to(device)
            fork_keys = self._fork_keys(seqs).to(device)
            rollout_logps = padded.rollout_logps.to(device)
            versions = padded.versions.to(device)
            trial_advantage = torch.tensor([s.advantage * s.scale for s in seqs], dtype=torch.float32, device=device)
            if cfg.trl_loss_type == "grpo":
                # TRL averages over sequences; a trial's segments were scaled to sum to one sequence, so
                # averaging over trials instead is a factor sequences / trials (1 without forks).
                trial_advantage *= totals.rows / totals.trials
            harness_of = [float(harnesses.index(s.harness)) if harnesses else 0.0 for s in seqs]
            output = {
                "prompt_ids": padded.prompt_ids.to(device),
                "prompt_mask": torch.ones_like(padded.prompt_ids).to(device),
                "completion_ids": padded.completion_ids.to(device),
                "completion_mask": padded.completion_mask.to(device),
                "tool_mask": mask,
                "num_items_in_batch": torch.tensor(float(totals.sampled), device=device),
                "fork_keys": fork_keys,
            }
            if routing is not None and self.replay:
                output["routed_experts"] = routing
            if from_forward:
                output.update({"trial_advantages": trial_advantage, "rollout_logps": rollout_logps,
                               "harness_ids": torch.tensor(harness_of, device=device), "token_versions": versions,
                               _FROM_FORWARD: True})
                return output
            with torch.no_grad(), disable_gradient_checkpointing(model, checkpointing_kwargs):
                old_logps, watch = self.score(input_ids, attention_mask, logits_to_keep, routing,
                                              padded.completion_mask.to(device) * mask, fork_keys)
            weights, values["weight"], values["raw"] = self._importance_weights(old_logps, rollout_logps, mask)
            sampled = mask > 0
            values["old"], values["rollout"] = old_logps[sampled], rollout_logps[sampled]
            values["harness"] = torch.tensor(harness_of, device=device)[:, None].expand_as(mask)[sampled]
            values["version"] = value_versions(versions, mask, cfg.importance_sampling)
            values["tokens"] = value_tokens(mask, cfg.importance_sampling)
            output.update({"advantages": trial_advantage[:, None] * weights, "old_per_token_logps": old_logps})
        if not from_forward:
            self._record_health(values, harnesses, watch, batch)
        return output

    def _fold(self, inputs: dict[str, Any], logps: torch.Tensor) -> None:
        """A micro-batch's old logprobs are its training forward's, detached: TRL then uses them as
        ``old_per_token_logps`` (ratio 1); the importance weights against the rollout and the per-token
        advantages are made from them here, before TRL's loss reads them, and their figures kept for
        the end of the batch."""
        cfg = self.train_config
        old, mask = logps.detach(), inputs["tool_mask"]
        weights, weight, raw = self._importance_weights(old, inputs["rollout_logps"], mask)
        inputs["advantages"] = inputs["trial_advantages"][:, None] * weights
        sampled = mask > 0
        version = value_versions(inputs["token_versions"], mask, cfg.importance_sampling)
        tokens = value_tokens(mask, cfg.importance_sampling)
        if cfg.importance_sampling in SEGMENT_LEVELS:  # one weight per row: not the rows that only pad the piece
            trained = sampled.any(-1)
            weight, raw, version, tokens = weight[trained], raw[trained], version[trained], tokens[trained]
        harness = inputs["harness_ids"][:, None].expand_as(mask)[sampled]
        for name, value in zip(_HEALTH_VALUES, (old[sampled], inputs["rollout_logps"][sampled], harness, weight, raw,
                                                version, tokens), strict=True):
            self._health_values[name].append(value)

    def _importance_weights(
        self, old: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        cfg = self.train_config
        return importance_weights(old, rollout, mask, cfg.importance_sampling, cfg.is_cap, cfg.is_mode, cfg.is_lower)

    def _flush_health(self) -> None:
        """After a generation batch's last micro-step: the figures of the old logprobs its forwards gave."""
        if self._health is None or self._step % self.steps_per_generation:
            return
        device = self.accelerator.device
        values = {name: torch.cat(parts) if parts else torch.zeros(0, device=device)
                  for name, parts in self._health_values.items()}
        harnesses, batch = self._health
        self._health, self._health_values = None, {name: [] for name in _HEALTH_VALUES}
        self._record_health(values, harnesses, RoutingWatch(), batch)

    def _record_health(
        self, local: dict[str, torch.Tensor], harnesses: list[str], watch: RoutingWatch, batch: list[TrainSequence]
    ) -> None:
        """The fidelity, importance-weight (also per staleness level) and routing figures of the whole batch
        (every process's rows)."""
        cfg = self.train_config
        gathered = {name: gather_cat(self.accelerator, value) for name, value in local.items()}
        old, rollout = gathered["old"], gathered["rollout"]
        everywhere = torch.ones_like(old)
        self._record(fidelity(old, rollout, everywhere))
        correction = (cfg.is_cap, cfg.is_mode, cfg.is_lower)
        self._record(weight_stats(gathered["weight"], gathered["raw"], *correction, gathered["tokens"]).as_dict())
        self._record(weight_stats_by_lag(gathered["weight"], gathered["raw"], gathered["version"], self.step_data.step,
                                         *correction, gathered["tokens"]))
        for index, harness in enumerate(harnesses):
            rows = gathered["harness"] == index
            self._record(fidelity(old[rows], rollout[rows], everywhere[rows]), harness)
        if self.uses_routing:
            flips, decisions = sum_across(self.accelerator, [float(watch.flips), float(watch.decisions)])
            self._record({
                mk.ROUTING_REPLAY: float(self.replay),
                mk.ROUTING_NATURAL_FLIP_RATE: flips / max(decisions, 1.0),
                mk.ROUTING_EFFECTIVE_FLIP_RATE: 0.0 if self.replay else flips / max(decisions, 1.0),
            })
        lengths = [len(s) for s in batch]
        padding = 0.0 if cfg.padding_free else 1.0 - sum(lengths) / (len(lengths) * max(lengths))
        self._record({mk.BATCH_SEQUENCES: float(len(batch)), mk.BATCH_PADDING_SHARE: padding})

    def _no_op(self, seq: TrainSequence, totals: BatchTotals, *, run: bool) -> dict[str, Any]:
        """A micro-batch that changes no weight: two tokens of ``seq``, none of them trained. ``run``:
        another process trains in this micro-step, so this one must run it too (DDP's collectives);
        otherwise it does not run at all (:meth:`training_step`)."""
        device = self.accelerator.device
        ids = torch.from_numpy(seq.token_ids[:2]).to(device)[None]
        ones = torch.ones((1, 1), dtype=torch.long, device=device)
        zeros = torch.zeros((1, 1), dtype=torch.float32, device=device)
        out: dict[str, Any] = {
            "prompt_ids": ids[:, :1], "prompt_mask": ones, "completion_ids": ids[:, 1:], "completion_mask": ones,
            "tool_mask": zeros, "advantages": zeros, "old_per_token_logps": zeros,
            "num_items_in_batch": torch.tensor(float(totals.sampled), device=device),
            "fork_keys": torch.full((1,), -1, dtype=torch.long, device=device), _NO_WORK: not run,
        }
        if self.replay and seq.routed_experts is not None:
            out["routed_experts"] = torch.from_numpy(seq.routed_experts[:2].astype("int64")).to(device)[None]
        return out

    def _fork_keys(self, seqs: list[Any]) -> torch.Tensor:
        """One key per row: rows of one trial may share a prefix (-1 for every row: none shares)."""
        if not self.train_config.share_prefixes:
            return torch.full((len(seqs),), -1, dtype=torch.long)
        trials: dict[str, int] = {}
        return torch.tensor([trials.setdefault(s.trial_id, len(trials)) for s in seqs], dtype=torch.long)

    def pack_rows(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, fork_keys: torch.Tensor,
        routing: torch.Tensor | None,
    ) -> Packed:
        keys = [int(k) if k >= 0 else -1 - i for i, k in enumerate(fork_keys.tolist())]
        return pack(input_ids, attention_mask, keys, routing, MIN_SHARED_PREFIX)

    def score(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int, routing: torch.Tensor | None,
        score_mask: torch.Tensor | None = None, fork_keys: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, RoutingWatch]:
        """Per-token logprobs of the last ``logits_to_keep`` positions, in chunks (of ``logprob_batch_size``
        rows and, padding-free, ``logprob_max_tokens`` tokens), routing replayed (or watched) per chunk."""
        watch = RoutingWatch()
        cfg = self.train_config
        padding_free = cfg.padding_free and score_mask is not None
        if padding_free:
            chunks = token_chunks(attention_mask.sum(-1).tolist(), cfg.logprob_max_tokens, cfg.logprob_batch_size)
        else:
            size = cfg.logprob_batch_size
            chunks = [list(range(s, min(s + size, input_ids.shape[0]))) for s in range(0, input_ids.shape[0], size)]
        out = []
        for chunk in chunks:
            rows = torch.tensor(chunk, device=input_ids.device)
            chunk_routing = None if routing is None else routing[rows]
            if not padding_free:
                with self.routing_context(chunk_routing, watch):
                    logps, _, _ = self._get_per_token_logps_and_entropies(
                        self.model, input_ids[rows], attention_mask[rows], logits_to_keep
                    )
                out.append(logps)
                continue
            assert score_mask is not None
            keys = fork_keys[rows] if fork_keys is not None else torch.full((len(chunk),), -1)
            packed = self.pack_rows(input_ids[rows], attention_mask[rows], keys, chunk_routing)
            unwrapped = self.accelerator.unwrap_model(self.model)
            with packed_attention(unwrapped), self.routing_context(packed.routing, watch), self.accelerator.autocast():
                scored = sampled_logps(
                    self.accelerator.unwrap_model(self.model), packed, input_ids[rows, -logits_to_keep:],
                    score_mask[rows], temperature=self.temperature, compute_entropy=False,
                    cast_lm_head_to_fp32=self.train_config.cast_lm_head_to_fp32,
                )
            out.append(scored.logps)
        return torch.cat(out, dim=0), watch

    def _get_per_token_logps_and_entropies(
        self, model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int,
        batch_size: int | None = None, compute_entropy: bool = False, compute_aux_loss: bool = False, **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """TRL's, unless ``_compute_loss`` packed the batch: then only the sampled positions are scored."""
        scoring = self._scoring
        if scoring is None:
            logps, entropies, aux = super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy, compute_aux_loss,
                **kwargs,
            )
            if self._fold_into is not None:
                self._fold(self._fold_into, logps)
            return logps, entropies, aux
        if scoring.packed.rows != input_ids.shape[0]:
            raise LegorlError(f"packed {scoring.packed.rows} rows but asked to score {input_ids.shape[0]}")
        with self.accelerator.autocast():
            scored = sampled_logps(
                self.accelerator.unwrap_model(model), scoring.packed, input_ids[:, -logits_to_keep:],
                scoring.score_mask, temperature=self.temperature, compute_entropy=compute_entropy,
                compute_aux_loss=compute_aux_loss, cast_lm_head_to_fp32=self.train_config.cast_lm_head_to_fp32,
                forward_through=model,  # the DDP wrapper under accelerate launch: it syncs the gradients
            )
        if self._fold_into is not None:
            self._fold(self._fold_into, scored.logps)
        return scored.logps, scored.entropies, scored.aux_loss

    @contextmanager
    def routing_context(self, routing: torch.Tensor | None, watch: RoutingWatch | None = None) -> Iterator[None]:
        """Replay ``routing`` [B, T, layers, top_k] in the forwards inside (when replay is on), else only
        watch how the router's own choices differ from it."""
        if routing is None or self.routing_shape is None:
            yield
            return
        model = self.accelerator.unwrap_model(self.model)
        recorded = (routing >= 0).all(-1).reshape(-1, routing.shape[-2])  # [tokens, layers]
        if self.replay:
            with replay_routing(model, routing) as replay:
                yield
            if watch is not None:
                watch.flips += replay.flips
                watch.decisions += int(recorded.sum())
            return
        with capture_routing(model) as capture:
            yield
        if watch is not None:
            natural = torch.from_numpy(capture.take()).to(routing.device).long()
            forced = routing.reshape(-1, *routing.shape[-2:])
            differs = (natural.sort(-1).values != forced.sort(-1).values).any(-1)
            watch.flips += int((differs & recorded).sum())
            watch.decisions += int(recorded.sum())

    # ------------------------------------------------------------------ the loss: TRL's, under replay

    def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> torch.Tensor:
        """TRL's, with the routing replay and packed attention held open through the backward pass
        (gradient checkpointing re-runs the forward there); a micro-batch no process trains in does
        no forward and no backward (never the last of an update, where DDP synchronises)."""
        model.train()  # what Trainer.training_step does first; the look ahead needs it too
        if self._prepare_inputs(inputs).get(_NO_WORK):
            self._step += 1  # TRL's micro-step count, as its training_step would
            self._flush_health()
            return torch.zeros((), device=self.accelerator.device)
        with ExitStack() as held:
            self._held = held
            try:
                loss: torch.Tensor = super().training_step(model, inputs, num_items_in_batch)
            finally:
                self._held = None
        self._flush_health()
        return loss

    def _compute_loss(self, model: Any, inputs: dict[str, Any]) -> torch.Tensor:
        prompt_mask, completion_mask = inputs["prompt_mask"], inputs["completion_mask"]
        trained = inputs["tool_mask"].sum(-1) > 0  # not the rows that only pad a piece (pad_rows)
        self.trained_tokens += int(completion_mask[trained].sum()) + int(prompt_mask[trained].sum())
        routing = inputs.get("routed_experts")
        with ExitStack() as local:
            held = self._held if self._held is not None else local
            if self.train_config.padding_free:
                input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
                attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
                keys = inputs.get("fork_keys")
                if keys is None:
                    keys = torch.full((input_ids.shape[0],), -1, dtype=torch.long)
                packed = self.pack_rows(input_ids, attention_mask, keys, routing)
                self._scoring = _Scoring(packed, completion_mask * inputs["tool_mask"])
                self.forward_tokens += packed.length
                routing = packed.routing
                held.enter_context(packed_attention(self.accelerator.unwrap_model(model)))
                if self.args.gradient_checkpointing:  # memory over compute: MLPs in tiles too (tiling.py)
                    held.enter_context(tiled_mlp(self.accelerator.unwrap_model(model)))
            else:
                self.forward_tokens += int(completion_mask.numel()) + int(prompt_mask.numel())
                self.padding_tokens += int((completion_mask == 0).sum())
            held.enter_context(self.routing_context(routing))
            self._fold_into = inputs if inputs.get(_FROM_FORWARD) else None
            try:
                loss: torch.Tensor = super()._compute_loss(model, inputs)
            finally:
                self._scoring = self._fold_into = None
        return loss

    # ------------------------------------------------------------------ metrics and state

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

    def _prepare_for_training(self, max_steps: int, train_dataloader: Any, resume_from_checkpoint: Any) -> Any:
        """When continuing from the previous step's checkpoint, carry its optimizer and LR schedule."""
        prepared = super()._prepare_for_training(max_steps, train_dataloader, resume_from_checkpoint)
        if resume_from_checkpoint is None and self.carry_state_from is not None:
            self._load_optimizer_and_scheduler(str(self.carry_state_from))
        return prepared
