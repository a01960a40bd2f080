"""The private TRL / transformers surface the trainer relies on is still there, and named in one place.

A TRL upgrade that renames, removes or re-signs one of these fails here first, in a second, before
any training test runs (docs/trainer.md says what else to re-check).
"""

from __future__ import annotations

import inspect

from transformers import Trainer
from trl import GRPOTrainer

from legorl.training import checkpoint
from legorl.training.trainer import TRL_PRIVATE_HOOKS, TRL_PRIVATE_STATE, SegmentGRPOTrainer


def _private_overrides() -> set[str]:
    own = {name for name, value in vars(SegmentGRPOTrainer).items() if callable(value) or isinstance(value, property)}
    return {name for name in own if name.startswith("_") and not name.startswith("__") and hasattr(GRPOTrainer, name)}


def test_every_private_override_is_named_with_a_reason() -> None:
    assert _private_overrides() == set(TRL_PRIVATE_HOOKS)
    assert all(len(why) > 20 for why in TRL_PRIVATE_HOOKS.values())


def test_each_hook_keeps_the_parameters_the_trainer_uses() -> None:
    wanted = {
        "_prepare_inputs": ["generation_batch"],
        "_generate_and_score_completions": ["inputs"],
        "_get_per_token_logps_and_entropies": ["model", "input_ids", "attention_mask", "logits_to_keep", "batch_size",
                                               "compute_entropy", "compute_aux_loss"],
        "_compute_loss": ["model", "inputs"],
    }
    assert set(wanted) == set(TRL_PRIVATE_HOOKS)
    for name, params in wanted.items():
        theirs = list(inspect.signature(getattr(GRPOTrainer, name)).parameters)[1:]
        assert theirs[: len(params)] == params, name


def test_trls_loss_asks_the_overridden_forward_for_its_logprobs() -> None:
    """The packed forward is reached only because TRL's ``_compute_loss`` calls this method by name."""
    loss = inspect.getsource(GRPOTrainer._compute_loss)
    assert "self._get_per_token_logps_and_entropies(" in loss
    assert 'inputs["advantages"]' in loss and '"tool_mask"' in loss
    step = inspect.getsource(GRPOTrainer.training_step)
    assert "self._step += 1" in step  # the count SegmentGRPOTrainer.training_step advances for a skipped micro-step


def test_private_state_and_checkpoint_helpers_exist() -> None:
    init = inspect.getsource(GRPOTrainer.__init__)
    for name in TRL_PRIVATE_STATE:
        assert f"self.{name} =" in init, name
    source = inspect.getsource(checkpoint)
    for helper in ("_save_optimizer_and_scheduler", "_save_rng_state", "_load_optimizer_and_scheduler"):
        assert hasattr(Trainer, helper) and f".{helper}(" in source, helper
        assert list(inspect.signature(getattr(Trainer, helper)).parameters)[1:2] in (["output_dir"], ["checkpoint"])
