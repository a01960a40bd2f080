"""examples/swebench-verified/Makefile: every command it runs is one the code takes.

``make -n`` expands each target with the Makefile's own defaults (and harmless overrides); every
``legorl ...`` and ``accelerate launch ... -m legorl.cli ...`` line is then parsed by the real CLI
(the subcommand must exist, every option must be one of its options, every value must convert),
``accelerate launch``'s own options by accelerate's parser, the vLLM server line against the flags
legorl's own server uses, and the tasks helper runs on local SWE-bench-schema rows. No network,
no GPU, no process of legorl's started but ``make`` and ``hf --help``.
"""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import typer.main
from typer.testing import CliRunner

from legorl.cli.app import app

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "examples" / "swebench-verified"
TARGETS = ("setup", "model", "view", "tasks", "check-tasks", "vllm", "proxy", "rollout", "grade", "train", "loop", "eval", "report")
# The CPU counterparts of the recipe's GPU stages, and what in each shows it exercises them.
COUNTERPARTS = {
    "tests/test_vllm_real.py": "--upstream",
    "tests/test_ray_executor.py": "--executor",
    "tests/test_sharded_stages.py": "--shard",
    "tests/test_train_distributed.py": "--multi_gpu",
}

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs GNU make")


def recipe_lines(makefile_dir: Path, run: Path, targets: tuple[str, ...] = TARGETS, **variables: str) -> list[str]:
    """The shell lines ``make -n`` would run for ``targets``, continuation lines joined."""
    overrides = [f"{k}={v}" for k, v in {"RUN": str(run), **variables}.items()]
    proc = subprocess.run(["make", "--no-print-directory", "-n", "-C", str(makefile_dir), *overrides, *targets],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return [line for line in proc.stdout.replace("\\\n", " ").splitlines() if line.strip()]


def _strip_env(tokens: list[str]) -> list[str]:
    while tokens and "=" in tokens[0] and tokens[0].split("=", 1)[0].isidentifier():
        tokens = tokens[1:]
    return tokens


def legorl_invocations(lines: list[str]) -> list[tuple[list[str], list[str]]]:
    """(accelerate's own arguments, legorl's arguments) of each line that runs legorl (the former empty
    for a plain ``legorl`` line)."""
    found = []
    for line in lines:
        tokens = _strip_env(shlex.split(line))
        if tokens[:1] == ["legorl"]:
            found.append(([], tokens[1:]))
        elif tokens[:2] == ["accelerate", "launch"]:
            at = tokens.index("-m")
            assert tokens[at + 1] == "legorl.cli", line
            found.append((tokens[2:at], tokens[at + 2:]))
    return found


def parse_legorl(argv: list[str]) -> tuple[str, dict[str, Any]]:
    """Parse ``argv`` as the real CLI does, without running the command: (its name, the parsed values).
    Raises the CLI's usage error for an unknown subcommand or option, or a value that does not convert."""
    command: Any = typer.main.get_command(app)
    ctx = command.make_context("legorl", list(argv), resilient_parsing=True)  # the group only resolves names
    names: list[str] = []
    args = list(argv)
    while hasattr(command, "list_commands"):
        assert args, f"legorl {' '.join(names)}: no subcommand"
        name = args.pop(0)
        sub = command.get_command(ctx, name)
        if sub is None:
            raise LookupError(f"legorl {' '.join([*names, name])}: no such command")
        names.append(name)
        command, ctx = sub, sub.make_context(name, [], parent=ctx, resilient_parsing=True)
    parsed = command.make_context(" ".join(names), args, parent=ctx.parent)
    return " ".join(names), dict(parsed.params)


@pytest.fixture(scope="module")
def lines(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    return recipe_lines(RECIPE, tmp_path_factory.mktemp("run"))


@pytest.mark.heavy
def test_every_legorl_line_parses(lines: list[str]) -> None:
    invocations = legorl_invocations(lines)
    commands = {parse_legorl(argv)[0] for _, argv in invocations}
    assert commands >= {"setup", "harness install", "vllm view", "tasks import", "serve-proxy", "rollout", "grade",
                        "train", "loop", "eval", "inspect", "dashboard"}, commands


def test_the_recipe_asks_for_the_scale_out_paths(lines: list[str]) -> None:
    parsed = {name: values for name, values in (parse_legorl(argv) for _, argv in legorl_invocations(lines))}
    for stage in ("rollout", "grade"):
        assert parsed[stage]["executor"] == "ray" and parsed[stage]["shard"] == "0/1", parsed[stage]
    assert parsed["grade"]["gold"] is False  # the last grade line is the rollouts', not check-tasks' gold run
    assert parsed["rollout"]["proxy_url"] and parsed["rollout"]["api_key"]
    for stage in ("loop", "eval", "serve-proxy"):
        assert parsed[stage]["engine"] == "vllm" and parsed[stage]["upstream"] == "http://127.0.0.1:8100", stage
    assert parsed["loop"]["reload_tolerance"] == pytest.approx(0.1)
    assert parsed["train"]["bf16"] is True and parsed["loop"]["bf16"] is True


def test_accelerate_launch_takes_the_recipes_options(lines: list[str]) -> None:
    from accelerate.commands.launch import launch_command_parser

    launches = [(own, argv) for own, argv in legorl_invocations(lines) if own]
    assert len(launches) == 1
    own, argv = launches[0]
    assert argv[0] == "train"
    args = launch_command_parser().parse_args([*own, "-m", "legorl.cli", *argv])  # exits on an unknown option
    assert args.multi_gpu and args.num_processes == 4 and args.module and args.training_script == "legorl.cli"
    assert "--bf16" in argv


def test_a_wrong_option_or_command_is_caught(lines: list[str], tmp_path: Path) -> None:
    rollout = next(argv for _, argv in legorl_invocations(lines) if argv[0] == "rollout")
    with pytest.raises(Exception, match="--shards"):
        parse_legorl([*rollout, "--shards", "0/4"])
    with pytest.raises(Exception, match="--executor"):  # a value that does not fit (missing)
        parse_legorl([*rollout, "--executor"])
    with pytest.raises(LookupError, match="roll-out"):
        parse_legorl(["roll-out", "--run", "r"])
    # The same through the Makefile: a copy whose grade target misspells an option fails the check.
    broken = tmp_path / "recipe"
    shutil.copytree(RECIPE, broken)
    makefile = broken / "Makefile"
    makefile.write_text(makefile.read_text().replace("--executor ray --address $(RAY_ADDRESS) --shard $(SHARD)\n\ntrain",
                                                     "--executor ray --adress $(RAY_ADDRESS) --shard $(SHARD)\n\ntrain"))
    grade = legorl_invocations(recipe_lines(broken, tmp_path / "run", ("grade",)))
    assert grade and "--adress" in grade[0][1]
    with pytest.raises(Exception, match="--adress"):
        parse_legorl(grade[0][1])


def test_overrides_reach_the_commands(tmp_path: Path) -> None:
    lines = recipe_lines(RECIPE, tmp_path, ("rollout", "grade", "train", "loop"), SHARD="3/8", GPUS="8",
                         TRAIN_GPUS="2,3", STEPS="4")
    parsed = {name: values for name, values in (parse_legorl(argv) for _, argv in legorl_invocations(lines))}
    assert parsed["rollout"]["shard"] == "3/8" and parsed["grade"]["shard"] == "3/8"
    assert parsed["rollout"]["run"] == tmp_path and parsed["loop"]["steps"] == 4
    assert any("--num_processes 8" in line and line.startswith("CUDA_VISIBLE_DEVICES=2,3 ") for line in lines)
    assert any(line.startswith("CUDA_VISIBLE_DEVICES=2 ") and " loop " in line for line in lines)


def test_the_vllm_line_has_the_flags_legorl_needs(lines: list[str]) -> None:
    from legorl.engines.vllm_server import VLLMServer

    server = VLLMServer(Path("/m"), name="policy")
    ours = server.command("python", Path("/m"))
    recipe = next(line for line in lines if "vllm.entrypoints.openai.api_server" in line)
    tokens = shlex.split(recipe)
    assert tokens[tokens.index("-m") + 1] == ours[2]
    cpu_only = {"--enforce-eager", "--max-num-seqs", "--dtype", "--host", "--port", "--model"}
    for i, flag in enumerate(ours):
        if flag.startswith("--") and flag not in cpu_only:
            assert flag in tokens, f"the recipe's vLLM line lacks {flag}"
            value = ours[i + 1] if i + 1 < len(ours) and not ours[i + 1].startswith("--") else None
            if value is not None:
                assert tokens[tokens.index(flag) + 1] == value, flag
    assert server.environment()["VLLM_SERVER_DEV_MODE"] == "1" and "VLLM_SERVER_DEV_MODE=1" in tokens
    assert "--enable-return-routed-experts" not in tokens  # dense by default; MoE opts in
    moe = recipe_lines(RECIPE, Path("/r"), ("vllm",), ROUTED_EXPERTS="--enable-return-routed-experts")
    assert "--enable-return-routed-experts" in shlex.split(moe[0])


def test_hf_download_takes_the_recipes_options(lines: list[str]) -> None:
    download = shlex.split(next(line for line in lines if line.startswith("hf download")))
    hf = Path(sys.executable).with_name("hf")
    proc = subprocess.run([str(hf), "download", "--help"], capture_output=True, text=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1", "NO_COLOR": "1", "COLUMNS": "200"})
    assert proc.returncode == 0, proc.stderr
    for token in download:
        if token.startswith("--"):
            assert token in proc.stdout, token


def _verified_row(instance_id: str, image: str | None = None) -> dict[str, Any]:
    diff = "diff --git a/m.py b/m.py\n--- a/m.py\n+++ b/m.py\n@@ -1 +1 @@\n-x = 1\n+x = 2\n"
    test = "diff --git a/t.py b/t.py\n--- a/t.py\n+++ b/t.py\n@@ -1 +1 @@\n-y = 1\n+y = 2\n"
    row = {"instance_id": instance_id, "repo": "o/r", "base_commit": "0" * 40, "patch": diff, "test_patch": test,
           "problem_statement": "p", "hints_text": "", "created_at": "2023-01-01T00:00:00Z", "version": "1.0",
           "FAIL_TO_PASS": json.dumps(["t.py::test_a"]), "PASS_TO_PASS": json.dumps([]),
           "environment_setup_commit": "0" * 40}
    if image is not None:
        row["image"] = image
    return row


def test_tasks_target_writes_official_images_and_imports(lines: list[str], tmp_path: Path) -> None:
    source = tmp_path / "verified.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in (
        _verified_row("django__django-11099"), _verified_row("astropy__astropy-12907", image="mine:1"))))
    tasks = recipe_lines(RECIPE, tmp_path / "run", ("tasks",), DATASET=str(source), PYTHON=sys.executable, LIMIT="2")
    helper = shlex.split(tasks[0])
    proc = subprocess.run(helper, cwd=RECIPE, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    imported = legorl_invocations(tasks)
    assert [argv[:2] for _, argv in imported] == [["tasks", "import"]]
    result = CliRunner().invoke(app, [*imported[0][1], "--json"])
    assert result.exit_code == 0, result.output
    listed = CliRunner().invoke(app, ["tasks", "list", "--run", str(tmp_path / "run"), "--json"])
    assert listed.exit_code == 0, listed.output
    images = {t["instance_id"]: t["image"] for t in json.loads(listed.output)}
    assert images == {"django__django-11099": "docker.io/swebench/sweb.eval.x86_64.django_1776_django-11099:latest",
                      "astropy__astropy-12907": "mine:1"}


def test_the_cpu_counterparts_exist_and_the_readme_names_them() -> None:
    readme = (RECIPE / "README.md").read_text()
    for path, marker in COUNTERPARTS.items():
        assert marker in (ROOT / path).read_text(), path
        assert path in readme, path
