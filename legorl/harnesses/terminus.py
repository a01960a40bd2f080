"""Terminus-2 (Harbor's reference agent, PyPI ``harbor``): inside the trial container, in its tmux session.

Terminus-2 acts only through a tmux session it drives with ``tmux send-keys``/``capture-pane``,
each a command its Harbor environment executes. It runs where the commands run, like OpenHands:
its venv and the Python >= 3.12 it was made from are bind-mounted read-only into the container,
and a small runner (:mod:`legorl.harnesses._terminus_runner`) gives it an environment whose
``exec`` is a local ``bash -c`` there. Its model calls (LiteLLM, non-streamed chat completions,
replies parsed as JSON) go to the trial's own session through the relay on the container's
loopback (:mod:`legorl.harnesses.channel`); the container has no other network.

tmux: task images need not have it (the base image does not), and Harbor's fallback — apt-get it
or build it from source inside the container — needs a network the container does not have. So the
install carries its own: Debian's tmux and the libraries it links (all but the C library, which must
be the image's), unpacked beside the venv, tmux's rpath pointing at them (``Recipe.debian_tools``),
mounted with the install and put first on the runner's PATH. It needs the image's glibc to be at least
the host's, as the mounted interpreter does; where it cannot run, the runner fails before the agent
starts, naming tmux (an infrastructure error: no call reached the model). Adding tmux to the base
image instead would leave every task image built elsewhere (Harbor tasks' own Dockerfiles) without it.

Its pane log stays in the container (``/logs/agent``); what the agent saw is in its trajectory
(``agent/trajectory.json`` in the trial folder), each observation capped by Terminus-2 at 10 kB.

Terminus-2 is configured only through its constructor: the proxy URL, the turn limit, the
temperature, the engine's context (so it summarizes before it overflows), no asciinema recording.
"""

from __future__ import annotations

from pathlib import Path

from legorl.harnesses.base import (
    End,
    Launch,
    ProcessHarness,
    ProcResult,
    TrialPaths,
    TrialSpec,
    json_file,
    no_account,
)
from legorl.sandbox.base import Sandbox

RUNNER = Path(__file__).with_name("_terminus_runner.py")

# The runner's account of how Terminus-2 ended (its ``end`` field).
_ENDS = {
    "task_complete": End.SUBMITTED,  # ``task_complete: true`` twice in a row, as Terminus-2 asks
    "max_turns": End.MAX_TURNS,  # its episode limit
    "context_overflow": End.CONTEXT_OVERFLOW,
    "api_error": End.API_ERROR,  # a LiteLLM/OpenAI error after Terminus-2's own retries
    "session_ended": End.FINISHED,  # the agent ended its own terminal (exit): its edits stand as they are
}


class Terminus2(ProcessHarness):
    name = "terminus-2"
    in_container = True

    def launch(self, trial: TrialSpec, paths: TrialPaths, sandbox: Sandbox) -> Launch:
        return self.python_runner(RUNNER, "terminus.json", trial, paths, {
            "context_tokens": trial.context_tokens, "tools_path": self.install.extra.get("tools_path")}, {})

    def read_end(self, paths: TrialPaths, proc: ProcResult) -> tuple[End, str | None]:
        result = json_file(paths.host / "result.json")
        if result is None:
            return no_account(proc)
        end = str(result.get("end"))
        exception = result.get("exception")
        detail = str(exception) if exception else f"{end} after {result.get('episodes')} episodes"
        return _ENDS.get(end, End.CRASHED), detail
