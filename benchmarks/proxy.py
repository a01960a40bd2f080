"""Proxy overhead per model call: legorl's proxy vs calling the engine directly, and vs LiteLLM.

    .venv/bin/python benchmarks/proxy.py [--model DIR] [--sessions 8] [--turns 12] [--litellm BIN]

Workload: agent-like sessions (system prompt + a tool, each turn one tool call and a ~600-character
tool result, so prompts grow to a few thousand tokens), non-streamed OpenAI chat completions over
keep-alive HTTP (httpx), identical in every run.

- **engine time**: the same prompt ids (taken from the proxy's own capture) given straight to the
  engine, in-process;
- **legorl overhead** = client-measured latency through the proxy − engine time for that call
  (so it includes the HTTP client, the loopback hop, validation, rendering, tokenizing the new
  suffix, capture and the JSON response);
- **LiteLLM overhead** = latency through a LiteLLM proxy (``litellm --config``, one model entry per
  session) placed in front of the legorl proxy − latency straight to the legorl proxy, same calls.

The engine is the scripted one (a fixed tool-call completion, deterministic and ~free), so the
overhead is not hidden in engine noise; the *fraction of engine time* uses the embedded tiny model's
time on the same prompts (CPU, fp32), which a real engine would only exceed. The proxy runs in its
own process. LiteLLM is looked for at ``--litellm`` or in ``$LEGORL_CACHE/bench-litellm`` (a
separate venv: ``python -m venv ~/.cache/legorl/bench-litellm && ~/.cache/legorl/bench-litellm/bin/pip
install 'litellm[proxy]'`` — avoid 1.82.7/1.82.8); without it that part is skipped and said so.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

COMPLETION = '<tool_call>\n{"name": "bash", "arguments": {"command": "grep -rn \\"def parse\\" src/ | head -20"}}\n</tool_call>'
TOOLS = [{"type": "function", "function": {
    "name": "bash", "description": "Run a shell command in the repository and return its output.",
    "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}]
SYSTEM = "You are a careful software engineer. Fix the issue described by the user. " * 6
MASTER_KEY = "sk-legorl-bench-0123456789abcdef"  # LiteLLM's proxy refuses to start without one
RESULT = "src/parser.py:{n}: def parse(text: str) -> Node:  # returns the syntax tree of one statement\n" * 7


# ------------------------------------------------------------------------------------ server side


def serve(model: str) -> None:
    """Child process: a ProxyServer over a scripted engine; prints its URL, runs until stdin closes."""
    from transformers import AutoTokenizer

    from legorl.engines.scripted import ScriptedEngine
    from legorl.proxy.server import ProxyServer

    tok = AutoTokenizer.from_pretrained(model)
    server = ProxyServer(ScriptedEngine(tok, [COMPLETION], cycle=True, max_context=1 << 20), tok).start()
    print(server.base_url, flush=True)
    sys.stdin.read()
    server.close()


# ------------------------------------------------------------------------------------ client side


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def run_traffic(base: str, sessions: int, turns: int, session_url: Any, model_of: Any) -> list[float]:
    """Latency (s) of every call, sessions interleaved turn by turn, in a fixed order."""
    import httpx

    client = httpx.Client(timeout=120, headers={"Authorization": f"Bearer {MASTER_KEY}"})
    convs = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Issue {s}: parse() drops comments."}]
             for s in range(sessions)]
    latencies: list[float] = []
    for turn in range(turns):
        for s in range(sessions):
            body = json.dumps({"model": model_of(s), "messages": convs[s], "tools": TOOLS, "max_tokens": 128})
            t0 = time.perf_counter()  # the client's own JSON encoding is not the proxy's overhead
            r = client.post(session_url(s) + "/chat/completions", content=body,
                            headers={"content-type": "application/json"})
            latencies.append(time.perf_counter() - t0)
            r.raise_for_status()
            msg = r.json()["choices"][0]["message"]
            call = msg["tool_calls"][0]
            convs[s].append({"role": "assistant", "content": msg.get("content") or "", "tool_calls": [call]})
            convs[s].append({"role": "tool", "tool_call_id": call["id"], "content": RESULT.format(n=turn)})
    client.close()
    return latencies


def prompts_from_capture(base: str, sessions: int, prefix: str) -> list[list[int]]:
    """Each call's exact prompt ids, in the order run_traffic made them."""
    import httpx

    per_session = []
    for s in range(sessions):
        traj = httpx.get(f"{base}/sess/{prefix}{s}/trajectory").json()
        tokens = traj["segments"][0]["token_ids"]
        per_session.append([tokens[: c["prompt_tokens"]] for c in traj["calls"]])
    turns = len(per_session[0])
    return [per_session[s][t] for t in range(turns) for s in range(sessions)]


