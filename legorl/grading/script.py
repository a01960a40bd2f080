"""The grading container's script, and how its output is read back.

One fresh container per grade runs :func:`grading_script` as root (network off; for tasks built
from a ``repo_source`` the image's filesystem is read-only and ``/testbed`` and ``/tmp`` are
size-capped tmpfs mounts, so nothing in it can fill the host's disk):

1. ``/testbed/.git`` is moved out of the tree and a pristine copy of the tree is taken;
2. the patch is applied as an unprivileged user (``git apply``, then ``--reject``, then GNU
   ``patch --fuzz=5``, the tree put back between tries), whose processes are then all killed;
3. :mod:`legorl.grading.sandboxed.judge` (root, ``python3 -I``) compares the tree with the pristine
   copy and undoes what a candidate patch may not change;
4. the hidden tests go in (root applies ``test_patch``), ``.git`` comes back, the whole tree is
   made root's and read-only to everyone else (so the code under test cannot rewrite a test module
   pytest has not read yet, plant bytecode, or drop a module on ``sys.path``), and the tests run as
   the unprivileged user through :mod:`legorl.grading.sandboxed.runner`, their output going to a
   root-owned file on the size-capped tmpfs and the runner's report through an append-only
   descriptor on a root-only file; afterwards every process of that user is killed (a daemon the
   tests left cannot hold the grade open) and root prints the output (capped) and the report.

What the host learns comes from **event lines** ``@@legorl <nonce> <event> [data]``. The nonce is
drawn per grade and lives only in the script, which sits in a root-only folder, so code under test
(another user) cannot print an event: what the test output says about itself never counts.
SWE-bench's markers are printed too, so its tools can read the log.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import json
import re
import secrets
import shlex
import tarfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from legorl.grading.logparse import END_MARKER, EXIT_CODE_MARKER, START_MARKER  # SWE-bench's, for its tools
from legorl.grading.patches import added_lines

WORK = "/tmp/.legorl-grade"  # root-only (0700): the script, its inputs, the pristine copy
RUNNER_DIR = "/tmp/.legorl-runner"  # root-owned, readable: the runner the test user runs
REPORT_FD = 3  # the runner's report goes to this descriptor, root's append-only file in WORK
TEST_UID = 1777
APPLY_TIMEOUT_S = 120  # per apply method: a patch that stalls an applier simply does not apply
JUDGE_TIMEOUT_S = 120  # the judge past this is the patch's doing (its size bought the minutes)
MAX_JUDGE_OUTPUT = 1_000_000  # bytes of the judge's verdict that reach the host
# The test user's environment: its own HOME; git may read the (root-owned) repository.
TEST_ENV = ("HOME=/tmp/.legorl-home GIT_CONFIG_COUNT=1 GIT_CONFIG_KEY_0=safe.directory GIT_CONFIG_VALUE_0='*' "
            "GIT_CONFIG_GLOBAL=/dev/null")
MAX_TEST_OUTPUT = 20_000_000  # bytes of test output that reach the host; the rest is cut
# The runner's report is parsed on the host, and the code under test can write into it: JSON of tiny
# objects costs ~60x its size in Python objects (50 MB of "{}," took 1.3 GB), so a bigger report is
# never sent (the run failed, the patch's doing). An honest report of 10,000 tests is ~1 MB.
MAX_REPORT_BYTES = 8_000_000
APPLY_METHODS = (
    ("git apply", "git apply -v {f}"),
    ("git apply --reject", "git apply -v --reject {f}"),
    ("patch --fuzz=5", "patch --batch --forward --fuzz=5 -p1 -i {f}"),
)
PYTHON_RE = re.compile(r"^(?:.*/)?python(?:3(?:\.\d+)?)?$")
ASSIGN_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
SHELL_CHARS = frozenset(";&|<>()`$\n")


@dataclass
class PytestCommand:
    """A test command of the plain shape ``[VAR=value ...] [python[3] -m] pytest ARGS``."""

    env: list[str]
    python: str
    args: list[str]


def parse_pytest_command(command: str) -> PytestCommand | None:
    """The command's parts when it is a plain pytest run (else None: it runs as a shell command)."""
    try:
        words = shlex.split(command)
    except ValueError:
        return None
    if any(ch in command for ch in SHELL_CHARS - {"$"}) or "$(" in command or "`" in command:
        return None
    env = []
    while words and ASSIGN_RE.match(words[0]):
        env.append(words.pop(0))
    if len(words) >= 3 and PYTHON_RE.match(words[0]) and words[1] == "-m" and words[2] in ("pytest", "py.test"):
        return PytestCommand(env, words[0], words[3:])
    if words and words[0] in ("pytest", "py.test"):
        return PytestCommand(env, "python3", words[1:])
    return None


