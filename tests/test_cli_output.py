"""legorl's output read from a pipe or a log: progress lines while a stage runs, help that is never cut,
a throughput figure that counts calls still generating, and a Ctrl-C that says how to resume."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LEGORL = [sys.executable, "-m", "legorl.cli"]
STAMP = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d"


def _env() -> dict[str, str]:
    drop = ("COLUMNS", "LINES", "TERMINAL_WIDTH", "TTY_INTERACTIVE", "FORCE_COLOR")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    return env | {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


class Piped:
    """A real legorl process whose stdout and stderr are one pipe, read line by line as they come
    (with the time each arrived), as a log file or CI would."""

    def __init__(self, *args: str, cwd: Path = ROOT, env: dict[str, str] | None = None):
        self.proc = subprocess.Popen([*LEGORL, *args], cwd=cwd, env=_env() | (env or {}), stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
        self.raw: list[str] = []
        self.lines: list[tuple[float, str]] = []  # colours taken out
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.raw.append(line)
            self.lines.append((time.monotonic(), re.sub(r"\x1b\[[0-9;]*m", "", line.rstrip("\n"))))

    def wait_for(self, pattern: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for _, line in list(self.lines):
                if re.search(pattern, line):
                    return line
            if self.proc.poll() is not None and not self._reader.is_alive():
                break
            time.sleep(0.2)
        raise AssertionError(f"no line matching {pattern!r} within {timeout} s:\n{self.text()}")

    def finish(self, timeout: float) -> tuple[int, float]:
        rc = self.proc.wait(timeout)
        ended = time.monotonic()
        self._reader.join(10)
        return rc, ended

    def text(self) -> str:
        return "\n".join(line for _, line in self.lines)


@pytest.mark.heavy
def test_help_in_a_pipe_has_every_option_name_whole_on_its_line() -> None:
    import typer

    from legorl.cli.app import app

    out = subprocess.run([*LEGORL, "train", "--help"], cwd=ROOT, env=_env(), capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert "…" not in out.stdout and "╭" not in out.stdout, out.stdout  # nothing cut, no 80-column box
    lines = out.stdout.splitlines()
    assert any(line.lstrip().startswith("--importance-sampling, --is ") for line in lines), out.stdout
    train = typer.main.get_command(app).commands["train"]  # type: ignore[attr-defined]
    for param in train.params:
        for opt in param.opts:
            assert re.search(rf"(^|[\s,/]){re.escape(opt)}([\s,/]|$)", out.stdout), f"{opt} missing or cut"
    # A help text is one line, however long, not folded at 80 columns.
    loss = next(line for line in lines if line.lstrip().startswith("Policy loss"))
    assert "importance_sampling_level." in loss and len(loss) > 120


def test_a_stage_in_a_log_prints_timestamped_lines_while_it_runs(tmp_path: Path, tiny_model: Path) -> None:
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    # FORCE_COLOR (some CI sets it) makes rich call a pipe a terminal: colours, but no live redraws
    run = Piped("model", "warmup", str(model), "--steps", "8", "--batch-size", "2", "--seq-len", "64",
                env={"FORCE_COLOR": "1"})
    rc, ended = run.finish(timeout=600)
    assert rc == 0, run.text()
    assert not any(c in "".join(run.raw) for c in ("\r", "\x1b[2K", "\x1b[?25l")), run.raw
    progress = [(t, line) for t, line in run.lines if re.match(rf"{STAMP} warmup \d+/8 · ", line)]
    assert progress, run.text()
    assert progress[0][1].split(" warmup ")[1].startswith("0/8 · 0s · loading the model"), run.text()
    assert progress[-1][1].split(" warmup ")[1].startswith("8/8 · "), run.text()
    # the first line came as the stage started, not with the rest at the end
    assert ended - progress[0][0] > 2.0, run.text()
    assert "warmed up" in run.text()


@pytest.mark.heavy
def test_log_lines_come_at_a_steady_interval_while_nothing_finishes(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from legorl.cli import common, progress

    assert not common.console.is_interactive  # pytest captures stderr: the console writes a log
    monkeypatch.setattr(progress, "LOG_INTERVAL_S", 1.0)
    monkeypatch.setattr(progress, "MIN_GAP_S", 60.0)
    bar: progress.StageBar[str] = progress.StageBar("stage", lambda row: f"last {row}", transient=False,
                                                    tick=lambda: "waiting")
    with bar:
        bar.on_start(2, 0)
        time.sleep(3.5)
        bar.on_done("a")  # within MIN_GAP_S of a heartbeat: no line of its own
        bar.on_done("b")  # the last one always has one
    lines = [line for line in capsys.readouterr().err.splitlines() if " stage " in line]
    assert re.fullmatch(rf"{STAMP} stage 0/2 · 0s", lines[0]), lines
    beats = [line for line in lines if line.endswith("· waiting")]
    assert 2 <= len(beats) <= 4, lines  # one a second over 3.5 s (a busy machine may skip one)
    assert re.fullmatch(rf"{STAMP} stage 2/2 · \ds · last b", lines[-1]), lines
    assert len(lines) == len(beats) + 2, lines


def test_status_in_a_log_prints_start_heartbeat_and_end(monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    from legorl.cli import common

    monkeypatch.setattr(common, "LOG_INTERVAL_S", 0.4)
    with common.console.status("training on [bold]runs/x[/]"):
        time.sleep(1.0)
    lines = capsys.readouterr().err.splitlines()
    assert re.fullmatch(rf"{STAMP} training on runs/x …", lines[0]), lines
    assert any(re.fullmatch(rf"{STAMP} training on runs/x … 0s", line) for line in lines[1:-1]), lines
    assert re.fullmatch(rf"{STAMP} training on runs/x: done after \ds", lines[-1]), lines


@pytest.mark.heavy
def test_long_lines_are_not_wrapped_in_a_log(tmp_path: Path) -> None:
    run = tmp_path / ("a-run-directory-with-a-name-long-enough-to-pass-eighty-columns-by-itself-" * 2)
    out = subprocess.run([*LEGORL, "tasks", "import", str(ROOT / "examples/tasks/tasks.parquet"), "--run", str(run),
                          "--limit", "1"], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    done = [line for line in out.stderr.splitlines() if line.startswith("imported ")]
    assert len(done) == 1 and done[0].endswith("/tasks (0 already there)") and len(done[0]) > 200, out.stderr


def test_throughput_counts_tokens_of_calls_still_generating(tiny_model: Path) -> None:
    from legorl.engines.base import SamplingParams
    from legorl.engines.embedded import EmbeddedEngine
    from legorl.engines.watched import WatchedEngine

    async def main() -> tuple[list[int], int]:
        engine = WatchedEngine(EmbeddedEngine(tiny_model, max_batch=1))
        seen = []
        try:
            async for chunk in engine.stream([1, 2, 3], SamplingParams(max_tokens=12, temperature=1.0, seed=0)):
                if chunk.final is None:
                    seen.append(engine.tokens)  # the call is still in flight here
                else:
                    assert engine.in_flight == 1
            return seen, engine.tokens
        finally:
            await engine.close()

    seen, total = asyncio.run(main())
    assert seen == list(range(1, len(seen) + 1)) and len(seen) >= 1, seen
    assert total == len(seen) + 1


@pytest.mark.slow
@pytest.mark.podman
@pytest.mark.harness
def test_ctrl_c_on_a_rollout_says_how_to_resume_and_exits_130(tmp_path: Path, tiny_model: Path,
                                                              base_image: str) -> None:
    from legorl.harnesses.install import installed

    if installed("mini-swe-agent") is None:
        pytest.skip("mini-swe-agent is not installed (legorl harness install mini-swe-agent)")
    imported = subprocess.run([*LEGORL, "tasks", "import", str(ROOT / "examples/tasks/tasks.parquet"), "--run",
                               str(tmp_path), "--limit", "1"], cwd=ROOT, env=_env(), capture_output=True,
                              text=True, timeout=300)
    assert imported.returncode == 0, imported.stderr
    command = ["rollout", "--run", str(tmp_path), "--model", str(tiny_model), "--harness", "mini-swe-agent",
               "--samples", "2", "--max-turns", "2", "--max-tokens", "64"]
    # A test run started in the background (`nohup`, `&`) ignores SIGINT and its children inherit that,
    # so the stage would never see this Ctrl-C: start it as a terminal would, SIGINT at its default.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        run = Piped(*command)
    finally:
        signal.signal(signal.SIGINT, previous)
    run.wait_for(rf"{STAMP} rollout 0/2 · ", timeout=300)  # the stage is running: trials have started
    time.sleep(3)
    run.proc.send_signal(signal.SIGINT)
    rc, _ = run.finish(timeout=180)
    assert rc == 130, run.text()
    assert run.lines[-1][1] == "interrupted — rerun the same command to resume", run.text()
    assert "Traceback" not in run.text(), run.text()


@pytest.mark.heavy
def test_tasks_list_shows_the_order_limit_takes(tmp_path: Path) -> None:
    import json

    import pyarrow.parquet as pq

    from legorl.stages.rollout import RolloutConfig, plan

    source = ROOT / "examples/tasks/tasks.parquet"
    imported = [str(r["instance_id"]) for r in pq.read_table(source, columns=["instance_id"]).to_pylist()[:4]]
    assert imported != sorted(imported)  # the file's order is not the instance ids' order
    subprocess.run([*LEGORL, "tasks", "import", str(source), "--run", str(tmp_path), "--limit", "4"], cwd=ROOT,
                   env=_env(), check=True, capture_output=True, timeout=300)
    shown = subprocess.run([*LEGORL, "tasks", "list", "--run", str(tmp_path), "--json"], cwd=ROOT, env=_env(),
                           check=True, capture_output=True, text=True, timeout=120)
    listed = [t["instance_id"] for t in json.loads(shown.stdout)]
    assert listed == sorted(imported)
    jobs, _ = plan(RolloutConfig(run=tmp_path, harnesses=["simple"], limit=2))
    assert [j.task.instance_id for j in jobs] == listed[:2]
