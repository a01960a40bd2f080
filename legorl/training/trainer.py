"""TRL's GRPO trainer, minus generation, plus segments.

:class:`SegmentGRPOTrainer` subclasses ``trl.GRPOTrainer`` and changes only where the batch comes
from. TRL's loop, losses (``_compute_loss``: grpo, dr_grpo, dapo, sequence-level GSPO), clipping,
logging, checkpointing and reporters are used as they are:

- the train dataloader yields generation batches of whole groups (:mod:`.batching`), each
  repeated for TRL's ``num_iterations x steps_per_generation`` micro-steps;
- ``_generate_and_score_completions`` generates nothing: it pads the stored token ids, turns the
  loss mask into TRL's ``tool_mask``, recomputes the old logprobs with the model (routing replayed
  for MoE), folds the importance weights against the rollout logprobs and the trial weighting into
  per-token advantages of shape (B, T), and records the health metrics;
- ``_compute_loss`` is TRL's, run inside the routing-replay context.

Advantages are computed before training, per group over the whole step (:mod:`.advantages`), so
how a generation batch is cut into micro-batches never changes them.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
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

from legorl import metric_keys as mk
from legorl.errors import LegorlError
from legorl.routing import capture_routing, replay_routing, routing_shape
from legorl.training.batching import GroupBatchSampler, pad, split
from legorl.training.config import TrainConfig
from legorl.training.data import StepData
from legorl.training.importance import importance_weights
from legorl.training.metrics import MetricsRecorder, fidelity, harness_split

# Keys of TRL/Trainer logs not worth a metrics row (run summaries, bookkeeping).
_SKIP_LOG_KEYS = ("epoch", "total_flos", "train_runtime", "train_samples_per_second", "train_steps_per_second",
                  "train_loss", "num_tokens", "step_time")


def stored_reward(prompts: Any = None, completions: Any = None, **kwargs: Any) -> list[float | None]:
    """TRL requires a reward source; ours are the grades shards, so this is never called."""
    raise RuntimeError("SegmentGRPOTrainer never scores completions: rewards come from the grades shards")


@dataclass
class RoutingWatch:
    """Routing decisions the trainer's own router would make differently from the recorded ones."""

    flips: int = 0
    decisions: int = 0


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
        self.trained_tokens = 0
        self.padded_tokens = 0
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

    # ------------------------------------------------------------------ data: whole groups, no generation

    def get_train_dataloader(self) -> DataLoader:
        sampler = GroupBatchSampler(self.batches, repeat=self.num_iterations * self.steps_per_generation)
        dataset: Any = self.train_dataset
        loader = DataLoader(dataset, batch_sampler=sampler, collate_fn=identity, num_workers=0)
        return self.accelerator.prepare(loader)

    def _prepare_inputs(self, generation_batch: Any) -> dict[str, Any]:
        """TRL's buffering (one scored batch reused for ``num_iterations`` updates), with a split that
        keeps every row even when the batch size is not a multiple of the micro-batch count."""
        model: Any = self.model
        if not model.training:
            raise LegorlError("SegmentGRPOTrainer trains only; evaluate with `legorl eval`")
        generate_every = self.steps_per_generation * self.num_iterations
        if self._step % generate_every == 0 or self._buffered_inputs is None:
            scored = self._generate_and_score_completions(generation_batch)
            # Seeded by the update count, so a resumed run cuts the same micro-batches.
            generator = torch.Generator().manual_seed(self.train_config.seed * 1_000_003 + self.state.global_step)
            self._buffered_inputs = split(scored, self.steps_per_generation, generator)
        inputs: dict[str, Any] = self._buffered_inputs[self._step % len(self._buffered_inputs)]
        return inputs

    @property
    def steps_per_generation(self) -> int:
        steps = self.train_config.steps_per_generation
        assert steps is not None  # GRPOConfig.__post_init__ derives it
        return steps

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        device = self.accelerator.device
        seqs = [self.step_data.sequences[int(row["seq"])] for row in inputs]
        padded = pad(seqs, self.pad_id)
        input_ids = padded.input_ids.to(device)
        attention_mask = padded.attention_mask.to(device)
        logits_to_keep = padded.completion_ids.shape[1]
        routing = padded.routing.to(device) if padded.routing is not None and self.uses_routing else None

        model: Any = self.model
        checkpointing_kwargs: Any = self.args.gradient_checkpointing_kwargs
        with torch.no_grad(), disable_gradient_checkpointing(model, checkpointing_kwargs):
            old_logps, watch = self.score(input_ids, attention_mask, logits_to_keep, routing)

        mask = padded.loss_mask.to(device)
        rollout_logps = padded.rollout_logps.to(device)
        cfg = self.train_config
        weights, weight_stats = importance_weights(old_logps, rollout_logps, mask, cfg.importance_sampling, cfg.is_cap)
        trial_advantage = torch.tensor([s.advantage * s.scale for s in seqs], dtype=torch.float32, device=device)
        if cfg.trl_loss_type == "grpo":
            # TRL averages over sequences; a trial's segments were scaled to sum to one sequence, so
            # averaging over trials instead is a factor sequences / trials (1 without forks).
            trial_advantage *= len(seqs) / len({s.trial_id for s in seqs})
        advantages = trial_advantage[:, None] * weights

        self._record(fidelity(old_logps, rollout_logps, mask))
        self._record(weight_stats.as_dict())
        for harness in harness_split(s.harness for s in seqs):
            rows = torch.tensor([s.harness == harness for s in seqs], device=device)
            self._record(fidelity(old_logps[rows], rollout_logps[rows], mask[rows]), harness)
        if self.uses_routing:
            self._record({
                mk.ROUTING_REPLAY: float(self.replay),
                mk.ROUTING_NATURAL_FLIP_RATE: watch.flips / max(watch.decisions, 1),
                mk.ROUTING_EFFECTIVE_FLIP_RATE: 0.0 if self.replay else watch.flips / max(watch.decisions, 1),
            })
        self._record({mk.BATCH_SEQUENCES: float(len(seqs)), mk.BATCH_PADDING_SHARE: float(
            1.0 - attention_mask.sum().item() / attention_mask.numel())})

        output: dict[str, Any] = {
            "prompt_ids": padded.prompt_ids.to(device),
            "prompt_mask": torch.ones_like(padded.prompt_ids).to(device),
            "completion_ids": padded.completion_ids.to(device),
            "completion_mask": padded.completion_mask.to(device),
            "tool_mask": mask,
            "advantages": advantages,
            "old_per_token_logps": old_logps,
            "num_items_in_batch": mask.sum(),
        }
        if routing is not None and self.replay:
            output["routed_experts"] = routing
        return output

    def score(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int, routing: torch.Tensor | None
    ) -> tuple[torch.Tensor, RoutingWatch]:
        """Per-token logprobs of the last ``logits_to_keep`` positions, in chunks, routing replayed (or
        watched) per chunk."""
        watch = RoutingWatch()
        out = []
        size = self.train_config.logprob_batch_size
        for start in range(0, input_ids.shape[0], size):
            end = start + size
            with self.routing_context(None if routing is None else routing[start:end], watch):
                logps, _, _ = self._get_per_token_logps_and_entropies(
                    self.model, input_ids[start:end], attention_mask[start:end], logits_to_keep
                )
            out.append(logps)
        return torch.cat(out, dim=0), watch

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

    def _compute_loss(self, model: Any, inputs: dict[str, Any]) -> torch.Tensor:
        self.trained_tokens += int(inputs["completion_mask"].sum()) + int(inputs["prompt_mask"].sum())
        self.padded_tokens += int(inputs["completion_mask"].numel()) + int(inputs["prompt_mask"].numel())
        with self.routing_context(inputs.get("routed_experts")):
            loss: torch.Tensor = super()._compute_loss(model, inputs)
        return loss

    # ------------------------------------------------------------------ metrics and state

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
