"""`legorl serve-proxy` as a process: serves a session, writes it as a shard on shutdown."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import openai
import pytest

from legorl.core import shards
from legorl.core.paths import RunDir
from legorl.core.schemas import Kind


def test_serve_proxy_command(tiny_model: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = subprocess.Popen(
        [str(Path(sys.executable).with_name("legorl")), "serve-proxy", "--model", str(tiny_model), "--port", "0",
         "--run", str(run), "--max-turns", "2"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line, proc.stderr.read() if proc.stderr else ""
        info = json.loads(line)
        client = openai.OpenAI(base_url=info["base_url"] + "/sess/cli-test/v1", api_key="x", max_retries=0)
        msgs = [{"role": "user", "content": "hello"}]
        for _ in range(3):
            r = client.chat.completions.create(model="m", messages=msgs, max_tokens=4)
        assert "maximum number of turns" in (r.choices[0].message.content or "")  # --max-turns applies
        bare = openai.OpenAI(base_url=info["base_url"] + "/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.NotFoundError, match="names no session"):  # no shared "default" session
            bare.chat.completions.create(model="m", messages=msgs, max_tokens=4)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    assert proc.returncode == 0
    (row,) = shards.read_rows(RunDir.at(run).proxy_sessions, Kind.ROLLOUTS)
    assert row.harness == "external" and row.task_id == "proxy/cli-test" and row.outcome == "max_turns"
    assert len(row.calls) == 3 and sum(row.segments[0].loss_mask) == row.calls[0].completion_tokens
