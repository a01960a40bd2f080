"""The sandbox interface. Sandboxes know containers, never agents or graders."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

MAX_PATCH_BYTES = 20_000_000  # the most a trial's patch may hold (Sandbox.patch refuses more; so does grading)


@dataclass
class ExecResult:
    exit_code: int
    output: str  # stdout and stderr interleaved, decoded with errors="replace"
    timed_out: bool = False
    duration_s: float = 0.0


@dataclass(frozen=True)
class SandboxSpec:
    image: str
    labels: dict[str, str] = field(default_factory=dict)
    # Always False: every container runs with --network none (a trial reaches its proxy session
    # through a unix socket mounted in, see legorl.harnesses.channel); True is refused.
    network: bool = False
    memory: str = "4g"
    pids_limit: int = 1024
    cpus: float | None = None
    mounts: tuple[tuple[str, str, bool], ...] = ()  # (host path, container path, read_only)
    read_only: bool = False  # the image's filesystem read-only: writes go only to the tmpfs mounts
    tmpfs: tuple[tuple[str, str], ...] = ()  # (container path, mount options, e.g. "size=1g,mode=1777")
    env: dict[str, str] = field(default_factory=dict)
    workdir: str = "/testbed"
    deadline_s: float | None = None  # wall-clock lifetime after which the reaper removes it
    init: bool = True  # --init: a tiny PID 1 that forwards signals and reaps zombies
    command: tuple[str, ...] = ("sleep", "infinity")  # what the container runs while it waits for execs


class Sandbox(Protocol):
    name: str

    def exec(
        self, command: str | list[str], timeout: float | None = None, workdir: str | None = None,
        env: dict[str, str] | None = None, user: str | None = None,
    ) -> ExecResult:
        """Run a command (a string goes through ``bash -lc``); a timeout kills it and sets timed_out."""
        ...

    def put_file(self, path: str, data: bytes, mode: int = 0o644) -> None: ...

    def get_file(self, path: str) -> bytes: ...

    def put_dir(self, host_dir: str, path: str) -> None: ...

    def alive(self) -> bool: ...

    def patch(self, base: str | None = None, path: str = "/testbed") -> str:
        """``git diff --binary`` of everything changed under ``path`` since ``base`` (default: the
        commit the testbed was created at), untracked files included; ignored files are not."""
        ...

    def remove(self) -> None:
        """Remove the container; safe to call twice."""
        ...
