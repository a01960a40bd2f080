"""An adversary standing in for an in-container harness, for the trial attack suites
(tests/test_trial_container_attacks.py, tests/test_trial_floods.py): ``Agent`` runs a Python script
(``Agent.SCRIPT`` after ``PRELUDE``) in a real trial container, where an in-container harness runs
— same sandbox, mounts, relay, session socket, URLs — against the real proxy on a scripted engine.
Every script first makes one real model call through the relay, so the policy "has spoken" and
nothing after it may be infrastructure."""

from __future__ import annotations

import json
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from rollout_support import import_one

from legorl.core import shards
from legorl.core.schemas import Kind, TrialRow
from legorl.engines.scripted import ScriptedEngine
from legorl.harnesses import HARNESSES
from legorl.harnesses.base import CONTAINER_TRIAL_DIR, Launch, TrialPaths, TrialSpec
from legorl.harnesses.channel import CONTAINER_DIR, PORT, SOCKET_NAME
from legorl.harnesses.claude_code import ClaudeCode
from legorl.proxy.clients import InProcessProxy
from legorl.sandbox.base import Sandbox
from legorl.stages.rollout import RolloutConfig, rollout_stage

PROBE = Path(__file__).with_name("isolation_probe.py")

# What every agent script starts with: its config, the relay client of tests/isolation_probe.py (put
# next to it), and one real model call through the relay.
PRELUDE = r'''
import http.client, json, os, socket, subprocess, sys, time
cfg = json.load(open(sys.argv[1]))
here = os.path.dirname(sys.argv[1])
out = {}
sys.dont_write_bytecode = True
sys.path.insert(0, here)  # python3 -I leaves the script's folder off sys.path
import isolation_probe

def request(method, path, body=None, timeout=60):
    return isolation_probe.request(cfg, method, path, body, timeout=timeout)

def call():
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16}
    return request("POST", "/sess/%s/v1/chat/completions" % cfg["session"], body)[0]

out["first_call"] = call()

def save():
    with open(os.path.join(here, "agent.json"), "w") as handle:
        json.dump(out, handle)
'''


class Agent(ClaudeCode):
    """An in-container 'harness' that runs ``SCRIPT`` (after ``PRELUDE``) with python3 -I."""

    name = "agent2"
    needs_install = False
    SCRIPT = ""

    def mounts(self, trial_dir: Path) -> list[tuple[str, str, bool]]:
        return [(str(trial_dir.resolve()), CONTAINER_TRIAL_DIR, False)]

    def launch(self, trial: TrialSpec, paths: TrialPaths, sandbox: Sandbox) -> Launch:
        session = trial.anthropic_base_url.rstrip("/").rsplit("/", 1)[-1]
        cfg = {"session": session, "port": PORT, "socket": f"{CONTAINER_DIR}/{SOCKET_NAME}",
               "openai_base_url": trial.openai_base_url}
        (paths.host / "agent-config.json").write_text(json.dumps(cfg))
        shutil.copy(PROBE, paths.host / PROBE.name)
        (paths.host / "agent.py").write_text(PRELUDE + self.SCRIPT)
        return Launch(["python3", "-I", paths.at("agent.py"), paths.at("agent-config.json")], self.base_env(paths))


@pytest.fixture
def agent(monkeypatch: pytest.MonkeyPatch) -> type[Agent]:
    monkeypatch.setitem(HARNESSES, Agent.name, Agent)
    return Agent


@pytest.fixture
def proxy(tiny_model: Path) -> Iterator[InProcessProxy]:
    engine = ScriptedEngine(str(tiny_model), lambda call: "hello from the policy", max_context=1 << 20)
    with InProcessProxy(engine, str(tiny_model)) as handle:
        yield handle


def run_dir(tmp_path: Path) -> Path:
    return tmp_path / f"r2-{uuid.uuid4().hex[:8]}"


def rollout(run: Path, proxy: InProcessProxy, **kw: object) -> list[TrialRow]:
    opts: dict[str, object] = {"timeout_s": 60.0, "max_turns": 4, "retries": 0, "backoff_s": 0.1} | kw
    if not (run / "tasks").exists():
        import_one(run, run.parent)
    rollout_stage(RolloutConfig(run=run, harnesses=[Agent.name], **opts), proxy)  # type: ignore[arg-type]
    return shards.read_rows(run / "rollouts", Kind.ROLLOUTS)


def trial_dir(run: Path) -> Path:
    [trial_dir] = (run / "logs" / "rollout").iterdir()
    return trial_dir


def agent_out(run: Path) -> dict[str, object]:
    return json.loads((trial_dir(run) / "agent.json").read_text())
