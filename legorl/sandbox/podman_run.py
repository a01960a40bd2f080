"""The ``podman run`` arguments for a sandbox spec: the container policy (no network, memory and
pid limits, dropped capabilities, ``nodev,nosuid`` mounts, owner and deadline labels) in one place,
for :class:`~legorl.sandbox.podman.PodmanBackend` and for harnesses that reuse it."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import resource
import uuid
from pathlib import Path

from legorl.core.paths import cache_dir
from legorl.sandbox.base import SandboxSpec
from legorl.sandbox.errors import SandboxError
from legorl.sandbox.host import hard_limit, nproc_limit
from legorl.sandbox.memory_rootfs import RootfsCopy
from legorl.sandbox.reaper import owner_labels


def _label_key(key: str) -> str:
    return key if key.startswith("legorl") else f"legorl.{key}"


def container_name(labels: dict[str, str]) -> str:
    hint = "-".join(v for k in ("run", "trial") if (v := labels.get(k) or labels.get(f"legorl.{k}")))
    hint = re.sub(r"[^a-zA-Z0-9_.-]+", "-", hint).strip("-.")[:60]
    return f"legorl-{hint + '-' if hint else ''}{uuid.uuid4().hex[:8]}"


DEFAULT_SECCOMP = Path("/usr/share/containers/seccomp.json")  # podman's own default profile (containers-common)
# The kernel's keyrings are per uid, not per container: a key a test process stores in a named keyring in
# one container is there in the next container of the same uid (a red team carried what the ordinary
# grading run saw into its canary run this way). Docker's default profile denies these calls too.
KEYRING_SYSCALLS = frozenset({"keyctl", "add_key", "request_key"})


@functools.cache
def seccomp_profile() -> Path | None:
    """podman's default seccomp profile without the keyring calls, written once to the cache (None:
    this host has no default profile to start from, and podman's built-in one stays)."""
    try:
        profile = json.loads(DEFAULT_SECCOMP.read_text())
        for rule in profile["syscalls"]:
            if rule.get("action") == "SCMP_ACT_ALLOW":
                rule["names"] = [n for n in rule["names"] if n not in KEYRING_SYSCALLS]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    text = json.dumps(profile, sort_keys=True)
    path = cache_dir() / "sandbox" / f"seccomp-{hashlib.sha256(text.encode()).hexdigest()[:16]}.json"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(text)
        os.replace(tmp, path)
    return path


def run_args(spec: SandboxSpec, name: str, command: list[str] | None = None, *, detach: bool = True,
             rootfs: RootfsCopy | None = None) -> list[str]:
    """The ``podman run`` arguments for a spec.

    ``detach=False`` (with a ``command``) is the one-shot form
    :meth:`~legorl.sandbox.podman.PodmanBackend.run_once` uses: ``--rm -i``, stdin attached, the
    container removed by podman when its command exits. ``rootfs``: run from this copy of the image's
    files instead of its layers.
    """
    labels = {**owner_labels(spec.deadline_s), **{_label_key(k): v for k, v in spec.labels.items()}}
    args = ["run", "-d" if detach else "--rm", "--name", name, "--hostname", "sandbox"]
    if not detach:
        args.append("-i")
    if spec.init:
        args.append("--init")
    if spec.network:
        raise SandboxError("sandboxes have no network: a trial reaches its proxy through its session's "
                           "unix socket (legorl.harnesses.channel)")
    args += ["--network", "none"]
    nofile, nproc = hard_limit(resource.RLIMIT_NOFILE, spec.nofile), nproc_limit()
    # one --ulimit replaces all of containers.conf's default_ulimits, so nproc is named again
    args += ["--memory", spec.memory, "--memory-swap", spec.memory, "--pids-limit", str(spec.pids_limit),
             "--ulimit", f"nofile={nofile}:{nofile}", "--ulimit", f"nproc={nproc}:{nproc}",
             f"--log-driver={spec.log_driver}",
             # no device nodes and no file capabilities, even inside: nothing needs them, and what the
             # container writes into a host folder must never become a way to root on the host
             "--cap-drop", "MKNOD", "--cap-drop", "SETFCAP"]
    profile = seccomp_profile()
    if profile is not None:
        args += ["--security-opt", f"seccomp={profile}"]
    if spec.cpus is not None:
        args += ["--cpus", f"{spec.cpus:g}"]
    for key, value in labels.items():
        args += ["--label", f"{key}={value}"]
    if spec.read_only:
        args.append("--read-only")
    for ctr, options in spec.tmpfs:
        if not any(opt.startswith("size=") for opt in options.split(",")):
            options = f"{options},size={spec.tmpfs_size}" if options else f"size={spec.tmpfs_size}"
        args += ["--tmpfs", f"{ctr}:rw,exec,{options}"]
    for host, ctr, read_only in spec.mounts:
        if not Path(host).exists():
            raise SandboxError(f"mount source {host} does not exist")
        # nodev,nosuid: what the container plants in a host folder is never a device or a setuid file
        args += ["-v", f"{os.path.abspath(host)}:{ctr}:{'ro' if read_only else 'rw'},nodev,nosuid"]
    image_env = dict(e.partition("=")[::2] for e in rootfs.env) if rootfs is not None else {}  # podman's image default
    for key, value in {**image_env, **spec.env}.items():
        args += ["-e", f"{key}={value}"]
    command = list(spec.command if command is None else command)
    if spec.workdir:
        # runc does not create a missing -w directory (the container never starts), so the
        # container makes it; execs then default to it.
        command = ["sh", "-c", 'mkdir -p "$0" && exec "$@"', spec.workdir, *command]
    image = rootfs.run_args(writable=not spec.read_only) if rootfs is not None else [spec.image]
    return [*args, *image, *command]
