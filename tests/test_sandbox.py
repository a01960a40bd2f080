"""The podman sandbox, against real podman and the base image from `legorl setup`."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from platform import machine as platform_machine

import pytest

from legorl.core.errors import LegorlError
from legorl.sandbox import (
    PodmanBackend,
    PodmanSandbox,
    SandboxError,
    SandboxSpec,
    install_testbed,
)
from legorl.sandbox.host import run_podman

pytestmark = pytest.mark.podman


@pytest.fixture
def box(image: str) -> Iterator[PodmanSandbox]:
    with PodmanBackend().create(SandboxSpec(image=image, labels={"run": "pytest", "trial": "box"})) as sandbox:
        yield sandbox


def container_exists(name: str) -> bool:
    return run_podman(["container", "exists", name], check=False).returncode == 0


def git(cwd: Path, *args: str) -> str:
    env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t", "HOME": str(cwd), "PATH": "/usr/bin:/bin"}
    return subprocess.run(["git", *args], cwd=cwd, env=env, check=True, capture_output=True, text=True).stdout.strip()


def test_lifecycle_exec_files_remove(box: PodmanSandbox) -> None:
    name = box.name
    assert container_exists(name) and box.alive()
    res = box.exec("echo out; echo err >&2; pwd; exit 3")
    assert (res.exit_code, res.output, res.timed_out) == (3, "out\nerr\n/testbed\n", False)
    assert box.exec(["python3", "-c", "import sys; print(sys.argv[1])", "a b"]).output == "a b\n"
    assert box.exec("pwd", workdir="/tmp", env={"X": "1"}).output == "/tmp\n"

    data = bytes(range(256)) * 10
    box.put_file("/work/deep/dir/blob.bin", data, mode=0o750)
    assert box.get_file("/work/deep/dir/blob.bin") == data
    assert box.exec("stat -c %a /work/deep/dir/blob.bin").output.strip() == "750"
    with pytest.raises(FileNotFoundError):
        box.get_file("/no/such/file")

    box.remove()
    box.remove()  # twice is fine
    assert not container_exists(name)
    assert not box.alive()


def test_put_dir(box: PodmanSandbox, tmp_path: Path) -> None:
    (tmp_path / "pkg" / "sub").mkdir(parents=True)
    (tmp_path / "pkg" / "sub" / "m.py").write_text("X = 1\n")
    (tmp_path / "pkg" / "run.sh").write_text("#!/bin/sh\necho ran\n")
    (tmp_path / "pkg" / "run.sh").chmod(0o755)
    box.put_dir(str(tmp_path / "pkg"), "/opt/pkg")
    assert box.exec("/opt/pkg/run.sh && cat /opt/pkg/sub/m.py").output == "ran\nX = 1\n"


def test_timeout_kills_the_whole_process_group(box: PodmanSandbox) -> None:
    start = time.monotonic()
    res = box.exec("sleep 300 & sleep 301 & echo started; wait", timeout=2)
    assert res.timed_out and res.exit_code in (124, 137)
    assert "started" in res.output
    assert time.monotonic() - start < 10
    left = box.exec("ps -eo args | grep -c '^sleep 30[01]' || true").output.strip()
    assert left == "0", box.exec("ps -eo pid,pgid,args").output
    fast = box.exec("true", timeout=5)
    assert not fast.timed_out and fast.exit_code == 0


def test_timeout_kills_processes_that_left_the_group(box: PodmanSandbox) -> None:
    box.host_grace_s = 1.0
    start = time.monotonic()
    res = box.exec("setsid sleep 302 & sleep 303", timeout=1)  # setsid's sleep keeps the output open
    assert res.timed_out and time.monotonic() - start < 10
    assert box.exec("ps -eo args | grep -c '^sleep 30[23]' || true").output.strip() == "0"


def test_exit_code_124_without_timeout_is_not_a_timeout(box: PodmanSandbox) -> None:
    res = box.exec("exit 124", timeout=30)
    assert res.exit_code == 124 and not res.timed_out


def test_patch_has_modified_untracked_deleted_and_binary_files(box: PodmanSandbox, tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "lib.py").write_text("def f():\n    return 1\n")
    (repo / "gone.txt").write_text("bye\n")
    (repo / ".gitignore").write_text("*.pyc\n")
    git(repo, "init", "-q")
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "base")
    base = git(repo, "rev-parse", "HEAD")
    commit = install_testbed(box, repo, base)
    assert box.patch() == ""

    box.exec("sed -i 's/return 1/return 2/' lib.py && rm gone.txt && mkdir -p new && echo hello > new/file.txt "
             "&& printf '\\000\\001\\002' > new/blob.bin && echo junk > cache.pyc")
    box.exec("git add lib.py && git commit -qm 'agent commit'")  # committing does not hide the change
    patch = box.patch()
    assert "return 2" in patch and "new/file.txt" in patch and "gone.txt" in patch
    assert "GIT binary patch" in patch and "cache.pyc" not in patch
    assert box.patch(base=commit) == patch
    assert box.exec("git status --porcelain").output.count("??") >= 1  # the agent's index is untouched

    # The patch reproduces the agent's tree on a clean checkout of the base commit.
    check = tmp_path / "check"
    shutil.copytree(repo, check)
    subprocess.run(["git", "apply", "--binary", "-"], cwd=check, input=patch.encode(), check=True)
    assert (check / "lib.py").read_text() == "def f():\n    return 2\n"
    assert not (check / "gone.txt").exists()
    assert (check / "new" / "blob.bin").read_bytes() == b"\x00\x01\x02"


def test_network_is_unreachable_by_default(box: PodmanSandbox) -> None:
    probe = ("import socket\n"
             "for host in ('10.0.2.2', '1.1.1.1', '8.8.8.8'):\n"
             "    try:\n"
             "        socket.create_connection((host, 53), timeout=3); print('REACHED', host)\n"
             "    except OSError as exc: print('blocked', host, exc.errno)\n")
    res = box.exec(["python3", "-c", probe], timeout=30)
    assert "REACHED" not in res.output and res.output.count("blocked") == 3
    assert box.exec("ls /sys/class/net").output.split() == ["lo"]


def test_no_sandbox_gets_a_network(image: str) -> None:
    """A trial reaches its proxy through its session's socket (tests/test_trial_isolation.py), never a network."""
    with pytest.raises(SandboxError, match="no network"):
        PodmanBackend().create(SandboxSpec(image=image, network=True))
    args = PodmanBackend().run_args(SandboxSpec(image=image), "x")
    assert [a for a in args if a in ("--network", "none")] == ["--network", "none"]


