"""Activation memory per packed token: the backbone's forward and backward over a long row, by path.

One forward and backward of the tiny model's backbone (gradient checkpointing on, one thread) over
two documents of T tokens, in a fresh process per point; the figure is the RSS high-water mark of
the backward over the RSS before the forward (weights and the rest of the process excluded), and its
slope between two lengths, KB per token. Paths:

- ``tiled``: legorl's packed row (``legorl_packed`` attention) with its decoder layers in token
  tiles (``training/tiling.py``) and freed blocks unmapped (``training/memory.py``): what
  ``legorl train --gradient-checkpointing`` runs;
- ``untiled``: the same packed row, layers whole (the path before the tiles);
- ``padded``: a ``[2, T]`` batch through transformers' SDPA attention with glibc's default
  allocator: the backbone as plain TRL runs it.

The slope is what a longer trajectory costs; the whole-trainer figures (LM head, optimizer, phases)
are ``benchmarks/train.py --sweep``'s.

    python benchmarks/activations.py [--lengths 4096,16384] [--paths tiled,untiled,padded]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
from pathlib import Path

import torch

PATHS = ("tiled", "untiled", "padded")


def _kb(key: str) -> int:
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(key + ":"))
    return int(line.split()[1])


def child(path: str, length: int, model_dir: str) -> None:
    from transformers import AutoModelForCausalLM

    from legorl.training.attention import packed_attention
    from legorl.training.memory import map_large_blocks
    from legorl.training.packing import Document
    from legorl.training.tiling import token_tiles

    torch.set_num_threads(1)
    torch.manual_seed(0)
    if path != "padded":
        map_large_blocks()
    model = AutoModelForCausalLM.from_pretrained(model_dir).train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids = torch.randint(0, model.config.vocab_size, (2, length))
    with contextlib.ExitStack() as held:
        if path == "padded":
            model.config._attn_implementation = "sdpa"
            inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        else:
            held.enter_context(packed_attention(model))
            if path == "tiled":
                held.enter_context(token_tiles(model))
            inputs = {"input_ids": ids.view(1, -1), "position_ids": torch.arange(length).repeat(1, 2),
                      "legorl_documents": (Document(0, length), Document(length, length))}
        before = _kb("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM back to the current RSS
        hidden = model.model(**inputs, use_cache=False).last_hidden_state
        hidden[..., ::20, :].square().sum().backward()  # a loss on 5% of the positions, as sampled tokens are
        print(json.dumps({"path": path, "length": length, "backward_gb": (_kb("VmHWM") - before) / 2**20}))


def main() -> None:
    if len(sys.argv) == 5 and sys.argv[1] == "--child":
        child(sys.argv[2], int(sys.argv[3]), sys.argv[4])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="4096,16384", help="two or more document lengths (tokens)")
    parser.add_argument("--paths", default=",".join(PATHS), help=f"comma-separated, of {', '.join(PATHS)}")
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).parent))
    from train import tiny_model_dir

    model_dir = str(tiny_model_dir())
    lengths = sorted(int(x) for x in args.lengths.split(","))
    print("| path | " + " | ".join(f"backward GB at 2 x {n // 1024}k" for n in lengths) + " | KB per packed token |")
    print("|---|" + "---|" * (len(lengths) + 1))
    slopes = {}
    for path in args.paths.split(","):
        gb = []
        for n in lengths:
            done = subprocess.run([sys.executable, __file__, "--child", path, str(n), model_dir],
                                  capture_output=True, text=True, check=True)
            gb.append(json.loads(done.stdout.splitlines()[-1])["backward_gb"])
        slopes[path] = (gb[-1] - gb[0]) * 2**20 / (2 * (lengths[-1] - lengths[0]))
        print(f"| {path} | " + " | ".join(f"{g:.3f}" for g in gb) + f" | {slopes[path]:.1f} |")
    for other in ("untiled", "padded"):
        if "tiled" in slopes and other in slopes:
            print(f"{other} / tiled, KB per packed token: {slopes[other] / slopes['tiled']:.2f}x")


if __name__ == "__main__":
    main()
