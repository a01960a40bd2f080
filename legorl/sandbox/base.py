"""The sandbox interface. Sandboxes know containers, never agents or graders."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

MAX_PATCH_BYTES = 20_000_000  # the most a trial's patch may hold (Sandbox.patch refuses more; so does grading)
# What the host keeps of one command's output, whatever the container writes: its first and last
# halves, the middle dropped and marked (legorl.sandbox.bounded).
MAX_EXEC_OUTPUT = 16_000_000
MAX_FILE_BYTES = 64_000_000  # the largest file Sandbox.get_file reads back by default


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
    memory: str = "4g"  # tmpfs pages count against it too
    pids_limit: int = 1024
    nofile: int = 16384  # open files per process (lowered to the host's hard limit where that is less)
    cpus: float | None = None
    mounts: tuple[tuple[str, str, bool], ...] = ()  # (host path, container path, read_only)
    read_only: bool = False  # the image's filesystem read-only: writes go only to the tmpfs mounts
    # No kernel cache of the image's files (pages, names looked up) shared with other containers: runs from a
    # copy in memory where the host allows (legorl.sandbox.memory_rootfs), else the page cache is warmed first
    cache_isolation: bool = False
    tmpfs: tuple[tuple[str, str], ...] = ()  # (container path, mount options, e.g. "size=1g,mode=1777")
    tmpfs_size: str = "1g"  # the size of a tmpfs mount whose options name none (the kernel's default: half the RAM)
    # What the container's PID 1 writes (any process there can open /proc/1/fd/1) would be conmon's
    # log file on the host's disk, unbounded: discarded instead. Execs and run_once's attached
    # output are not logs and are unaffected.
    log_driver: str = "none"
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

    def get_file(self, path: str, max_bytes: int = MAX_FILE_BYTES) -> bytes:
        """The file's bytes; FileNotFoundError if absent, an error if it holds more than ``max_bytes``."""
        ...

    def put_dir(self, host_dir: str, path: str) -> None: ...

    def alive(self) -> bool: ...

    def patch(self, base: str | None = None, path: str = "/testbed") -> str:
        """``git diff --binary`` of everything changed under ``path`` since ``base`` (default: the
        commit the testbed was created at), untracked files included; ignored files are not."""
        ...

    def remove(self) -> None:
        """Remove the container; safe to call twice."""
        ...