KEYRING_PROBE = """
import ctypes, sys
libc = ctypes.CDLL(None, use_errno=True)
KEYCTL_JOIN_SESSION_KEYRING, KEYCTL_DESCRIBE = 1, 6
keyring = libc.syscall(250, ctypes.c_long(KEYCTL_JOIN_SESSION_KEYRING), ctypes.c_char_p(b"legorl-probe"))
print("keyring", keyring, ctypes.get_errno())
"""


def test_containers_share_no_kernel_keyring(image: str) -> None:
    """Keyrings are the kernel's, per uid, not per container: a named one joined in one container is
    there in the next (a red team carried what the ordinary grading run saw into its canary run so).
    The sandbox's seccomp profile denies the keyring calls, as Docker's default does."""
    backend = PodmanBackend()
    if platform_machine() != "x86_64":
        pytest.skip("the probe calls keyctl by its x86_64 number")
    for _ in range(2):
        res = backend.run_once(SandboxSpec(image=image), ["python3", "-c", KEYRING_PROBE], stdin=b"", timeout=60)
        keyring, errno = (int(x) for x in res.output.split()[1:3])
        assert keyring == -1 and errno in (1, 38), res.output  # EPERM or ENOSYS: refused


def test_fork_bomb_is_contained(image: str) -> None:
    box = PodmanBackend().create(SandboxSpec(image=image, pids_limit=64))
    try:
        assert box.exec("cat /sys/fs/cgroup/pids/pids.max 2>/dev/null || cat /sys/fs/cgroup/pids.max").output == "64\n"
        res = box.exec("bomb() { bomb | bomb & }; bomb; sleep 3", timeout=8)
        assert "Resource temporarily unavailable" in res.output  # the pids limit stopped it
        # the host still forks freely while the bomb sits at its limit
        assert all(subprocess.run(["true"]).returncode == 0 for _ in range(20))
    finally:
        start = time.monotonic()
        box.remove()
    assert not container_exists(box.name) and time.monotonic() - start < 30


def test_memory_hog_is_contained(image: str) -> None:
    with PodmanBackend().create(SandboxSpec(image=image, memory="128m")) as box:
        res = box.exec(["python3", "-c", "b = [bytearray(32 * 2**20) for _ in range(64)]; print('allocated 2 GiB')"],
                       timeout=60)
        assert res.exit_code != 0 and "allocated" not in res.output
        assert box.alive() and box.exec("echo alive").output == "alive\n"
        limit = box.exec("cat /sys/fs/cgroup/memory/memory.limit_in_bytes 2>/dev/null "
                         "|| cat /sys/fs/cgroup/memory.max").output.strip()
        assert limit == str(128 * 2**20)


def test_limits_and_labels_are_set(image: str) -> None:
    spec = SandboxSpec(image=image, labels={"run": "r1", "trial": "t/1"}, cpus=0.5, deadline_s=600, pids_limit=100)
    with PodmanBackend().create(spec) as box:
        info = json.loads(run_podman(["container", "inspect", box.name]).stdout)[0]
        labels = info["Config"]["Labels"]
        assert labels["legorl"] == "1" and labels["legorl.run"] == "r1" and labels["legorl.trial"] == "t/1"
        assert int(labels["legorl.owner_pid"]) > 0 and int(labels["legorl.deadline"]) > time.time() + 500
        host = info["HostConfig"]
        assert host["PidsLimit"] == 100 and host["NanoCpus"] == 500_000_000
        assert host["NetworkMode"] == "none"
        assert box.exec("cat /proc/1/cmdline | tr '\\0' ' '").output.startswith("/run/podman-init")


def test_workdir_missing_from_the_image_is_created(image: str) -> None:
    with PodmanBackend().create(SandboxSpec(image=image, workdir="/work/repo")) as box:
        assert box.exec("pwd").output == "/work/repo\n"
        assert box.exec(["pwd"], workdir="/").output == "/\n"


def test_missing_image_is_a_clear_error() -> None:
    if shutil.which("podman") is None:
        pytest.skip("podman is not installed")
    with pytest.raises(LegorlError, match="legorl setup"):
        PodmanBackend().create(SandboxSpec(image="localhost/legorl-base:doesnotexist"))
    with pytest.raises(LegorlError, match="does not exist"):
        PodmanBackend().create(SandboxSpec(image="localhost/someone-elses-image:nope"))
