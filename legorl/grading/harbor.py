"""Grade a Harbor task (``TaskRow.grader == "harbor"``): its own ``tests/test.sh`` decides the reward.

One fresh container from the task's image (network off) runs :func:`harbor_script` as root:

1. the WORKDIR's ``.git`` is moved aside and a pristine copy of the tree is taken; the tree is
   handed to the unprivileged test user (uid 1777), who applies the patch as legorl applies patches
   (``git apply``, ``--reject``, GNU ``patch --fuzz=5``, the tree put back between tries); every
   process of that user is then killed, and whatever ``.git`` the patch made is replaced by the pristine one;
   where the image has python3, :mod:`.sandboxed.judge` puts back what a patch may not change (a
   module shadowing ``pytest`` or the stdlib, ``conftest.py``, ``.pth``, links, native code...) and
   screens its Python lines, as for SWE tasks, except that a new module that shadows nothing stays;
2. ``/tests`` and ``/logs`` are made afresh by root — whatever the image or the patch put there is
   gone — ``/tests`` from the task row only now, root's and read-only, ``/logs`` root's with only
   ``/logs/verifier`` the test user's;
3. ``test.sh`` runs as the test user under the verifier timeout; a process of that user still
   running once it exited makes the run a failure (a daemon left behind could rewrite the reward);
   every process of that user is killed, and only then root reads ``/logs/verifier/reward.txt`` (a float, Harbor's precedence)
   or ``reward.json`` (``{"reward": x}`` or one number) — a link, a hard link or a special file is refused.

What the host learns comes from event lines carrying a nonce the test user cannot read (as in
:mod:`.script`). ``test.sh`` killed by a signal, no reward file, or a malformed one is a failure
after the patch went in: ``tests_errored``, reward 0, unless the task's control run (the gold
patch, else the empty one) fails too — then it is the task's or the infrastructure's
(``infra_error``). The code under test runs with ``test.sh``'s privileges, so it can write the reward
file itself; docs/threat-model.md says what that leaves open.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import secrets
import shlex
from collections.abc import Callable
from dataclasses import dataclass

from legorl.core.schemas import GradeRow, GradeStatus, Resolution, TaskRow, TestResult
from legorl.grading.container import INFRA_SLACK_S, GradingContainers, GradingInfraError, Run
from legorl.grading.options import GradeOptions
from legorl.grading.patches import touched_paths
from legorl.grading.report import F2P, zero
from legorl.grading.script import (
    APPLY_METHODS,
    APPLY_TIMEOUT_S,
    JUDGE_TIMEOUT_S,
    MAX_JUDGE_OUTPUT,
    MAX_TEST_OUTPUT,
    WORK,
    Events,
    bundle,
    launch,
    patch_apply_block,
    read_events,
    sandboxed_files,
    script_head,
)
from legorl.sandbox.base import SandboxSpec

REWARD_FILES = ("reward.txt", "reward.json")  # Harbor's precedence: reward.txt first
MAX_REWARD_BYTES = 65_536
_UNPACK = f"tar -x -i --no-same-owner -C / -f - && exec bash {WORK}/harbor.sh"
_REFUSED = {"link": "a symbolic link", "hardlink": "a hard link", "special": "not a regular file",
            "readonly": "not writable by test.sh (made read-only, so that test.sh's own write failed)"}
_WRITE_FAILED = r": line [0-9]+: (/logs/verifier/)?reward\.(txt|json): "


def harbor_script(nonce: str, *, workdir: str, command: str, timeout: float, has_patch: bool) -> str:
    """The whole grade as one bash script (root, in the container)."""
    q = shlex.quote
    apply_block = patch_apply_block('"$D"') if has_patch else ""
    return script_head(nonce, "legorl/grading/harbor.py") + f"""user_alive() {{ for p in /proc/[0-9]*; do [ "$(stat -c %u "$p" 2>/dev/null)" = "$U" ] || continue
  grep -qs '^State:[[:space:]]*Z' "$p/status" || return 0; done; return 1; }}
survivors() {{ for _ in 1 2 3; do user_alive || return 1; sleep 0.1; done; return 0; }}
kill_user() {{ for _ in 1 2 3 4 5 6 7 8 9 10; do as_user bash -c 'kill -9 -1' >/dev/null 2>&1; user_alive || return 0; \\
  sleep 0.2; done; ev infra "processes of the test user survive kill -9"; exit 0; }}
