"""Plug-in harnesses (``--harness chaos_harnesses:Name``, with this folder on PYTHONPATH) that hang
the way real ones do: each makes one model call (so the policy has spoken and the trial is the
agent's, not infrastructure), then leaves a child behind that keeps its output open and never
exits. ``CHAOS_MARKER`` in the environment is put on every such child's command line, so a test
can look for survivors with ``pgrep -f``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from legorl.harnesses.base import (
    BaseHarness,
    End,
    HarnessRun,
    Launch,
    ProcessHarness,
    ProcResult,
    TrialPaths,
    TrialSpec,
)
from legorl.sandbox.base import Sandbox

_CALL = """
import json, sys, urllib.request
body = json.dumps({"model": "policy", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4})
req = urllib.request.Request(sys.argv[1] + "/chat/completions", body.encode(), {"Content-Type": "application/json"})
urllib.request.urlopen(req, timeout=60).read()
"""


def one_call(openai_base_url: str) -> None:
    """One chat completion against the trial's session."""
    body = json.dumps({"model": "policy", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4})
    req = urllib.request.Request(openai_base_url + "/chat/completions", body.encode(),
                                 {"Content-Type": "application/json"})
    urllib.request.urlopen(req, timeout=60).read()


class ChildHoldsLog(ProcessHarness):
    """A harness program on the host that starts a child in a session of its own (out of reach of a
    process-group kill) holding its stdout, then hangs itself."""

    name = "chaos-child-holds-log"
    in_container = False
    needs_install = False

    def launch(self, trial: TrialSpec, paths: TrialPaths, sandbox: Sandbox) -> Launch:
        marker = os.environ.get("CHAOS_MARKER", "chaos")
        script = (_CALL + "import subprocess, time\n"
                  f"subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)', {marker!r}],"
                  " start_new_session=True)\ntime.sleep(300)\n")
        return Launch([sys.executable, "-c", script, trial.openai_base_url, marker], self.base_env(paths))

    def read_end(self, paths: TrialPaths, proc: ProcResult) -> tuple[End, str | None]:
        return End.UNKNOWN, None


class PipeHeldOpen(BaseHarness):
    """A Python plug-in that runs a helper with its output on a pipe and waits for that output to
    end; the helper's own child keeps the pipe open, so the wait never returns."""

    name = "chaos-pipe-held-open"
    in_container = False
    needs_install = False

    def run(self, trial: TrialSpec, sandbox: Sandbox, trial_dir: Path) -> HarnessRun:
        start = time.monotonic()
        one_call(trial.openai_base_url)
        marker = os.environ.get("CHAOS_MARKER", "chaos")
        helper = ("import subprocess, sys; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)', "
                  f"{marker!r}]); print('started')")
        subprocess.run([sys.executable, "-c", helper], capture_output=True)
        return HarnessRun(End.FINISHED, "the helper ended", 0, False, time.monotonic() - start,
                          trial_dir / "harness.log")
