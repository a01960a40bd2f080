"""The READMEs' shell blocks run as written: every `legorl` line names real commands and options (a
flag that no longer exists fails here), every `make` line a real target, the by-hand run is sized
for the tiny model with its cost on each line, and (slow) that block runs on the tiny model."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import time
from pathlib import Path

import pytest
import typer

from legorl.cli.app import app

ROOT = Path(__file__).resolve().parents[1]
READMES = [ROOT / "README.md", ROOT / "examples" / "cpu-demo" / "README.md"]

# What the by-hand run may cost at most, in the tiny model's sampled tokens (trials x turns x tokens per
# call) and warm-up tokens: a few minutes on two cores.
MAX_ROLLOUT_TOKENS = 5_000
MAX_WARMUP_TOKENS = 100_000


def bash_blocks(path: Path) -> list[list[str]]:
    """The lines of each ```bash block (a trailing `# comment` kept: it is the line's cost statement)."""
    blocks = re.findall(r"^```(?:bash|sh|console)\n(.*?)^```", path.read_text(), flags=re.S | re.M)
    return [[line for line in block.splitlines() if line.strip() and not line.lstrip().startswith("#")]
            for block in blocks]


def commands(line: str) -> list[list[str]]:
    """The simple commands of a shell line (``a && b; c``), as argv lists, comment dropped."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
    lexer.whitespace_split = True
    lexer.commenters = "#"
    argvs: list[list[str]] = [[]]
    for token in lexer:
        if token in ("&&", "||", ";", "|", "&"):
            argvs.append([])
        else:
            argvs[-1].append(token)
    return [a for a in argvs if a]


def legorl_lines() -> list[tuple[Path, str, list[str]]]:
    return [(path, line, argv) for path in READMES for block in bash_blocks(path) for line in block
            for argv in commands(line) if argv[0] == "legorl"]


def parse(argv: list[str]) -> dict[str, object]:
    """``legorl …`` parsed by the real CLI, not run (typer's own click: a usage error is a TyperException)."""
    command = typer.main.get_command(app)
    args = argv[1:]
    while (subcommands := getattr(command, "commands", None)) is not None:  # a group: descend
        assert args and args[0] in subcommands, f"`{shlex.join(argv)}`: no command {args[:1]}"
        command, args = subcommands[args[0]], args[1:]
    return dict(command.make_context(shlex.join(argv[:2]), list(args)).params)


def by_hand_block() -> list[str]:
    return next(block for block in bash_blocks(ROOT / "README.md") if any("legorl rollout" in ln for ln in block))


def test_the_readmes_have_legorl_lines() -> None:
    assert len(legorl_lines()) >= 10


@pytest.mark.parametrize(("path", "line", "argv"), legorl_lines(),
                         ids=[f"{p.parent.name}:{shlex.join(a)}" for p, _, a in legorl_lines()])
def test_every_legorl_line_parses_with_the_real_cli(path: Path, line: str, argv: list[str]) -> None:
    try:
        parse(argv)
    except typer.TyperException as exc:
        pytest.fail(f"{path.name}: `{line}`: {exc}")


def test_every_make_line_names_a_target() -> None:
    targets = {ROOT: set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), flags=re.M))}
    for path in READMES:
        for block in bash_blocks(path):
            for line in block:
                for argv in commands(line):
                    if argv[0] == "make":
                        names = [a for a in argv[1:] if not a.startswith("-") and "=" not in a]
                        assert set(names) <= targets[ROOT], f"{path.name}: `{line}`: no such make target"


def test_a_removed_flag_would_fail_the_check() -> None:
    with pytest.raises(typer.TyperException, match="--samplez"):
        parse(["legorl", "rollout", "--run", "r", "--harness", "mini-swe-agent", "--samplez", "2"])


def test_the_by_hand_run_is_sized_for_the_tiny_model_and_says_what_each_line_costs() -> None:
    from legorl.harnesses import parse_names

    block = by_hand_block()
    for line in block:
        assert "#" in line, f"`{line}`: say what it costs in a comment"
    rollout = next(parse(argv) for line in block for argv in commands(line) if argv[:2] == ["legorl", "rollout"])
    trials = int(rollout["limit"]) * len(parse_names(str(rollout["harnesses"]))) * int(rollout["samples"])
    sampled = trials * int(rollout["max_turns"]) * int(rollout["max_tokens"])
    assert sampled <= MAX_ROLLOUT_TOKENS, f"the by-hand rollout may sample {sampled} tokens: size it for the tiny model"
    warmup = next(parse(argv) for line in block for argv in commands(line) if argv[1:3] == ["model", "warmup"])
    tokens = int(warmup["steps"]) * int(warmup["batch_size"]) * int(warmup["seq_len"])
    assert tokens <= MAX_WARMUP_TOKENS or (warmup["minutes"] is not None and float(warmup["minutes"]) <= 3)


@pytest.mark.slow
@pytest.mark.podman
@pytest.mark.harness
def test_the_by_hand_block_runs_as_written(tmp_path: Path, base_image: str) -> None:
    """Each line in a fresh directory (the repository's `examples/` linked in), in order, each within
    ten minutes; what the block promises is on disk at the end."""
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    # OMP_NUM_THREADS=1: what the README says to do on shared cores (the suite's machine is one)
    env = os.environ | {"PATH": f"{ROOT / '.venv' / 'bin'}:{os.environ['PATH']}", "HF_HUB_OFFLINE": "1",
                        "OMP_NUM_THREADS": "1"}
    spent: list[tuple[str, float]] = []
    for line in by_hand_block():
        t0 = time.monotonic()
        out = subprocess.run(["bash", "-euo", "pipefail", "-c", line], cwd=tmp_path, env=env, capture_output=True,
                             text=True, timeout=600)
        spent.append((line.split("#")[0].strip(), round(time.monotonic() - t0)))
        assert out.returncode == 0, f"`{line}` exited {out.returncode}:\n{out.stdout}\n{out.stderr}"
    print("\n".join(f"{s:5d} s  {line}" for line, s in spent))
    run = tmp_path / "runs" / "r1"
    import pandas as pd

    trials = pd.read_parquet(run / "rollouts")
    assert len(trials) == 4 and set(trials["harness"]) == {"mini-swe-agent", "opencode"}
    assert len(pd.read_parquet(run / "grades")) == 4
    assert (run / "train" / "checkpoints" / "step-0").is_dir()
    assert (run / "dashboard" / "index.html").is_file()