reset_tree() {{ find "$D" -mindepth 1 -maxdepth 1 -exec rm -rf {{}} + && cp -a $W/pristine/. "$D"/ && chown -R $U:$U "$D"; }}
reward_file() {{ f=/logs/verifier/$1
  if [ -L "$f" ]; then ev "$1" link; elif [ -e "$f" ] && [ ! -f "$f" ]; then ev "$1" special
  elif [ -f "$f" ]; then if [ "$(stat -c %h "$f")" != 1 ]; then ev "$1" hardlink
    elif ! as_user test -w "$f"; then ev "$1" readonly
    else ev "$1" "data:$(head -c {MAX_REWARD_BYTES + 1} "$f" | base64 -w0)"; fi; fi; }}
export HOME=/nonexistent GIT_CONFIG_NOSYSTEM=1 GIT_CONFIG_GLOBAL=/dev/null GIT_CEILING_DIRECTORIES=/ \\
  GIT_TERMINAL_PROMPT=0
command -v setpriv >/dev/null || {{ ev infra "the image has no setpriv (util-linux)"; exit 0; }}
cd {q(workdir)} 2>/dev/null || {{ ev infra "the image has no WORKDIR "{q(workdir)}; exit 0; }}
D=$(pwd -P)
if [ -e .git ]; then mv .git $W/git || {{ ev infra "cannot move the WORKDIR's .git"; exit 0; }}; fi
cp -a "$D" $W/pristine && chown -R $U:$U "$D" || {{ ev infra "cannot copy the WORKDIR"; exit 0; }}
mkdir -p $W/tests && base64 -d $W/tests.b64 | tar -xz --no-same-owner -C $W/tests \\
  || {{ ev infra "cannot unpack the task's tests"; exit 0; }}
ev ready
{apply_block}ev applied
rm -rf "$D/.git"
PY=$(command -v python3 || true)
if [ -n "$PY" ]; then
  J=$(cd $W && timeout -k 5 {JUDGE_TIMEOUT_S} "$PY" -I -c {q(launch(WORK, 'judge'))} $W/judge.json 2>$W/judge.err \
    | head -c {MAX_JUDGE_OUTPUT}; exit "${{PIPESTATUS[0]}}"); jc=$?
  if [ $jc -ne 0 ]; then ev judge_failed "$(tail -c 400 $W/judge.err | base64 -w0)"; exit 0; fi
  ev judged "$(printf %s "$J" | base64 -w0)"
fi
if [ -d $W/git ]; then mv $W/git "$D/.git"; fi
rm -rf $W/pristine /tests /logs && mkdir -p /tests /logs/verifier /logs/agent /tmp/.legorl-home \\
  && cp -a $W/tests/. /tests/ && chown -R 0:0 /tests /logs && chmod -R go-w,a+rX /tests && chmod 755 /logs \\
  && chown $U:$U /logs/verifier /tmp/.legorl-home || {{ ev infra "cannot prepare /tests and /logs"; exit 0; }}
ev tests_start
t0=$SECONDS
(cd "$D" && timeout -k 5 {timeout:g} setpriv --reuid=$U --regid=$U --clear-groups env HOME=/tmp/.legorl-home \\
  bash -c {q(command)}) >$W/test.out 2>&1 </dev/null
code=$?
elapsed=$((SECONDS - t0))
if survivors; then ev survivors; fi
kill_user
# bash's own error for a redirection test.sh could not open ("line 4: /logs/verifier/reward.txt: Too many
# open files"): code under test lowered its limits or its access; whatever is in the file is not test.sh's
if grep -aqE {q(_WRITE_FAILED)} $W/test.out; then ev reward_write_failed; fi
head -c {MAX_TEST_OUTPUT} $W/test.out
ev tests_end "$code $elapsed"
if [ -L /logs/verifier ] || [ ! -d /logs/verifier ]; then ev reward_dir gone; else
  for f in {" ".join(REWARD_FILES)}; do reward_file "$f"; done; fi
