"""The podman backend: one container per trial.

CLI or podman-py? ``benchmarks/sandbox.py`` measures both on this host. Starting and removing a
container cost the same either way (~0.2–0.35 s, podman's own work dominates), so those go through
the ``podman`` CLI: no daemon needed, failures are exit codes and stderr, and the container exists
even if everything else in this process dies. Exec round-trips and file copies are 1.5–3× faster
through the REST API (each CLI call pays ~0.1–0.2 s of process start-up), and a trial or a grading
run does dozens of them, so those go through a private ``podman system service``
(:mod:`legorl.sandbox.service`) when one can be started, and through the CLI otherwise
(``PodmanBackend(api="cli")`` forces the CLI). Harnesses that shell out to ``podman exec``
(mini-swe-agent) work the same with either. On both paths the output is streamed into bounded
buffers (:mod:`legorl.sandbox.bounded`): any process in a container can write to an exec's pipes.

A job that needs no back-and-forth with the container (grading) uses :meth:`PodmanBackend.run_once`
instead: one ``podman run --rm -i`` with its input on stdin creates, runs and removes the container
in a single podman call.

One running container and what a trial does with it: :mod:`legorl.sandbox.podman_container`.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Literal

from legorl.sandbox import bounded, live, memory_rootfs, pagecache
from legorl.sandbox.base import ExecResult, SandboxSpec
from legorl.sandbox.bounded import Cap
from legorl.sandbox.errors import SandboxError
from legorl.sandbox.host import podman_env, podman_path, require_image, run_podman
from legorl.sandbox.podman_container import STDERR, PodmanSandbox, output_text
from legorl.sandbox.podman_run import container_name, run_args
from legorl.sandbox.service import get_service

# run_once (grading) keeps what the grading script can print whole: 20 MB of test output and a 50 MB
# report as base64 (legorl.grading.script) fit in the tail after any flood of the patch appliers'
# output. A cut there loses events, which fails the run (the patch's 0), never passes it.
RUN_ONCE_OUTPUT = Cap(32_000_000, 96_000_000)


class PodmanBackend:
    """Creates sandboxes: ``with PodmanBackend().create(spec) as box: box.exec("pytest")``."""

    def __init__(self, api: Literal["auto", "cli"] = "auto") -> None:
        """``api="auto"``: exec and file copies go through a private podman API service when one
        can be started (faster per call), else the CLI; ``"cli"``: the CLI for everything."""
        self.api = api
        self._images_checked: set[str] = set()
        self._lock = threading.Lock()

    def run_args(self, spec: SandboxSpec, name: str, command: list[str] | None = None, *,
                 detach: bool = True) -> list[str]:
        """The ``podman run`` arguments for a spec (public so harnesses can reuse the policy;
        :func:`legorl.sandbox.podman_run.run_args`).

        ``detach=False`` (with a ``command``) is the one-shot form :meth:`run_once` uses:
        ``--rm -i``, stdin attached, the container removed by podman when its command exits.
        """
        return run_args(spec, name, command, detach=detach)

    def _check_image(self, image: str) -> None:
        with self._lock:
            if image not in self._images_checked:
                require_image(image)
                self._images_checked.add(image)

    def create(self, spec: SandboxSpec) -> PodmanSandbox:
        """Start a fresh container for ``spec``; it is removed on exit, SIGTERM, or by the reaper."""
        if spec.cache_isolation:
            raise SandboxError("cache_isolation is for run_once (a container that outlives the call would hold "
                               "its copy of the image open)")
        self._check_image(spec.image)
        live.install_handlers()
        name = container_name(spec.labels)
        args = self.run_args(spec, name)
        box = PodmanSandbox(name, spec, get_service() if self.api == "auto" else None)
        live.register(box)  # before it exists, so a signal mid-create still removes it
        proc = run_podman(args, check=False, timeout=300)
        if proc.returncode != 0:
            box.remove()
            err = proc.stderr.decode(errors="replace").strip().splitlines()
            raise SandboxError(f"could not start a container from {spec.image}: {err[-1] if err else proc.returncode}")
        return box

    def run_once(self, spec: SandboxSpec, argv: list[str], *, stdin: bytes | None = None,
                 timeout: float | None = None) -> ExecResult:
        """Run ``argv`` as the only command of a fresh container and remove it: one ``podman run
        --rm -i`` for what :meth:`create`, an exec and a removal do in three podman calls.

        ``stdin`` is piped to the command; stdout and stderr come back interleaved (podman's own
        errors last; exit 125 is podman's). ``spec.command`` is not used. With a ``timeout`` the
        container is removed (everything in it killed) when it expires, and the result has
        ``timed_out=True``. Removal on every exit path: podman removes the container when the
        command exits, this process's exit handlers when it is terminated, and the reaper (owner
        and deadline labels) when it is SIGKILLed.
        """
        self._check_image(spec.image)
        live.install_handlers()
        name = container_name(spec.labels)
        box = PodmanSandbox(name, spec, None)
        live.register(box)  # a signal before podman's own --rm removes it goes through live.remove_all
        command = ["sh", "-c", 'exec 2>&1; exec "$@"', "sh", *argv]
        with memory_rootfs.held(spec.image) if spec.cache_isolation else contextlib.nullcontext() as rootfs:
            if spec.cache_isolation and rootfs is None:  # no copy in memory here: at least every page cached
                pagecache.warm(spec.image)
            start = time.monotonic()
            clean = False
            try:
                out = bounded.run([podman_path(), *run_args(spec, name, command, detach=False, rootfs=rootfs)],
                                  input=stdin if stdin is not None else b"", timeout=timeout, env=podman_env(),
                                  stdout=RUN_ONCE_OUTPUT, stderr=STDERR)
                clean = not out.timed_out and out.returncode != 125  # 125: podman itself failed, maybe half-way
            finally:
                if clean:
                    box.removed_by_podman()
                else:  # a timeout killed the client only; the container is removed here
                    box.remove()
        if out.timed_out:
            return ExecResult(137, out.stdout.decode(errors="replace"), True, time.monotonic() - start)
        return ExecResult(out.returncode, output_text(out), False, time.monotonic() - start)
