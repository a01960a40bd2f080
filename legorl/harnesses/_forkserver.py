"""A warm interpreter that forks one process per trial. Runs in a harness's venv, not legorl's.

Usage: ``python _forkserver.py FOLDER MARKER_VAR MODULE...``. It imports the MODULEs (the slow part of a
harness's start: litellm is ~15 s of CPU on two shared cores), refuses to serve if that left a
thread or a socket behind (neither survives a fork intact), binds ``FOLDER/fork.sock`` (FOLDER is
the private 0700 folder its parent made) and prints ``ready`` on stdout.

Each connection, accepted only from the parent process (SO_PEERCRED), carries one request: a
4-byte big-endian length and a JSON object ``{"argv": [python, SCRIPT, ARG...], "env": {...},
"cwd": "..."}``, with the trial's log file descriptor attached (SCM_RIGHTS). The child then does
what ``python SCRIPT ARG...`` started by ``subprocess.Popen(..., start_new_session=True)`` would:
its own session, stdin from /dev/null, stdout and stderr on the log, exactly the request's
environment and cwd, ``sys.argv``/``sys.path[0]`` of the script, the script run as ``__main__``,
then the interpreter's exit (non-daemon threads joined, atexit handlers, the exit status).
Replies are JSON lines: ``{"pid": N}`` once forked (the pid is the child's process group), then
``{"returncode": R}`` (subprocess's convention: negative for a signal); ``{"error": "..."}`` for a
refused request.

Lifetimes: the child is killed when the server dies (PR_SET_PDEATHSIG) and, with its whole process
group, when its connection closes before it ends; when it ends, what is left of its group is killed
before it is reaped (so the group id cannot have been reused). The server itself stops, killing
every child group and every process that carries its own run marker (its environment's MARKER_VAR:
what a trial forked without exec'ing still shows the server's environment), when its stdin (a pipe
only the parent holds) reaches EOF: the parent is gone.

The server is single-threaded (a selector over the listening socket, the connections, the
children's pidfds and stdin) and never makes a model call, so no client state exists to be shared:
each child starts from the same freshly imported modules, in its own copy of them.

This file must not import legorl: it is executed by another interpreter.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import json
import os
import random
import runpy
import selectors
import shutil
import signal
import socket
import struct
import sys
import threading
import traceback
from dataclasses import dataclass

SOCKET_NAME = "fork.sock"
MAX_REQUEST = 16 << 20
_PR_SET_PDEATHSIG = 1
_LENGTH = struct.Struct(">I")
_PEERCRED = struct.Struct("3i")


class Refused(Exception):
    """A request the server will not run (its text goes back to the client)."""


@dataclass
class Request:
    argv: list[str]
    env: dict[str, str]
    cwd: str


@dataclass
class Child:
    pid: int
    pidfd: int
    conn: socket.socket | None  # None once the client is gone


def open_fds() -> dict[int, str]:
    """This process's open descriptors and what they are (not the listing's own, closed by then)."""
    found = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            found[int(name)] = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
    return found


def check_forkable() -> None:
    """Refuse to serve where a fork would not be a clean copy: another thread, or an open socket."""
    threads = len(os.listdir("/proc/self/task"))
    if threads != 1 or threading.active_count() != 1:
        raise Refused(f"{threads} threads after the imports (a fork keeps only one)")
    os.close(os.pidfd_open(os.getpid()))  # Linux >= 5.3: how the server learns that a child ended
    for fd, target in open_fds().items():
        if fd > 2 and target.startswith("socket:"):
            raise Refused(f"an open socket after the imports (fd {fd}): children would share it")


def exit_code(code: object) -> int:
    """What the interpreter exits with for ``SystemExit(code)``."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def run_script(argv: list[str]) -> int:
    """``python SCRIPT ARG...`` from here on: the script as ``__main__``, then the interpreter's exit."""
    script = argv[1]
    sys.argv = argv[1:]
    sys.path[0] = os.path.dirname(os.path.realpath(script))
    try:
        runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as exc:
        code = exit_code(exc.code)
    except BaseException:  # what an uncaught exception does: its traceback, status 1
        traceback.print_exc()
        code = 1
    # What the interpreter's exit does: threading's exit hooks (concurrent.futures stops its
    # workers there), non-daemon threads joined, then the atexit handlers.
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    return code


