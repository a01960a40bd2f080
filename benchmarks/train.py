"""Training throughput: legorl's SegmentGRPOTrainer vs a plain TRL GRPOTrainer fed the same sequences.

Both train the same model on the same multi-turn sequences (prompt, then sampled turns
interleaved with tool output; the loss mask covers the sampled tokens), one batch of whole groups
per update, ``num_iterations=1``. The plain trainer gets the sequences through TRL's own
``rollout_func`` (prompt = tokens before the first sampled one, completion = the rest, with
``env_mask`` = the loss mask) and its rewards through a reward function. TRL pads prompts on the left
and completions on the right, so its batch is ``max prompt + max completion`` wide; legorl cuts every
row at the same place and pads only on the right. legorl also needs the old logprobs for its
importance weights and fidelity metrics: with ``num_iterations=1`` it takes them from the training
forward itself, as plain TRL does (``legorl 2-pass``: with the separate no-grad pass this replaced).

tokens/s counts real (non-padding) tokens per update over wall time.

``--sweep`` measures cost against work on coding-agent-shaped segments (10% prompt, then sampled
turns of 48 tokens between ~900-token tool outputs: ~5% of the tokens sampled): one group of two
segments, one update, for each segment length and vocabulary (the tiny model's 8,192 and a tiny
Qwen3 with Qwen3's 151,936-token embedding), legorl and plain TRL each in a fresh subprocess
(fixed seeds) so that each peak is its own: peak memory is the subprocess's RSS high-water mark
(everything the process touched, weights and optimizer included), and the peak of each phase of the
update (:class:`PhasePeaks`); ``+step`` is the update's own rise: activations, LM-head tiles and
temporaries, over the model and its gradients. Both run with gradient checkpointing, plain TRL's default. A run that exceeds ``--mem-cap-gb`` of address space
(RLIMIT_AS) or is killed is reported as OOM. A fork-heavy trial (three rewrite segments of one
prompt, two trials) is timed with legorl's padded path (``padding_free=False``: the path before
packing) and the packed one.

    python benchmarks/train.py [--groups 4] [--group-size 4] [--updates 3] [--threads 1] [--model DIR]
    python benchmarks/train.py --sweep [--quick] [--lengths 1024,4096,16384,32768,65536] [--vocabs 8192,151936]
        [--trainers legorl,trl] [--repeat 2] [--no-forks] [--timeout S] [--results FILE.jsonl]
    python benchmarks/train.py --table FILE.jsonl [FILE.jsonl ...]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import threading
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


def agent_data(length: int, vocab: int, trials: int = 2, forks: int = 1, seed: int = 0) -> Any:
    """One group of ``trials`` trials; each is ``forks`` segments of ``length`` tokens. A segment is a
    10% prompt, then 48 sampled tokens per ~950 (the rest tool output); forks share all but their
    last turn (a rewritten history: same prefix, own final sampled turn)."""
    from legorl.training.data import StepData, TrainSequence, Trial

    rng = np.random.default_rng(seed)
    data = StepData(step=0, trials=[], sequences=[])
    for k in range(trials):
        ids = rng.integers(0, vocab, length).astype(np.int64)
        mask = np.zeros(length, dtype=np.float32)
        prompt = max(length // 10, 16)
        for start in range(prompt, length, 950):
            mask[start : start + 48] = 1
        tail = length - 96 if forks > 1 else length  # each fork's own last turn: 96 sampled tokens
        trial = Trial(f"g0/s{k}", "g0", "bench", float(k % 2), False)
        for f in range(forks):
            seg_ids, seg_mask = ids.copy(), mask.copy()
            if forks > 1:
                seg_ids[tail:] = rng.integers(0, vocab, length - tail)
                seg_mask[:tail] = 0
                seg_mask[tail:] = 1
            trial.sequences.append(len(data.sequences))
            data.sequences.append(TrainSequence(
                trial.trial_id, trial.group_id, "bench", f, "main" if f == 0 else "rewrite", seg_ids, seg_mask,
                np.where(seg_mask > 0, -2.0, 0.0).astype(np.float32), None, trial.reward,
            ))
        data.trials.append(trial)
    return data


def run_legorl(
    model_dir: Path, data: Any, updates: int, out: Path, probe: PhasePeaks | None = None, **options: Any,
) -> tuple[float, int, float]:
    from legorl.stages.train import _build_trainer, prepare
    from legorl.training.config import TrainConfig

    # The same work as plain TRL, which trains zero-advantage rows too.
    config = TrainConfig(learning_rate=1e-5, **{"skip_zero_advantage": False, **options})
    prepare(data, config)
    batch = [i for t in data.trials for i in t.sequences]
    trainer = _build_trainer(model_dir, out, data, [batch] * updates, config, None, [])
    trainer.args.save_strategy = "no"
    if probe is not None:
        probe.attach(trainer)
    start = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - start
    return wall, trainer.trained_tokens, trainer.padding_tokens / max(trainer.forward_tokens, 1)


def run_plain_trl(
    model_dir: Path, data: Any, group_size: int, updates: int, out: Path, probe: PhasePeaks | None = None,
) -> tuple[float, int, float]:
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
    if probe is not None:
        probe.attach(trainer)
    start = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - start
    return wall, stats["real"], 1.0 - stats["real"] / stats["padded"]


def tiny_model_dir() -> Path:
    from legorl.core.paths import cache_dir
    from legorl.models import MODEL_RECIPE_VERSION, init_model

    model_dir = cache_dir() / "test-models" / f"dense-v{MODEL_RECIPE_VERSION}"
    if not (model_dir / "config.json").exists():
        init_model(model_dir, moe=False, size="tiny", seed=0)
    return model_dir


def wide_model_dir(vocab: int) -> Path:
    """The tiny model's architecture with a ``vocab``-token embedding (tied head), random weights."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from legorl.core.paths import cache_dir

    tiny = tiny_model_dir()
    if vocab == AutoConfig.from_pretrained(tiny).vocab_size:
        return tiny
    out = cache_dir() / "bench-models" / f"dense-vocab{vocab}"
    if not (out / "config.json").exists():
        config = AutoConfig.from_pretrained(tiny)
        config.vocab_size = vocab
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(out)
        AutoTokenizer.from_pretrained(tiny).save_pretrained(out)
    return out


