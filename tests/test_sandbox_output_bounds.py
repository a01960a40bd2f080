"""The host never holds unbounded output a container can write (issue #25).

A process in a container can open ``/proc/<pid>/fd/1`` (or ``fd/2``) of any process a host
``podman exec`` started, or of the container's PID 1, and write gigabytes to it; a git clean
filter or a ``git`` of the agent's own writes to the stderr of the patch's exec. Each flood here is
measured in a fresh subprocess (its peak resident memory reset just before the call, ``VmHWM``
after), so this process's own history does not count. Before the fix each of these grew the host
by more than the flood (the bytes, then their decoded copy).
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import uuid
from collections.abc import Iterator

import pytest

from legorl.grading.script import read_events
from legorl.sandbox import bounded
from legorl.sandbox.base import SandboxSpec

FLOOD = 768 << 20
BUDGET_MB = 200  # what one exec or patch may add to the host's peak memory, whatever the container writes
# run_once keeps 128 MB (the grading script's own output, podman.RUN_ONCE_OUTPUT); the peak is a few
# times that (the kept chunks, their joined bytes, the decoded text)
RUN_ONCE_BUDGET_MB = 700

_PRELUDE = r'''
import gc, json, sys, time
from pathlib import Path

def _kb(field):
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(field)

def measure(fn):
    """fn(), and the peak resident memory (MB) it added above this point."""
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    before = _kb("VmRSS")
    value = fn()
    return (_kb("VmHWM") - before) / 1024, value
'''

# Waits for the pid in /tmp/target, then writes ``n`` bytes to that process's descriptor ``fd``.
_FLOODER = r'''
import os, sys, time
n, fdno = int(sys.argv[1]), sys.argv[2]
while not os.path.exists("/tmp/target"):
    time.sleep(0.01)
pid = open("/tmp/target").read().strip()
fd = os.open(f"/proc/{pid}/fd/{fdno}", os.O_WRONLY)
chunk = (b"x" * 1023 + b"\n") * 1024
for _ in range(n // len(chunk)):
    os.write(fd, chunk)
os.close(fd)
open("/tmp/flood-done", "w").close()
'''
# The exec the host makes: it names itself as the target and waits for the flood to end.
_TARGET = ('echo $$ > /tmp/target.tmp && mv /tmp/target.tmp /tmp/target; '
           'while [ ! -e /tmp/flood-done ]; do sleep 0.05; done; echo END-OF-EXEC')


def _measured(code: str, timeout: float = 240) -> dict[str, object]:
    """Run ``_PRELUDE + code`` in a fresh interpreter; it prints one JSON line."""
    proc = subprocess.run([sys.executable, "-c", _PRELUDE + code], capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


@pytest.fixture
def run_label() -> Iterator[str]:
    """A run label for this test's containers; whatever is left with it is removed afterwards."""
    from legorl.sandbox.host import run_podman

    label = f"bounds-{uuid.uuid4().hex[:8]}"
    yield label
    ids = run_podman(["ps", "-aq", "--filter", f"label=legorl.run={label}"], check=False, timeout=60)
    names = ids.stdout.decode().split()
    if names:
        run_podman(["rm", "-f", "-t", "0", *names], check=False, timeout=120)


# --------------------------------------------------------------------------- the reader itself


def test_the_reader_keeps_head_and_tail_and_counts_what_it_dropped() -> None:
    script = "import sys; w = sys.stdout.buffer.write; w(b'HEAD' + b'.' * 50_000_000 + b'TAIL'); " \
             "sys.stderr.buffer.write(b'e' * 3_000_000)"
    out = bounded.run([sys.executable, "-c", script], stdout=bounded.Cap(4, 4), stderr=bounded.Cap(0, 10))
    assert out.returncode == 0 and not out.timed_out
    assert out.stdout == b"HEAD" + bounded.marker(50_000_000) + b"TAIL"
    assert out.stdout_dropped == 50_000_000 and out.stderr_dropped == 2_999_990
    assert out.stderr.endswith(b"\n" + b"e" * 10)


@pytest.mark.heavy
def test_the_reader_feeds_stdin_and_kills_on_timeout() -> None:
    data = bytes(range(256)) * 40_000  # 10 MB: more than a pipe holds
    out = bounded.run(["cat"], input=data, stdout=bounded.Cap(len(data), 0), stderr=bounded.Cap(100, 0))
    assert out.stdout == data and out.returncode == 0
    slow = bounded.run(["sh", "-c", "echo started; sleep 30"], timeout=1.0, stdout=bounded.Cap(100, 100),
                       stderr=bounded.Cap(100, 0))
    assert slow.timed_out and slow.stdout == b"started\n"


