"""The GPU check's rows (benchmarks/gpu_check.py): the embedded engine against the trainer's
recompute, a real ``vllm serve`` behind ``legorl serve-proxy``, a train step at agent lengths against
plain TRL, and two DDP processes against one.

    python benchmarks/gpu_rows.py SPEC_JSON   # one trainer at each length (train_rows runs it)
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from gpu_env import REPO, WORK, Skip, Table, half_b_model


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
    from legorl.core import shards
    from legorl.core.paths import RunDir
    from legorl.core.schemas import GradeRow, Kind, Outcome, TrialRow
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
    from legorl.core import metric_keys as mk

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
            done = subprocess.run([sys.executable, __file__, json.dumps(spec)], capture_output=True,
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


if __name__ == "__main__":
    train_child(json.loads(sys.argv[1]))
