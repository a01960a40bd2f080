"""What one patch can make ``legorl grade`` spend is bounded: the code under test writing a gigabyte
to its output and everything it can reach — above all a report the host parses, made of millions of
tiny JSON objects — costs the grading process a fixed budget of memory, and the grade is the
patch's (a 0, never infrastructure)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from grading_support import Tree, shipped_tasks

pytestmark = pytest.mark.podman

TASK = "parse__constant-13d57205"
BUDGET_MB = 500  # the acceptance bar: the grading process's peak memory grows by less than this

# At import, in the test process: the report descriptor (the runner's, inherited) gets a valid JSON
# object of millions of empty objects — the biggest thing the host parses for the cheapest bytes —
# then stdout, stderr and every pipe get a gigabyte, and the process leaves before the runner's report.
FLOOD = '''
import os as _os, stat as _stat


def _flood():
    tiny = b"{}," * (1 << 18)
    for fd in range(3, 256):
        try:
            if _os.readlink("/proc/self/fd/%d" % fd).endswith("report.json"):
                _os.write(fd, b\'{"statuses": {}, "tampered": [\')
                for _ in range(400):  # 300 MB, far past any cap
                    _os.write(fd, tiny)
                _os.write(fd, b"{}]}")
        except OSError:
            pass
    chunk = b"x" * (1 << 20)
    for fd in range(256):
        try:
            mode = _os.fstat(fd).st_mode
            if fd in (1, 2) or _stat.S_ISFIFO(mode):
                for _ in range(1024):
                    _os.write(fd, chunk)
        except OSError:
            pass
    _os._exit(0)


_flood()
'''

# Grades in a fresh process, so its peak memory is this grade's alone: the peak before grading (the
# imports, the task) and after.
GRADE = r'''
import json, sys
from legorl.grading.grader import GradeOptions, Grader
from legorl.core.schemas import TaskRow

def hwm_mb():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) // 1024

task = TaskRow.from_dict(json.loads(open(sys.argv[1]).read()))
patch = open(sys.argv[2]).read()
grader = Grader(GradeOptions(test_timeout=120, canaries=False))
grader.reference(task)  # the gold run: what any grade of this task costs
before = hwm_mb()
row = grader.grade(task, patch)
print(json.dumps({"before": before, "after": hwm_mb(), "reward": row.reward, "infra": row.infra_failure,
                  "status": str(row.status), "error": row.error, "seconds": row.duration_s}))
'''


def test_a_patch_flooding_its_report_and_output_costs_the_grader_a_fixed_budget(base_image: str, tmp_path: Path) -> None:
    task = shipped_tasks()[TASK]
    tree = Tree(task, tmp_path / "repo")
    patch = tree.diff(tree.append("parse/__init__.py", FLOOD))
    (tmp_path / "task.json").write_text(json.dumps(task.to_dict()))
    (tmp_path / "patch.diff").write_text(patch)
    (tmp_path / "grade.py").write_text(GRADE)
    start = time.monotonic()
    proc = subprocess.run([sys.executable, str(tmp_path / "grade.py"), str(tmp_path / "task.json"),
                           str(tmp_path / "patch.diff")], capture_output=True, text=True, timeout=900)
    took = time.monotonic() - start
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (seen["reward"], seen["infra"]) == (0.0, False), seen
    grew = seen["after"] - seen["before"]
    print(f"report and output flood: grading process peak {seen['before']} -> {seen['after']} MB, "
          f"{seen['status']} ({seen['error']}), {took:.0f} s")
    assert grew < BUDGET_MB, seen


# Just under the report's byte cap: ~2.6 million empty objects in 7.9 MB (a red team's: it cost the
# grading process 400 MB before JSON values were counted).
UNDER_THE_BYTE_CAP = '''
import os as _os

for _fd in range(3, 256):
    try:
        if _os.readlink("/proc/self/fd/%d" % _fd).endswith("report.json"):
            _os.write(_fd, b'{"x": [' + b"{}," * 2_630_000 + b'{}]}')
    except OSError:
        pass
_os._exit(0)
'''


def test_a_report_just_under_its_byte_cap_is_refused_by_its_count_of_values(base_image: str, tmp_path: Path) -> None:
    task = shipped_tasks()[TASK]
    tree = Tree(task, tmp_path / "repo")
    (tmp_path / "task.json").write_text(json.dumps(task.to_dict()))
    (tmp_path / "patch.diff").write_text(tree.diff(tree.append("parse/__init__.py", UNDER_THE_BYTE_CAP)))
    (tmp_path / "grade.py").write_text(GRADE)
    proc = subprocess.run([sys.executable, str(tmp_path / "grade.py"), str(tmp_path / "task.json"),
                           str(tmp_path / "patch.diff")], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (seen["reward"], seen["infra"]) == (0.0, False), seen
    assert "JSON values" in (seen["error"] or ""), seen
    print(f"report of 2.6 M values: grading process peak {seen['before']} -> {seen['after']} MB")
    assert seen["after"] - seen["before"] < 100, seen