def _status() -> dict[str, float]:
    """VmRSS and VmHWM (the RSS high-water mark) of this process, GB."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0]) / 1e6
    return out


class PhasePeaks:
    """The peak RSS of each phase of one update. At each phase boundary VmHWM is read, then reset to
    the current RSS (``/proc/self/clear_refs`` ``5``), so each phase's peak is its own: ``import``
    (interpreter, torch/transformers/TRL, data), ``setup`` (model load, trainer construction),
    ``forward`` (to the loss), ``backward`` (to the optimizer step; gradients allocated here),
    ``optimizer`` (Adam's step; its state allocated here)."""

    def __init__(self) -> None:
        self.peak: dict[str, float] = {}
        self.rss: dict[str, float] = {}
        self.param_bytes = 0
        self.mark("import")

    def mark(self, phase: str) -> None:
        status = _status()
        self.peak[phase] = max(self.peak.get(phase, 0.0), status["VmHWM"])
        self.rss[phase] = status["VmRSS"]
        Path("/proc/self/clear_refs").write_text("5")

    def attach(self, trainer: Any) -> None:
        from transformers import TrainerCallback

        self.mark("setup")
        self.param_bytes = sum(p.numel() * p.element_size() for p in trainer.model.parameters() if p.requires_grad)
        inner = trainer.compute_loss
        probe = self

        def compute_loss(*args: Any, **kwargs: Any) -> Any:
            loss = inner(*args, **kwargs)
            probe.mark("forward")
            return loss

        class Marks(TrainerCallback):
            def on_pre_optimizer_step(self, *args: Any, **kwargs: Any) -> None:
                probe.mark("backward")

            def on_optimizer_step(self, *args: Any, **kwargs: Any) -> None:
                probe.mark("optimizer")

        trainer.compute_loss = compute_loss
        trainer.add_callback(Marks())

    def figures(self) -> dict[str, Any]:
        """``step_gb``: the update's own rise -- the forward/backward peak over the RSS with the model
        loaded, less the gradients (one float per parameter, resident at that peak): activations,
        LM-head tiles and temporaries."""
        grads = self.param_bytes / 1e9
        fwd_bwd = max(self.peak.get("forward", 0.0), self.peak.get("backward", 0.0))
        return {"phases": self.peak, "rss": self.rss, "param_gb": grads,
                "step_gb": fwd_bwd - self.rss["setup"] - grads}


def _deadline(probe: PhasePeaks, seconds: float) -> None:
    """Past ``seconds``, report the peaks so far (a lower bound on the run's) and end the process."""
    time.sleep(seconds)
    probe.mark("timeout")
    print(json.dumps({"timeout": True, "peak_gb": max(probe.peak.values()), "phases": probe.peak}), flush=True)
    os._exit(0)


def _out_of_memory(probe: PhasePeaks, error: str) -> dict[str, Any]:
    """A run that hit the address-space cap: its peak so far, the RSS when the allocation failed and
    the allocation's size (torch names it), so ``needs_gb`` (RSS + request) bounds its peak from below."""
    probe.mark("oom")
    rss = probe.rss["oom"]
    found = re.search(r"allocate (\d+) bytes", error)
    requested = int(found.group(1)) / 1e9 if found else 0.0
    return {"oom": True, "error": error[:300], "peak_gb": max(probe.peak.values()), "phases": probe.peak,
            "rss_gb": rss, "requested_gb": requested, "needs_gb": rss + requested}


def child(spec: dict[str, Any]) -> None:
    """One measured run (its own process, so its peak is its own); prints one JSON line."""
    cap = int(spec["mem_cap_gb"] * 1e9)
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    torch.set_num_threads(spec["threads"])
    torch.manual_seed(0)
    model_dir = Path(spec["model"])
    data = agent_data(spec["length"], spec["vocab"], trials=spec["trials"], forks=spec["forks"])
    probe = PhasePeaks()
    threading.Thread(target=_deadline, args=(probe, spec["timeout"]), daemon=True).start()
    with tempfile.TemporaryDirectory() as tmp:
        try:
            if spec["trainer"] == "trl":
                wall, tokens, waste = run_plain_trl(model_dir, data, spec["trials"], 1, Path(tmp), probe)
            else:
                wall, tokens, waste = run_legorl(model_dir, data, 1, Path(tmp), probe, **spec["options"])
        except (MemoryError, RuntimeError) as e:
            if "alloc" not in str(e).lower() and not isinstance(e, MemoryError):
                raise
            print(json.dumps(_out_of_memory(probe, str(e))))
            return
    probe.mark("end")
    # Not ru_maxrss: resetting VmHWM resets it too; the whole-process peak is the highest phase's.
    peak = max(probe.peak.values())
    print(json.dumps({"wall": wall, "tokens": tokens, "waste": waste, "peak_gb": peak, **probe.figures()}))


def measure(spec: dict[str, Any], timeout: float) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", json.dumps({**spec, "timeout": timeout})]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout + 120)
    except subprocess.TimeoutExpired:
        return {"timeout": True}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        oom = done.returncode in (-9, 137) or "alloc" in done.stderr.lower() or "MemoryError" in done.stderr
        return {"oom": True} if oom else {"error": done.stderr.strip().splitlines()[-1:] or [str(done.returncode)]}
    result: dict[str, Any] = json.loads(lines[-1])
    return result


def measure_point(spec: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """``--repeat`` runs of one point: memory from the first (it does not depend on load), the median
    wall time, every wall time kept; appended to ``--results``."""
    runs = []
    for _ in range(args.repeat):
        runs.append(measure(spec, args.timeout))
        if "wall" not in runs[-1]:
            break
    result = dict(runs[0])
    if all("wall" in r for r in runs):
        result["walls"] = [r["wall"] for r in runs]
        result["wall"] = float(np.median(result["walls"]))
    result["spec"] = {**spec, "timeout_s": args.timeout}
    if args.results:
        with open(args.results, "a") as f:
            f.write(json.dumps(result) + "\n")
    return result


HEADER = ("| point | trainer | peak GB | import | model loaded | fwd peak | bwd peak | opt peak | +step GB "
          "| tok/s | wall s (runs) |")


def _row(r: dict[str, Any]) -> str:
    spec = r["spec"]
    point = f"V={spec['vocab'] // 1000}k T={spec['length'] // 1024}k" + (f" x{spec['forks']} forks"
                                                                          if spec["forks"] > 1 else "")
    name = spec.get("label") or spec["trainer"]
    if "wall" not in r:
        what = "OOM" if r.get("oom") else f"error {r.get('error')}"
        if r.get("needs_gb"):
            what = (f"out of memory under the {spec['mem_cap_gb']:g} GB cap: {r['rss_gb']:.2f} GB resident, "
                    f"asked for {r['requested_gb']:.2f} GB more (needs >= {r['needs_gb']:.2f})")
        if r.get("timeout"):
            what = "timeout" + (f", peak so far {r['peak_gb']:.2f}" if "peak_gb" in r else "")
        return f"| {point} | {name} | {what} |" + " |" * 8
    ph = r["phases"]
    walls = ", ".join(f"{w:.0f}" for w in r.get("walls", [r["wall"]]))
    return (f"| {point} | {name} | {r['peak_gb']:.2f} | {ph['import']:.2f} | {r['rss']['setup']:.2f} "
            f"| {ph.get('forward', 0):.2f} | {ph.get('backward', 0):.2f} | {ph.get('optimizer', 0):.2f} "
            f"| {r['step_gb']:.2f} | {r['tokens'] / r['wall']:.0f} | {walls} |")


def _ratio(ours: dict[str, Any], theirs: dict[str, Any]) -> str:
    if "wall" in ours and theirs.get("needs_gb"):
        return (f"peak >= {theirs['needs_gb'] / ours['peak_gb']:.1f}x less (the other ran out of memory; "
                "its update did not complete)")
    if not all("wall" in r for r in (ours, theirs)):
        return "-"
    speed = (ours["tokens"] / ours["wall"]) / (theirs["tokens"] / theirs["wall"])
    return (f"peak {theirs['peak_gb'] / ours['peak_gb']:.1f}x less, +step {theirs['step_gb'] / ours['step_gb']:.1f}x "
            f"less, {speed:.2f}x tokens/s")


def table(results: list[dict[str, Any]]) -> str:
    """Markdown: one row per measured point, then legorl against plain TRL per point."""
    lines = [HEADER, "|" + "---|" * 11]
    lines += [_row(r) for r in results]
    by_point: dict[tuple[Any, ...], dict[str, dict[str, Any]]] = {}
    for r in results:
        spec = r["spec"]
        key = (spec["vocab"], spec["length"], spec["forks"])
        by_point.setdefault(key, {})[spec.get("label") or spec["trainer"]] = r
    lines.append("")
    for (vocab, length, forks), named in by_point.items():
        names = list(named)
        if len(names) == 2:
            point = f"V={vocab // 1000}k T={length // 1024}k" + (f" x{forks} forks" if forks > 1 else "")
            lines.append(f"- {point}, {names[0]} vs {names[1]}: {_ratio(named[names[0]], named[names[1]])}")
    return "\n".join(lines)


def sweep(args: argparse.Namespace) -> None:
    lengths = [int(x) for x in args.lengths.split(",")] if args.lengths else (
        [1024, 4096] if args.quick else [1024, 4096, 16384, 32768, 65536])
    vocabs = [int(x) for x in args.vocabs.split(",")]
    trainers = args.trainers.split(",")
    base = {"threads": args.threads, "mem_cap_gb": args.mem_cap_gb, "trials": 2, "forks": 1}
    print(f"sweep: one group of 2 segments, 1 update, {args.threads} thread(s), address-space cap "
          f"{args.mem_cap_gb:g} GB, {args.repeat} run(s) per point (median wall); GB columns: RSS",
          flush=True)
    results = []
    for vocab in vocabs:
        model = str(wide_model_dir(vocab))
        for length in lengths:
            spec = {**base, "model": model, "vocab": vocab, "length": length}
            # Gradient checkpointing on, as in plain TRL's defaults (legorl's default is off).
            if "legorl" in trainers:
                results.append(measure_point(
                    {**spec, "trainer": "legorl", "options": {"gradient_checkpointing": True}}, args))
                print(_row(results[-1]), flush=True)
            if "trl" in trainers:
                results.append(measure_point({**spec, "trainer": "trl", "options": {}}, args))
                print(_row(results[-1]), flush=True)
    if args.forks:
        length = 1920
        spec = {**base, "model": str(wide_model_dir(vocabs[0])), "vocab": vocabs[0], "length": length, "forks": 3,
                "trainer": "legorl"}
        results.append(measure_point({**spec, "label": "legorl packed+shared", "options": {}}, args))
        results.append(measure_point({**spec, "label": "legorl padded", "options": {"padding_free": False}}, args))
    print(table(results))


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        child(json.loads(sys.argv[2]))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--updates", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--model", type=Path, default=None, help="model folder (default: build the tiny one)")
    parser.add_argument("--sweep", action="store_true", help="cost against work over segment length and vocabulary")
    parser.add_argument("--quick", action="store_true", help="with --sweep: lengths 1k and 4k only")
    parser.add_argument("--lengths", default="", help="with --sweep: comma-separated segment lengths")
    parser.add_argument("--vocabs", default="8192,151936", help="with --sweep: comma-separated vocabulary sizes")
    parser.add_argument("--mem-cap-gb", type=float, default=16.0, help="with --sweep: address-space cap per run")
    parser.add_argument("--timeout", type=float, default=1800.0, help="with --sweep: seconds per run")
    parser.add_argument("--trainers", default="legorl,trl", help="with --sweep: legorl, trl or both")
    parser.add_argument("--repeat", type=int, default=2, help="with --sweep: runs per point (median wall time)")
    parser.add_argument("--no-forks", dest="forks", action="store_false", help="with --sweep: skip the fork point")
    parser.add_argument("--results", default="", help="with --sweep: append every measured point here (JSON lines)")
    parser.add_argument("--table", nargs="+", type=Path, default=None,
                        help="print the table of --results files (several runs combined) and exit")
    args = parser.parse_args()
    if args.table:
        print(table([json.loads(line) for path in args.table for line in path.read_text().splitlines() if line]))
        return
    torch.set_num_threads(args.threads)
    if args.sweep:
        sweep(args)
        return

    model_dir = args.model or tiny_model_dir()
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
        # The path before the old logprobs came from the training forward: a separate no-grad pass.
        two_wall, two_tokens, two_waste = run_legorl(model_dir, data, args.updates, Path(tmp) / "legorl-2",
                                                     score_in_training_forward=False)
    trl_tps, lg_tps, two_tps = trl_tokens / trl_wall, lg_tokens / lg_wall, two_tokens / two_wall
    seqs = len(data.sequences)
    print(f"model {model_dir}  batch {seqs} sequences ({args.groups} groups x {args.group_size}), "
          f"{args.updates} updates, {args.threads} thread(s)")
    print(f"{'':14s}{'tokens/s':>10s}{'wall s':>9s}{'real tokens':>13s}{'padding waste':>15s}")
    print(f"{'plain TRL':14s}{trl_tps:10.0f}{trl_wall:9.2f}{trl_tokens:13d}{trl_waste:15.1%}")
    print(f"{'legorl':14s}{lg_tps:10.0f}{lg_wall:9.2f}{lg_tokens:13d}{lg_waste:15.1%}")
    print(f"{'legorl 2-pass':14s}{two_tps:10.0f}{two_wall:9.2f}{two_tokens:13d}{two_waste:15.1%}")
    print(f"ratio legorl / plain TRL: {lg_tps / trl_tps:.2f}x")
    print(f"ratio legorl / legorl with a separate scoring pass: {lg_tps / two_tps:.2f}x")


if __name__ == "__main__":
    main()