SANDBOXED = resources.files("legorl.grading.sandboxed")
# The sandboxed scripts go in as a package of this name (a name no tree under test uses), in WORK; the
# runner's part is copied to RUNNER_DIR for the test user.
PACKAGE = "legorl_grading"
RUNNER_FILES = ("__init__.py", "runner.py", "guard.py")


def launch(folder: str, module: str, package: str = PACKAGE) -> str:
    """The ``python3 -I -c`` code that runs ``package.module`` as ``__main__`` from ``folder`` (the
    package's parent). ``-I`` puts no folder of ours on ``sys.path``: the launcher puts ``folder`` first
    to import the package, then moves it to the end, where it shadows nothing and a ``spawn`` or
    ``forkserver`` child of the tests can still import ``__main__`` by its name (with the folder taken
    off, every such child died and a pool waited for the grade's timeout, the gold patch's included)."""
    return (f"import runpy, sys; sys.path.insert(0, {folder!r}); import {package}; sys.path.append(sys.path.pop(0)); "
            f"runpy.run_module('{package}.{module}', run_name='__main__', alter_sys=True)")


def sandboxed_files(*names: str) -> dict[str, str]:
    """``PACKAGE/<name>`` -> the text of these sandboxed files, the package's ``__init__.py`` among them."""
    return {f"{PACKAGE}/{name}": SANDBOXED.joinpath(name).read_text() for name in ("__init__.py", *names)}


# What the container runs, as a digest: part of the key of a cached gold run.
SANDBOXED_DIGEST = hashlib.sha256("".join(
    [*(f.read_text() for f in sorted(SANDBOXED.iterdir(), key=lambda f: f.name) if f.name.endswith(".py")),
     Path(__file__).read_text()]).encode()).hexdigest()[:16]


def patch_apply_block(tree: str) -> str:
    """The bash that applies ``$W/patch.diff`` to ``tree`` as the unprivileged user, one method after
    another (each under a timeout, the tree reset between tries), then removes the appliers' leftovers."""
    q = shlex.quote
    tries = "\n".join(
        f"  if [ -z \"$applied\" ]; then echo '>>>>> legorl: trying {name}'; "
        f"if (cd {tree} && timeout -k 5 {APPLY_TIMEOUT_S} setpriv --reuid=$U --regid=$U --clear-groups "
        f"{cmd.format(f='/tmp/.legorl-patch/patch.diff')}) 2>&1; "
        f"then applied={q(name)}; else kill_user; reset_tree; fi; fi"
        for name, cmd in APPLY_METHODS)
    return f"""mkdir -p /tmp/.legorl-patch && cp $W/patch.diff /tmp/.legorl-patch/ && chmod 755 /tmp/.legorl-patch \\
  && chmod 644 /tmp/.legorl-patch/patch.diff || {{ ev infra "cannot stage the patch"; exit 0; }}
applied=
{tries}
kill_user
rm -rf /tmp/.legorl-patch
if [ -z "$applied" ]; then echo '>>>>> Patch Apply Failed'; ev apply_failed; exit 0; fi
echo ">>>>> Applied Patch ($applied)"
find {tree} -path {tree}/.git -prune -o \\( -name '*.rej' -o -name '*.orig' \\) -type f -newer $W/patch.diff -print0 \\
  | xargs -0 -r rm -f --
"""


def script_head(nonce: str, source: str) -> str:
    """The first lines of a grading script (root, in a fresh container): the events' nonce, the work
    folder, the test user, and the two helpers every grade uses (``ev``: an event line; ``as_user``)."""
    return f"""#!/bin/bash
# Generated by legorl: one grade, as root, in a fresh container (see {source}).
set -u
N={shlex.quote(nonce)}
W={WORK}
U={TEST_UID}
ev() {{ printf '\\n@@legorl %s %s\\n' "$N" "$*"; }}
as_user() {{ setpriv --reuid=$U --regid=$U --clear-groups "$@"; }}
"""