ev done
"""


def parse_reward(events: Events) -> tuple[float | None, str | None]:
    """The reward the task's test.sh wrote, or why there is none (Harbor's rules: reward.txt, a
    float, before reward.json; legorl's: finite, within [0, 1])."""
    if "reward_dir" in events:
        return None, "/logs/verifier is gone or was replaced"
    for name in REWARD_FILES:  # a planted file is named as such before the write it made fail
        if events.data(name) in _REFUSED:
            return None, f"/logs/verifier/{name} is {_REFUSED[events.data(name)]} (refused)"
    if "reward_write_failed" in events:
        return None, "test.sh could not write its reward file (its bash reported the redirection failing)"
    for name in REWARD_FILES:
        data = events.data(name)
        if not data:
            continue
        try:
            raw = base64.b64decode(data.removeprefix("data:"), validate=True)
        except (binascii.Error, ValueError):
            return None, f"/logs/verifier/{name} could not be read back"
        if len(raw) > MAX_REWARD_BYTES:
            return None, f"/logs/verifier/{name} is over {MAX_REWARD_BYTES} bytes"
        text = raw.decode("utf-8", "replace").strip()
        value: object
        if name == "reward.txt":
            try:
                value = float(text)
            except ValueError:
                return None, f"/logs/verifier/reward.txt is not a number: {text[:60]!r}"
        else:
            try:
                data_json = json.loads(text)
            except (json.JSONDecodeError, RecursionError):
                return None, "/logs/verifier/reward.json is not JSON"
            if not isinstance(data_json, dict) or not data_json:
                return None, "/logs/verifier/reward.json is not a JSON object of rewards"
            if "reward" in data_json:
                value = data_json["reward"]
            elif len(data_json) == 1:
                value = next(iter(data_json.values()))
            else:
                return None, f"/logs/verifier/reward.json has several rewards and no 'reward' ({', '.join(list(data_json)[:5])})"
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            return None, f"/logs/verifier/{name}: the reward is not a finite number ({value!r})"
        if not 0.0 <= value <= 1.0:
            return None, f"/logs/verifier/{name}: the reward {value:g} is outside [0, 1]"
        return float(value), None
    return None, "test.sh wrote neither /logs/verifier/reward.txt nor /logs/verifier/reward.json"


@dataclass
class HarborRun:
    """One Harbor grading container's run."""

    run: Run  # for its events, result and before_patch_error
    events: Events
    timeout: float

    @property
    def exit_and_elapsed(self) -> tuple[int | None, int | None]:
        parts = self.events.data("tests_end").split()
        try:
            return int(parts[0]), int(parts[1])
        except (ValueError, IndexError):
            return None, None

    def timed_out(self) -> bool:
        code, elapsed = self.exit_and_elapsed
        return code in (124, 137) and elapsed is not None and elapsed >= self.timeout - 1

    def failure(self) -> str | None:
        """Why this run gives no trustworthy reward after the patch went in (None: it does)."""
        ev = self.events
        if "applied" not in ev:
            return f"the grading script stopped while applying the patch (exit {self.run.result.exit_code})"
        if "judge_failed" in ev:
            return "the patched tree could not be judged"
        if "tests_end" not in ev:
            if "infra" in ev:
                return ev.data("infra")
            return (f"the grading script stopped during the tests (exit {self.run.result.exit_code}"
                    f"{', timed out' if self.run.result.timed_out else ''})")
        if "done" not in ev:
            return ev.data("infra") or "the grading script stopped before reading the reward"
        code, _ = self.exit_and_elapsed
        if code is None:
            return "test.sh's exit status could not be read"
        if code > 128 and not self.timed_out():
            return f"test.sh was killed by signal {code - 128}"
        if "survivors" in ev:
            return "processes test.sh started were still running after it exited (one could rewrite the reward)"
        _reward, problem = parse_reward(ev)
        return problem


