"""The podman backend: one container per trial, driven through the ``podman`` CLI.

Why the CLI and not podman-py over ``podman system service``: ``benchmarks/sandbox.py`` measures
both on this host (container start, exec round-trip, copy-in). The CLI needs no long-lived service
process to start, watch and clean up, its failures are plain exit codes and stderr, and harnesses
such as mini-swe-agent shell out to the same ``podman exec`` anyway. See the benchmark's output for
the figures behind the choice.

A container runs ``sleep infinity`` under ``--init`` (catatonit as PID 1, so removal is instant and
zombies are reaped); every command is a ``podman exec``. A command's timeout is enforced *inside*
the container by coreutils ``timeout``, which runs the command in its own process group and
signals the whole group (TERM, then KILL 2 s later) — killing the ``podman exec`` client alone
would leave the process running in the container. A host-side timeout a little later kills that
process group by its id as a last resort.
"""

from __future__ import annotations

import atexit
import os
import re
import signal
import subprocess
import threading
import time
import uuid
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

from legorl.errors import LegorlError
from legorl.sandbox.base import ExecResult, SandboxSpec
from legorl.sandbox.host import podman_env, podman_path, require_image, run_podman
from legorl.sandbox.reaper import owner_labels

KILL_GRACE_S = 2.0  # TERM → KILL inside the container
HOST_GRACE_S = 10.0  # how much longer the host waits before killing the group itself
_PIDFILE_DIR = "/tmp/.legorl-exec"


class SandboxError(LegorlError):
    """A container could not be created, reached or read."""


# --------------------------------------------------------------------------- cleanup on exit

_live: dict[str, PodmanSandbox] = {}
_live_lock = threading.Lock()
_handlers_installed = False


def _remove_all() -> None:
    with _live_lock:
        boxes = list(_live.values())
    if boxes:
        subprocess.run(
            [podman_path(), "rm", "-f", "-i", "-t", "0", *[b.name for b in boxes]],
            capture_output=True, env=podman_env(), timeout=120,
        )
        with _live_lock:
            for box in boxes:
                _live.pop(box.name, None)
                box._removed = True


def _install_handlers() -> None:
    """atexit + SIGTERM/SIGHUP: remove this process's containers. SIGKILL is the reaper's job."""
    global _handlers_installed
    if _handlers_installed:
        return
    _handlers_installed = True
    atexit.register(_remove_all)
    if threading.current_thread() is not threading.main_thread():
        return  # signal handlers can only be set from the main thread; atexit still covers us
    for sig in (signal.SIGTERM, signal.SIGHUP):
        previous = signal.getsignal(sig)

        def handler(signum: int, frame: FrameType | None, previous: Any = previous) -> None:
            _remove_all()
            if callable(previous):
                previous(signum, frame)
            elif previous == signal.SIG_IGN:
                return
            else:  # default action: die of the same signal, as if we had never caught it
                signal.signal(signum, signal.SIG_DFL)
                os.kill(os.getpid(), signum)

        signal.signal(sig, handler)


# --------------------------------------------------------------------------- the backend


def _label_key(key: str) -> str:
    return key if key.startswith("legorl") else f"legorl.{key}"


def _container_name(labels: dict[str, str]) -> str:
    hint = "-".join(v for k in ("run", "trial") if (v := labels.get(k) or labels.get(f"legorl.{k}")))
    hint = re.sub(r"[^a-zA-Z0-9_.-]+", "-", hint).strip("-.")[:60]
    return f"legorl-{hint + '-' if hint else ''}{uuid.uuid4().hex[:8]}"


