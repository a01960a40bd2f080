"""Shard I/O vs JSON Lines: write and read N trial rows with realistic token segments.

Each trial carries ~32k tokens split over a few segments (token ids, loss mask, logprobs), plus
calls and a conversation — what a long agentic trajectory looks like. "Read" means getting every
segment's token ids, mask and logprobs back as arrays, which is what the trainer does.

    python benchmarks/shards.py [--trials 64] [--tokens 32768] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow.compute as pc

from legorl.core import shards
from legorl.core.schemas import Call, Kind, Segment, TrialRow


def make_trials(n: int, tokens: int, seed: int = 0, as_lists: bool = False) -> list[TrialRow]:
    """Trials whose segments hold numpy arrays (as engines and the proxy produce them), or Python
    lists with ``as_lists``."""
    rng = np.random.default_rng(seed)
    trials = []
    for i in range(n):
        parts = 4
        segments = []
        for s in range(parts):
            length = tokens // parts
            ids = rng.integers(0, 150_000, length).astype(np.int32)
            mask = (rng.random(length) < 0.3).astype(np.int8)
            logprobs = np.where(mask == 1, -rng.exponential(0.7, length), 0.0).astype(np.float32)
            if as_lists:
                ids, mask, logprobs = ids.tolist(), mask.tolist(), logprobs.tolist()
            segments.append(Segment(ids, mask, logprobs, reason="main" if s == 0 else "rewrite", parent=None if s == 0 else 0))
        calls = [Call(index=c, api="openai", stream=False, segment=0, latency_s=0.5, prompt_tokens=1000,
                      completion_tokens=200, finish_reason="tool_calls") for c in range(40)]
        messages = json.dumps([{"role": "user", "content": "x" * 2000}] * 40)
        trials.append(TrialRow.new(f"task{i}", "mini-swe-agent", 0, 0, outcome="submitted", segments=segments,
                                   calls=calls, messages=messages, patch="diff\n" * 50))
    return trials


def write_shards(trials: list[TrialRow], out: Path) -> None:
    # A stage commits one part file per batch of finished trials.
    for start in range(0, len(trials), 16):
        shards.write(out, Kind.ROLLOUTS, trials[start : start + 16])


def read_shards(out: Path) -> int:
    table = shards.read(out, Kind.ROLLOUTS).table
    flat = pc.list_flatten(table.column("segments")).combine_chunks()
    ids = pc.list_flatten(flat.field("token_ids")).to_numpy()
    mask = pc.list_flatten(flat.field("loss_mask")).to_numpy()
    logprobs = pc.list_flatten(flat.field("logprobs")).to_numpy()
    return int(ids.size + mask.size + logprobs.size)


def write_jsonl(trials: list[TrialRow], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "rollouts.jsonl", "w") as handle:
        for trial in trials:
            handle.write(json.dumps(trial.to_dict(), default=_jsonable) + "\n")


def _jsonable(value: object) -> object:
    if isinstance(value, np.ndarray):
        return value.tolist()
    raise TypeError(type(value))


def read_jsonl(out: Path) -> int:
    total = 0
    with open(out / "rollouts.jsonl") as handle:
        for line in handle:
            row = json.loads(line)
            for seg in row["segments"]:
                total += np.asarray(seg["token_ids"], np.int32).size
                total += np.asarray(seg["loss_mask"], np.int8).size
                total += np.asarray(seg["logprobs"], np.float32).size
    return total


def timed(fn: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def size_of(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    print(f"shards benchmark: {args.trials} trials x {args.tokens} tokens, median of {args.repeat}")
    for as_lists in (False, True):
        bench(make_trials(args.trials, args.tokens, as_lists=as_lists), args.repeat,
              "segments as Python lists" if as_lists else "segments as numpy arrays (as captured)")


def bench(trials: list[TrialRow], repeat: int, label: str) -> None:
    root = Path(tempfile.mkdtemp(prefix="legorl-bench-"))
    try:
        def fresh(name: str) -> Path:
            path = root / name
            shutil.rmtree(path, ignore_errors=True)
            return path

        w_shard = timed(lambda: write_shards(trials, fresh("shards")), repeat)
        w_json = timed(lambda: write_jsonl(trials, fresh("jsonl")), repeat)
        assert read_shards(root / "shards") == read_jsonl(root / "jsonl")
        r_shard = timed(lambda: read_shards(root / "shards"), repeat)
        r_json = timed(lambda: read_jsonl(root / "jsonl"), repeat)
        s_shard, s_json = size_of(root / "shards"), size_of(root / "jsonl")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f" {label}:")
    print(f"  write  shards {w_shard:7.3f} s   jsonl {w_json:7.3f} s   ratio {w_json / w_shard:5.1f}x faster")
    print(f"  read   shards {r_shard:7.3f} s   jsonl {r_json:7.3f} s   ratio {r_json / r_shard:5.1f}x faster")
    print(f"  size   shards {s_shard / 1e6:7.1f} MB  jsonl {s_json / 1e6:7.1f} MB  ratio {s_json / s_shard:5.1f}x smaller")


if __name__ == "__main__":
    main()
