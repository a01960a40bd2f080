"""Record the raw requests each real harness sends while it rewrites its own history.

    PATH=$PWD/.venv/bin:$PATH .venv/bin/python tests/record_harness_requests.py [SCENARIO ...]

Each scenario runs one real trial (``legorl rollout``'s own trial runner: podman sandbox, the
installed harness, the in-process proxy) on a scripted engine that answers in the harness's own tool
vocabulary, with only the harness's own knob turned down so the rewrite happens in a short trial.
Every request body the proxy receives is written, in order, to
``tests/recorded/harness_requests/<scenario>.jsonl.xz``: one ``{"api": ..., "body": ...}`` per line
(``api``: ``openai``, ``responses`` or ``anthropic``; token counts left out). xz, not gzip: the
requests repeat a long system prompt, which only a long window compresses. ``tests/test_segment_reasons.py`` replays them.
"""

from __future__ import annotations

import json
import lzma
import shutil
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from rollout_support import import_one, tool_call  # noqa: E402

from legorl.engines.scripted import ScriptedCall, ScriptedEngine  # noqa: E402
from legorl.harnesses import HARNESSES  # noqa: E402
from legorl.harnesses.base import Launch, TrialPaths, TrialSpec  # noqa: E402
from legorl.harnesses.claude_code import ClaudeCode  # noqa: E402
from legorl.harnesses.codex import Codex  # noqa: E402
from legorl.harnesses.opencode import OpenCode  # noqa: E402
from legorl.harnesses.openhands import OpenHands  # noqa: E402
from legorl.proxy.app import ProxyApp  # noqa: E402
from legorl.sandbox.base import Sandbox  # noqa: E402

OUT = ROOT / "tests" / "recorded" / "harness_requests"
SUMMARY = ("<analysis>\nThe agent looked around with seq; nothing is changed yet.\n</analysis>\n\n<summary>\n"
           "1. Primary Request and Intent: fix the failing tests.\n2. Current Work: listing numbers with seq.\n"
           "3. Optional Next Step: keep listing numbers.\n</summary>")


def output_command(n: int) -> str:
    """A command whose output is about 1.5 kB, different at each turn."""
    return f"seq {n * 1000} {n * 1000 + 300}"


# --------------------------------------------------------------------------- harnesses with their knob down

_CONDENSING_RUNNER = '''"""The adapter's OpenHands runner with the default agent's summarizing condenser set to a small max_size."""
import runpy, sys
import openhands.tools.preset.default as preset
from openhands.sdk.context.condenser import LLMSummarizingCondenser
preset.get_default_condenser = lambda llm: LLMSummarizingCondenser(llm=llm, max_size=MAX_SIZE, keep_first=2)
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
'''


class CondensingOpenHands(OpenHands):
    max_size = 8

    def launch(self, trial: TrialSpec, paths: TrialPaths, sandbox: Sandbox) -> Launch:
        launch = super().launch(trial, paths, sandbox)
        (paths.host / "condensing_runner.py").write_text(_CONDENSING_RUNNER.replace("MAX_SIZE", str(self.max_size)))
        launch.argv[1:1] = [paths.at("condensing_runner.py")]
        return launch


class CompactingClaudeCode(ClaudeCode):
    window = 100_000  # the least Claude Code accepts
    pct = 40  # compaction fires a few turns past its ~27k-token system prompt and tools

    def launch(self, trial: TrialSpec, paths: TrialPaths, sandbox: Sandbox) -> Launch:
        launch = super().launch(trial, paths, sandbox)
        launch.env |= {"CLAUDE_CODE_AUTO_COMPACT_WINDOW": str(self.window),
                       "CLAUDE_AUTOCOMPACT_PCT_OVERRIDE": str(self.pct)}
        return launch


class CompactingCodex(Codex):
    compact_at = 9000  # a few turns past its ~7k-token first request

    def config(self, trial: TrialSpec) -> dict[str, Any]:
        return {**super().config(trial), "model_auto_compact_token_limit": self.compact_at}


class CompactingOpenCode(OpenCode):
    context = 14000

    def config(self, trial: TrialSpec) -> dict[str, object]:
        cfg = super().config(trial)
        model = cfg["provider"][PROVIDER_KEY]["models"][trial.model]  # type: ignore[index]
        model["limit"] = {"context": self.context, "output": 1024}
        return cfg


PROVIDER_KEY = "legorl"


# --------------------------------------------------------------------------- what the policy "samples"


def _turns(text: str) -> int:
    return text.count("<|im_start|>assistant") - 1


