"""The host side of sandboxes: podman + runc present, a containers.conf that works here, the base image.

Everything here is idempotent: each ``ensure_*`` looks first, fixes only what is missing, and
returns a :class:`Step` saying what it found or did. ``legorl setup`` is these steps in order.

Every podman command legorl runs goes through :func:`run_podman` / :func:`podman_env`, which point
``CONTAINERS_CONF`` at legorl's own containers.conf (runc, ulimits inside the host's hard limits),
so nothing depends on the system-wide configuration. Harnesses that shell out to ``podman`` from
legorl's process inherit it when they are given ``podman_env()``.
"""

from __future__ import annotations

import hashlib
import json
import os
import resource
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

from legorl.core.errors import LegorlError
from legorl.core.paths import cache_dir, file_lock
from legorl.sandbox import bounded

Status = Literal["ok", "fixed", "failed", "manual", "skipped"]

# The base image: what every task without its own image runs in. Changing anything in the recipe
# changes the image's tag, so `legorl setup` rebuilds instead of reusing a stale image.
BASE_SUITE = "bookworm"
BASE_PACKAGES = (
    "python3",
    "python3-pytest",
    "python3-pip",
    "python3-venv",
    "git",
    "patch",
    "procps",
    "ca-certificates",
)
BASE_IMAGE_REPO = "localhost/legorl-base"
BASE_GITCONFIG = (
    "[user]\n\tname = legorl\n\temail = legorl@localhost\n"
    "[safe]\n\tdirectory = *\n"
    "[init]\n\tdefaultBranch = main\n"
    "[gc]\n\tauto = 0\n"
)
BASE_ENV = ("LANG=C.UTF-8", "PYTHONDONTWRITEBYTECODE=1", "PIP_DISABLE_PIP_VERSION_CHECK=1")
REGISTRY_BASE = "docker.io/library/debian:bookworm-slim"
_RECIPE_VERSION = 1


@dataclass
class Step:
    """One check of `legorl setup`: what it looked at, what it found or did."""

    name: str
    status: Status
    detail: str
    seconds: float = 0.0


@dataclass
class SetupReport:
    steps: list[Step] = field(default_factory=list)

    @property
    def changed(self) -> bool:
        return any(s.status == "fixed" for s in self.steps)

    @property
    def ok(self) -> bool:
        return not any(s.status in ("failed", "manual") for s in self.steps)

    def as_dict(self) -> dict[str, object]:
        return {"ok": self.ok, "changed": self.changed, "steps": [asdict(s) for s in self.steps]}


# --------------------------------------------------------------------------- containers.conf


def containers_conf_path() -> Path:
    return cache_dir() / "containers.conf"


def hard_limit(kind: int, want: int) -> int:
    """``want``, lowered to this process's hard limit of ``kind`` (a container asking for more never starts)."""
    _soft, hard = resource.getrlimit(kind)
    return want if hard == resource.RLIM_INFINITY else min(want, hard)


def _pid_max() -> int:
    try:
        return int(Path("/proc/sys/kernel/pid_max").read_text())
    except (OSError, ValueError):
        return 32768


def nproc_limit() -> int:
    """The containers' nproc limit. It counts every process of the uid on the whole host (rootful:
    all of root's), so it must be high; but runc cannot set it above pid_max here (measured: 32768
    works, 32769 does not). A container's own processes are bounded by its pids limit instead."""
    return min(hard_limit(resource.RLIMIT_NPROC, 65536), _pid_max())