def test_a_flood_in_the_tests_cannot_push_the_grading_events_out() -> None:
    """run_once's cap keeps the grading script's report: a flood in the test output (where code under
    test writes) loses test output, never the events after it (and losing an event is a failure of
    the run, never a pass)."""
    from legorl.sandbox.podman import RUN_ONCE_OUTPUT

    nonce = "n" * 32
    script = (f"import sys; w = sys.stdout.buffer.write; ev = lambda e: w(b'\\n@@legorl {nonce} ' + e + b'\\n'); "
              "ev(b'ready'); ev(b'applied'); ev(b'tests_start runner'); "
              "[w(b'flood' * 200_000) for _ in range(200)]; "  # 200 MB of test output
              "ev(b'tests_end 1'); ev(b'report ' + b'QUJD' * 2_000_000); ev(b'done')")
    out = bounded.run([sys.executable, "-c", script], stdout=RUN_ONCE_OUTPUT, stderr=bounded.Cap(100, 100))
    assert out.stdout_dropped > 0
    events = read_events(out.stdout.decode(), nonce)
    assert {"ready", "applied", "tests_start", "tests_end", "report", "done"} <= set(events.seen)
    assert events.data("tests_end") == "1" and len(events.data("report")) == 8_000_000


# --------------------------------------------------------------------------- floods through podman


@pytest.mark.podman
@pytest.mark.parametrize("api", ["cli", "service"])
def test_an_exec_flooded_through_proc_stays_bounded(base_image: str, run_label: str, api: str) -> None:
    """A process in the container writes 768 MB to the stdout of the host's exec: the exec returns
    with its own last line, the middle dropped, and the host grows by at most BUDGET_MB."""
    timeout = "60" if api == "cli" else "None"  # timed execs take the CLI, untimed ones the API service
    result = _measured(f'''
from legorl.sandbox import PodmanBackend, SandboxSpec
with PodmanBackend(api={"cli" if api == "cli" else "auto"!r}).create(
        SandboxSpec(image={base_image!r}, labels={{"run": {run_label!r}}})) as box:
    assert ({api!r} == "cli") == (box._service is None), box._service
    box.exec(["sh", "-c", "setsid python3 -c " + {shlex.quote(_FLOODER)!r} + " {FLOOD} 1 </dev/null >/dev/null 2>&1 &"])
    growth, res = measure(lambda: box.exec(["sh", "-c", {_TARGET!r}], timeout={timeout}))
print(json.dumps({{"growth": growth, "code": res.exit_code, "len": len(res.output), "tail": res.output[-200:],
                  "timed_out": res.timed_out}}))
''')
    print(result)
    assert result["code"] == 0 and not result["timed_out"], result
    assert "END-OF-EXEC" in str(result["tail"]), result  # the command's own last words survive
    assert int(result["len"]) <= 20_000_000, result  # type: ignore[call-overload]
    assert float(result["growth"]) < BUDGET_MB, result  # type: ignore[arg-type]


def _box_with_repo(image: str, run_label: str, content: str) -> str:
    """Code that opens a container whose /testbed is a one-commit repository holding ``a.py``."""
    return f'''
from legorl.sandbox import PodmanBackend, SandboxSpec
with PodmanBackend().create(SandboxSpec(image={image!r}, labels={{"run": {run_label!r}}})) as box:
    setup = box.exec(["sh", "-c", "git init -q . && echo '{content}' > a.py && git add -A && git commit -qm base "
                      "&& git rev-parse HEAD"])
    assert setup.exit_code == 0, setup.output
    box.testbed_commit = setup.output.split()[-1]
'''


@pytest.mark.podman
def test_a_clean_filter_does_not_run_when_the_patch_is_taken(base_image: str, run_label: str) -> None:
    """The agent's clean filter would flood stderr and forge the staged content: it does not run (and
    the agent's edit is in the patch even when made in the same second as the last index write)."""
    result = _measured(_box_with_repo(base_image, run_label, "REAL = 1") + f'''
    agent = ("echo 'REAL = 2' > a.py && echo '*.py filter=flood' > .gitattributes && "
             "git config filter.flood.required true && git config filter.flood.clean "
             "\\"sh -c 'touch /tmp/filter-ran; head -c {FLOOD} /dev/zero >&2; sed s/REAL/FORGED/'\\"")
    assert box.exec(["sh", "-c", agent]).exit_code == 0
    time.sleep(1.1)  # a same-size edit in the index's own second: git sees it only by the index's mtime
    growth, patch = measure(box.patch)
    ran = box.exec(["test", "-e", "/tmp/filter-ran"]).exit_code == 0
print(json.dumps({{"growth": growth, "patch": patch, "ran": ran}}))
''')
    print("growth MB", result["growth"])
    patch = str(result["patch"])
    assert "+REAL = 2" in patch and "FORGED" not in patch, patch
    assert not result["ran"], "the agent's clean filter ran on the host's git add"
    assert float(result["growth"]) < BUDGET_MB, result  # type: ignore[arg-type]