def grading_script(nonce: str, report_nonce: str, *, has_patch: bool, has_test_patch: bool, command: str,
                   timeout: float) -> str:
    """The whole grade as one bash script (root, in the container)."""
    q = shlex.quote
    pytest = parse_pytest_command(command)
    if pytest is not None:
        env = " ".join(q(e) for e in pytest.env)
        run = (f"env {TEST_ENV} {env} {q(pytest.python)} -I -c {q(launch(RUNNER_DIR, 'runner'))} {REPORT_FD} {RUNNER_DIR}/changes.json "
               + " ".join(q(a) for a in pytest.args))
        mode = "runner"
    else:
        run = f"env {TEST_ENV} bash -c {q(command)}"
        mode = "shell"
    apply_block = patch_apply_block("/testbed") if has_patch else ""
    test_patch_block = ""
    if has_test_patch:
        test_patch_block = ("(cd /testbed && git apply -v $W/test.diff) 2>&1 || "
                            "{ echo '>>>>> Reset Failed'; ev test_patch_failed; exit 0; }\n")
    return script_head(nonce, "legorl/grading/script.py") + f"""kill_user() {{ as_user bash -c 'kill -9 -1' >/dev/null 2>&1; true; }}
reset_tree() {{ find /testbed -mindepth 1 -maxdepth 1 -exec rm -rf {{}} + && cp -a $W/pristine/. /testbed/ \\
  && chown -R $U:$U /testbed; }}
export HOME=/nonexistent GIT_CONFIG_NOSYSTEM=1 GIT_CONFIG_GLOBAL=/dev/null GIT_CEILING_DIRECTORIES=/ \\
  GIT_TERMINAL_PROMPT=0 PYTHONDONTWRITEBYTECODE=1
command -v setpriv >/dev/null || {{ ev infra "the image has no setpriv (util-linux)"; exit 0; }}
PY=$(command -v python3 || command -v python) || {{ ev infra "the image has no python3"; exit 0; }}
cd /testbed 2>/dev/null || {{ ev infra "the image has no /testbed"; exit 0; }}
if [ -e /testbed/.git ]; then mv /testbed/.git $W/git || {{ ev infra "cannot move /testbed/.git"; exit 0; }}; fi
cp -a /testbed $W/pristine && chown -R $U:$U /testbed || {{ ev infra "cannot copy the testbed"; exit 0; }}
ev ready
{apply_block}ev applied
cd $W && J=$(timeout -k 5 {JUDGE_TIMEOUT_S} "$PY" -I -c {q(launch(WORK, 'judge'))} $W/judge.json 2>$W/judge.err | head -c {MAX_JUDGE_OUTPUT}; \
  exit "${{PIPESTATUS[0]}}"); jc=$?
if [ $jc -ne 0 ]; then ev judge_failed "$(tail -c 400 $W/judge.err | base64 -w0)"; exit 0; fi
ev judged "$(printf %s "$J" | base64 -w0)"
cd /testbed || exit 0
{test_patch_block}C=$(cd $W && "$PY" -I -c {q(launch(WORK, 'canary'))} $W/canary.json 2>$W/canary.err) \
  || {{ ev canary_failed "$(tail -c 300 $W/canary.err | base64 -w0)"; exit 0; }}
ev canaries "$(printf %s "$C" | base64 -w0)"
if [ -d $W/git ]; then mv $W/git /testbed/.git; fi
rm -rf $W/pristine
chown -R 0:0 /testbed && chmod -R go-w,a+rX /testbed || {{ ev infra "cannot seal the testbed"; exit 0; }}
rm -rf {RUNNER_DIR} && mkdir -p /tmp/.legorl-home {RUNNER_DIR}/{PACKAGE} && cp $W/changes.json {RUNNER_DIR}/ \\
  && (cd $W/{PACKAGE} && cp {" ".join(RUNNER_FILES)} {RUNNER_DIR}/{PACKAGE}/) \\
  && chmod 755 {RUNNER_DIR} {RUNNER_DIR}/{PACKAGE} && chmod 644 {RUNNER_DIR}/changes.json {RUNNER_DIR}/{PACKAGE}/* \\
  && chown $U:$U /tmp/.legorl-home && : > $W/report.json || {{ ev infra "cannot prepare the test run"; exit 0; }}
ev tests_start {mode}
echo '{START_MARKER}'
timeout -k 5 {timeout:g} setpriv --reuid=$U --regid=$U --clear-groups {run} >$W/test.out 2>&1 {REPORT_FD}>>$W/report.json <<< {q(report_nonce)}
code=$?
kill_user
head -c {MAX_TEST_OUTPUT} $W/test.out
echo
echo '{END_MARKER}'
ev tests_end "$code"
if [ "$code" = 124 ] || [ "$code" = 137 ]; then echo '>>>>> Tests Timed Out'; fi
echo "{EXIT_CODE_MARKER}: $code"
R=$(stat -c %s $W/report.json 2>/dev/null || echo 0)
if [ "$R" -gt {MAX_REPORT_BYTES} ]; then ev report_too_large "$R"; elif [ "$R" -gt 0 ]; then ev report "$(base64 -w0 < $W/report.json)"; fi
ev done
"""