class HarborTests:
    """The grading of Harbor tasks: their own test.sh decides."""

    def __init__(self, options: GradeOptions, containers: GradingContainers,
                 after_patch: Callable[[TaskRow, GradeRow, str], None]):
        self.options = options
        self.containers = containers
        self.after_patch = after_patch  # a run that broke after the patch went in: the control run decides

    def run(self, task: TaskRow, patch: str) -> HarborRun:
        """``patch`` graded by the task's test.sh in one fresh container."""
        if not task.hidden_tests or not task.workdir:
            raise GradingInfraError(f"task {task.instance_id}: a harbor task row needs hidden_tests and workdir")
        options = self.options
        timeout = task.test_timeout or options.test_timeout
        nonce = secrets.token_hex(16)
        files = {
            "harbor.sh": harbor_script(nonce, workdir=task.workdir, command=task.test_command or "bash /tests/test.sh",
                                       timeout=timeout, has_patch=bool(patch.strip())),
            "patch.diff": patch,
            "tests.b64": task.hidden_tests,
            **sandboxed_files("judge.py", "screen.py"),
            # in a WORKDIR (usually a flat folder) a new module is the usual shape of a solution; one that
            # shadows the stdlib or an installed module still goes back
            "judge.json": json.dumps({"tree": task.workdir, "pristine": f"{WORK}/pristine", "hidden": [],
                                      "changes": f"{WORK}/changes.json", "gold": touched_paths(task.patch),
                                      "top_level_modules": True}),
        }
        limit = timeout + INFRA_SLACK_S + len(APPLY_METHODS) * (APPLY_TIMEOUT_S + 5)
        spec = SandboxSpec(image=self.containers.image_for(task), labels={"role": "grade", **options.labels},
                           network=False, memory=options.memory, cpus=options.cpus, workdir=task.workdir,
                           deadline_s=limit + INFRA_SLACK_S, tmpfs=(("/tmp", "size=2g,mode=1777"),), cache_isolation=True)
        res = self.containers.run_container(spec, ["sh", "-c", _UNPACK], bundle(files), limit)
        events = read_events(res.output, nonce)
        return HarborRun(Run(res, events.seen, events.test_output, None, None, "shell"), events, timeout)

    def grade(self, task: TaskRow, patch: str, out: GradeRow) -> None:
        """Grade ``patch`` on a Harbor task into ``out`` (the checks of the patch text are the grader's)."""
        hr = self.run(task, patch)
        out.log = hr.run.result.output
        if "apply_failed" in hr.events:
            zero(out, GradeStatus.PATCH_APPLY_FAILED, "the patch did not apply by any method", task)
            return
        if "ready" not in hr.events:
            raise GradingInfraError(hr.run.before_patch_error())
        out.apply_method = next((line[len(">>>>> Applied Patch ("):-1] for line in out.log.splitlines()
                                 if line.startswith(">>>>> Applied Patch (")), None)
        judged = _json_event(hr.events, "judged")
        if judged is not None:
            reset = [r for r in judged.get("reset", []) if isinstance(r, list) and len(r) == 2]
            out.dropped_paths = sorted({str(path) for path, _why in reset})
            out.suspicious = [str(s) for s in judged.get("suspicious", [])][:50]
        if "tests_end" in hr.events and hr.timed_out():
            zero(out, GradeStatus.TEST_TIMEOUT, f"test.sh ran past {hr.timeout:g} s", task)
            return
        failure = hr.failure()
        if failure is not None:
            self.after_patch(task, out, failure)
            return
        reward, _ = parse_reward(hr.events)
        assert reward is not None
        passed = reward == 1.0
        out.reward, out.resolved = reward, passed
        out.resolution = Resolution.FULL if passed else Resolution.PARTIAL if reward > 0 else Resolution.NO
        if passed and out.suspicious and self.options.suspicious_scores_zero:
            out.status, out.reward, out.resolved, out.resolution = GradeStatus.SUSPICIOUS, 0.0, False, Resolution.NO
            out.error = f"test.sh gave 1, but the patch's code reaches into the test runner ({out.suspicious[0]})"
        out.tests = [TestResult(name=name, kind=F2P, status="PASSED" if passed else "FAILED", passed=passed)
                     for name in task.FAIL_TO_PASS]

    def control_problem(self, task: TaskRow) -> str | None:
        """The control run (the gold patch, else the empty one): None when it yields a reward, else why not."""
        hr = self.run(task, task.patch or "")
        if "ready" not in hr.events:
            return hr.run.before_patch_error()
        if "apply_failed" in hr.events:
            return "the task's gold patch does not apply"
        if "tests_end" in hr.events and hr.timed_out():
            return f"test.sh ran past {hr.timeout:g} s"
        return hr.failure()


def _json_event(events: Events, name: str) -> dict[str, list[object]] | None:
    try:
        data = json.loads(events.decoded(name) or "null")
    except (json.JSONDecodeError, RecursionError):
        return None
    return data if isinstance(data, dict) else None
