"""Harbor task directories as a task source: reading and checking them (no podman), importing the
shipped ones through `legorl tasks import` (images built offline), and grading through `legorl
grade` — gold 1, empty 0, and attacks on the reward file 0 (docs/threat-model.md, "Harbor tasks")."""

from __future__ import annotations

import base64
import difflib
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from legorl.core import shards
from legorl.core.schemas import GradeRow, Kind, TaskRow
from legorl.grading.harbor import parse_reward
from legorl.grading.script import Events
from legorl.sandbox.host import podman_env
from legorl.tasks.harbor import HarborTaskError, read_task, task_dirs

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples" / "harbor-tasks"
LEGORL = str(Path(sys.executable).parent / "legorl")
SHIPPED = ("fix-fizzbuzz", "roman-numerals", "word-frequencies")


def _legorl(*args: str, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    return subprocess.run([LEGORL, *args], capture_output=True, text=True, timeout=timeout)


# --------------------------------------------------------------------------- reading task directories


def _copy(tmp_path: Path, name: str = "fix-fizzbuzz") -> Path:
    dst = tmp_path / name
    shutil.copytree(EXAMPLES / "fix-fizzbuzz", dst, symlinks=True)
    return dst


def test_the_shipped_tasks_read_cleanly() -> None:
    tasks = [read_task(p) for p in task_dirs(EXAMPLES)]
    assert [t.name for t in tasks] == list(SHIPPED)
    words = tasks[2]
    assert words.verifier_timeout == 120.0 and words.verifier_env == {"WORDS_MIN_SCORE": "1.0"}
    assert words.test_command == "WORDS_MIN_SCORE=1.0 bash /tests/test.sh"
    assert task_dirs(EXAMPLES / "roman-numerals") == [EXAMPLES / "roman-numerals"]  # one task dir is a source too


@pytest.mark.parametrize("breakage, problem", [
    (lambda d: (d / "instruction.md").unlink(), "missing instruction.md"),
    (lambda d: (d / "instruction.md").write_text("  \n"), "instruction.md is empty"),
    (lambda d: (d / "task.toml").write_text("[verifier\ntimeout_sec = 1\n"), "task.toml is not valid TOML"),
    (lambda d: (d / "task.toml").write_text("[verifier]\ntimeout_sec = -3\n"), "timeout_sec must be a positive"),
    (lambda d: (d / "task.toml").write_text("[verifier]\nenv = { A = 1 }\n"), "[verifier] env must be a table"),
    (lambda d: (d / "tests" / "test.sh").unlink(), "missing tests/test.sh"),
    (lambda d: ((d / "tests" / "test.sh").unlink(), (d / "tests" / "test.sh").symlink_to("/bin/true")),
     "tests/test.sh is not a regular file"),
    (lambda d: ((d / "environment" / "Dockerfile").unlink(),
                (d / "environment" / "docker-compose.yaml").write_text("services: {}\n")),
     "environment/ has no Dockerfile (found app, docker-compose.yaml)"),
    (lambda d: shutil.rmtree(d / "environment"), "no environment/ folder and no [environment] docker_image"),
    (lambda d: (d / "task.toml").write_text('[environment]\ndocker_image = ""\n'), "docker_image must be an image"),
])
def test_bad_task_dirs_are_named_with_their_problem(tmp_path: Path, breakage, problem: str) -> None:
    task = _copy(tmp_path, "broken-task")
    breakage(task)
    with pytest.raises(HarborTaskError) as err:
        read_task(task)
    assert str(err.value).startswith("harbor task broken-task: ") and problem in str(err.value)


def _events(**files: str) -> Events:
    """What the grading script reports about /logs/verifier (data: base64 of the file's bytes)."""
    return Events(seen={k.replace("_", "."): v if v in ("link", "hardlink", "special") else
                        "data:" + base64.b64encode(v.encode()).decode() for k, v in files.items()})


@pytest.mark.parametrize("files, reward, problem", [
    ({"reward_txt": "1\n"}, 1.0, None),
    ({"reward_txt": " 0.25 "}, 0.25, None),
    ({"reward_txt": "0", "reward_json": '{"reward": 1}'}, 0.0, None),  # Harbor: reward.txt first
    ({"reward_json": '{"reward": 1}'}, 1.0, None),
    ({"reward_json": '{"accuracy": 0.5}'}, 0.5, None),
    ({}, None, "wrote neither"),
    ({"reward_txt": "yes"}, None, "not a number"),
    ({"reward_txt": "nan"}, None, "not a finite number"),
    ({"reward_txt": "7"}, None, "outside [0, 1]"),
    ({"reward_json": '{"a": 1, "b": 0}'}, None, "several rewards and no 'reward'"),
    ({"reward_json": "[1]"}, None, "not a JSON object"),
    ({"reward_json": '{"reward": true}'}, None, "not a finite number"),
    ({"reward_txt": "link", "reward_json": '{"reward": 1}'}, None, "reward.txt is a symbolic link"),
    ({"reward_txt": "special", "reward_json": '{"reward": 1}'}, None, "reward.txt is not a regular file"),
    ({"reward_txt": "hardlink"}, None, "reward.txt is a hard link"),
])
def test_reward_file_rules(files: dict[str, str], reward: float | None, problem: str | None) -> None:
    got, why = parse_reward(_events(**files))
    assert got == reward
    assert (why is None) if problem is None else (problem in (why or ""))


# --------------------------------------------------------------------------- podman: import and grade


def _file_patch(path: str, old: str | None, new: str) -> str:
    """A git-style patch turning ``path`` from ``old`` (None: absent) into ``new``."""
    before = [] if old is None else old.splitlines(keepends=True)
    body = "".join(difflib.unified_diff(before, new.splitlines(keepends=True),
                                        "/dev/null" if old is None else f"a/{path}", f"b/{path}"))
    mode = "new file mode 100644\n" if old is None else ""
    return f"diff --git a/{path} b/{path}\n{mode}{body}"


BUGGY = (EXAMPLES / "fix-fizzbuzz" / "environment" / "app" / "fizzbuzz.py").read_text()


def _fizz_attack(code: str) -> str:
    """fizzbuzz.py left buggy, with ``code`` run when the tests import it (as the test user)."""
    return _file_patch("fizzbuzz.py", BUGGY, "import os, sys, time\n" + code + "\n" + BUGGY)


# Each attack: a patch that fixes nothing and tries to make the reward 1 anyway; what stops it.
ATTACKS = {
    # a daemon outlives test.sh to write 1 after test.sh wrote its 0: a survivor fails the run, and it is
    # killed before root reads the file
    "late daemon": _fizz_attack(
        "if os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n        for _ in range(100):\n"
        "            time.sleep(0.1)\n            try:\n                open('/logs/verifier/reward.txt', 'w').write('1')\n"
        "            except OSError:\n                pass\n    os._exit(0)\n"),
    # write 1, then kill test.sh before it writes its 0: a test.sh killed by a signal gives no reward
    "kill test.sh": _fizz_attack(
        "open('/logs/verifier/reward.txt', 'w').write('1')\nos.kill(os.getppid(), 9)\n"),
    # reward.txt a link to a read-only file holding 1, so test.sh's `echo 0 >` fails: links are refused
    "reward link": _fizz_attack(
        "open('/app/one', 'w').write('1')\nos.chmod('/app/one', 0o444)\n"
        "os.symlink('/app/one', '/logs/verifier/reward.txt')\n"),
    # reward.txt a folder (test.sh's write fails) and reward.json says 1: reward.txt exists, so it decides
    "reward folder + json": _fizz_attack(
        "os.mkdir('/logs/verifier/reward.txt')\n"
        "open('/logs/verifier/reward.json', 'w').write('{\"reward\": 1}')\n"),
    # test.sh is read by bash as it runs: rewriting it would append `echo 1`; /tests is root's and read-only
    "rewrite test.sh": _fizz_attack(
        "try:\n    open('/tests/test.sh', 'a').write('\\necho 1 > /logs/verifier/reward.txt\\n')\n"
        "except OSError:\n    pass\n"),
    # test.sh runs `python3 -m pytest` in /app, so /app/pytest.py would be the test runner: the judge puts back
    # a module shadowing an installed one
    "shadow pytest": _file_patch("pytest.py", None, "import sys\nprint('3 passed')\nsys.exit(0)\n"),
    # the patch itself plants a reward file and a test.sh outside the WORKDIR: refused by every applier,
    # and /logs and /tests are made afresh after the patch anyway
    "planted /logs and /tests": _file_patch("../logs/verifier/reward.txt", None, "1\n")
    + _file_patch("../tests/test.sh", None, "echo 1 > /logs/verifier/reward.txt\n"),
}


def _slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name)


