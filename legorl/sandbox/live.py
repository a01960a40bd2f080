"""The containers this process created and has not removed yet, and their removal when it exits
or is terminated (atexit, SIGTERM, SIGHUP); a SIGKILLed process's containers are the reaper's."""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import threading
from types import FrameType
from typing import Any, Protocol

from legorl.sandbox.host import podman_env, podman_path


class Tracked(Protocol):
    """A container this process created (:class:`~legorl.sandbox.podman_container.PodmanSandbox`)."""

    name: str
    _removed: bool  # set once it is gone, so its own remove() does nothing


_live: dict[str, Tracked] = {}
_live_lock = threading.Lock()
_handlers_installed = False


def remove_all() -> None:
    """Remove every tracked container at once (one podman call)."""
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


def install_handlers() -> None:
    """atexit + SIGTERM/SIGHUP: remove this process's containers. SIGKILL is the reaper's job."""
    global _handlers_installed
    if _handlers_installed:
        return
    _handlers_installed = True
    atexit.register(remove_all)
    if threading.current_thread() is not threading.main_thread():
        return  # signal handlers can only be set from the main thread; atexit still covers us
    for sig in (signal.SIGTERM, signal.SIGHUP):
        previous = signal.getsignal(sig)

        def handler(signum: int, frame: FrameType | None, previous: Any = previous) -> None:
            remove_all()
            if callable(previous):
                previous(signum, frame)
            elif previous == signal.SIG_IGN:
                return
            else:  # default action: die of the same signal, as if we had never caught it
                signal.signal(signum, signal.SIG_DFL)
                os.kill(os.getpid(), signum)

        signal.signal(sig, handler)


def register(box: Tracked) -> None:
    """Track ``box`` until it is removed (before its container exists, so a signal mid-create removes it)."""
    with _live_lock:
        _live[box.name] = box


def forget(name: str) -> None:
    """Stop tracking a container that is gone."""
    with _live_lock:
        _live.pop(name, None)


def live_sandboxes() -> list[str]:
    """Names of the containers this process created and has not removed yet."""
    with _live_lock:
        return list(_live)
