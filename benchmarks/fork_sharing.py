"""What prefix sharing saves when training a trial that forks at every compaction, like Claude Code's.

A Claude-Code-like trial (the shape ``tests/recorded/harness_requests/claude-code-compaction.jsonl.xz``
records, scaled down): a long system prompt and tools, a few turns, then a compaction request that
repeats the whole conversation up to its last tool output with a "summarize, no tools" instruction,
then main again on the summary, and so on for ``--cycles`` compactions; the system prompt's first
line carries a hash that changes after the first compaction (so the segments before and after share
only the header), and one sub-agent whose own prompt shares only that header line. Two such trials
(one group, rewards 0 and 1) train one update of the tiny model through legorl's trainer
(``legorl.stages.train``'s own trainer: packed, padding-free), with ``share_prefixes`` on and off.

    python benchmarks/fork_sharing.py [--prefix 400] [--cycles 2] [--turns 2] [--threads 2] [--repeat 2]

It prints each trial's fork cost (``legorl.trials.costs.fork_cost``: segment tokens per sampled token, the
share that is a prefix shared with an earlier segment), the tokens each way puts through the model,
the wall time of an update each way and their ratio.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).parent))

from train import tiny_model_dir

HEADER, HASH, TASK, SAMPLED, TOOL, INSTRUCTION, SUMMARY = 24, 3, 150, 48, 250, 300, 120


def _turns(rng: np.random.Generator, vocab: int, n: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    ids, mask = [], []
    for _ in range(n):
        ids += [rng.integers(0, vocab, SAMPLED), rng.integers(0, vocab, TOOL)]
        mask += [np.ones(SAMPLED), np.zeros(TOOL)]
    return ids, mask


def claude_code_like(vocab: int, prefix: int, cycles: int, turns: int, seed: int) -> list[tuple[str, np.ndarray, np.ndarray]]:
    """One trial's segments, (reason, token ids, loss mask) in the order the proxy would make them."""
    rng = np.random.default_rng(seed)
    header = rng.integers(0, vocab, HEADER)
    body = rng.integers(0, vocab, prefix)
    hashes = [rng.integers(0, vocab, HASH) for _ in range(2)]
    segments = []
    start = [header, hashes[0], body, rng.integers(0, vocab, TASK)]  # main's first prompt
    for cycle in range(cycles + 1):
        ids, mask = _turns(rng, vocab, turns)
        main_ids = np.concatenate([*start, *ids]).astype(np.int64)
        main_mask = np.concatenate([np.zeros(sum(len(p) for p in start)), *mask]).astype(np.float32)
        segments.append(("main" if cycle == 0 else "rewrite", main_ids, main_mask))
        if cycle == cycles:
            break
        # compaction: the conversation up to its last tool output, an instruction, a sampled summary
        keep = len(main_ids) - TOOL // 2
        compact_ids = np.concatenate([main_ids[:keep], rng.integers(0, vocab, INSTRUCTION + SUMMARY)])
        compact_mask = np.concatenate([np.zeros(keep + INSTRUCTION), np.ones(SUMMARY)])
        segments.append(("rewrite", compact_ids.astype(np.int64), compact_mask.astype(np.float32)))
        start = [header, hashes[1], body, compact_ids[-SUMMARY:]]  # main on the summary, another hash
        if cycle == 0:  # a sub-agent: its own prompt, the header line in common
            sub_prompt = [header, hashes[0], rng.integers(0, vocab, prefix // 2), rng.integers(0, vocab, TASK)]
            ids, mask = _turns(rng, vocab, turns)
            segments.append(("subagent", np.concatenate([*sub_prompt, *ids]).astype(np.int64),
                             np.concatenate([np.zeros(sum(len(p) for p in sub_prompt)), *mask]).astype(np.float32)))
    return segments


def step_data(vocab: int, prefix: int, cycles: int, turns: int) -> Any:
    from legorl.training.data import StepData, TrainSequence, Trial

    data = StepData(step=0, trials=[], sequences=[])
    for k in range(2):
        trial = Trial(f"g0/s{k}", "g0", "claude-code", float(k), False)
        for index, (reason, ids, mask) in enumerate(claude_code_like(vocab, prefix, cycles, turns, seed=k)):
            trial.sequences.append(len(data.sequences))
            data.sequences.append(TrainSequence(trial.trial_id, trial.group_id, "claude-code", index, reason, ids, mask,
                                                np.where(mask > 0, -2.0, 0.0).astype(np.float32), None, trial.reward))
        data.trials.append(trial)
    return data


def one_update(model: Path, data: Any, out: Path, share: bool) -> tuple[float, int]:
    """Wall seconds of one update through legorl's trainer, and the positions its forwards ran."""
    from legorl.stages.train import _build_trainer, prepare
    from legorl.training.config import TrainConfig

    config = TrainConfig(learning_rate=1e-5, share_prefixes=share)
    prepare(data, config)
    batch = [i for t in data.trials for i in t.sequences]
    trainer = _build_trainer(model, out, data, [batch], config, None, [])
    trainer.args.save_strategy = "no"
    start = time.perf_counter()
    trainer.train()
    return time.perf_counter() - start, trainer.forward_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefix", type=int, default=400, help="system prompt and tools, tokens")
    parser.add_argument("--cycles", type=int, default=2, help="compactions per trial")
    parser.add_argument("--turns", type=int, default=2, help="sampled turns between compactions")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=2, help="updates timed each way (the best is kept)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from legorl.training.packing import fork_clusters
    from legorl.trials.costs import fork_cost

    model = tiny_model_dir()
    vocab = 8192
    data = step_data(vocab, args.prefix, args.cycles, args.turns)
    for trial in data.trials:
        seqs = [data.sequences[i] for i in trial.sequences]
        cost = fork_cost([s.token_ids for s in seqs], int(sum(s.loss_mask.sum() for s in seqs)))
        rows = [torch.as_tensor(s.token_ids) for s in seqs]
        clusters = fork_clusters(rows, [0] * len(rows), [None] * len(rows))
        packed = sum(shared + sum(len(rows[m]) - shared for m in members) for shared, members in clusters)
        print(f"trial {trial.trial_id}: {cost.segments} segments, {cost.segment_tokens} segment tokens for "
              f"{cost.sampled_tokens} sampled ({cost.tokens_per_sampled}x), {100 * (cost.shared_share or 0):.1f} % a "
              f"prefix shared with an earlier segment; packed with sharing: {packed} tokens "
              f"({packed / cost.segment_tokens:.2f} of them; a prefix tree would need "
              f"{cost.segment_tokens - cost.shared_tokens})", flush=True)
    walls: dict[bool, list[float]] = {False: [], True: []}
    forward: dict[bool, int] = {}
    with tempfile.TemporaryDirectory(prefix="legorl-fork-bench-") as tmp:
        for r in range(args.repeat):  # interleaved, so a busy machine slows both alike
            for share in (False, True):
                wall, forward[share] = one_update(model, data, Path(tmp) / f"{share}-{r}", share)
                walls[share].append(wall)
    for share, label in ((False, "without sharing"), (True, "with sharing")):
        print(f"{label}: {forward[share]} positions through the model, one update {min(walls[share]):.2f} s "
              f"(best of {args.repeat}: {', '.join(f'{w:.2f}' for w in walls[share])})")
    print(f"without / with sharing: {forward[False] / forward[True]:.2f}x the positions, "
          f"{min(walls[False]) / min(walls[True]):.2f}x the update time (tiny model, {args.threads} threads)")


if __name__ == "__main__":
    main()
