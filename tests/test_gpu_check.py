"""`make gpu-check` on CPU (benchmarks/gpu_check.py, docs/gpu-check.md): the script that runs when a GPU is
lent must not rot between loans. Its CPU mode runs end to end here with a small budget: every CPU row
is filled with sane figures, every CUDA row says it was skipped, and nothing fails."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parent.parent


def test_cpu_mode_fills_every_cpu_row_and_skips_every_cuda_row(tmp_path: Path) -> None:
    out = tmp_path / "gpu-check.json"
    # 300 s leaves the vllm-cpu rows (est. 240 s, run last on CPU) out unless the rest took under a minute;
    # --lengths 512 keeps plain TRL short.
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "gpu_check.py"), "--mode", "cpu", "--budget", "300",
         "--lengths", "512", "--out", str(out)],
        capture_output=True, text=True, timeout=900, cwd=REPO,
        env={**os.environ, "GPU_CHECK_WORK": str(tmp_path / "work"), "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    table = json.loads(out.read_text())
    rows = {r["name"]: r for r in table["rows"]}
    print("\n" + done.stdout)
    assert table["header"]["device"].startswith("cpu") and table["header"]["mode"] == "cpu"
    assert "| embedded engine float32 dense vs trainer recompute | ok |" in done.stdout  # printed as it goes

    assert not [r for r in rows.values() if r["status"].startswith("failed")], done.stdout
    cuda_rows = [r for r in rows.values() if r["cuda"]]
    assert len(cuda_rows) >= 8 and all(r["status"].startswith("skipped") for r in cuda_rows), cuda_rows
    for name in ("embedded engine bfloat16 dense vs trainer recompute", "train step 2 x 64k tokens: legorl vs plain TRL",
                 "vllm serve MoE behind serve-proxy: routed experts returned + replayed"):
        assert rows[name]["cuda"], name

    for name in ("dense", "MoE"):  # fp32 engine vs the trainer's own recompute: the same numbers
        figures = rows[f"embedded engine float32 {name} vs trainer recompute"]["figures"]
        assert figures["tokens"] >= 40 and figures["pearson"] > 0.9999, figures
        assert figures["max_abs_diff"] < 1e-4 and figures["mismatch_kl"] < 1e-8, figures
    moe = rows["embedded engine float32 MoE vs trainer recompute"]["figures"]
    assert moe["replay"] == 1.0 and moe["flips_after_replay"] == 0.0 and moe["routed_segments"] == "4/4"

    train = rows["train step 2 x 0.5k tokens: legorl vs plain TRL"]
    assert train["status"] == "ok", train
    figures = train["figures"]
    assert figures["legorl_tok_s"] > 0 and figures["trl_tok_s"] > 0, figures
    assert 0.1 < figures["legorl_peak_gb"] < 8 and 0.1 < figures["trl_peak_gb"] < 8, figures

    ddp = rows["two processes (accelerate launch, DDP) = one process"]
    assert ddp["status"] == "ok" or ddp["status"].startswith("skipped: time budget"), ddp  # last CPU row: load
    if ddp["status"] == "ok":
        assert ddp["figures"]["max_weight_diff_vs_one_process"] < 1e-4
    vllm = rows["vllm serve dense behind serve-proxy: capture fidelity"]  # vllm-cpu, last: over budget unless quick
    assert vllm["status"] == "ok" or vllm["status"].startswith("skipped"), vllm
    if vllm["status"] == "ok":
        assert vllm["figures"]["pearson"] > 0.9999 and vllm["figures"]["max_abs_diff"] < 1e-4, vllm
