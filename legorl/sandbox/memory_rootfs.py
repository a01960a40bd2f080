"""An image's files copied into memory (tmpfs), for containers that must share no kernel cache.

Containers of one image share its layers on the host's disk, and with them the kernel's caches of
those files: the page cache (pages loaded or evicted) and the cache of names looked up — including
names that do not exist. Code in one container can leave a mark there and code in a later one can
time a lookup or a read to see it: a red team carried what one grade saw into the next grade of the
same task by ``os.stat`` of made-up names in the image's ``encodings/`` folder (a cached miss took
9 µs, a fresh one 13 µs) and learnt which tests were canaries. On tmpfs neither mark holds: a name
that does not exist is never cached (``always_delete_dentry``), every existing name and every page
stays in memory, and without swap nothing is evicted. So a container that asks for
``SandboxSpec.cache_isolation`` runs from such a copy (``podman run --rootfs``; writable through an
overlay where the spec is not read-only), and the image's config (environment, working folder,
user) is applied as podman would apply it; the image's entrypoint is not run.

Where the copy cannot be used — podman run rootless (``podman image mount`` needs root) or a host
with swap (a tmpfs page can be swapped out, and a read's timing says which) — :func:`held` yields
None and the caller falls back to warming the page cache (:mod:`.pagecache`), which leaves the
names channel open (docs/threat-model.md).

Copies live in ``/dev/shm/legorl-rootfs/<image id>``, made once per image and boot (~2 s and the
image's size in memory); at most :data:`MAX_COPIES` are kept, the least recently used removed when
no container runs from it (a shared ``flock`` per copy while one does).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from legorl.core.errors import LegorlError
from legorl.sandbox.errors import SandboxError
from legorl.sandbox.host import run_podman

ROOT = Path("/dev/shm/legorl-rootfs")
MAX_COPIES = 4
COPY_TIMEOUT_S = 600


@dataclass(frozen=True)
class RootfsCopy:
    """One image's files in memory, and the image config ``podman run --rootfs`` does not apply."""

    path: Path
    env: tuple[str, ...]
    workdir: str
    user: str

    def run_args(self, writable: bool) -> list[str]:
        """What replaces the image name in ``podman run``'s arguments (the environment goes with the spec's)."""
        args = []
        if self.workdir:
            args += ["--workdir", self.workdir]
        if self.user:
            args += ["--user", self.user]
        return [*args, "--rootfs", f"{self.path}:O" if writable else str(self.path)]


@functools.cache
def usable() -> bool:
    """Whether copies can be made and trusted here: podman as root, ``/dev/shm`` a tmpfs, no swap."""
    if os.geteuid() != 0:
        return False
    try:
        mounts = Path("/proc/self/mounts").read_text().splitlines()
        meminfo = Path("/proc/meminfo").read_text().splitlines()
    except OSError:
        return False
    shm_is_tmpfs = any(line.split()[1:3] == ["/dev/shm", "tmpfs"] for line in mounts if len(line.split()) > 2)
    swap = next((line.split()[1] for line in meminfo if line.startswith("SwapTotal:")), "1")
    return shm_is_tmpfs and swap == "0"


@contextlib.contextmanager
def held(image: str) -> Iterator[RootfsCopy | None]:
    """The image's copy in memory, kept from removal while the caller runs a container from it (None
    where copies are not :func:`usable`). A copy that cannot be made is a :class:`SandboxError`:
    running from the shared layers instead would quietly reopen the channel."""
    if not usable():
        yield None
        return
    ident = _image_id(image)
    while True:
        copy = _ensure(image, ident)
        lock = os.open(ROOT / f"{ident}.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(lock, fcntl.LOCK_SH)
            if (ROOT / f"{ident}.json").exists():  # not removed between _ensure and the lock
                os.utime(ROOT / f"{ident}.json")  # recently used
                yield copy
                return
        finally:
            os.close(lock)


@functools.lru_cache(maxsize=64)
def _image_id(image: str) -> str:
    """The image's id (asked once per process, as its layers are: :mod:`.pagecache`)."""
    try:
        out = run_podman(["image", "inspect", "--format", "{{.Id}}", image], timeout=60).stdout.decode().strip()
    except LegorlError as exc:
        raise SandboxError(f"cannot inspect image {image}: {exc}") from exc
    if not out.isalnum():
        raise SandboxError(f"podman gave image {image} the id {out[:80]!r}")
    return out[:32]


@contextlib.contextmanager
def _exclusive() -> Iterator[None]:
    """One process at a time makes or removes copies."""
    ROOT.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(ROOT / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _ensure(image: str, ident: str) -> RootfsCopy:
    meta = ROOT / f"{ident}.json"
    with _exclusive():
        if not meta.exists():
            for stale in ROOT.glob(".*.tmp"):  # a copier killed half-way (copies are made under the lock)
                shutil.rmtree(stale, ignore_errors=True) if stale.is_dir() else stale.unlink()
            _evict(keep=MAX_COPIES - 1)
            _copy(image, ident)
    data = json.loads(meta.read_text())
    return RootfsCopy(ROOT / ident, tuple(data["env"]), data["workdir"], data["user"])


def _copy(image: str, ident: str) -> None:
    """Copy the image's files (``podman image mount``) and its config into ROOT; the config file last,
    so its presence says the copy is whole."""
    tmp = ROOT / f".{ident}.{os.getpid()}.tmp"
    try:
        config = json.loads(run_podman(["image", "inspect", "--format", "{{json .Config}}", image],
                                       timeout=60).stdout.decode() or "{}") or {}
        mounted = run_podman(["image", "mount", image], timeout=120).stdout.decode().strip()
        try:
            tmp.mkdir(mode=0o755)
            proc = subprocess.run(["cp", "-a", f"{mounted}/.", f"{tmp}/"], capture_output=True,
                                  timeout=COPY_TIMEOUT_S, check=False)
        finally:
            run_podman(["image", "unmount", image], timeout=120, check=False)
        if proc.returncode != 0:
            last = proc.stderr.decode(errors="replace").strip().splitlines()[-1:] or [f"exit {proc.returncode}"]
            raise SandboxError(f"cannot copy image {image} into {ROOT}: {last[0]}")
        shutil.rmtree(ROOT / ident, ignore_errors=True)
        os.rename(tmp, ROOT / ident)
        meta = {"env": [str(e) for e in config.get("Env") or []], "workdir": str(config.get("WorkingDir") or ""),
                "user": str(config.get("User") or ""), "image": image, "made": time.time()}
        (ROOT / f".{ident}.json.tmp").write_text(json.dumps(meta))
        os.rename(ROOT / f".{ident}.json.tmp", ROOT / f"{ident}.json")
    except (LegorlError, OSError, ValueError, subprocess.SubprocessError) as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, SandboxError):
            raise
        raise SandboxError(f"cannot copy image {image} into memory: {exc}") from exc


def _evict(keep: int) -> None:
    """Remove the least recently used copies past ``keep``, skipping any a container runs from."""
    metas = sorted(ROOT.glob("*.json"), key=lambda p: p.stat().st_mtime, reverse=True)
    for meta in metas[keep:]:
        ident = meta.stem
        lock = os.open(ROOT / f"{ident}.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(lock)
            continue
        try:
            meta.unlink()
            shutil.rmtree(ROOT / ident, ignore_errors=True)
        finally:
            os.close(lock)
