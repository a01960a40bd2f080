"""A trial reaches exactly one network endpoint (its own proxy session), the host never follows a
link the agent planted in the trial folder, and the infrastructure label comes only from signals
the agent cannot write — with real podman containers set up by the rollout stage itself, the real
proxy and a scripted engine.

The "harness" here is an adversary: ``tests/isolation_probe.py`` run inside the trial container
exactly where an in-container harness runs (same sandbox, mounts, relay, session socket, URLs).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from rollout_support import import_one

from legorl.core import shards
from legorl.core.schemas import Kind, Outcome, TrialRow
from legorl.engines.scripted import ScriptedEngine
from legorl.harnesses import HARNESSES
from legorl.harnesses.base import (
    CONTAINER_TRIAL_DIR,
    Launch,
    ProcResult,
    TrialPaths,
    TrialSpec,
    json_file,
    json_lines,
    tail,
)
from legorl.harnesses.channel import CONTAINER_DIR, PORT, SOCKET_NAME
from legorl.harnesses.claude_code import ClaudeCode
from legorl.harnesses.openhands import OpenHands
from legorl.harnesses.trialfiles import UnsafeFile, read_trial_file
from legorl.proxy.clients import InProcessProxy, ProxyHandle, RemoteProxy
from legorl.proxy.server import ProxyServer
from legorl.sandbox.base import Sandbox
from legorl.stages.rollout import RolloutConfig, rollout_stage

pytestmark = [pytest.mark.podman]
PROBE = Path(__file__).with_name("isolation_probe.py")


class Probe(ClaudeCode):
    """An in-container 'harness' that runs the probe script; it reads its end like Claude Code
    (the result event in harness.log), so a planted log is read by a real adapter's code."""

    name = "probe"
    needs_install = False
    extra: dict[str, object] = {}  # noqa: RUF012 - set per test

    def mounts(self, trial_dir: Path) -> list[tuple[str, str, bool]]:
        return [(str(trial_dir.resolve()), CONTAINER_TRIAL_DIR, False)]

    def launch(self, trial: TrialSpec, paths: TrialPaths, sandbox: Sandbox) -> Launch:
        shutil.copy(PROBE, paths.host / PROBE.name)
        session = trial.anthropic_base_url.rstrip("/").rsplit("/", 1)[-1]
        cfg = {"session": session, "port": PORT, "socket": f"{CONTAINER_DIR}/{SOCKET_NAME}",
               "openai_base_url": trial.openai_base_url, **self.extra}
        (paths.host / "probe-config.json").write_text(json.dumps(cfg))
        return Launch(["python3", "-I", paths.at(PROBE.name), paths.at("probe-config.json")], self.base_env(paths))


class Claimer(Probe):
    """Makes one real model call, then claims in its log (Claude Code's result event) that the API failed."""

    name = "claimer"
    SCRIPT = ("import json, sys, urllib.request\n"
              "cfg = json.load(open(sys.argv[1]))\n"
              "body = json.dumps({'model': 'x', 'messages': [{'role': 'user', 'content': 'hi'}]}).encode()\n"
              "req = urllib.request.Request(cfg['openai_base_url'] + '/chat/completions', body,\n"
              "                             {'content-type': 'application/json'})\n"
              "try:\n"
              "    urllib.request.urlopen(req, timeout=60).read()\n"
              "except Exception as exc:\n"
              "    print('call failed:', exc)\n"
              "print(json.dumps({'type': 'result', 'subtype': 'error_during_execution', 'is_error': True,\n"
              "                  'result': 'API Error: 500 {\"type\":\"error\",\"error\":{\"type\":\"api_error\"}}'}))\n"
              "sys.exit(1)\n")

    def launch(self, trial: TrialSpec, paths: TrialPaths, sandbox: Sandbox) -> Launch:
        launch = super().launch(trial, paths, sandbox)
        (paths.host / PROBE.name).write_text(self.SCRIPT)
        return launch