@pytest.mark.podman
def test_a_git_of_the_agents_flooding_stderr_leaves_the_patch_bounded(base_image: str, run_label: str) -> None:
    """The agent puts its own ``git`` first on PATH (no config override reaches that): it floods
    stderr during ``git add``; the patch is still taken and the host stays within its budget."""
    wrapper = f'#!/bin/sh\nif [ "$1" = add ]; then head -c {FLOOD} /dev/zero >&2; fi\nexec /usr/bin/git "$@"\n'
    result = _measured(_box_with_repo(base_image, run_label, "x = 1") + f'''
    box.put_file("/usr/local/bin/git", {wrapper.encode()!r}, mode=0o755)
    assert box.exec(["sh", "-c", "echo 'x = 2' > a.py && command -v git"]).output.strip() == "/usr/local/bin/git"
    growth, patch = measure(box.patch)
print(json.dumps({{"growth": growth, "patch": patch}}))
''')
    print("growth MB", result["growth"])
    assert "+x = 2" in str(result["patch"]), result["patch"]
    assert float(result["growth"]) < BUDGET_MB, result  # type: ignore[arg-type]


@pytest.mark.podman
def test_run_once_flooded_through_pid_1_stays_bounded(base_image: str, run_label: str) -> None:
    """The one-shot container's command writes 1 GB to PID 1's stdout and 256 MB to its stderr (the
    pipes podman's own client reads): the host keeps the cap's worth and the command's last line."""
    command = (f"head -c {1 << 30} /dev/zero > /proc/1/fd/1; head -c {256 << 20} /dev/zero > /proc/1/fd/2; "
               "echo; echo LAST-LINE")
    result = _measured(f'''
from legorl.sandbox import PodmanBackend, SandboxSpec
res = None
def go():
    return PodmanBackend().run_once(SandboxSpec(image={base_image!r}, labels={{"run": {run_label!r}}}),
                                    ["sh", "-c", {command!r}], timeout=200)
growth, res = measure(go)
print(json.dumps({{"growth": growth, "code": res.exit_code, "len": len(res.output), "timed_out": res.timed_out,
                  "last": "LAST-LINE" in res.output[-20_000_000:]}}))
''')
    print(result)
    assert result["code"] == 0 and not result["timed_out"], result
    assert result["last"], result
    assert int(result["len"]) <= 200_000_000, result  # type: ignore[call-overload]
    assert float(result["growth"]) < RUN_ONCE_BUDGET_MB, result  # type: ignore[arg-type]


# --------------------------------------------------------------------------- container limits


@pytest.mark.podman
def test_container_limits_are_in_force(base_image: str, run_label: str) -> None:
    """Open files, tmpfs sizes and the container's own log are bounded."""
    from legorl.sandbox import PodmanBackend
    from legorl.sandbox.host import run_podman

    spec = SandboxSpec(image=base_image, labels={"run": run_label}, tmpfs=(("/scratch", "mode=1777"),))
    with PodmanBackend(api="cli").create(spec) as box:
        limits = box.exec("ulimit -Sn; ulimit -Hn").output.split()
        assert limits == [str(spec.nofile)] * 2, limits
        mount = box.exec("grep ' /scratch ' /proc/mounts").output
        assert "size=" in mount, mount
        # what PID 1 writes is the container's log on the host: discarded, never on the host's disk
        assert box.exec(f"head -c {64 << 20} /dev/zero > /proc/1/fd/1").exit_code == 0
        info = run_podman(["container", "inspect", "-f", "{{.HostConfig.LogConfig.Type}}|{{.HostConfig.LogConfig.Path}}", box.name],
                          timeout=60).stdout.decode().strip()
        driver, _, path = info.partition("|")
        assert driver == "none", info
        if path:
            size = subprocess.run(["stat", "-c", "%s", path], capture_output=True, text=True).stdout.strip() or "0"
            assert int(size) < 1 << 20, (path, size)
