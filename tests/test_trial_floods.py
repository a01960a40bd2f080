# ruff: noqa: F811 - the fixtures `agent` and `proxy` come from trial_agents and are test arguments here
"""What one trial can make the rollout stage spend, from inside its container (issue #25): each
flood runs beside a bystander session on the same proxy, whose calls must stay fast while the
stage's descriptors and memory stay within a fixed budget, and the attacker's trial stays the
agent's (never infrastructure). The limits: docs/threat-model.md, "Resource limits"."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
from trial_agents import Agent, agent, agent_out, proxy, rollout, run_dir  # noqa: F401 - fixtures

from legorl.proxy.clients import InProcessProxy

pytestmark = [pytest.mark.podman]




class Bystander:
    """Another trial's session on the same proxy, called every 0.2 s while an attack runs, with this
    process's (the rollout stage's) open descriptors and resident memory sampled beside it."""

    def __init__(self, proxy: InProcessProxy) -> None:
        self.server = proxy.server
        self.session = self.server.new_session()
        self.latencies: list[float] = []
        self.statuses: list[int] = []
        self.fds: list[int] = []
        self.rss_mb: list[float] = []
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def __enter__(self) -> Bystander:
        self.fds.append(len(os.listdir("/proc/self/fd")))
        self.rss_mb.append(_rss_mb())
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join(120)

    def _poll(self) -> None:
        import httpx

        client = httpx.Client(base_url=self.server.base_url, timeout=120)
        chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        while not self._done.is_set():
            t0 = time.monotonic()
            self.statuses.append(client.post(f"/sess/{self.session}/v1/chat/completions", json=chat).status_code)
            self.latencies.append(time.monotonic() - t0)
            self.fds.append(len(os.listdir("/proc/self/fd")))
            self.rss_mb.append(_rss_mb())
            time.sleep(0.2)

    def check(self) -> str:
        """The bystander's calls all succeeded within a couple of seconds; a summary line."""
        assert self.statuses and set(self.statuses) == {200}, self.statuses
        assert max(self.latencies) < 2.0, f"a bystander's call waited {max(self.latencies):.1f} s"
        return (f"{len(self.latencies)} bystander calls, max {max(self.latencies) * 1000:.0f} ms; fds "
                f"{self.fds[0]} -> max {max(self.fds)}; RSS {self.rss_mb[0]:.0f} -> max {max(self.rss_mb):.0f} MB")


def _rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def test_a_connection_flood_costs_the_stage_no_descriptors(proxy: InProcessProxy, agent: type[Agent],
                                                           base_image: str, tmp_path: Path) -> None:
    """20,000 connections held open on the trial's own session socket (they took every descriptor of
    the rollout process, and the stage died): the socket accepts a few dozen, the kernel refuses the
    rest, the bystander's calls go on, and the session serves the trial again once it lets go."""
    agent.SCRIPT = r'''
held, refused = [], 0
for _ in range(20000):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.setblocking(False)
    try:
        s.connect(cfg["socket"])
    except OSError:  # EAGAIN: the socket's backlog is full
        refused += 1
        s.close()
        continue
    held.append(s)
out["held"], out["refused"] = len(held), refused
time.sleep(6)
for s in held:
    s.close()
out["after"] = call()
save()
'''
    run = run_dir(tmp_path)
    with Bystander(proxy) as bystander:
        [row] = rollout(run, proxy)
    seen = agent_out(run)
    print(seen["held"], "held,", seen["refused"], "refused;", bystander.check())
    assert not row.infra_failure and seen["after"] == 200, (row.error, seen)
    assert seen["refused"] > 10000, seen  # the cap, not the container's descriptors, stopped it
    assert max(bystander.fds) - bystander.fds[0] < 500, bystander.fds


def test_an_output_flood_costs_the_stage_a_fixed_memory_budget(proxy: InProcessProxy, agent: type[Agent],
                                                               base_image: str, tmp_path: Path) -> None:
    """The in-container harness writes 1.5 GB to its exec's stdout (the pipe the host reads; it grew
    the rollout process by 4 GB): the host keeps a bounded part, the trial is the agent's."""
    agent.SCRIPT = r'''
save()
chunk = b"x" * (1 << 20)
for _ in range(1536):
    os.write(1, chunk)
'''
    run = run_dir(tmp_path)
    with Bystander(proxy) as bystander:
        [row] = rollout(run, proxy, timeout_s=180.0)
    print(bystander.check())
    assert not row.infra_failure, row.error
    assert max(bystander.rss_mb) - bystander.rss_mb[0] < 500, bystander.rss_mb


def test_a_parse_flood_neither_stalls_the_proxy_nor_makes_the_trial_infrastructure(
        proxy: InProcessProxy, agent: type[Agent], base_image: str, tmp_path: Path) -> None:
    """A red team's flood: a detached child sends, in waves, 16 bodies of 16 MB of ``{},`` (plus a
    lone surrogate escape, whose repair walks every value) that the proxy parsed on its event loop,
    ~7 s each: a bystander's call waited 92 s, the stage grew by 6 GB, and closing the session
    socket timed out behind the queue, which made the trial infrastructure. Now such a body is a 400
    before it is parsed (max_json_items), bodies are parsed off the loop, and closing never waits."""
    agent.SCRIPT = r'''
import threading
def conn():
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM); s.connect(cfg["socket"]); return s
def drain(s):
    try:
        while s.recv(65536):
            pass
    except OSError:
        pass
    s.close()
unit = b"{},"
bomb = b'{"model":"m","y":"\\ud800","x":[' + unit * ((16 << 20) // 3) + b'0],"messages":[],"max_tokens":8}'
head = ("POST /sess/%s/v1/chat/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
        "content-length: %d\r\n\r\n" % (cfg["session"], len(bomb))).encode()
def wave():
    socks = [conn() for _ in range(16)]
    for x in socks:
        x.sendall(head + bomb[:-1])
    for x in socks:
        x.sendall(bomb[-1:])
    for x in socks:
        drain(x)
if os.fork() == 0:
    os.setsid()
    for _ in range(4):
        try:
            wave()
        except Exception:
            time.sleep(0.5)
    os._exit(0)
time.sleep(3)
save()
'''
    run = run_dir(tmp_path)
    with Bystander(proxy) as bystander:
        [row] = rollout(run, proxy)
    print(bystander.check())
    assert not row.infra_failure, row.error
    assert max(bystander.rss_mb) - bystander.rss_mb[0] < 500, bystander.rss_mb
