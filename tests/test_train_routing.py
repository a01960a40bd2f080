"""Routing replay (R3) in the training stage on a tiny Qwen3-MoE model."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from train_support import TrialSpec, make_run

from legorl.core import metric_keys as mk
from legorl.core import shards
from legorl.core.paths import RunDir
from legorl.core.schemas import Kind
from legorl.stages.train import run_train
from legorl.training.config import TrainConfig

SPECS = [TrialSpec("t1", i, r) for i, r in enumerate([1.0, 0.0, 0.0, 1.0])]
SHOWN = (mk.ROUTING_NATURAL_FLIP_RATE, mk.ROUTING_EFFECTIVE_FLIP_RATE, mk.LOGPROB_PEARSON,
         mk.MISMATCH_KL, mk.LOGPROB_ABS_DIFF_MAX)


def _perturbed(model_dir: Path, out: Path, scale: float = 0.03) -> Path:
    """The model with every weight multiplied by (1 + scale * N(0, 1)): a policy a few updates on."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1 + scale * torch.randn(p.shape, generator=gen))
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(out)
    return out


def _train_metrics(run: RunDir, model: Path, replay: str) -> dict[str, float]:
    run_train(run.root, model, None, TrainConfig(routing_replay=replay))  # type: ignore[arg-type]
    return {r.key: r.value for r in shards.read_rows(run.metrics, Kind.METRICS) if r.harness is None}


def test_replay_side_by_side_on_perturbed_moe(tiny_moe_model: Path, tmp_path: Path) -> None:
    base = make_run(tmp_path / "base", tiny_moe_model, SPECS)
    runs = {}
    for name in ("same_replay", "perturbed_replay", "perturbed_off"):
        shutil.copytree(base.root, tmp_path / name)
        runs[name] = RunDir.at(tmp_path / name)
    perturbed = _perturbed(tiny_moe_model, tmp_path / "perturbed-model")

    same = _train_metrics(runs["same_replay"], tiny_moe_model, "auto")
    on = _train_metrics(runs["perturbed_replay"], perturbed, "on")
    off = _train_metrics(runs["perturbed_off"], perturbed, "off")
    print("\n" + f"{'':32s}{'same weights':>14s}{'replay on':>14s}{'replay off':>14s}")
    for key in SHOWN:
        print(f"{key:32s}{same[key]:14.6g}{on[key]:14.6g}{off[key]:14.6g}")

    # Same weights as the rollout: replay is on by default, nothing to correct.
    assert same[mk.ROUTING_REPLAY] == 1.0
    assert same[mk.LOGPROB_PEARSON] >= 0.9999
    assert same[mk.MISMATCH_KL] < 1e-5
    # Perturbed weights: the router would choose differently; with replay no decision flips.
    assert on[mk.ROUTING_REPLAY] == 1.0 and off[mk.ROUTING_REPLAY] == 0.0
    assert on[mk.ROUTING_NATURAL_FLIP_RATE] > 0
    assert on[mk.ROUTING_EFFECTIVE_FLIP_RATE] == 0.0
    assert off[mk.ROUTING_EFFECTIVE_FLIP_RATE] > 0
    assert on[mk.MISMATCH_KL] < off[mk.MISMATCH_KL]
