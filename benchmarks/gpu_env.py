"""The GPU check's environment (benchmarks/gpu_check.py): where it works, how it runs a command and
records a row, what it installs on a bare GPU machine, and the models it builds.

GPU mode installs, from the package registries only: uv, a venv with PyPI's torch (a CUDA build on
Linux x86_64) and legorl, vLLM in a venv of its own (it pins its own torch and transformers) and
flash-attn only if PyPI has a wheel, all under ``.cache/gpu-check/`` (a rerun reuses them). Each row
is ``ok``, ``skipped: why`` or ``failed: why``; one row's failure never loses the others.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
WORK = Path(os.environ.get("GPU_CHECK_WORK") or REPO / ".cache" / "gpu-check")  # venvs, models, runs (git-ignored)
GPU_VENV = WORK / "venv"
GPU_CACHE = WORK / "legorl-cache"  # $LEGORL_CACHE of the GPU checks: its vllm-venv is the CUDA vLLM
# A Qwen3-0.6B-shaped model (random weights) for the train rows on a GPU.
HALF_B = {"hidden_size": 1024, "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
          "head_dim": 128, "intermediate_size": 3072, "vocab_size": 151936, "max_position_embeddings": 131072}


class Skip(Exception):
    """A row that cannot run here: ``skipped: <message>``."""


class Table:
    """The rows so far: each printed as it finishes, and the whole table rewritten to ``out`` as JSON."""

    def __init__(self, out: Path, deadline: float, cuda: bool, header: dict[str, Any], append: bool = False):
        self.out, self.deadline, self.cuda, self.header = out, deadline, cuda, header
        old = json.loads(out.read_text()) if append and out.exists() else {}
        self.rows: list[dict[str, Any]] = old.get("rows", [])
        self.header = {**old.get("header", {}), **header}
        print(f"# gpu-check: {' | '.join(f'{k} {v}' for k, v in self.header.items())}", flush=True)

    def left(self) -> float:
        return self.deadline - time.time()

    def add(self, name: str, status: str, figures: dict[str, Any] | None = None, seconds: float = 0.0,
            cuda: bool = False) -> None:
        row = {"name": name, "status": status, "figures": figures or {}, "seconds": round(seconds, 1), "cuda": cuda}
        self.rows.append(row)
        print(_line(row), flush=True)
        self.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.out.with_suffix(".tmp")
        tmp.write_text(json.dumps({"header": self.header, "rows": self.rows}, indent=1, default=str))
        tmp.replace(self.out)

    def run(self, name: str, fn: Callable[[], dict[str, Any]], *, cuda: bool = False, est: float = 0.0,
            skip: str | None = None) -> dict[str, Any] | None:
        """Run one row: ``fn`` returns its figures (or raises :class:`Skip`); any other error fails it alone."""
        if skip is None and cuda and not self.cuda:
            skip = "needs CUDA (CPU mode)"
        if skip is None and self.left() < est:
            skip = f"time budget ({self.left():.0f} s left, needs ~{est:.0f})"
        if skip is not None:
            self.add(name, f"skipped: {skip}", cuda=cuda)
            return None
        start = time.time()
        try:
            figures = fn()
        except Skip as exc:
            self.add(name, f"skipped: {exc}", seconds=time.time() - start, cuda=cuda)
            return None
        except Exception as exc:  # one row's failure is reported, the others still run
            lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()] or [""]
            reason = lines[0][:300] + (f" ... {lines[-1][:300]}" if len(lines) > 1 else "")  # a log's tail: its end
            self.add(name, f"failed: {type(exc).__name__}: {reason}", seconds=time.time() - start, cuda=cuda)
            return None
        seconds = figures.pop("seconds", time.time() - start)
        self.add(name, str(figures.pop("status", "ok")), figures, seconds, cuda)
        return figures


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"
    return str(value)


def _line(row: dict[str, Any]) -> str:
    figures = ", ".join(f"{k} {_fmt(v)}" for k, v in row["figures"].items())
    return f"| {row['name']} | {row['status']} | {figures} | {row['seconds']:.0f} |"


def sh(cmd: list[str], log: Path, timeout: float, env: dict[str, str] | None = None) -> str:
    """Run ``cmd`` (output appended to ``log``); its last output line, or an error naming it."""
    with open(log, "a") as handle:
        handle.write(f"$ {' '.join(map(str, cmd))}\n")
        handle.flush()
        try:
            proc = subprocess.run(cmd, stdout=handle, stderr=subprocess.STDOUT, timeout=timeout,
                                  env={**os.environ, **(env or {})})
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"{Path(cmd[0]).name} timed out after {timeout:.0f} s (log: {log})") from None
    lines = log.read_text(errors="replace").strip().splitlines()
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, cmd[:4]))} ... exit {proc.returncode}: {lines[-1] if lines else ''}")
    return lines[-1] if lines else ""


# ----------------------------------------------------------------------------------- GPU installs


def install(table: Table, args: argparse.Namespace) -> bool:
    """uv; the GPU venv (torch + legorl) and vLLM's venv side by side; flash-attn if a wheel exists."""
    WORK.mkdir(parents=True, exist_ok=True)
    got = table.run("install: uv", lambda: {"uv": _uv(WORK / "install-uv.log")})
    if got is None:
        return False
    uv, py = got["uv"], str(GPU_VENV / "bin" / "python")
    found = re.search(r'VLLM_VERSION = "(.+?)"', (REPO / "legorl/engines/vllm_server.py").read_text())
    version = found.group(1) if found else "0"
    vllm_spec = args.vllm_spec or f"vllm=={version}"

    def legorl_venv(log: Path = WORK / "install-legorl.log") -> dict[str, Any]:
        start = time.time()
        if not (GPU_VENV / ".installed").exists():
            sh([uv, "venv", "--allow-existing", "--python", sys.executable, str(GPU_VENV)], log, 120)
            sh([uv, "pip", "install", "--python", py, args.torch_spec], log, 900)
            sh([uv, "pip", "install", "--python", py, "-e", str(REPO)], log, 600)
            (GPU_VENV / ".installed").touch()
        probe = "import torch; print(torch.__version__, 'CUDA', torch.version.cuda, torch.cuda.is_available())"
        return {"torch": sh([py, "-c", probe], log, 120), "install_s": time.time() - start}

    def vllm_venv(log: Path = WORK / "install-vllm.log") -> dict[str, Any]:
        start, root = time.time(), GPU_CACHE / "vllm-venv"
        vpy = str(root / "bin" / "python")
        if not (root / "legorl-vllm.json").exists():
            sh([uv, "venv", "--allow-existing", "--python", sys.executable, str(root)], log, 120)
            sh([uv, "pip", "install", "--python", vpy, vllm_spec], log, 900)
            # legorl's own install marker (legorl/engines/vllm_server.py): its VLLMServer then starts this vLLM.
            (root / "legorl-vllm.json").write_text(json.dumps({"version": version, "root": str(root), "python": vpy,
                                                                "seconds": time.time() - start}))
        return {"vllm": sh([vpy, "-c", "import vllm; print(vllm.__version__)"], log, 300),
                "install_s": time.time() - start}

    def flash_attn() -> dict[str, Any]:
        try:
            sh([uv, "pip", "install", "--python", py, "--only-binary", ":all:", "flash-attn"],
               WORK / "install-flash-attn.log", 180)
        except RuntimeError as exc:
            raise Skip("no wheel on PyPI for this torch/CUDA/Python (flash-attn ships an sdist)") from exc
        return {"installed": True}

    with ThreadPoolExecutor(2) as pool:  # two downloads at once; uv's cache shares the torch they both need
        legorl, vllm = pool.submit(legorl_venv), pool.submit(vllm_venv)
        ok = table.run(f"install: {args.torch_spec} + legorl", legorl.result) is not None
        table.run(f"install: {vllm_spec} (own venv)", vllm.result)
    if ok:
        table.run("install: flash-attn (wheel only)", flash_attn)
    if os.environ.get("OUT"):  # the device tool brings back $OUT only
        for log in WORK.glob("install-*.log"):
            shutil.copy(log, Path(os.environ["OUT"]) / log.name)
    return ok


