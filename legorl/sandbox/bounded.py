"""Run a child and read its output without trusting its size.

Whatever a container writes reaches the host through the pipes of a ``podman`` client (a process in
the container can open ``/proc/<pid>/fd/1`` of any exec'd process and write gigabytes to it), so
the host keeps at most a fixed number of bytes of each stream: the first ``head`` bytes and the
last ``tail`` bytes, the middle read and discarded (the child never blocks on a full pipe), with a
marker line saying how much was dropped.
"""

from __future__ import annotations

import collections
import contextlib
import os
import selectors
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass

CHUNK = 1 << 16
KILL_DRAIN_S = 5.0  # after a kill, how long to wait for the pipes to close (a grandchild may hold them)


def marker(dropped: int) -> bytes:
    return f"\n[... legorl: {dropped} bytes of output dropped here ...]\n".encode()


@dataclass(frozen=True)
class Cap:
    """How much of one stream the host keeps: its first ``head`` and last ``tail`` bytes."""

    head: int
    tail: int

    @classmethod
    def halves(cls, total: int) -> Cap:
        return cls(total // 2, total - total // 2)


class Capped:
    """A stream's bytes, at most ``cap.head + cap.tail`` of them kept (as the chunks read: joined
    once, at the end)."""

    def __init__(self, cap: Cap) -> None:
        self.cap = cap
        self._head: list[bytes] = []
        self._tail: collections.deque[bytes] = collections.deque()
        self._head_len = self._tail_len = 0
        self.total = 0

    def feed(self, data: bytes) -> None:
        self.total += len(data)
        room = self.cap.head - self._head_len
        if room > 0:
            part = data if len(data) <= room else data[:room]
            self._head.append(part)
            self._head_len += len(part)
            data = data[len(part):]
        if data and self.cap.tail > 0:
            self._tail.append(data)
            self._tail_len += len(data)
            # whole chunks go once the rest still holds the tail's share
            while self._tail_len - len(self._tail[0]) >= self.cap.tail:
                self._tail_len -= len(self._tail.popleft())

    @property
    def dropped(self) -> int:
        return self.total - self._head_len - min(self._tail_len, self.cap.tail)

    def value(self) -> bytes:
        """The kept bytes, a :func:`marker` between head and tail where bytes were dropped."""
        dropped = self.dropped
        extra = self._tail_len - self.cap.tail
        if extra > 0:  # the oldest chunk still holds bytes before the tail's share
            self._tail[0] = self._tail[0][extra:]
            self._tail_len -= extra
        return b"".join((*self._head, marker(dropped) if dropped else b"", *self._tail))


@dataclass
class Output:
    """A finished child: its exit status and what was kept of its output (``*_dropped``: bytes cut)."""

    returncode: int
    stdout: bytes
    stderr: bytes
    timed_out: bool = False
    stdout_dropped: int = 0
    stderr_dropped: int = 0


def run(argv: Sequence[str], *, stdout: Cap, stderr: Cap, input: bytes | None = None,
        timeout: float | None = None, env: dict[str, str] | None = None) -> Output:
    """Run ``argv`` with ``input`` on its stdin (None: /dev/null), keeping at most ``stdout`` and
    ``stderr`` of its two streams. With a ``timeout`` the child is killed when it expires and the
    result has ``timed_out=True`` and what was read until then."""
    proc = subprocess.Popen(list(argv), stdin=subprocess.DEVNULL if input is None else subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    assert proc.stdout is not None and proc.stderr is not None
    out_fd, err_fd = proc.stdout.fileno(), proc.stderr.fileno()
    kept = {out_fd: Capped(stdout), err_fd: Capped(stderr)}
    deadline = None if timeout is None else time.monotonic() + timeout
    timed_out = False
    view = memoryview(input or b"")
    sel = selectors.DefaultSelector()
    done = False
    try:
        for fd in kept:
            sel.register(fd, selectors.EVENT_READ)
        if proc.stdin is not None:
            if view:
                os.set_blocking(proc.stdin.fileno(), False)
                sel.register(proc.stdin.fileno(), selectors.EVENT_WRITE)
            else:
                proc.stdin.close()
        while sel.get_map():
            wait = None if deadline is None else deadline - time.monotonic()
            if wait is not None and wait <= 0:
                if timed_out:  # killed, yet something else still holds the pipes open
                    break
                timed_out = True
                proc.kill()
                deadline = time.monotonic() + KILL_DRAIN_S
                continue
            for key, _events in sel.select(wait):
                fd = key.fd
                if fd in kept:
                    data = os.read(fd, CHUNK)
                    if data:
                        kept[fd].feed(data)
                        continue
                else:
                    try:
                        view = view[os.write(fd, view[:CHUNK]):]
                    except BlockingIOError:
                        continue
                    except BrokenPipeError:  # the child stopped reading: the rest is not wanted
                        view = view[:0]
                    if view:
                        continue
                    assert proc.stdin is not None
                    with contextlib.suppress(BrokenPipeError):
                        proc.stdin.close()
                sel.unregister(fd)
        done = True
    finally:
        sel.close()
        if not done:  # an exception (an interrupt) in this process: the child goes too
            proc.kill()
        for stream in (proc.stdin, proc.stdout, proc.stderr):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()
        if deadline is None:
            proc.wait()
        else:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                timed_out = True
                proc.kill()
                proc.wait()
    out, err = kept.pop(out_fd), kept.pop(err_fd)
    return Output(proc.returncode, out.value(), err.value(), timed_out, out.dropped, err.dropped)
