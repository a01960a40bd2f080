"""One running podman container: its commands, its files, the patch left in it.

A container runs ``sleep infinity`` under ``--init`` (catatonit as PID 1, so removal is instant and
zombies are reaped); every command is a ``podman exec``. A command's timeout is enforced *inside*
the container by coreutils ``timeout``, which runs the command in its own process group and
signals the whole group (TERM, then KILL 2 s later) — killing the ``podman exec`` client alone
would leave the process running in the container. Every process a command starts carries a unique
``LEGORL_EXEC`` token in its environment; after a timeout (or if ``podman exec`` itself has not
returned a little later) the host kills every process with that token, including any that left
the process group.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import tarfile
import threading
import time
import uuid
from pathlib import Path
from types import TracebackType

from legorl.sandbox import bounded, live
from legorl.sandbox.base import MAX_EXEC_OUTPUT, MAX_FILE_BYTES, MAX_PATCH_BYTES, ExecResult, SandboxSpec
from legorl.sandbox.bounded import Cap
from legorl.sandbox.errors import SandboxError
from legorl.sandbox.host import podman_env, podman_path, run_podman
from legorl.sandbox.service import Service

KILL_GRACE_S = 2.0  # TERM → KILL inside the container
HOST_GRACE_S = 10.0  # how much longer the host waits before killing the group itself
_TOKEN = "LEGORL_EXEC"
PATCH_TIMEOUT_S = 600.0
EXEC_OUTPUT = Cap.halves(MAX_EXEC_OUTPUT)
STDERR = Cap(100_000, 900_000)  # an exec's stderr: podman's own messages (the command's joins its stdout)


def _read_upto(raw: io.RawIOBase, n: int) -> bytes:
    """``n`` bytes from ``raw``, fewer only at its end."""
    data = b""
    while len(data) < n and (more := raw.read(n - len(data))):
        data += more
    return data


def output_text(out: bounded.Output) -> str:
    """stdout then stderr, decoded (without a joined copy of the bytes: they may be 128 MB)."""
    text = out.stdout.decode(errors="replace")
    if out.stderr:
        text += out.stderr.decode(errors="replace")
    return text


class PodmanSandbox:
    """One running container. Use it as a context manager, or call :meth:`remove`."""

    def __init__(self, name: str, spec: SandboxSpec, service: Service | None = None) -> None:
        self.name = name
        self.spec = spec
        self.testbed_commit: str | None = None  # set by legorl.sandbox.testbed when it builds /testbed
        self.host_grace_s = HOST_GRACE_S
        self._service = service
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
        """The full ``podman exec`` command line (for callers that stream or pipe themselves);
        run it with ``env=legorl.sandbox.podman_env()``."""
        cmd = [podman_path(), "exec"]
        workdir = workdir or self.spec.workdir or None
        if interactive:
            cmd.append("-i")
        if workdir:
            cmd += ["-w", workdir]
        if user:
            cmd += ["-u", user]
        for key, value in (env or {}).items():
            cmd += ["-e", f"{key}={value}"]
        return [*cmd, self.name, *argv]

    def _run(self, argv: list[str], *, workdir: str | None = None, env: dict[str, str] | None = None,
             user: str | None = None, stdin: bytes | None = None, timeout: float | None = None,
             stdout: Cap = EXEC_OUTPUT, stderr: Cap = STDERR) -> bounded.Output:
        """One exec, at most ``stdout`` and ``stderr`` of its output kept; through the API service when
        there is one and the exec needs neither stdin nor a timeout (the API has no timeout)."""
        workdir = workdir or self.spec.workdir or None
        if self._service is not None and stdin is None and timeout is None:
            return self._api_exec(argv, workdir=workdir, env=env, user=user, stdout=stdout, stderr=stderr)
        return bounded.run(self.exec_argv(argv, workdir=workdir, env=env, user=user, interactive=stdin is not None),
                           input=stdin, timeout=timeout, env=podman_env(), stdout=stdout, stderr=stderr)

    def _api_exec(self, argv: list[str], *, workdir: str | None, env: dict[str, str] | None, user: str | None,
                  stdout: Cap, stderr: Cap) -> bounded.Output:
        """An exec through the API service, its multiplexed output streamed into bounded buffers
        (podman-py's ``exec_run`` would hold all of it, then copy it once a frame)."""
        from podman.errors import APIError, NotFound

        assert self._service is not None
        api = self._service.client().api
        body = {"AttachStdout": True, "AttachStderr": True, "AttachStdin": False, "Tty": False, "Cmd": argv,
                "Env": [f"{k}={v}" for k, v in (env or {}).items()], "WorkingDir": workdir}
        if user:
            body["User"] = user
        kept = {1: bounded.Capped(stdout), 2: bounded.Capped(stderr)}
        try:
            created = api.post(f"/containers/{self.name}/exec", data=json.dumps(body))
            created.raise_for_status()
            exec_id = created.json()["Id"]
            started = api.post(f"/exec/{exec_id}/start", data=json.dumps({"Detach": False, "Tty": False}), stream=True)
            started.raise_for_status()
            with contextlib.closing(started):
                raw = started.raw
                while len(header := _read_upto(raw, 8)) == 8:  # a frame: stream (1 out, 2 err), 3 pad, 4 size
                    left = int.from_bytes(header[4:], "big")
                    sink = kept.get(header[0], kept[2])
                    while left and (chunk := raw.read(min(left, bounded.CHUNK))):
                        sink.feed(chunk)
                        left -= len(chunk)
                    if left:
                        break
            inspected = api.get(f"/exec/{exec_id}/json")
            inspected.raise_for_status()
            code = inspected.json().get("ExitCode")
        except NotFound as exc:
            raise SandboxError(f"{self.name}: container is gone") from exc
        except APIError as exc:
            raise SandboxError(f"{self.name}: exec failed: {exc}") from exc
        except OSError as exc:  # the service died: this process uses the CLI from now on
            self._service = None
            raise SandboxError(f"{self.name}: lost the podman API service: {exc}") from exc
        out, err = kept[1], kept[2]
        return bounded.Output(code if isinstance(code, int) else -1, out.value(), err.value(), False,
                              out.dropped, err.dropped)

    def exec(
        self, command: str | list[str], timeout: float | None = None, workdir: str | None = None,
        env: dict[str, str] | None = None, user: str | None = None, stdin: bytes | None = None,
    ) -> ExecResult:
        """Run a command (a string goes through ``bash -lc``), stdout and stderr interleaved.

        With a timeout, the command and everything it started are killed inside the container
        when it expires, and the result has ``timed_out=True``.
        """
        argv = ["bash", "-lc", command] if isinstance(command, str) else list(command)
        token = uuid.uuid4().hex[:16]
        if timeout is not None:
            # timeout(1) makes itself a process-group leader and signals the whole group on expiry.
            wrapper = f'exec 2>&1; exec timeout -k {KILL_GRACE_S:g} {timeout:g} "$@"'
        else:
            wrapper = 'exec 2>&1; exec "$@"'
        # Every process of this command inherits LEGORL_EXEC=token, so the host can find and kill
        # them even if they left the process group.
        full = ["sh", "-c", wrapper, "sh", *argv]
        env = {**(env or {}), _TOKEN: token}
        start = time.monotonic()
        watchdog = None
        if timeout is not None:  # last resort if the exec has not returned well after its timeout
            watchdog = threading.Timer(timeout + KILL_GRACE_S + self.host_grace_s, self.kill_tagged, [token])
            watchdog.daemon = True
            watchdog.start()
        try:
            res = self._run(full, workdir=workdir, env=env, user=user, stdin=stdin,
                            timeout=None if timeout is None else timeout + KILL_GRACE_S + 60)
        finally:
            if watchdog is not None:
                watchdog.cancel()
        duration = time.monotonic() - start
        if res.timed_out:  # the client was killed; the container's side goes here
            self.kill_tagged(token)
            return ExecResult(137, res.stdout.decode(errors="replace"), True, duration)
        timed_out = timeout is not None and res.returncode in (124, 137) and duration >= timeout
        if timed_out:
            self.kill_tagged(token)  # what escaped the process group (setsid, daemons) goes too
        return ExecResult(res.returncode, output_text(res), timed_out, duration)

    def kill_tagged(self, token: str) -> None:
        """SIGKILL every process in the container whose environment holds ``LEGORL_EXEC=token``."""
        script = (f'for p in /proc/[0-9]*; do grep -qxz "{_TOKEN}={token}" "$p/environ" 2>/dev/null '
                  '&& kill -KILL "${p#/proc/}" 2>/dev/null; done; true')
        with contextlib.suppress(SandboxError):
            self._run(["sh", "-c", script], timeout=60)

    # -- files

    def put_file(self, path: str, data: bytes, mode: int = 0o644) -> None:
        """Write ``data`` to ``path`` in the container (parents created), binary-safe."""
        if not path.startswith("/"):
            raise SandboxError(f"{self.name}: put_file needs an absolute path, got {path!r}")
        if self._service is not None:
            buf = io.BytesIO()
            with tarfile.open(fileobj=buf, mode="w") as tar:
                # missing parents are created by the copy; listing them would reset existing ones
                info = tarfile.TarInfo(path.lstrip("/"))
                info.size, info.mode, info.mtime = len(data), mode, int(time.time())
                tar.addfile(info, io.BytesIO(data))
            if self._copy_in("/", buf.getvalue()):
                return
        script = 'mkdir -p "$(dirname "$1")" && cat > "$1" && chmod "$2" "$1"'
        res = self.exec(["sh", "-c", script, "sh", path, f"{mode:o}"], stdin=data)
        if res.exit_code != 0:
            raise SandboxError(f"{self.name}: cannot write {path}: {res.output.strip()[-200:]}")

    def _copy_in(self, path: str, tar_bytes: bytes) -> bool:
        """put_archive through the service; False when the CLI should do it instead."""
        from podman.errors import APIError, NotFound

        assert self._service is not None
        try:
            return bool(self._service.container(self.name).put_archive(path, tar_bytes))
        except NotFound as exc:
            raise SandboxError(f"{self.name}: container is gone") from exc
        except (APIError, OSError):
            return False

    def get_file(self, path: str, max_bytes: int = MAX_FILE_BYTES) -> bytes:
        """Read a file from the container; FileNotFoundError if it is not there, SandboxError if it
        holds more than ``max_bytes``."""
        res = self._run(["cat", "--", path], timeout=300, stdout=Cap(max_bytes + 1, 0))
        if res.timed_out:
            raise SandboxError(f"{self.name}: reading {path} took over 300 s")
        if res.returncode != 0:
            if b"No such file" in res.stderr:
                raise FileNotFoundError(f"{self.name}:{path}")
            raise SandboxError(f"{self.name}: cannot read {path}: {res.stderr.decode(errors='replace').strip()[-200:]}")
        if len(res.stdout) > max_bytes:
            raise SandboxError(f"{self.name}: {path} holds more than {max_bytes} bytes")
        return res.stdout

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
        and commits are left as they were; ignored files (``.gitignore``) are left out. The
        commands the agent's git config names (fsmonitor, hooks, filter drivers, textconv,
        external diff) do not run; a ``git`` of the agent's own still could, so the output kept
        and the time taken are bounded too.
        """
        base = base or self.testbed_commit or "$(git rev-list --max-parents=0 HEAD | tail -n 1)"
        script = (
            'set -e; idx=$(mktemp); trap \'rm -f "$idx" "$idx.diff" "$idx.cfg"\' EXIT; '
            # every filter driver the agent's config names is emptied (an empty command filters
            # nothing) and made optional, through the environment's config (it overrides the repo's)
            "git config --name-only --get-regexp '^filter[.]' > \"$idx.cfg\" || true; n=$GIT_CONFIG_COUNT; "
            'while IFS= read -r key; do case "$key" in *.required) val=false;; *.clean|*.smudge|*.process) val=;; '
            '*) continue;; esac; export "GIT_CONFIG_KEY_$n=$key" "GIT_CONFIG_VALUE_$n=$val"; n=$((n + 1)); '
            'done < "$idx.cfg"; export GIT_CONFIG_COUNT=$n; '
            'cp -p "$(git rev-parse --git-dir)/index" "$idx" 2>/dev/null || rm -f "$idx"; '
            'export GIT_INDEX_FILE="$idx"; '
            "git add -A . >/dev/null; "
            "git -c core.quotepath=off diff --cached --binary --no-color --no-ext-diff --no-textconv "
            f'{base} -- > "$idx.diff"; '
            f'head -c {MAX_PATCH_BYTES + 1} "$idx.diff"'
        )
        # the agent's repository config may name commands git would run (fsmonitor, hooks): not here
        safe = {"GIT_CONFIG_COUNT": "3", "GIT_CONFIG_KEY_0": "safe.directory", "GIT_CONFIG_VALUE_0": "*",
                "GIT_CONFIG_KEY_1": "core.fsmonitor", "GIT_CONFIG_VALUE_1": "false",
                "GIT_CONFIG_KEY_2": "core.hooksPath", "GIT_CONFIG_VALUE_2": "/dev/null"}
        res = self._run(["sh", "-c", script], workdir=path, env=safe, timeout=PATCH_TIMEOUT_S,
                        stdout=Cap(MAX_PATCH_BYTES + 1, 0))
        if res.timed_out:
            raise SandboxError(f"{self.name}: git diff in {path} did not finish within {PATCH_TIMEOUT_S:g} s")
        if len(res.stdout) > MAX_PATCH_BYTES:
            raise SandboxError(f"{self.name}: the patch is over {MAX_PATCH_BYTES} bytes")
        if res.returncode != 0:
            raise SandboxError(f"{self.name}: git diff in {path} failed: "
                               f"{res.stderr.decode(errors='replace').strip()[-300:]}")
        # --binary diffs are ASCII; text in another encoding than UTF-8 is the rare lossy case
        return res.stdout.decode(errors="replace")

    # -- lifetime

    def alive(self) -> bool:
        proc = run_podman(["container", "inspect", "-f", "{{.State.Running}}", self.name], check=False, timeout=60)
        return proc.returncode == 0 and proc.stdout.strip() == b"true"

    def removed_by_podman(self) -> None:
        """podman removed the container itself (``run --rm`` whose command exited)."""
        self._removed = True
        live.forget(self.name)

    def remove(self) -> None:
        """Remove the container at once (no stop grace); safe to call twice."""
        if self._removed:
            return
        run_podman(["rm", "-f", "-i", "-t", "0", self.name], check=False, timeout=120)
        self._removed = True
        live.forget(self.name)

