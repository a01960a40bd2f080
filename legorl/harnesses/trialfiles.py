"""Reading the trial folder from the host, where the agent may have planted anything.

An in-container harness's trial folder is bind-mounted into the container (``/legorl``), so the
agent can replace any file there with a symlink (to ``/etc/shadow``, ``/proc/self/environ``…), a
fifo that blocks a reader forever, or a file of any size. Every host read of a file there goes
through :func:`read_trial_file`: the last component is opened with ``O_NOFOLLOW`` (and
``O_NONBLOCK``, so a fifo cannot block the open), anything but a regular file is refused, and at
most ``limit`` bytes are read. A refusal is an :class:`UnsafeFile` (an ``OSError``); callers treat
it like a missing file — the agent's outcome, never a crash of legorl.

When the container is gone, :func:`defuse_tree` clears setuid/setgid bits from what it left, and
:func:`remove_tree` removes a folder the agent wrote, whatever its depth or names.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import subprocess
from pathlib import Path

DEFAULT_LIMIT = 16 << 20


class UnsafeFile(OSError):
    """A file in the trial folder the host will not read (a link, not a regular file)."""


def read_trial_file(path: Path, limit: int = DEFAULT_LIMIT, *, tail: bool = False) -> bytes:
    """The bytes of ``path``: its first ``limit`` bytes, or with ``tail`` its last ``limit`` bytes.

    Raises ``FileNotFoundError`` when it is missing and :class:`UnsafeFile` when it is a symlink or
    not a regular file."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | getattr(os, "O_NOCTTY", 0)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # the last component is a symlink
            raise UnsafeFile(exc.errno, "refusing to follow a symlink", str(path)) from None
        raise
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise UnsafeFile(0, "not a regular file", str(path))
        if tail and info.st_size > limit:
            os.lseek(fd, info.st_size - limit, os.SEEK_SET)
        chunks: list[bytes] = []
        left = limit
        while left > 0 and (chunk := os.read(fd, min(left, 1 << 20))):
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def read_trial_text(path: Path, limit: int = DEFAULT_LIMIT, *, tail: bool = False) -> str:
    return read_trial_file(path, limit, tail=tail).decode(errors="replace")


def defuse_tree(path: Path) -> None:
    """Clear the setuid/setgid bits of anything the container left in a host folder (the mount is
    nosuid, but the files outlive it on the host's disk)."""
    with contextlib.suppress(OSError, subprocess.TimeoutExpired):
        subprocess.run(["find", str(path), "-xdev", "-perm", "/6000", "!", "-type", "l", "-exec", "chmod", "ug-s", "{}",
                        "+"], check=False, capture_output=True, timeout=600)


def remove_tree(path: Path) -> None:
    """Remove a folder the agent could write (any depth, any names: ``rm -rf``, not a recursive
    Python walk that a deep enough tree turns into a RecursionError)."""
    with contextlib.suppress(OSError, subprocess.TimeoutExpired):  # left behind, never a reason to lose a row
        subprocess.run(["rm", "-rf", "--one-file-system", "--", str(path)], check=False, capture_output=True,
                       timeout=600)
