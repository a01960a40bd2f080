"""Training throughput: legorl's SegmentGRPOTrainer vs a plain TRL GRPOTrainer fed the same sequences.

Both train the same model on the same multi-turn sequences (prompt, then sampled turns
interleaved with tool output; the loss mask covers the sampled tokens), one batch of whole groups
per update, ``num_iterations=1``. The plain trainer gets the sequences through TRL's own
``rollout_func`` (prompt = tokens before the first sampled one, completion = the rest, with
``env_mask`` = the loss mask) and its rewards through a reward function. TRL pads prompts on the left
and completions on the right, so its batch is ``max prompt + max completion`` wide; legorl cuts every
row at the same place and pads only on the right. legorl also recomputes the old logprobs for its
importance weights and fidelity metrics (one extra no-grad forward) where plain TRL skips them.

tokens/s counts real (non-padding) tokens per update over wall time.

    python benchmarks/train.py [--groups 4] [--group-size 4] [--updates 3] [--threads 1] [--model DIR]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def make_data(groups: int, group_size: int, vocab: int, seed: int = 0) -> Any:
    from legorl.training.data import StepData, TrainSequence, Trial

    rng = np.random.default_rng(seed)
    data = StepData(step=0, trials=[], sequences=[])
    for g in range(groups):
        for k in range(group_size):
            prompt = int(rng.integers(48, 256))
            parts_ids, parts_mask = [rng.integers(0, vocab, prompt)], [np.zeros(prompt)]
            for _turn in range(int(rng.integers(1, 4))):
                n_sampled, n_tool = int(rng.integers(16, 128)), int(rng.integers(8, 96))
                parts_ids += [rng.integers(0, vocab, n_sampled), rng.integers(0, vocab, n_tool)]
                parts_mask += [np.ones(n_sampled), np.zeros(n_tool)]
            ids = np.concatenate(parts_ids).astype(np.int64)[:-1]
            mask = np.concatenate(parts_mask).astype(np.float32)[:-1]
            trial = Trial(f"g{g}/s{k}", f"g{g}", "bench", float(rng.integers(0, 2)), False)
            trial.sequences.append(len(data.sequences))
            data.sequences.append(TrainSequence(
                trial.trial_id, trial.group_id, "bench", 0, "main", ids, mask,
                np.where(mask > 0, -2.0, 0.0).astype(np.float32), None, trial.reward,
            ))
            data.trials.append(trial)
    return data


def run_legorl(model_dir: Path, data: Any, updates: int, out: Path) -> tuple[float, int, float]:
    from legorl.stages.train import _build_trainer, prepare
    from legorl.training.config import TrainConfig

    config = TrainConfig(learning_rate=1e-5)
    prepare(data, config)
    batch = [i for t in data.trials for i in t.sequences]
    trainer = _build_trainer(model_dir, out, data, [batch] * updates, config, None, [])
    trainer.args.save_strategy = "no"
    start = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - start
    return wall, trainer.trained_tokens, 1.0 - trainer.trained_tokens / trainer.padded_tokens


def run_plain_trl(model_dir: Path, data: Any, group_size: int, updates: int, out: Path) -> tuple[float, int, float]:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    groups: dict[str, list[Any]] = {}
    for seq in data.sequences:
        groups.setdefault(seq.group_id, []).append(seq)
    served: dict[str, int] = {}
    stats = {"real": 0, "padded": 0}

    def rollout_func(prompts: list[str], trainer: Any) -> dict[str, Any]:
        out: dict[str, list[Any]] = {"prompt_ids": [], "completion_ids": [], "logprobs": [], "env_mask": [],
                                     "stored_reward": []}
        for prompt in prompts:
            seq = groups[prompt][served.get(prompt, 0) % group_size]
            served[prompt] = served.get(prompt, 0) + 1
            cut = seq.first_sampled
            out["prompt_ids"].append(seq.token_ids[:cut].tolist())
            out["completion_ids"].append(seq.token_ids[cut:].tolist())
            out["logprobs"].append(seq.logprobs[cut:].tolist())
            out["env_mask"].append(seq.loss_mask[cut:].astype(int).tolist())
            out["stored_reward"].append(seq.reward)
        p = max(len(x) for x in out["prompt_ids"])
        c = max(len(x) for x in out["completion_ids"])
        stats["real"] += sum(len(x) + len(y) for x, y in zip(out["prompt_ids"], out["completion_ids"], strict=True))
        stats["padded"] += (p + c) * len(prompts)
        return out

    def reward(completions: Any, stored_reward: list[float | None], **kwargs: Any) -> list[float | None]:
        return stored_reward

    n = len(data.sequences)
    args = GRPOConfig(
        output_dir=str(out), per_device_train_batch_size=n, num_generations=group_size, max_steps=updates,
        learning_rate=1e-5, logging_steps=1, save_strategy="no", report_to=["none"], use_cpu=True,
        max_completion_length=max(len(s) for s in data.sequences), disable_tqdm=True, loss_type="grpo",
        log_completions=False, lr_scheduler_type="constant", shuffle_dataset=False,
    )
    prompts = Dataset.from_dict({"prompt": sorted(groups)})
    os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=prompts,
                          processing_class=AutoTokenizer.from_pretrained(model_dir), rollout_func=rollout_func)
    from transformers.trainer_callback import PrinterCallback

    trainer.remove_callback(PrinterCallback)
    start = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - start
    return wall, stats["real"], 1.0 - stats["real"] / stats["padded"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--updates", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--model", type=Path, default=None, help="model folder (default: build the tiny one)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    model_dir = args.model
    if model_dir is None:
        from legorl.models import init_model
        from legorl.paths import cache_dir

        model_dir = cache_dir() / "test-models" / "dense"
        if not (model_dir / "config.json").exists():
            init_model(model_dir, moe=False, size="tiny", seed=0)
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(model_dir).vocab_size
    data = make_data(args.groups, args.group_size, vocab)
    with tempfile.TemporaryDirectory() as tmp:
        # Warm both code paths once (allocators, kernels), then measure.
        run_plain_trl(model_dir, make_data(1, 2, vocab, seed=1), 2, 1, Path(tmp) / "warm-trl")
        run_legorl(model_dir, make_data(1, 2, vocab, seed=1), 1, Path(tmp) / "warm-legorl")
        trl_wall, trl_tokens, trl_waste = run_plain_trl(model_dir, data, args.group_size, args.updates,
                                                        Path(tmp) / "trl")
        lg_wall, lg_tokens, lg_waste = run_legorl(model_dir, data, args.updates, Path(tmp) / "legorl")
    trl_tps, lg_tps = trl_tokens / trl_wall, lg_tokens / lg_wall
    seqs = len(data.sequences)
    print(f"model {model_dir}  batch {seqs} sequences ({args.groups} groups x {args.group_size}), "
          f"{args.updates} updates, {args.threads} thread(s)")
    print(f"{'':14s}{'tokens/s':>10s}{'wall s':>9s}{'real tokens':>13s}{'padding waste':>15s}")
    print(f"{'plain TRL':14s}{trl_tps:10.0f}{trl_wall:9.2f}{trl_tokens:13d}{trl_waste:15.1%}")
    print(f"{'legorl':14s}{lg_tps:10.0f}{lg_wall:9.2f}{lg_tokens:13d}{lg_waste:15.1%}")
    print(f"ratio legorl / plain TRL: {lg_tps / trl_tps:.2f}x")


if __name__ == "__main__":
    main()
