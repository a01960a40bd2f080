"""Embedded engine throughput: one request vs N concurrent (batched), against transformers' generate().

    .venv/bin/python benchmarks/engine.py [--model DIR] [--concurrency 8] [--tokens 64] [--threads 1]

Prints decode tokens/s for: generate() one request at a time (the natural alternative), the engine
with one request at a time, and the engine with N concurrent requests (continuous batching), plus
the ratios. Builds the tiny model in a temporary directory when --model is not given.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path)
    ap.add_argument("--moe", action="store_true")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0 = torch's default)")
    args = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    from legorl.engines.base import SamplingParams
    from legorl.engines.embedded import EmbeddedEngine
    from legorl.models import init_model

    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = args.model or init_model(Path(tempfile.mkdtemp()) / "m", moe=args.moe)
    n, t_new = args.concurrency, args.tokens
    prompts = [[(17 * i + j) % 8000 for j in range(args.prompt_len)] for i in range(n)]
    # min_new == max_new: every request decodes exactly t_new tokens (no early EOS) for a fair count.
    params = [SamplingParams(max_tokens=t_new, seed=i, stop_token_ids=()) for i in range(n)]

    hf = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    t0 = time.perf_counter()
    with torch.inference_mode():
        for p in prompts:
            hf.generate(torch.tensor([p]), max_new_tokens=t_new, min_new_tokens=t_new, do_sample=True,
                        top_k=0, top_p=1.0, pad_token_id=0)
    hf_tps = n * t_new / (time.perf_counter() - t0)

    engine = EmbeddedEngine(model_dir)
    engine.eos_token_ids = ()  # count exactly t_new tokens per request

    async def one_at_a_time() -> int:
        return sum([len((await engine.generate(p, sp)).token_ids) for p, sp in zip(prompts, params, strict=True)])

    async def concurrent() -> int:
        gens = await asyncio.gather(*(engine.generate(p, sp) for p, sp in zip(prompts, params, strict=True)))
        return sum(len(g.token_ids) for g in gens)

    asyncio.run(engine.generate(prompts[0], SamplingParams(max_tokens=4)))  # warm
    t0 = time.perf_counter()
    single_tokens = asyncio.run(one_at_a_time())
    single_tps = single_tokens / (time.perf_counter() - t0)
    t0 = time.perf_counter()
    conc_tokens = asyncio.run(concurrent())
    conc_tps = conc_tokens / (time.perf_counter() - t0)
    asyncio.run(engine.close())

    print(f"model {model_dir} ({sum(p.numel() for p in hf.parameters()) / 1e6:.1f} M params), prompt {args.prompt_len}, "
          f"{t_new} new tokens x {n} requests, torch threads {torch.get_num_threads()}")
    print(f"  transformers generate(), one at a time : {hf_tps:8.1f} tok/s")
    print(f"  embedded engine, one at a time         : {single_tps:8.1f} tok/s  ({single_tps / hf_tps:.2f}x generate)")
    print(f"  embedded engine, {n} concurrent         : {conc_tps:8.1f} tok/s  ({conc_tps / single_tps:.2f}x one at a time, "
          f"{conc_tps / hf_tps:.2f}x generate; max batch {engine.stats.max_batch})")


if __name__ == "__main__":
    main()