def _uv(log: Path) -> str:
    found = shutil.which("uv") or (WORK / "uv" / "bin" / "uv")
    if Path(found).exists():
        return str(found)
    sh([sys.executable, "-m", "pip", "install", "--quiet", "--target", str(WORK / "uv"), "uv"], log, 300,
       env={"PIP_BREAK_SYSTEM_PACKAGES": "1"})
    return str(WORK / "uv" / "bin" / "uv")


# ------------------------------------------------------------------------------------------ models


def tiny_models() -> tuple[Path, Path]:
    """The test suite's tiny dense and MoE models (legorl's cache; built offline in seconds if missing)."""
    from legorl.core.paths import cache_dir
    from legorl.models import MODEL_RECIPE_VERSION, init_model

    out = []
    for kind, moe in (("dense", False), ("moe", True)):
        path = cache_dir() / "test-models" / f"{kind}-v{MODEL_RECIPE_VERSION}"
        if not (path / "config.json").exists():
            init_model(path, moe=moe, size="tiny", seed=0)
        out.append(path)
    return out[0], out[1]


def half_b_model(tiny: Path) -> Path:
    """:data:`HALF_B` with random weights (bf16, built on the GPU) and the tiny model's tokenizer."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    out = WORK / "models" / "qwen3-0.6b-shaped"
    if not (out / "config.json").exists():
        config = AutoConfig.from_pretrained(tiny)
        for key, value in HALF_B.items():
            setattr(config, key, value)
        torch.manual_seed(0)
        with torch.device("cuda"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        model.save_pretrained(out)
        AutoTokenizer.from_pretrained(tiny).save_pretrained(out)
        del model
        torch.cuda.empty_cache()
    return out


def gpu_name() -> str:
    """The first GPU and its driver as nvidia-smi names them ("" when there is none)."""
    try:
        found = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                               capture_output=True, text=True, timeout=60).stdout.strip().splitlines()
    except (OSError, subprocess.TimeoutExpired):
        return ""
    if not found:
        return ""
    name, _, driver = found[0].rpartition(", ")
    return f"{name}, driver {driver}, {len(found)} GPU(s)"


def summary(out: Path) -> None:
    table = json.loads(out.read_text())
    counts = {s: sum(r["status"].startswith(s) for r in table["rows"]) for s in ("ok", "skipped", "failed")}
    print("\n| row | status | figures | s |\n|---|---|---|---|")
    print("\n".join(_line(r) for r in table["rows"]))
    print(f"\n{counts['ok']} ok, {counts['skipped']} skipped, {counts['failed']} failed; JSON: {out}", flush=True)