@pytest.fixture(scope="module")
def harbor_run(base_image: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run whose tasks/ holds the shipped Harbor tasks, imported through the CLI next to bad ones."""
    src = tmp_path_factory.mktemp("harbor-src")
    for name in SHIPPED:
        shutil.copytree(EXAMPLES / name, src / name)
    shutil.copytree(EXAMPLES / "fix-fizzbuzz", src / "no-tests")
    (src / "no-tests" / "tests" / "test.sh").unlink()
    shutil.copytree(EXAMPLES / "fix-fizzbuzz", src / "bad-from")
    (src / "bad-from" / "environment" / "Dockerfile").write_text("FROM localhost/no-such-image:1\nWORKDIR /app\n")
    run = tmp_path_factory.mktemp("harbor") / "run"
    proc = _legorl("tasks", "import", str(src), "--run", str(run), "--json")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    out = json.loads(proc.stdout[:proc.stdout.rindex("}") + 1])
    assert sorted(out["written"]) == sorted(SHIPPED)
    errors = "\n".join(out["errors"])
    assert "harbor task no-tests: missing tests/test.sh" in errors
    assert "harbor task bad-from: environment/Dockerfile does not build offline" in errors
    return run


@pytest.mark.podman
def test_import_builds_images_and_records_the_gold_patch(harbor_run: Path) -> None:
    tasks: dict[str, TaskRow] = {t.instance_id: t for t in shards.read_rows(harbor_run / "tasks", Kind.TASKS)}
    assert sorted(tasks) == sorted(SHIPPED)
    for task in tasks.values():
        assert task.grader == "harbor" and task.workdir == "/app" and task.test_timeout == 120.0
        assert task.image and task.image.startswith("localhost/legorl-harbor-") and task.FAIL_TO_PASS == ["tests/test.sh"]
        assert task.patch and task.patch.startswith("diff --git ")
        # the agent's image: /testbed is the WORKDIR as a one-commit repository; no tests, no solution in it
        probe = subprocess.run(["podman", "run", "--rm", "--network", "none", task.image, "sh", "-c",
                                "readlink /testbed; git -C /testbed rev-list --count HEAD; git -C /testbed status "
                                "--porcelain | wc -l; ls -d /tests /solution /logs 2>&1 | grep -c 'No such'"],
                               capture_output=True, text=True, timeout=300, env=podman_env())
        assert probe.stdout.split() == ["/app", "1", "0", "3"], probe.stdout + probe.stderr
    assert "roman.py" in (tasks["roman-numerals"].patch or "") and "new file mode" in (tasks["roman-numerals"].patch or "")
    again = _legorl("tasks", "import", str(EXAMPLES / "roman-numerals"), "--run", str(harbor_run), "--json")
    assert again.returncode == 0 and json.loads(again.stdout)["unchanged"] == ["roman-numerals"]  # same image reused


@pytest.mark.podman
def test_gold_one_empty_zero_attacks_zero_through_legorl_grade(harbor_run: Path, tmp_path: Path) -> None:
    tasks = {t.instance_id: t for t in shards.read_rows(harbor_run / "tasks", Kind.TASKS)}
    gold = _legorl("grade", "--run", str(harbor_run), "--gold", "--concurrency", "2", "--json")
    assert gold.returncode == 0, gold.stderr
    assert {g["task_id"]: (g["reward"], g["status"]) for g in json.loads(gold.stdout)["grades"]} == \
        dict.fromkeys(SHIPPED, (1.0, "graded"))

    lines = [{"instance_id": iid, "model_patch": "", "model_name_or_path": "empty"} for iid in SHIPPED]
    lines += [{"instance_id": "fix-fizzbuzz", "model_patch": patch, "model_name_or_path": _slug(name)}
              for name, patch in ATTACKS.items()]
    lines += [{"instance_id": "word-frequencies", "model_patch": tasks["word-frequencies"].patch,
               "model_name_or_path": "gold-copy"}]
    predictions = tmp_path / "preds.jsonl"
    predictions.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    preds = _legorl("grade", "--run", str(harbor_run), "--predictions", str(predictions), "--concurrency", "2", "--json")
    assert preds.returncode == 0, preds.stderr
    rows: dict[str, GradeRow] = {}
    for row in shards.read_rows(harbor_run / "grades", Kind.GRADES):
        rows[f"{row.trial_id.split('/')[1]}:{row.task_id}" if "/" in row.trial_id else f"gold:{row.task_id}"] = row
    assert rows["gold-copy:word-frequencies"].reward == 1.0
    for iid in SHIPPED:
        assert rows[f"empty:{iid}"].reward == 0.0 and not rows[f"empty:{iid}"].infra_failure
    attacked = {name: rows[f"{_slug(name)}:fix-fizzbuzz"] for name in ATTACKS}
    verdicts = {name: (row.reward, row.status, row.error) for name, row in attacked.items()}
    print("\n" + "\n".join(f"{k}: {v}" for k, v in verdicts.items()))
    assert all(reward == 0.0 for reward, _status, _error in verdicts.values()), verdicts
    assert not any(row.infra_failure for row in attacked.values())
    assert verdicts["kill test.sh"][1:] == ("tests_errored", "test.sh was killed by signal 9")
    assert verdicts["reward link"][1] == "tests_errored" and "symbolic link" in (verdicts["reward link"][2] or "")
    assert verdicts["reward folder + json"][1] == "tests_errored" and "not a regular file" in (
        verdicts["reward folder + json"][2] or "")
    assert verdicts["late daemon"][1] == "tests_errored" and "still running" in (verdicts["late daemon"][2] or "")
    assert verdicts["rewrite test.sh"][1] == "graded"
    assert verdicts["shadow pytest"][1] == "graded" and attacked["shadow pytest"].dropped_paths == ["pytest.py"]
    assert verdicts["planted /logs and /tests"][1] == "patch_apply_failed"


@pytest.mark.podman
def test_a_trial_patch_from_testbed_grades(harbor_run: Path) -> None:
    """What a rollout does on a Harbor image — prepare /testbed, the agent edits it there, take the
    patch — gives a patch the grader scores 1: /testbed is the task's WORKDIR."""
    from legorl.grading.grader import GradeOptions, Grader
    from legorl.sandbox.base import SandboxSpec
    from legorl.sandbox.podman import PodmanBackend
    from legorl.trials.lifecycle import TrialRunner

    task = next(t for t in shards.read_rows(harbor_run / "tasks", Kind.TASKS) if t.instance_id == "fix-fizzbuzz")

    box = PodmanBackend(api="cli").create(SandboxSpec(image=task.image or "", labels={"role": "test"}))
    try:
        TrialRunner.prepare(box, task)
        fixed = BUGGY.replace('    if n % 3 == 0:\n', '    if n % 15 == 0:\n        return "FizzBuzz"\n    if n % 3 == 0:\n', 1)
        box.put_file("/testbed/fizzbuzz.py", fixed.encode())
        seen = box.exec("ls /tests /logs /solution 2>&1 | grep -c 'No such'; pwd -P").output.split()
        assert seen == ["3", "/app"]  # no hidden tests, logs or solution in the trial; /testbed is the WORKDIR
        patch = box.patch()
    finally:
        box.remove()
    assert patch.startswith("diff --git a/fizzbuzz.py b/fizzbuzz.py")
    row = Grader(GradeOptions()).grade(task, patch)
    assert (row.reward, row.status) == (1.0, "graded"), row.error


# The grading script with one defence taken out (each replacement must change the script). The
# reward link (to a read-only file) makes test.sh's own write fail, so the checks that catch that
# failure (the file not writable by the test user, bash's error) go with it.
WEAKENED: dict[str, list[tuple[str, str]]] = {
    "late daemon": [("if survivors; then ev survivors; fi\nkill_user\n", "sleep 2\nkill_user\n")],
    "reward link": [('if [ -L "$f" ]; then ev "$1" link; elif', "if false; then :; elif"),
                    ('elif ! as_user test -w "$f"; then ev "$1" readonly', "elif false; then :"),
                    ("then ev reward_write_failed; fi", "then :; fi")],
    "rewrite test.sh": [("chmod -R go-w,a+rX /tests", "chmod -R a+rwX /tests")],
}


@pytest.mark.podman
@pytest.mark.slow
def test_each_defence_is_what_stops_its_attack(harbor_run: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without its defence an attack scores 1 (the late daemon is then left to the screen)."""
    from legorl.grading import harbor
    from legorl.grading.grader import GradeOptions, Grader

    task = next(t for t in shards.read_rows(harbor_run / "tasks", Kind.TASKS) if t.instance_id == "fix-fizzbuzz")
    original = harbor.harbor_script
    for name, replacements in WEAKENED.items():
        def weakened(*args: object, _replacements: list[tuple[str, str]] = replacements, **kwargs: object) -> str:
            script = original(*args, **kwargs)  # type: ignore[arg-type]
            for old, new in _replacements:
                assert old in script
                script = script.replace(old, new)
            return script

        monkeypatch.setattr(harbor, "harbor_script", weakened)
        row = Grader(GradeOptions()).grade(task, ATTACKS[name])
        if name == "late daemon":  # it wins the reward file; only the screen's finding (os.fork) zeroes the pass
            assert (row.reward, row.status) == (0.0, "suspicious") and "test.sh gave 1" in (row.error or "")
        else:
            assert (row.reward, row.status) == (1.0, "graded"), (name, row.error)
    monkeypatch.setattr(harbor, "harbor_script", original)
    # no judge: /app/pytest.py is the test runner
    monkeypatch.setattr(harbor, "sandboxed_files", lambda *names: {"legorl_grading/judge.py": "def main():\n    print('{}')\n"})
    row = Grader(GradeOptions()).grade(task, ATTACKS["shadow pytest"])
    assert (row.reward, row.status) == (1.0, "graded")
