"""A test harness plug-in (``--harness loop_fixer:GoldFixer``): asks the model once, then applies the
task's gold patch, plus a marker line in every trial but sample 0's. With it a loop's trials are
graded 1 by the hidden tests, and a verifier can tell them apart (``loop_verifier``)."""

from __future__ import annotations

import time
from pathlib import Path

import pyarrow.parquet as pq

from legorl.harnesses.base import BaseHarness, End, HarnessRun, TrialSpec
from legorl.sandbox.base import Sandbox

SHIPPED = Path(__file__).resolve().parents[2] / "examples" / "tasks" / "tasks.parquet"
MARK = "# loop-verifier-marker"


def gold_patch(problem_statement: str) -> str:
    for row in pq.read_table(SHIPPED, columns=["problem_statement", "patch"]).to_pylist():
        if row["problem_statement"] == problem_statement:
            return str(row["patch"])
    raise LookupError("not a shipped task")


def marked(patch: str) -> str:
    """The patch with one comment line added to its first hunk (still the fix)."""
    lines = patch.splitlines(keepends=True)
    hunk = next(i for i, ln in enumerate(lines) if ln.startswith("@@"))
    new = lines[hunk].split("@@")[1].split()[1]
    start, _, count = new.partition(",")
    lines[hunk] = lines[hunk].replace(new, f"{start},{int(count or 1) + 1}", 1)
    lines.insert(hunk + 1, f"+{MARK}\n")
    return "".join(lines)


class GoldFixer(BaseHarness):
    name = "gold-fixer"
    in_container = False
    needs_install = False

    def run(self, trial: TrialSpec, sandbox: Sandbox, trial_dir: Path) -> HarnessRun:
        import openai

        start = time.monotonic()
        client = openai.OpenAI(base_url=trial.openai_base_url, api_key="legorl", max_retries=0)
        client.chat.completions.create(model=trial.model, max_tokens=4,
                                       messages=[{"role": "user", "content": trial.problem_statement}])
        patch = gold_patch(trial.problem_statement)
        if not trial.trial_id.endswith("sample0"):
            patch = marked(patch)
        sandbox.put_file("/tmp/fix.diff", patch.encode())
        applied = sandbox.exec(["git", "apply", "/tmp/fix.diff"], workdir=trial.workdir, timeout=60)
        log = trial_dir / "harness.log"
        log.write_text(applied.output)
        end = End.SUBMITTED if applied.exit_code == 0 else End.CRASHED
        return HarnessRun(end, applied.output[-200:] or None, applied.exit_code, False, time.monotonic() - start, log)