def engine_times(engine: Any, prompts: list[list[int]], max_tokens: int) -> list[float]:
    from legorl.engines.base import SamplingParams

    async def go() -> list[float]:
        out = []
        params = SamplingParams(max_tokens=max_tokens, seed=0)
        await engine.generate(prompts[0], params)
        for p in prompts:
            t0 = time.perf_counter()
            await engine.generate(p, params)
            out.append(time.perf_counter() - t0)
        return out

    return asyncio.run(go())


def find_litellm(arg: str | None) -> str | None:
    if arg:
        return arg
    from legorl.core.paths import cache_dir

    cand = cache_dir() / "bench-litellm" / "bin" / "litellm"
    return str(cand) if cand.exists() else shutil.which("litellm")


def start_litellm(binary: str, proxy_base: str, sessions: int, port: int, workdir: Path) -> subprocess.Popen[bytes]:
    import httpx

    lines = ["model_list:"]
    for s in range(sessions):
        lines += [f"  - model_name: s{s}", "    litellm_params:", "      model: openai/scripted",
                  f"      api_base: {proxy_base}/sess/ll{s}/v1", "      api_key: x"]
    lines += ["litellm_settings:", "  drop_params: true", "  telemetry: false"]
    cfg = workdir / "litellm.yaml"
    cfg.write_text("\n".join(lines) + "\n")
    env = {**os.environ, "LITELLM_MASTER_KEY": MASTER_KEY, "LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_LOG": "ERROR", "HOME": str(workdir)}
    proc = subprocess.Popen([binary, "--config", str(cfg), "--port", str(port), "--host", "127.0.0.1",
                             "--num_workers", "1"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env,
                            cwd=workdir)
    deadline = time.time() + 180
    while time.time() < deadline:
        if proc.poll() is not None:
            err = proc.stderr.read().decode()[-2000:] if proc.stderr else ""
            raise RuntimeError(f"litellm exited: {err}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health/liveliness", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("litellm did not start within 180 s")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path)
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--turns", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=8, help="calls left out of the statistics")
    ap.add_argument("--engine-calls", type=int, default=24, help="calls timed on the embedded engine")
    ap.add_argument("--litellm", help="path of the litellm executable")
    ap.add_argument("--no-litellm", action="store_true", help="skip the LiteLLM comparison")
    ap.add_argument("--serve", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        serve(args.serve)
        return

    from transformers import AutoTokenizer

    from legorl.core.paths import cache_dir
    from legorl.engines.embedded import EmbeddedEngine
    from legorl.engines.scripted import ScriptedEngine
    from legorl.models import init_model

    model_dir = args.model
    if model_dir is None:
        model_dir = cache_dir() / "test-models" / "dense"
        if not (model_dir / "config.json").exists():
            model_dir = init_model(Path(tempfile.mkdtemp()) / "m")
    child = subprocess.Popen([sys.executable, __file__, "--serve", str(model_dir)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None
    base = child.stdout.readline().strip()
    S, T, W = args.sessions, args.turns, args.warmup
    try:
        direct = run_traffic(base, S, T, lambda s: f"{base}/sess/d{s}/v1", lambda s: "scripted")
        prompts = prompts_from_capture(base, S, "d")
        tok = AutoTokenizer.from_pretrained(model_dir)
        scripted = ScriptedEngine(tok, [COMPLETION], cycle=True, max_context=1 << 20)
        eng = engine_times(scripted, prompts, 128)
        overhead = [lat - e for lat, e in zip(direct, eng, strict=True)][W:]
        n_tokens = len(tok.encode(COMPLETION)) + 1
        embedded = EmbeddedEngine(model_dir)
        step = max(1, len(prompts) // args.engine_calls)
        real = engine_times(embedded, prompts[::step][: args.engine_calls], n_tokens)
        asyncio.run(embedded.close())

        o50, o99 = pct(overhead, 0.5) * 1e3, pct(overhead, 0.99) * 1e3
        e50 = statistics.median(real) * 1e3
        print(f"machine: {os.cpu_count()} cpus, load average {os.getloadavg()[0]:.1f} (timings scale with it)")
        print(f"workload: {S} sessions x {T} turns, non-streamed OpenAI calls with tools; prompts "
              f"{len(prompts[0])}..{max(len(p) for p in prompts)} tokens; completion {n_tokens} tokens")
        print("engine behind the proxy: ScriptedEngine (fixed completion, deterministic, ~free) — "
              "overhead is measured against it, not against model time")
        print(f"scripted engine time per call:      p50 {statistics.median(eng[W:]) * 1e3:7.3f} ms")
        print(f"legorl proxy overhead per call:     p50 {o50:7.3f} ms   p99 {o99:7.3f} ms")
        print(f"embedded tiny model (CPU) per call: p50 {e50:7.1f} ms  ({len(real)} calls, same prompts)")
        print(f"overhead as a fraction of engine time (p50/p50): {o50 / e50:.2%}")

        binary = None if args.no_litellm else find_litellm(args.litellm)
        if binary is None:
            print("LiteLLM: not installed (see the module docstring); comparison skipped")
            return
        with tempfile.TemporaryDirectory() as tmp:
            import socket

            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
            sock.close()
            proc = start_litellm(binary, base, S, port, Path(tmp))
            try:
                via = run_traffic(f"http://127.0.0.1:{port}", S, T, lambda s: f"http://127.0.0.1:{port}/v1",
                                  lambda s: f"s{s}")
            finally:
                proc.terminate()
                proc.wait(timeout=30)
        again = run_traffic(base, S, T, lambda s: f"{base}/sess/e{s}/v1", lambda s: "scripted")
        added = [v - d for v, d in zip(via, again, strict=True)][W:]
        l50, l99 = pct(added, 0.5) * 1e3, pct(added, 0.99) * 1e3
        version = subprocess.run([binary.replace("/litellm", "/python") if binary.endswith("/litellm") else sys.executable,
                                  "-c", "import importlib.metadata as m; print(m.version('litellm'))"],
                                 capture_output=True, text=True).stdout.strip()
        print(f"LiteLLM {version} proxy overhead per call: p50 {l50:7.3f} ms   p99 {l99:7.3f} ms "
              f"(through LiteLLM − straight to the legorl proxy, same calls)")
        print(f"ratio LiteLLM overhead / legorl overhead (p50): {l50 / o50:.1f}x  (p99: {l99 / o99:.1f}x)")
        print(json.dumps({"legorl_overhead_ms_p50": round(o50, 3), "legorl_overhead_ms_p99": round(o99, 3),
                          "engine_ms_p50": round(e50, 2), "fraction_of_engine": round(o50 / e50, 4),
                          "litellm_overhead_ms_p50": round(l50, 3), "litellm_overhead_ms_p99": round(l99, 3),
                          "ratio_p50": round(l50 / o50, 2)}))
    finally:
        if child.stdin:
            child.stdin.close()
        child.wait(timeout=30)


if __name__ == "__main__":
    main()