def openhands_policy(call: ScriptedCall) -> str:
    text = call.prompt_text
    if "# Tools" not in text:
        return SUMMARY
    n = _turns(text)
    if n >= 12:
        return tool_call("finish", {"message": "Done."})
    return tool_call("terminal", {"command": output_command(n), "summary": "look", "security_risk": "LOW"})


def opencode_policy(call: ScriptedCall) -> str:
    text = call.prompt_text
    if "# Tools" not in text or "Respond with text ONLY" in text[-2000:]:
        return "Fix calc add" if "title generator" in text else SUMMARY
    n = _turns(text)
    if n >= 10:
        return "Done."
    return tool_call("bash", {"command": output_command(n), "description": "look around"})


def codex_policy(call: ScriptedCall) -> str:
    text = call.prompt_text
    if "# Tools" not in text:
        return SUMMARY
    n = _turns(text)
    if n >= 10:
        return "Done."
    return tool_call("exec_command", {"cmd": output_command(n)})


def claude_code_policy(call: ScriptedCall) -> str:
    text = call.prompt_text
    if "# Tools" not in text or "Do NOT call any tools" in text[-4000:]:
        return SUMMARY
    n = _turns(text)
    main = "cc_is_subagent=true" not in text
    if main and n == 0:
        return tool_call("Agent", {"description": "Look around", "subagent_type": "general-purpose",
                                   "run_in_background": False,
                                   "prompt": "List some numbers with seq twice, then report back."})
    if not main:
        if n >= 2:
            return "The numbers are listed."
        return tool_call("Bash", {"command": output_command(50 + n), "description": "list numbers"})
    if n >= 10:
        return "Done."
    return tool_call("Bash", {"command": output_command(n), "description": "list numbers"})


@dataclass(frozen=True)
class Scenario:
    harness: str
    adapter: type
    policy: Callable[[ScriptedCall], str]
    max_turns: int
    model: str = "policy"


SCENARIOS: dict[str, Scenario] = {
    "openhands-condenser": Scenario("openhands", CondensingOpenHands, openhands_policy, 14),
    "claude-code-compaction": Scenario("claude-code", CompactingClaudeCode, claude_code_policy, 24,
                                       model="claude-sonnet-4-5"),
    "codex-compaction": Scenario("codex", CompactingCodex, codex_policy, 14),
    "opencode-compaction": Scenario("opencode", CompactingOpenCode, opencode_policy, 20),
}


# --------------------------------------------------------------------------- recording


def record(name: str, tiny_model: Path, work: Path) -> Path:
    from legorl.proxy.clients import InProcessProxy
    from legorl.stages.rollout import RolloutConfig, rollout_stage

    sc = SCENARIOS[name]
    seen: list[dict[str, Any]] = []
    read = ProxyApp._read_request

    def recording(self: ProxyApp, raw: bytes, api: str) -> Any:
        body = json.loads(raw)
        if api != "anthropic" or "max_tokens" in body:  # not a count_tokens call
            seen.append({"api": api, "body": body})
        return read(self, raw, api)

    HARNESSES[sc.harness] = sc.adapter
    ProxyApp._read_request = recording  # type: ignore[method-assign]
    try:
        run = work / name / "run"
        import_one(run, work / name)
        engine = ScriptedEngine(str(tiny_model), sc.policy, name=sc.model, max_context=200_000)
        with InProcessProxy(engine, str(tiny_model)) as proxy:
            summary = rollout_stage(RolloutConfig(run=run, harnesses=[sc.harness], timeout_s=600.0,
                                                  max_turns=sc.max_turns, retries=0, max_tokens=1024), proxy)
    finally:
        ProxyApp._read_request = read  # type: ignore[method-assign]
    row = summary.rows[0]
    reasons = [s.reason for s in row.segments]
    print(f"{name}: {row.outcome} {row.error or ''}\n  {len(seen)} requests, segments {reasons}", flush=True)
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / f"{name}.jsonl.xz"
    with lzma.open(path, "wt", encoding="utf-8") as f:
        for item in seen:
            f.write(json.dumps(item, ensure_ascii=False, sort_keys=True) + "\n")
    return path


def main(names: list[str]) -> None:
    from legorl.core.paths import cache_dir
    from legorl.models import MODEL_RECIPE_VERSION, init_model

    tiny = cache_dir() / "test-models" / f"dense-v{MODEL_RECIPE_VERSION}"
    if not (tiny / "config.json").exists():
        init_model(tiny, moe=False, size="tiny", seed=0)
    work = Path(tempfile.mkdtemp(prefix="legorl-record-"))
    try:
        for name in names or list(SCENARIOS):
            print("wrote", record(name, tiny, work), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main(sys.argv[1:])
