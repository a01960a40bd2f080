"""Harbor grading: patches that fix nothing and try for a reward of 1 anyway (real podman, the
shipped Harbor tasks): each must score 0 and never be infrastructure, the gold patch 1.

From a red team that saw only the threat model and the code (docs/threat-model.md).
"""

from __future__ import annotations

import difflib
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from legorl.core import shards
from legorl.core.schemas import GradeRow, Kind, TaskRow

ROOT = Path(__file__).resolve().parents[2]
HARBOR_TASKS = ROOT / "examples" / "harbor-tasks"
LEGORL = str(Path(sys.executable).parent / "legorl")



def _file_patch(path: str, old: str | None, new: str, mode: str = "100644") -> str:
    """A git-style patch turning ``path`` from ``old`` (None: absent) into ``new``."""
    before = [] if old is None else old.splitlines(keepends=True)
    body = "".join(difflib.unified_diff(before, new.splitlines(keepends=True),
                                        "/dev/null" if old is None else f"a/{path}", f"b/{path}"))
    header = f"new file mode {mode}\n" if old is None else ""
    return f"diff --git a/{path} b/{path}\n{header}{body}"


BUGGY = (HARBOR_TASKS / "fix-fizzbuzz" / "environment" / "app" / "fizzbuzz.py").read_text()


def _fizz(code: str) -> str:
    """fizzbuzz.py left buggy, running ``code`` when the hidden tests import it (as the test user)."""
    return _file_patch("fizzbuzz.py", BUGGY, "import os, sys, time\n" + code + "\n" + BUGGY)


# Each: a patch on fix-fizzbuzz that fixes nothing. test.sh writes 0 on every path, as its last act.
HARBOR_ATTACKS = {
    # write 1, then make reward.txt read-only: test.sh's `echo 0 >` fails and the 1 stays — a regular
    # file, not a link, one link count
    "read-only reward": _fizz("open('/logs/verifier/reward.txt', 'w').write('1')\n"
                              "os.chmod('/logs/verifier/reward.txt', 0o444)\n"),
    # write 1, then lower test.sh's bash's open-file limit (same uid: no capability needed): its
    # `echo 0 >` redirection cannot open the file
    "starve test.sh of fds": _fizz("import resource\nopen('/logs/verifier/reward.txt', 'w').write('1')\n"
                                   "resource.prlimit(os.getppid(), resource.RLIMIT_NOFILE, (3, 3))\n"),
    # reach test.sh's bash through /proc/<ppid>/fd (its script, its stdout) and /proc/<ppid>/mem
    "test.sh through /proc": _fizz(
        "for _f in ('fd/255', 'fd/1', 'mem'):\n    try:\n"
        "        open('/proc/%d/%s' % (os.getppid(), _f), 'r+b').write(b'\\necho 1 > /logs/verifier/reward.txt\\n')\n"
        "    except OSError:\n        pass\n"),
    # the interpreter test.sh runs: shims in the WORKDIR (not on PATH), site hooks and a .pth next to
    # the code, a conftest.py in the WORKDIR; each exits 0 from pytest or writes the reward
    "python3/pytest/bash shims": _file_patch("python3", None, "#!/bin/sh\necho 1 > /logs/verifier/reward.txt\n",
                                             "100755")
    + _file_patch("pytest", None, "#!/bin/sh\nexit 0\n", "100755")
    + _file_patch("bin/bash", None, "#!/bin/sh\necho 1 > /logs/verifier/reward.txt\n", "100755"),
    "site hooks": _file_patch("sitecustomize.py", None, "import os\nos._exit(0)\n")
    + _file_patch("usercustomize.py", None, "import os\nos._exit(0)\n")
    + _file_patch("legorl.pth", None, "import os; os._exit(0)\n"),
    "workdir conftest": _file_patch("conftest.py", None,
                                    "def pytest_collection_modifyitems(items):\n    items.clear()\n"),
    # a package `__init__` beside the code under test that monkeypatches builtins and pytest's exit
    "builtins monkeypatch": _file_patch("__init__.py", None, "import builtins\nbuiltins.AssertionError = type("
                                        "'A', (Exception,), {})\n")
    + _fizz("import builtins\nbuiltins.print = lambda *a, **k: None\n"),
    # files under names test.sh or Harbor read: a reward, a report, a test module beside the code
    "planted names": _file_patch("logs/verifier/reward.txt", None, "1\n")
    + _file_patch("reward.txt", None, "1\n") + _file_patch("test_fizzbuzz.py", None, "def test_ok():\n    pass\n"),
    # the patch deletes what it can of the WORKDIR's repository
    "delete .git": "diff --git a/.git/HEAD b/.git/HEAD\ndeleted file mode 100644\n--- a/.git/HEAD\n+++ /dev/null\n"
    "@@ -1 +0,0 @@\n-ref: refs/heads/main\n",
    # a fork bomb while the tests run (the container's pids limit bounds it)
    "fork bomb": _fizz("for _ in range(100000):\n    try:\n        os.fork()\n    except OSError:\n"
                       "        time.sleep(0.01)\n"),
}
# What the grade must be: 0, never infrastructure. ``None``: any status but ``graded`` with reward 1.
EXPECTED_STATUS: dict[str, set[str]] = {
    "read-only reward": {"tests_errored"},
    "starve test.sh of fds": {"tests_errored"},
    "test.sh through /proc": {"graded", "suspicious"},
    "python3/pytest/bash shims": {"graded"},
    "site hooks": {"graded"},
    "workdir conftest": {"graded"},
    "builtins monkeypatch": {"graded", "suspicious"},
    "planted names": {"graded", "patch_apply_failed"},
    "delete .git": {"patch_apply_failed"},
    "fork bomb": {"graded", "tests_errored", "suspicious", "test_timeout"},
}