def containers_conf_text() -> str:
    """runc (crun fails on these hosts' hybrid cgroups) and ulimits no higher than the hard limits.

    podman's default ulimits (nofile 1048576) exceed the hard limits of many hosts, and a
    container asking for more than the hard limit never starts.
    """
    nofile = hard_limit(resource.RLIMIT_NOFILE, 65536)
    nproc = nproc_limit()
    lines = [
        "# Written by `legorl setup`; legorl points CONTAINERS_CONF here for every podman call.",
        "[containers]",
        f'default_ulimits = ["nofile={nofile}:{nofile}", "nproc={nproc}:{nproc}"]',
        "",
        "[engine]",
        'runtime = "runc"',
        'events_logger = "file"',
    ]
    if not Path("/run/systemd/system").is_dir():
        lines.append('cgroup_manager = "cgroupfs"')  # no systemd to ask for cgroups
    return "\n".join(lines) + "\n"


def _write_if_changed(path: Path, text: str) -> bool:
    if path.exists() and path.read_text() == text:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    tmp.write_text(text)
    tmp.replace(path)
    return True


def ensure_containers_conf() -> Step:
    path = containers_conf_path()
    changed = _write_if_changed(path, containers_conf_text())
    return Step("containers.conf", "fixed" if changed else "ok", f"{'wrote' if changed else 'up to date:'} {path}")


def ensure_system_containers_conf() -> Step:
    """Optional: install the same file system-wide, for podman commands run outside legorl."""
    target = Path("/etc/containers/containers.conf")
    text = containers_conf_text()
    if target.exists() and target.read_text() == text:
        return Step("system containers.conf", "ok", f"up to date: {target}")
    if os.geteuid() != 0:
        return Step("system containers.conf", "manual", f"run as root: cp {containers_conf_path()} {target}")
    if target.exists():
        shutil.copy2(target, target.with_name("containers.conf.legorl-backup"))
    _write_if_changed(target, text)
    return Step("system containers.conf", "fixed", f"wrote {target}")


def podman_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for any podman command legorl runs (or lets a harness run)."""
    path = containers_conf_path()
    if not path.exists() or path.read_text() != containers_conf_text():
        ensure_containers_conf()
    env = dict(os.environ)
    env["CONTAINERS_CONF"] = str(path)
    if extra:
        env.update(extra)
    return env


def podman_path() -> str:
    path = shutil.which("podman")
    if path is None:
        raise LegorlError("podman is not installed: run `legorl setup` (or `apt-get install podman runc`)")
    return path


PODMAN_OUTPUT = 64_000_000  # the most of a podman command's stdout run_podman keeps (its head: a cut answer fails to parse)
PODMAN_STDERR = 1_000_000


def run_podman(
    args: Sequence[str], *, input: bytes | None = None, timeout: float | None = None, check: bool = True,
) -> subprocess.CompletedProcess[bytes]:
    """Run ``podman ARGS`` with legorl's containers.conf; a failure is a one-line LegorlError."""
    cmd = [podman_path(), *args]
    # podman's answers name what containers hold (paths, errors): read without trusting their size
    out = bounded.run(cmd, input=input, timeout=timeout, env=podman_env(), stdout=bounded.Cap(PODMAN_OUTPUT, 0),
                      stderr=bounded.Cap.halves(PODMAN_STDERR))
    if out.timed_out:
        raise LegorlError(f"`podman {' '.join(args[:2])}` did not answer within {timeout:g} s")
    proc = subprocess.CompletedProcess(cmd, out.returncode, out.stdout, out.stderr)
    if check and proc.returncode != 0:
        err = proc.stderr.decode(errors="replace").strip().splitlines()
        raise LegorlError(f"`podman {' '.join(args[:2])}` failed: {err[-1] if err else f'exit {proc.returncode}'}")
    return proc


# --------------------------------------------------------------------------- podman + runc


def _apt_install(packages: Sequence[str]) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    subprocess.run(["apt-get", "update", "-q"], capture_output=True, text=True, env=env)
    return subprocess.run(
        ["apt-get", "install", "-y", "-q", "--no-install-recommends", *packages],
        capture_output=True, text=True, env=env,
    )