class Server:
    def __init__(self, folder: str) -> None:
        self.pid = os.getpid()
        self.parent = os.getppid()
        self.keep = set(open_fds())  # what the imports hold (checked: no socket); children keep them too
        # What the interpreter's own start added to its environment (PEP 538's LC_CTYPE): a cold start
        # of the trial's script adds it to the trial's environment as well.
        with open("/proc/self/environ", "rb") as handle:
            initial = {item.split(b"=", 1)[0].decode(errors="replace") for item in handle.read().split(b"\0") if item}
        self.added = {k: v for k, v in os.environ.items() if k not in initial}
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(os.path.join(folder, SOCKET_NAME))
        self.listener.listen(64)
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.listener, selectors.EVENT_READ, "accept")
        self.selector.register(0, selectors.EVENT_READ, "parent")
        self.children: dict[int, Child] = {}

    def serve(self) -> None:
        print("ready", flush=True)
        while True:
            for key, _ in self.selector.select():
                if key.data == "parent":
                    if not os.read(0, 4096):
                        return  # EOF: the parent is gone
                elif key.data == "accept":
                    self.accept()
                elif isinstance(key.data, Child) and key.fd == key.data.pidfd:
                    self.ended(key.data)
                elif isinstance(key.data, Child):
                    self.client_gone(key.data)

    def accept(self) -> None:
        conn, _ = self.listener.accept()
        try:
            pid, _uid, _gid = _PEERCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
            if pid != self.parent:
                raise Refused(f"requests are taken from process {self.parent} only")
            request, log_fd = self.read_request(conn)
            try:
                self.fork(conn, request, log_fd)
            finally:
                os.close(log_fd)
        except (Refused, OSError, ValueError) as exc:
            with contextlib.suppress(OSError):
                conn.sendall(json.dumps({"error": f"{type(exc).__name__}: {exc}"}).encode() + b"\n")
            conn.close()

    def read_request(self, conn: socket.socket) -> tuple[Request, int]:
        conn.settimeout(30.0)  # only the parent connects, and it sends at once
        data, fds, _flags, _addr = socket.recv_fds(conn, 1 << 16, 1)
        if len(fds) != 1:
            for fd in fds:
                os.close(fd)
            raise Refused("no log descriptor with the request")
        try:
            while len(data) < _LENGTH.size or len(data) < _LENGTH.size + _LENGTH.unpack_from(data)[0]:
                if len(data) > MAX_REQUEST:
                    raise Refused("request too large")
                chunk = conn.recv(1 << 16)
                if not chunk:
                    raise Refused("truncated request")
                data += chunk
            request = json.loads(data[_LENGTH.size:_LENGTH.size + _LENGTH.unpack_from(data)[0]])
            argv, env, cwd = request.get("argv"), request.get("env"), request.get("cwd")
            if not (isinstance(argv, list) and len(argv) >= 2 and all(isinstance(a, str) for a in argv)
                    and not argv[1].startswith("-")):
                raise Refused("argv must be [python, SCRIPT, ARG...]")
            if not (isinstance(env, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())):
                raise Refused("env must map strings to strings")
            if not isinstance(cwd, str):
                raise Refused("cwd must be a path")
        except BaseException:
            os.close(fds[0])
            raise
        conn.settimeout(None)
        return Request(argv, env, cwd), fds[0]

    def fork(self, conn: socket.socket, request: Request, log_fd: int) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                code = self.become_child(conn, request, log_fd)
            except BaseException:
                with contextlib.suppress(BaseException):
                    traceback.print_exc()
            finally:
                os._exit(code)
        child = Child(pid, os.pidfd_open(pid), conn)
        self.children[pid] = child
        self.selector.register(child.pidfd, selectors.EVENT_READ, child)
        self.selector.register(conn, selectors.EVENT_READ, child)
        try:
            conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
        except OSError:
            self.client_gone(child)

    def become_child(self, conn: socket.socket, request: Request, log_fd: int) -> int:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # as in a fresh interpreter (the server's is its stop)
        os.setsid()
        if ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            return 1
        if os.getppid() != self.pid:
            return 1  # the server died before the line above
        self.selector.close()
        self.listener.close()
        conn.close()
        for other in self.children.values():
            if other.conn is not None:
                other.conn.close()
            os.close(other.pidfd)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        for fd in set(open_fds()) - self.keep - {0, 1, 2}:
            with contextlib.suppress(OSError):
                os.close(fd)  # the log's and /dev/null's own descriptors, anything else of the server's
        os.environ.clear()
        os.environ.update(request.env)
        if "LC_ALL" not in request.env:
            for name, value in self.added.items():
                os.environ.setdefault(name, value)
        os.chdir(request.cwd)
        random.seed()  # fork re-seeds `random` already; a generator made at import is re-seeded here
        numpy = sys.modules.get("numpy")
        if numpy is not None:
            numpy.random.seed()
        return run_script(request.argv)

    def ended(self, child: Child) -> None:
        with contextlib.suppress(OSError):
            os.killpg(child.pid, signal.SIGKILL)  # what is left of its group; the zombie keeps the id ours
        _, status = os.waitpid(child.pid, 0)
        self.selector.unregister(child.pidfd)
        os.close(child.pidfd)
        del self.children[child.pid]
        if child.conn is not None:
            self.selector.unregister(child.conn)
            with contextlib.suppress(OSError):
                child.conn.sendall(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
            child.conn.close()

    def client_gone(self, child: Child) -> None:
        """The client closed its connection (or sent anything): the trial is killed, group and all."""
        if child.conn is not None:
            self.selector.unregister(child.conn)
            child.conn.close()
            child.conn = None
        with contextlib.suppress(OSError):
            os.killpg(child.pid, signal.SIGKILL)

    def stop(self, marker_var: str) -> None:
        for child in list(self.children.values()):
            self.client_gone(child)
        for child in list(self.children.values()):
            self.ended(child)
        if os.environ.get(marker_var):
            kill_marked(f"{marker_var}={os.environ[marker_var]}".encode())


def kill_marked(entry: bytes) -> None:
    """KILL every other process whose environment holds ``entry`` (legorl.harnesses.processes.kill_marked;
    this file cannot import it)."""
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as handle:
                found = entry in handle.read().split(b"\0")
        except OSError:
            continue
        if found:
            with contextlib.suppress(OSError):
                os.kill(int(name), signal.SIGKILL)


def main(folder: str, marker_var: str, modules: list[str]) -> int:
    try:
        for name in modules:
            __import__(name)
        check_forkable()
        server = Server(folder)
    except Exception as exc:
        print(f"error: {type(exc).__name__}: {exc}", flush=True)
        return 2
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        server.serve()
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        server.stop(marker_var)
        shutil.rmtree(folder, ignore_errors=True)  # its parent may be gone: nobody else removes it
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2], sys.argv[3:]))