@pytest.fixture(scope="module")
def harbor_tasks(base_image: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, TaskRow]:
    src = tmp_path_factory.mktemp("harbor-src")
    for name in ("fix-fizzbuzz", "word-frequencies"):
        shutil.copytree(HARBOR_TASKS / name, src / name)
    run = tmp_path_factory.mktemp("harbor") / "run"
    proc = subprocess.run([LEGORL, "tasks", "import", str(src), "--run", str(run), "--json"],
                          capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return {t.instance_id: t for t in shards.read_rows(run / "tasks", Kind.TASKS)}


@pytest.mark.podman
@pytest.mark.slow
def test_harbor_attacks_score_zero_and_gold_one(harbor_tasks: dict[str, TaskRow]) -> None:
    from legorl.grading.grader import GradeOptions, Grader

    grader = Grader(GradeOptions(test_timeout=120))
    fizz = harbor_tasks["fix-fizzbuzz"]
    jobs: list[tuple[str, TaskRow, str]] = [("gold", fizz, fizz.patch or ""), ("empty", fizz, "")]
    jobs += [(name, fizz, patch) for name, patch in HARBOR_ATTACKS.items()]
    with ThreadPoolExecutor(2) as pool:
        rows: dict[str, GradeRow] = dict(zip([j[0] for j in jobs],
                                             pool.map(lambda j: grader.grade(j[1], j[2]), jobs), strict=True))
    verdicts = {name: (row.reward, row.status, row.error) for name, row in rows.items()}
    print("\n" + "\n".join(f"{k}: {v} {rows[k].dropped_paths}" for k, v in verdicts.items()))
    assert verdicts["gold"][:2] == (1.0, "graded") and verdicts["empty"][:2] == (0.0, "empty_patch")
    for name in HARBOR_ATTACKS:
        reward, status, _ = verdicts[name]
        assert reward == 0.0 and not rows[name].infra_failure, (name, verdicts[name])
        assert status in EXPECTED_STATUS[name], (name, verdicts[name])
    assert "not writable by test.sh" in (verdicts["read-only reward"][2] or ""), verdicts["read-only reward"]
    # bash's error names the redirection that failed
    assert "could not write its reward file" in (verdicts["starve test.sh of fds"][2] or ""), verdicts
    assert set(rows["site hooks"].dropped_paths or []) == {"sitecustomize.py", "usercustomize.py", "legorl.pth"}
    assert rows["workdir conftest"].dropped_paths == ["conftest.py"]


# The grading script without each of the two checks added against them (each replacement must apply).
WEAKENED = (('    elif ! as_user test -w "$f"; then ev "$1" readonly\n', ""),
            ("then ev reward_write_failed; fi", "then :; fi"))


@pytest.mark.podman
@pytest.mark.slow
def test_without_its_checks_a_reward_test_sh_could_not_write_scores_one(
        harbor_tasks: dict[str, TaskRow], monkeypatch: pytest.MonkeyPatch) -> None:
    """The two holes found on 2 December were real: with the checks out both attacks score 1; with only
    the grep of bash's error out, the read-only file is still refused by the writability check."""
    from legorl.grading import harbor
    from legorl.grading.grader import GradeOptions, Grader

    original = harbor.harbor_script
    fizz = harbor_tasks["fix-fizzbuzz"]

    def weakened(*args: Any, **kwargs: Any) -> str:
        script = original(*args, **kwargs)
        for old, new in drop:
            assert old in script
            script = script.replace(old, new)
        return script

    monkeypatch.setattr(harbor, "harbor_script", weakened)
    grader = Grader(GradeOptions(test_timeout=120))
    drop = WEAKENED
    for name in ("read-only reward", "starve test.sh of fds"):
        row = grader.grade(fizz, HARBOR_ATTACKS[name])
        assert (row.reward, row.status) == (1.0, "graded"), (name, row.error)
    drop = WEAKENED[1:]
    row = grader.grade(fizz, HARBOR_ATTACKS["read-only reward"])
    assert (row.reward, row.status) == (0.0, "tests_errored") and "not writable by test.sh" in (row.error or "")


# pytest fails, then an interpreter-exit finaliser ends the process with status 0 (test.sh writes 1),
# reaching os._exit by a name none of the screen's patterns spell
EXIT_FORGERY = _fizz("import weakref\nclass _K:\n    pass\n_k = _K()\n"
                     "weakref.finalize(_k, getattr(os, '_ex' + 'it'), 0)\n")


@pytest.mark.podman
@pytest.mark.slow
@pytest.mark.xfail(strict=True, reason="open (docs/threat-model.md, Harbor residual risks): Harbor grading has no "
                   "runner report, so pytest's exit status forged in-process is stopped only by the screen")
def test_pytest_exit_status_forged_past_the_screen(harbor_tasks: dict[str, TaskRow]) -> None:
    from legorl.grading.grader import GradeOptions, Grader

    row = Grader(GradeOptions(test_timeout=120)).grade(harbor_tasks["fix-fizzbuzz"], EXIT_FORGERY)
    assert row.reward == 0.0, (row.status, row.error, row.suspicious)