def ensure_tools(install: bool = True) -> Step:
    """podman, runc (and debootstrap, for the offline base image) on PATH; apt-get them as root."""
    # catatonit is only a Recommends of Debian's podman, but every `--init` container needs it.
    wanted = {"podman": "podman", "runc": "runc", "debootstrap": "debootstrap", "slirp4netns": "slirp4netns",
              "catatonit": "catatonit"}
    missing = [pkg for binary, pkg in wanted.items() if shutil.which(binary) is None]
    if not missing:
        version = subprocess.run(["podman", "--version"], capture_output=True, text=True).stdout.strip()
        return Step("podman + runc", "ok", f"{version}; runc, debootstrap, slirp4netns, catatonit present")
    command = f"apt-get install -y {' '.join(missing)}"
    if not install or os.geteuid() != 0 or shutil.which("apt-get") is None:
        return Step("podman + runc", "manual", f"missing {', '.join(missing)}: run `sudo {command}`")
    proc = _apt_install(missing)
    still = [pkg for binary, pkg in wanted.items() if shutil.which(binary) is None]
    if proc.returncode != 0 or still:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or [""]
        return Step("podman + runc", "failed", f"`{command}` failed: {tail[0]}")
    return Step("podman + runc", "fixed", f"installed {', '.join(missing)}")


# --------------------------------------------------------------------------- base image


def base_recipe() -> dict[str, object]:
    """Everything that determines the base image's content (its tag is a hash of this)."""
    return {
        "version": _RECIPE_VERSION,
        "suite": BASE_SUITE,
        "packages": sorted(BASE_PACKAGES),
        "gitconfig": BASE_GITCONFIG,
        "env": list(BASE_ENV),
        "dirs": ["/testbed"],
    }


def base_image() -> str:
    """The name of the base image for the current recipe, e.g. ``localhost/legorl-base:3f2a…``."""
    digest = hashlib.sha256(json.dumps(base_recipe(), sort_keys=True).encode()).hexdigest()[:12]
    return f"{BASE_IMAGE_REPO}:{digest}"


def image_exists(name: str) -> bool:
    return run_podman(["image", "exists", name], check=False, timeout=60).returncode == 0


def _changes() -> list[str]:
    out = ["--change", "WORKDIR /testbed", "--change", 'CMD ["sleep", "infinity"]']
    for env in BASE_ENV:
        out += ["--change", f"ENV {env}"]
    out += ["--change", f"LABEL legorl.recipe={base_image().rsplit(':', 1)[1]}"]
    return out


def _finish_rootfs(root: Path) -> None:
    """What the recipe adds on top of the packages: /testbed, a git identity, no apt caches."""
    (root / "testbed").mkdir(exist_ok=True)
    (root / "etc" / "gitconfig").write_text(BASE_GITCONFIG)
    for sub in ("var/cache/apt/archives", "var/lib/apt/lists"):
        for item in (root / sub).glob("*"):
            if item.is_file():
                item.unlink()


def _build_debootstrap(name: str, log: Path) -> None:
    mirror = os.environ.get("LEGORL_DEBIAN_MIRROR", "http://deb.debian.org/debian")
    debs = cache_dir() / "debootstrap-debs"
    debs.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="rootfs-", dir=cache_dir()) as tmp, open(log, "w") as logf:
        root = Path(tmp) / "root"
        cmd = [
            "debootstrap", "--variant=minbase", f"--include={','.join(BASE_PACKAGES)}",
            f"--cache-dir={debs}", BASE_SUITE, str(root), mirror,
        ]
        logf.write("$ " + " ".join(cmd) + "\n")
        logf.flush()
        proc = subprocess.run(cmd, stdout=logf, stderr=subprocess.STDOUT)
        if proc.returncode != 0:
            raise LegorlError(f"debootstrap failed (exit {proc.returncode}); see {log}")
        _finish_rootfs(root)
        tar = subprocess.Popen(["tar", "-C", str(root), "--numeric-owner", "-c", "."], stdout=subprocess.PIPE)
        imp = subprocess.run(
            [podman_path(), "import", *_changes(), "-", name],
            stdin=tar.stdout, stdout=logf, stderr=subprocess.STDOUT, env=podman_env(),
        )
        assert tar.stdout is not None
        tar.stdout.close()
        if tar.wait() != 0 or imp.returncode != 0:
            raise LegorlError(f"`podman import` of the base image failed; see {log}")