@pytest.fixture
def harnesses(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(HARNESSES, Probe.name, Probe)
    monkeypatch.setitem(HARNESSES, Claimer.name, Claimer)


class Policy:
    """The scripted engine's completions: a fixed reply, or an engine failure when told to fail."""

    def __init__(self) -> None:
        self.fail = False

    def __call__(self, call: object) -> str:
        if self.fail:
            raise RuntimeError("the engine is down")
        return "hello from the policy"


@pytest.fixture
def policy() -> Policy:
    return Policy()


@pytest.fixture
def proxy(tiny_model: Path, policy: Policy) -> Iterator[InProcessProxy]:
    with InProcessProxy(ScriptedEngine(str(tiny_model), policy, max_context=4096), str(tiny_model)) as handle:
        yield handle


@pytest.fixture
def server(proxy: InProcessProxy) -> ProxyServer:
    return proxy.server


class Listener:
    """A TCP listener on the host's loopback, counting the connections it accepts."""

    def __init__(self) -> None:
        while True:
            self.sock = socket.create_server(("127.0.0.1", 0))
            self.port = self.sock.getsockname()[1]
            if self.port != PORT:
                break
            self.sock.close()
        self.accepted = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            conn.close()

    def close(self) -> None:
        self.sock.close()


def _rollout(run: Path, proxy: ProxyHandle, harness: str, **kw: object) -> list[TrialRow]:
    opts: dict[str, object] = {"timeout_s": 60.0, "max_turns": 4, "retries": 0, "backoff_s": 0.1} | kw
    if not (run / "tasks").exists():
        import_one(run, run.parent)
    rollout_stage(RolloutConfig(run=run, harnesses=[harness], **opts), proxy)  # type: ignore[arg-type]
    return shards.read_rows(run / "rollouts", Kind.ROLLOUTS)


def _trial_dir(run: Path) -> Path:
    [trial_dir] = (run / "logs" / "rollout").iterdir()
    return trial_dir


@pytest.mark.parametrize("mode", ["in-process", "external"])
def test_a_trial_reaches_only_its_own_session(mode: str, proxy: InProcessProxy, server: ProxyServer,
                                              base_image: str, harnesses: None, tmp_path: Path) -> None:
    run = tmp_path / "run"
    other = server.new_session()  # a bystander: another trial's session on the same proxy
    secret = tmp_path / "host-secret.json"
    secret.write_text('{"status": "finished", "finish_called": true, "secret": "HOST-ONLY"}')
    fake_log = tmp_path / "host-log.jsonl"
    fake_log.write_text('{"type": "result", "subtype": "success", "is_error": false, "result": "HOST-ONLY"}\n')
    listener = Listener()
    Probe.extra = {"other": other, "host_port": listener.port, "host_secret": str(secret), "host_log": str(fake_log)}
    try:
        if mode == "external":
            with RemoteProxy(server.base_url) as remote:
                [row] = _rollout(run, remote, "probe")
        else:
            [row] = _rollout(run, proxy, "probe")
    finally:
        listener.close()
    trial_dir = _trial_dir(run)
    probe = json.loads((trial_dir / "probe.json").read_text())

    # (a) no route out, only the loopback interface
    assert probe["interfaces"] == ["lo"] and probe["routes"] == [], probe
    assert all(not v.startswith("connected") for v in probe["outside"].values()), probe["outside"]
    # (b) the host's loopback listener is out of reach (the container's 127.0.0.1 is its own)
    assert probe["host_loopback"].startswith("ConnectionRefusedError"), probe["host_loopback"]
    assert listener.accepted == 0
    # (c) its own session works through the relay, plain and streamed
    assert probe["chat"] == [200, "hello from the policy"], probe["chat"]
    stream = probe["stream"]
    assert stream["status"] == 200 and stream["content_type"].startswith("text/event-stream"), stream
    assert stream["events"][-1] == "[DONE]" and len(stream["events"]) >= 4, stream
    text = "".join(json.loads(e)["choices"][0]["delta"].get("content") or "" for e in stream["events"][:-1])
    assert text == "hello from the policy"
    # (d) nothing but that session's model routes, through the relay or straight at the socket
    assert set(probe["others"].values()) == {404}, probe["others"]
    assert server.capture(other).calls == [] and server.core.get(other) is not None  # untouched, still there
    assert set(server.core.sessions) == {other}  # no "default" or other session was created
    assert len(row.calls) == 2 and not row.infra_failure  # the two calls of its own, nothing else
    # (e) the links and the fifo it planted are refused by the host readers, without blocking
    start = time.monotonic()
    for name in ("result.json", "environ.json", "events.fifo", "harness.log"):
        with pytest.raises(UnsafeFile):
            read_trial_file(trial_dir / name)
    assert json_file(trial_dir / "result.json") is None and json_lines(trial_dir / "harness.log") == []
    assert tail(trial_dir / "environ.json") == "" and tail(trial_dir / "events.fifo") == ""
    assert time.monotonic() - start < 1.0
    paths = TrialPaths(trial_dir, CONTAINER_TRIAL_DIR)
    proc = ProcResult(0, False, 1.0, "")
    assert OpenHands().read_end(paths, proc)[0].value == "crashed"  # not the host file's "finished"
    # ... and the trial is the agent's: its harness log was unreadable, so its harness crashed
    assert row.outcome == Outcome.HARNESS_CRASH and "HOST-ONLY" not in (row.error or ""), row.error


def test_api_error_claim_is_the_agents_an_engine_failure_is_infra(proxy: InProcessProxy, policy: Policy,
                                                                  base_image: str, harnesses: None,
                                                                  tmp_path: Path) -> None:
    [row] = _rollout(tmp_path / "claim", proxy, "claimer")
    assert row.outcome == Outcome.HARNESS_CRASH and not row.infra_failure, (row.outcome, row.error)
    assert "the proxy did not record" in (row.error or "") and len(row.calls) == 1

    policy.fail = True
    [row] = _rollout(tmp_path / "engine", proxy, "claimer", retries=1)
    assert row.outcome == Outcome.INFRA_ERROR and row.infra_failure and row.attempts == 2, row.error
    assert "engine failed" in (row.error or "")


def test_host_run_harness_commands_have_no_network(tiny_model: Path, base_image: str, tmp_path: Path) -> None:
    """The ``simple`` harness (like mini-swe-agent) runs on the host and execs the agent's
    commands in the trial container, which has no network and no relay."""
    from rollout_support import tool_call

    probe = "ls /sys/class/net /legorl-proxy; echo >/dev/tcp/1.1.1.1/53"  # short: the harness caps a reply

    def complete(call: object) -> str:
        done = "exit code" in str(getattr(call, "prompt_text", ""))
        return "DONE" if done else tool_call("bash", {"command": probe})

    run = tmp_path / "run"
    with InProcessProxy(ScriptedEngine(str(tiny_model), complete, max_context=4096), str(tiny_model)) as proxy:
        [row] = _rollout(run, proxy, "simple")
    output = "".join(str(m.get("content")) for m in json.loads(row.messages or "[]") if m.get("role") == "tool")
    assert "Network is unreachable" in output and "lo\n" in output, output
    assert "'/legorl-proxy': No such file or directory" in output  # no relay, no session socket mounted
    assert not row.infra_failure


# --------------------------------------------------------------------------- no container needed


@pytest.mark.parametrize("name", ["mini-swe-agent", "openhands", "opencode", "claude-code", "simple"])
def test_every_harness_sandbox_has_no_network(name: str, tmp_path: Path) -> None:
    """The podman arguments rollout starts each harness's trial container with: no network at
    all; an in-container harness gets the channel (read-only) and the relay as main process."""
    from legorl.harnesses import get
    from legorl.harnesses.channel import ProxyChannel
    from legorl.harnesses.install import installed
    from legorl.sandbox.podman import PodmanBackend
    from legorl.trials.lifecycle import TrialJob, TrialRunner

    harness = get(name)
    if harness.in_container and installed(name) is None:
        pytest.skip(f"{name} is not installed (legorl harness install {name})")
    run = tmp_path / "run"
    import_one(run, tmp_path)
    [task] = shards.read_rows(run / "tasks", Kind.TASKS)
    runner = TrialRunner(RolloutConfig(run=run, harnesses=[name]), proxy=None, create=lambda spec: None)  # type: ignore[arg-type]
    channel = ProxyChannel.create() if harness.in_container else None
    try:
        spec = runner.sandbox_spec(TrialJob(task, name, 0), "key", harness, tmp_path, channel)
        args = PodmanBackend().run_args(spec, "x")
    finally:
        if channel is not None:
            channel.close()
    assert args[args.index("--network") + 1] == "none" and args.count("--network") == 1
    assert not any(a.startswith(("--net=", "--network=", "--add-host", "--dns")) or "slirp" in a for a in args)
    if channel is not None:
        assert f"{channel.host_dir}:{CONTAINER_DIR}:ro,nodev,nosuid" in args
        assert args[-len(channel.command):] == list(channel.command)
    else:
        assert "-v" not in args  # nothing of the host mounted: the harness runs there, not here
        assert args[-2:] == ["sleep", "infinity"]


def _listen(path: Path, handle: ProxyHandle, sid: str) -> Callable[[], None]:
    sock = handle.serve_session(sid, path)
    return sock.close


@pytest.mark.parametrize("mode", ["in-process", "external"])
def test_session_socket_serves_one_session(mode: str, proxy: InProcessProxy, server: ProxyServer) -> None:
    import httpx

    own, other = server.new_session(), server.new_session()
    path = Path(f"/tmp/legorl-test-{os.getpid()}-{mode}.sock")
    remote = RemoteProxy(server.base_url) if mode == "external" else None
    close = _listen(path, remote or proxy, own)
    try:
        client = httpx.Client(transport=httpx.HTTPTransport(uds=str(path)), base_url="http://x", timeout=30)
        chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        r = client.post(f"/sess/{own}/v1/chat/completions", json=chat)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "hello from the policy"
        with client.stream("POST", f"/sess/{own}/v1/messages?beta=true",
                           json={"model": "m", "max_tokens": 32, "stream": True,
                                 "messages": [{"role": "user", "content": "hi"}]}) as resp:
            lines = [line for line in resp.iter_lines() if line.startswith("event:")]
        assert resp.status_code == 200 and lines[0] == "event: message_start" and lines[-1] == "event: message_stop"
        for method, url in [("POST", f"/sess/{other}/v1/chat/completions"), ("GET", f"/sess/{other}/trajectory"),
                            ("POST", f"/sess/{own}/finish"), ("POST", "/sessions"), ("POST", "/v1/chat/completions"),
                            ("GET", "/health"), ("GET", f"/sess/{own}/trajectory")]:
            assert client.request(method, url, json=chat).status_code == 404, url
        assert len(server.capture(own).calls) == 2 and server.capture(other).calls == []
        (remote or proxy).finish(own)  # a finished session is never re-created through its socket
        assert client.post(f"/sess/{own}/v1/chat/completions", json=chat).status_code == 404
        assert server.core.get(own) is None
    finally:
        close()
        if remote is not None:
            remote.__exit__(None, None, None)
    assert not path.exists()


def test_request_content_cannot_fake_an_engine_failure(proxy: InProcessProxy, server: ProxyServer) -> None:
    """An in-container agent can send its own requests through the relay: parameters the engine would
    choke on are the client's 400, never an engine failure recorded on the session (= infra)."""
    import httpx

    sid = server.new_session()
    path = Path(f"/tmp/legorl-test-{os.getpid()}-params.sock")
    sock = proxy.serve_session(sid, path)
    try:
        client = httpx.Client(transport=httpx.HTTPTransport(uds=str(path)), base_url="http://x", timeout=30)
        msgs = [{"role": "user", "content": "hi"}]
        for extra in ({"seed": 2**64}, {"seed": -(2**70)}, {"top_k": 2**63}):
            r = client.post(f"/sess/{sid}/v1/chat/completions", json={"model": "m", "messages": msgs, **extra})
            assert r.status_code == 400, (extra, r.text)
        r = client.post(f"/sess/{sid}/v1/messages", json={"model": "m", "max_tokens": 8, "messages": msgs,
                                                          "top_k": 2**64})
        assert r.status_code == 400, r.text
        assert proxy.finish(sid).engine_errors == []
    finally:
        sock.close()


def test_trial_file_reader_refuses_links_fifos_and_huge_files(tmp_path: Path) -> None:
    (tmp_path / "ok.json").write_text('{"a": 1}')
    (tmp_path / "link").symlink_to(tmp_path / "ok.json")
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "dir").mkdir()
    (tmp_path / "big").write_bytes(b"x" * 1000 + b"END")
    assert read_trial_file(tmp_path / "ok.json") == b'{"a": 1}'
    for name in ("link", "fifo", "dir"):
        with pytest.raises(UnsafeFile):
            read_trial_file(tmp_path / name)
    with pytest.raises(FileNotFoundError):
        read_trial_file(tmp_path / "missing")
    assert read_trial_file(tmp_path / "big", 10) == b"x" * 10
    assert read_trial_file(tmp_path / "big", 10, tail=True) == b"xxxxxxxEND"
    assert json_file(tmp_path / "ok.json") == {"a": 1} and json_file(tmp_path / "link") is None
    assert json_file(tmp_path / "big", limit=100) is None  # over the cap: garbled, the harness's doing


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