class PodmanBackend:
    """Creates sandboxes: ``with PodmanBackend().create(spec) as box: box.exec("pytest")``."""

    def __init__(self) -> None:
        self._images_checked: set[str] = set()
        self._lock = threading.Lock()

    def run_args(self, spec: SandboxSpec, name: str) -> list[str]:
        """The ``podman run`` arguments for a spec (public so harnesses can reuse the policy)."""
        labels = {**owner_labels(spec.deadline_s), **{_label_key(k): v for k, v in spec.labels.items()}}
        args = ["run", "-d", "--name", name, "--hostname", "sandbox"]
        if spec.init:
            args.append("--init")
        if spec.network:
            args += ["--network", "slirp4netns:allow_host_loopback=true", "--dns", "127.0.0.1"]
        else:
            args += ["--network", "none"]
        args += ["--memory", spec.memory, "--memory-swap", spec.memory, "--pids-limit", str(spec.pids_limit)]
        if spec.cpus is not None:
            args += ["--cpus", f"{spec.cpus:g}"]
        for key, value in labels.items():
            args += ["--label", f"{key}={value}"]
        for host, ctr, read_only in spec.mounts:
            if not Path(host).exists():
                raise SandboxError(f"mount source {host} does not exist")
            args += ["-v", f"{os.path.abspath(host)}:{ctr}{':ro' if read_only else ''}"]
        for key, value in spec.env.items():
            args += ["-e", f"{key}={value}"]
        if spec.workdir:
            args += ["-w", spec.workdir]
        return [*args, spec.image, *spec.command]

    def create(self, spec: SandboxSpec) -> PodmanSandbox:
        """Start a fresh container for ``spec``; it is removed on exit, SIGTERM, or by the reaper."""
        with self._lock:
            if spec.image not in self._images_checked:
                require_image(spec.image)
                self._images_checked.add(spec.image)
        _install_handlers()
        name = _container_name(spec.labels)
        box = PodmanSandbox(name, spec)
        with _live_lock:
            _live[name] = box  # registered before it exists, so a signal mid-create still removes it
        proc = run_podman(self.run_args(spec, name), check=False, timeout=300)
        if proc.returncode != 0:
            box.remove()
            err = proc.stderr.decode(errors="replace").strip().splitlines()
            raise SandboxError(f"could not start a container from {spec.image}: {err[-1] if err else proc.returncode}")
        return box