def bundle(files: dict[str, str]) -> bytes:
    """A tar of ``WORK/<name>`` files (WORK and its folders root-only), to follow the testbed on stdin."""
    buf = io.BytesIO()
    now = int(time.time())
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo(WORK.lstrip("/"))
        info.type, info.mode, info.mtime = tarfile.DIRTYPE, 0o700, now
        tar.addfile(info)
        folders = sorted({name.rsplit("/", 1)[0] for name in files if "/" in name})
        for folder in folders:
            info = tarfile.TarInfo(f"{WORK.lstrip('/')}/{folder}")
            info.type, info.mode, info.mtime = tarfile.DIRTYPE, 0o700, now
            tar.addfile(info)
        for name, text in files.items():
            data = text.encode("utf-8", "surrogateescape")
            info = tarfile.TarInfo(f"{WORK.lstrip('/')}/{name}")
            info.size, info.mode, info.mtime = len(data), 0o700 if name.endswith(".sh") else 0o600, now
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def grade_files(*, patch: str, test_patch: str, hidden: list[str], command: str, timeout: float,
                gold: list[str] | None = None, tests: Mapping[str, object] | None = None,
                canary_seed: str | None = None, candidates: list[str] | None = None) -> tuple[dict[str, str], str, str]:
    """The files of one grade (script, judge, runner, canary writer, patches), and its two nonces.

    With ``canary_seed`` the run is a canary run: the ``tests`` (test id -> its site and salt) have
    their expected values mutated (:mod:`.sandboxed.canary`; ``candidates``: every test a run of the
    task may mutate, whose assertions never count as the file's own); everything else, what the test user can
    see included, is the same as an ordinary run's."""
    nonce, report_nonce = secrets.token_hex(16), secrets.token_hex(16)
    script = grading_script(nonce, report_nonce, has_patch=bool(patch.strip()), has_test_patch=bool(test_patch.strip()),
                            command=command, timeout=timeout)
    files = {
        "script.sh": script,
        **sandboxed_files("judge.py", "screen.py", "canary.py", "expectations.py", *RUNNER_FILES[1:]),
        "canary.json": json.dumps({"tree": "/testbed", "files": [h for h in hidden if h.endswith(".py")],
                                   "tests": dict(tests or {}), "candidates": list(candidates or []),
                                   "added": added_lines(test_patch),
                                   "seed": canary_seed or "", "mutate": canary_seed is not None}),
        "judge.json": json.dumps({"tree": "/testbed", "pristine": f"{WORK}/pristine", "hidden": hidden,
                                  "changes": f"{WORK}/changes.json", "gold": gold or []}),
        "patch.diff": patch,
        "test.diff": test_patch,
    }
    return files, nonce, report_nonce


@dataclass
class Events:
    """What the grading script said, by event name (only lines carrying this grade's nonce)."""

    seen: dict[str, str] = field(default_factory=dict)
    test_output: str = ""

    def __contains__(self, name: str) -> bool:
        return name in self.seen

    def data(self, name: str) -> str:
        return self.seen.get(name, "")

    def decoded(self, name: str) -> str:
        try:
            return base64.b64decode(self.data(name), validate=True).decode("utf-8", "replace")
        except (binascii.Error, ValueError):
            return ""


def read_events(output: str, nonce: str) -> Events:
    """Events of the grade whose nonce is ``nonce``, and the test output between tests_start and tests_end."""
    prefix = f"@@legorl {nonce} "
    events = Events()
    lines = output.split("\n")
    start = end = None
    for i, line in enumerate(lines):
        if not line.startswith(prefix):
            continue
        name, _, data = line[len(prefix):].partition(" ")
        events.seen.setdefault(name, data.rstrip("\r"))
        if name == "tests_start" and start is None:
            start = i
        elif name == "tests_end" and end is None:
            end = i
    if start is not None:
        events.test_output = "\n".join(lines[start + 1: end if end is not None else len(lines)])
    return events