def _build_from_registry(name: str, log: Path) -> bool:
    """Where a registry answers: debian slim + the recipe's packages. False if it does not answer."""
    pull = run_podman(["pull", "-q", REGISTRY_BASE], check=False, timeout=300)
    if pull.returncode != 0:
        return False
    apt = " ".join(BASE_PACKAGES)
    dockerfile = "\n".join([
        f"FROM {REGISTRY_BASE}",
        "RUN apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "
        f"{apt} && rm -rf /var/lib/apt/lists/* && mkdir -p /testbed",
        "COPY gitconfig /etc/gitconfig",
        *[f"ENV {env}" for env in BASE_ENV],
        f"LABEL legorl.recipe={name.rsplit(':', 1)[1]}",
        "WORKDIR /testbed",
        'CMD ["sleep", "infinity"]',
    ])
    with tempfile.TemporaryDirectory(prefix="build-", dir=cache_dir()) as tmp, open(log, "w") as logf:
        (Path(tmp) / "Containerfile").write_text(dockerfile + "\n")
        (Path(tmp) / "gitconfig").write_text(BASE_GITCONFIG)
        proc = subprocess.run(
            [podman_path(), "build", "-t", name, tmp], stdout=logf, stderr=subprocess.STDOUT, env=podman_env()
        )
    if proc.returncode != 0:
        raise LegorlError(f"building the base image from {REGISTRY_BASE} failed; see {log}")
    return True


def ensure_base_image(build: bool = True) -> Step:
    """The base image for the current recipe: present, else pulled-and-built, else debootstrapped."""
    import time

    name = base_image()
    if image_exists(name):
        return Step("base image", "ok", f"{name} present")
    if not build:
        return Step("base image", "manual", f"{name} missing: run `legorl setup`")
    start = time.monotonic()
    with file_lock(cache_dir() / "base-image.lock"):  # concurrent `legorl setup`s
        if image_exists(name):  # somebody else built it while we waited
            return Step("base image", "ok", f"{name} present (built by a concurrent setup)")
        log = cache_dir() / "base-image-build.log"
        how = "from " + REGISTRY_BASE
        if not _build_from_registry(name, log):
            if os.geteuid() != 0 or shutil.which("debootstrap") is None:
                return Step("base image", "manual", f"no registry answers and an offline build needs root + "
                            f"debootstrap: run `sudo legorl setup` ({name})")
            how = f"offline with debootstrap ({BASE_SUITE})"
            _build_debootstrap(name, log)
    return Step("base image", "fixed", f"built {name} {how}", time.monotonic() - start)


def smoke_test(image: str) -> Step:
    """A container starts from the image with no network, runc and legorl's ulimits."""
    proc = run_podman(
        ["run", "--rm", "--network", "none", "--init", image, "sh", "-c", "test -d /testbed && python3 -c 'print(1)'"],
        check=False, timeout=120,
    )
    if proc.returncode != 0:
        err = proc.stderr.decode(errors="replace").strip().splitlines()
        return Step("container smoke test", "failed", err[-1] if err else f"exit {proc.returncode}")
    return Step("container smoke test", "ok", f"a no-network container from {image} runs python3")


def require_image(image: str) -> None:
    """A clear error before anything starts when the image a task needs is absent."""
    podman_path()
    if not image_exists(image):
        hint = "run `legorl setup`" if image.startswith(BASE_IMAGE_REPO) else "build or pull it first"
        raise LegorlError(f"podman image {image} does not exist: {hint}")