class PodmanSandbox:
    """One running container. Use it as a context manager, or call :meth:`remove`."""

    def __init__(self, name: str, spec: SandboxSpec) -> None:
        self.name = name
        self.spec = spec
        self.testbed_commit: str | None = None  # set by legorl.sandbox.testbed when it builds /testbed
        self._removed = False

    def __enter__(self) -> PodmanSandbox:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.remove()

    def __repr__(self) -> str:
        return f"PodmanSandbox({self.name!r}, image={self.spec.image!r})"

    # -- commands

    def exec_argv(self, argv: list[str], *, workdir: str | None = None, env: dict[str, str] | None = None,
                  user: str | None = None, interactive: bool = False) -> list[str]:
        """The full ``podman exec`` command line (for callers that stream or pipe themselves)."""
        cmd = [podman_path(), "exec"]
        if interactive:
            cmd.append("-i")
        if workdir:
            cmd += ["-w", workdir]
        if user:
            cmd += ["-u", user]
        for key, value in (env or {}).items():
            cmd += ["-e", f"{key}={value}"]
        return [*cmd, self.name, *argv]

    def exec(
        self, command: str | list[str], timeout: float | None = None, workdir: str | None = None,
        env: dict[str, str] | None = None, user: str | None = None, stdin: bytes | None = None,
    ) -> ExecResult:
        """Run a command (a string goes through ``bash -lc``), stdout and stderr interleaved.

        With a timeout, the command and everything it started in its process group are killed
        inside the container when it expires, and the result has ``timed_out=True``.
        """
        argv = ["bash", "-lc", command] if isinstance(command, str) else list(command)
        token = uuid.uuid4().hex[:12]
        if timeout is not None:
            # timeout(1) makes itself a process-group leader and signals the whole group on expiry;
            # its pid (= the group id) goes to a file so the host can kill the group as a last resort.
            wrapper = (f'mkdir -p {_PIDFILE_DIR} && echo $$ > {_PIDFILE_DIR}/{token}; exec 2>&1; '
                       f'exec timeout -k {KILL_GRACE_S:g} {timeout:g} "$@"')
        else:
            wrapper = 'exec 2>&1; exec "$@"'
        full = self.exec_argv(["sh", "-c", wrapper, "sh", *argv], workdir=workdir, env=env, user=user,
                              interactive=stdin is not None)
        start = time.monotonic()
        host_timeout = None if timeout is None else timeout + KILL_GRACE_S + HOST_GRACE_S
        try:
            proc = subprocess.run(full, input=stdin, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  env=podman_env(), timeout=host_timeout)
        except subprocess.TimeoutExpired as exc:
            self._kill_group(token)
            out = exc.stdout or b""
            return ExecResult(137, out.decode(errors="replace"), True, time.monotonic() - start)
        finally:
            if timeout is not None:
                self._quiet(["rm", "-f", f"{_PIDFILE_DIR}/{token}"])
        duration = time.monotonic() - start
        code = proc.returncode
        timed_out = timeout is not None and code in (124, 137) and duration >= timeout
        return ExecResult(code, proc.stdout.decode(errors="replace"), timed_out, duration)

    def _quiet(self, argv: list[str]) -> None:
        subprocess.run(self.exec_argv(argv), capture_output=True, env=podman_env(), timeout=60)

    def _kill_group(self, token: str) -> None:
        self._quiet(["sh", "-c", f'p=$(cat {_PIDFILE_DIR}/{token} 2>/dev/null) && kill -KILL -- -"$p"'])

    # -- files

    def put_file(self, path: str, data: bytes, mode: int = 0o644) -> None:
        """Write ``data`` to ``path`` in the container (parents created), binary-safe."""
        script = 'mkdir -p "$(dirname "$1")" && cat > "$1" && chmod "$2" "$1"'
        res = self.exec(["sh", "-c", script, "sh", path, f"{mode:o}"], stdin=data)
        if res.exit_code != 0:
            raise SandboxError(f"{self.name}: cannot write {path}: {res.output.strip()[-200:]}")

    def get_file(self, path: str) -> bytes:
        """Read a file from the container; FileNotFoundError if it is not there."""
        proc = subprocess.run(self.exec_argv(["cat", "--", path]), capture_output=True, env=podman_env(), timeout=300)
        if proc.returncode != 0:
            err = proc.stderr.decode(errors="replace")
            if "No such file" in err:
                raise FileNotFoundError(f"{self.name}:{path}")
            raise SandboxError(f"{self.name}: cannot read {path}: {err.strip()[-200:]}")
        return proc.stdout

    def put_dir(self, host_dir: str, path: str) -> None:
        """Copy the contents of ``host_dir`` into ``path`` (created if missing)."""
        if not Path(host_dir).is_dir():
            raise SandboxError(f"{host_dir} is not a directory")
        self._check(self.exec(["mkdir", "-p", path]), f"cannot create {path}")
        run_podman(["cp", f"{os.path.abspath(host_dir)}/.", f"{self.name}:{path}"], timeout=600)

    def get_dir(self, path: str, host_dir: str) -> None:
        """Copy the contents of ``path`` in the container into ``host_dir``."""
        Path(host_dir).mkdir(parents=True, exist_ok=True)
        run_podman(["cp", f"{self.name}:{path}/.", host_dir], timeout=600)

    def _check(self, res: ExecResult, what: str) -> ExecResult:
        if res.exit_code != 0:
            raise SandboxError(f"{self.name}: {what}: {res.output.strip()[-300:]}")
        return res

    # -- the agent's work

    def patch(self, base: str | None = None, path: str = "/testbed") -> str:
        """``git diff --binary`` from ``base`` to the working tree, untracked files included.

        The files are staged into a throwaway copy of the index, so the agent's own index, stash
        and commits are left as they were; ignored files (``.gitignore``) are left out.
        """
        base = base or self.testbed_commit or "$(git rev-list --max-parents=0 HEAD | tail -n 1)"
        script = (
            'set -e; idx=$(mktemp); trap \'rm -f "$idx"\' EXIT; '
            'cp "$(git rev-parse --git-dir)/index" "$idx" 2>/dev/null || rm -f "$idx"; '
            'export GIT_INDEX_FILE="$idx"; '
            "git add -A . >/dev/null; "
            f"git -c core.quotepath=off diff --cached --binary --no-color --no-ext-diff {base} --"
        )
        proc = subprocess.run(
            self.exec_argv(["sh", "-c", script], workdir=path, env={"GIT_CONFIG_COUNT": "1",
                           "GIT_CONFIG_KEY_0": "safe.directory", "GIT_CONFIG_VALUE_0": "*"}),
            capture_output=True, env=podman_env(), timeout=600,
        )
        if proc.returncode != 0:
            raise SandboxError(f"{self.name}: git diff in {path} failed: "
                               f"{proc.stderr.decode(errors='replace').strip()[-300:]}")
        # --binary diffs are ASCII; text in another encoding than UTF-8 is the rare lossy case
        return proc.stdout.decode(errors="replace")

    # -- lifetime

    def alive(self) -> bool:
        proc = run_podman(["container", "inspect", "-f", "{{.State.Running}}", self.name], check=False, timeout=60)
        return proc.returncode == 0 and proc.stdout.strip() == b"true"

    def remove(self) -> None:
        """Remove the container at once (no stop grace); safe to call twice."""
        if self._removed:
            return
        run_podman(["rm", "-f", "-i", "-t", "0", self.name], check=False, timeout=120)
        self._removed = True
        with _live_lock:
            _live.pop(self.name, None)


def live_sandboxes() -> list[str]:
    """Names of the containers this process created and has not removed yet."""
    with _live_lock:
        return list(_live)


