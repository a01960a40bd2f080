"""A reward plug-in beside the hidden tests: a Python verifier named by dotted path.

``legorl grade --verifier mypkg.rewards:verify`` (``--grade-verifier`` in ``eval`` and ``loop``) calls,
for every grade the hidden tests judged (status ``graded``)::

    def verify(task: dict, patch: str, report: dict) -> float | tuple[float, list[str]] | dict: ...

``task`` is the task row (its fields as in the tasks shard), ``patch`` the graded patch, ``report`` what
the grader concluded from the hidden tests: ``status``, ``reward``, ``resolved``, ``resolution`` and
``tests`` (``name``, ``kind``, ``status``, ``passed``). It returns the reward, or the reward and its
reasons (a tuple, or ``{"reward": ..., "reasons": [...]}``). The reward must be a finite number; the row
keeps the tests' own in ``tests_reward`` and the reasons in ``verifier_reasons``.

Where it runs, and what it sees (docs/threat-model.md): never in the agent's process, and never on
anything the agent could forge. It gets the grader's verdict, not the test log (which the code under
test writes), and the patch only as data. It runs in a fresh container of the sandbox base image —
network off, read-only, memory, processes and time bounded, as an unprivileged user — with the base
image's Python: the standard library and the verifier's own top-level package (mounted read-only),
nothing else from the host. A verifier that fails on a patch (an exception, a timeout, no reward)
scores that patch 0 (``verifier_failed``) — a patch must not buy its way out of a 0 by tripping it —
unless the same verifier fails on the task's gold patch too: then the verifier itself is broken, and
the grade is infrastructure. Grades the tests did not judge (tampered, timed out, errored, empty,
infrastructure) keep their verdict: a verifier never pays for a forgery. The canaries check a grade's
per-test statuses only when it resolved the task; in an unresolved grade they are the code under test's
claims, so partial credit for some passing tests pays on what nobody checked (docs/threat-model.md).
"""

from __future__ import annotations

import importlib.util
import json
import math
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from legorl.core.errors import ConfigError, LegorlError
from legorl.core.plugins import load_object
from legorl.sandbox.base import ExecResult, SandboxSpec

MOUNT_ROOT = "/opt/legorl-verifier"
MAX_REASONS, MAX_REASON_CHARS = 20, 500
MAX_INPUT_BYTES = 64 * 1024 * 1024  # the task and the patch are bounded upstream; this guards the protocol

# Runs in the container, on the image's Python: read the input, call the verifier, print one verdict line.
_RUNNER = r"""
import json, math, sys, importlib
data = json.loads(sys.stdin.buffer.read())
sys.path.insert(0, data["root"])
module, _, attr = data["spec"].partition(":")
if not attr:
    module, _, attr = data["spec"].rpartition(".")
obj = importlib.import_module(module)
for part in attr.split("."):
    obj = getattr(obj, part)
out, sys.stdout = sys.stdout, sys.stderr  # the verifier's prints are not the verdict
got = obj(data["task"], data["patch"], data["report"])
sys.stdout = out
if isinstance(got, dict):
    reward, reasons = got.get("reward"), got.get("reasons", [])
elif isinstance(got, tuple) and len(got) == 2:
    reward, reasons = got
else:
    reward, reasons = got, []
if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
    raise TypeError(f"the verifier returned {reward!r} as the reward, not a finite number")
if isinstance(reasons, str) or not isinstance(reasons, (list, tuple)):
    reasons = [reasons]
print(data["nonce"], json.dumps({"reward": float(reward), "reasons": [str(r) for r in reasons]}), flush=True)
"""


@dataclass(frozen=True)
class Verdict:
    reward: float
    reasons: list[str]


class VerifierFailed(LegorlError):
    """The verifier gave no reward for this input (the message says why, in one line)."""


class Verifier:
    """Runs the verifier ``spec`` in a fresh container per call, through ``run_once`` (podman's)."""

    def __init__(self, spec: str, image: str, run_once: Callable[..., ExecResult], timeout_s: float = 60.0,
                 memory: str = "1g"):
        self._mount = check_spec(spec)
        self.spec, self.image, self.timeout_s, self.memory = spec, image, timeout_s, memory
        self._run_once = run_once

    def __call__(self, task: dict[str, Any], patch: str, report: dict[str, Any]) -> Verdict:
        nonce = secrets.token_hex(16)
        payload = json.dumps({"spec": self.spec, "root": MOUNT_ROOT, "nonce": nonce, "task": task,
                              "patch": patch, "report": report}, default=str).encode()
        if len(payload) > MAX_INPUT_BYTES:
            raise VerifierFailed(f"the verifier's input is {len(payload)} bytes (at most {MAX_INPUT_BYTES})")
        spec = SandboxSpec(image=self.image, labels={"role": "verify"}, network=False, memory=self.memory,
                           pids_limit=256, read_only=True, mounts=(self._mount,),
                           tmpfs=(("/tmp", "size=64m,mode=1777"),), workdir="/tmp",
                           deadline_s=self.timeout_s + 60)
        argv = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                "timeout", "-k", "5", f"{self.timeout_s:g}", "python3", "-I", "-c", _RUNNER]
        start = time.monotonic()
        res = self._run_once(spec, argv, stdin=payload, timeout=self.timeout_s + 30)
        took = time.monotonic() - start
        if res.timed_out or res.exit_code in (124, 137):
            raise VerifierFailed(f"the verifier ran past {self.timeout_s:g} s")
        for line in reversed(res.output.splitlines()):
            if line.startswith(nonce + " "):
                return _verdict(line[len(nonce) + 1:])
        last = [ln for ln in res.output.strip().splitlines() if ln.strip()][-1:] or [f"exit {res.exit_code}"]
        raise VerifierFailed(f"the verifier gave no reward after {took:.1f} s: {last[0][:300]}")


def check_spec(spec: str) -> tuple[str, str, bool]:
    """A clear error now (the verifier cannot be imported, or is not a function), not one per grade; the
    mount of its package when it can be."""
    obj = load_object(spec, "verifier")
    if not callable(obj):
        raise ConfigError(f"verifier {spec!r}: {type(obj).__name__} is not callable (want verify(task, patch, report))")
    return _package_mount(spec)


def _verdict(text: str) -> Verdict:
    try:
        data = json.loads(text)
        reward = float(data["reward"])
        reasons = [str(r)[:MAX_REASON_CHARS] for r in data["reasons"]][:MAX_REASONS]
    except (ValueError, TypeError, KeyError) as exc:
        raise VerifierFailed(f"the verifier's verdict is not readable: {exc}") from None
    if not math.isfinite(reward):
        raise VerifierFailed(f"the verifier's reward is {reward}")
    return Verdict(reward, reasons)


def _package_mount(spec: str) -> tuple[str, str, bool]:
    """The verifier's top-level package (or module file), mounted read-only under :data:`MOUNT_ROOT`."""
    module = spec.partition(":")[0] if ":" in spec else spec.rpartition(".")[0]
    top = module.split(".")[0]
    found = importlib.util.find_spec(top)
    if found is None:
        raise ConfigError(f"verifier {spec!r}: no module named {top!r}")
    if found.submodule_search_locations:  # a package (namespace packages: their first folder)
        path = Path(next(iter(found.submodule_search_locations)))
        target = f"{MOUNT_ROOT}/{top}"
    elif found.origin and found.origin.endswith(".py"):
        path, target = Path(found.origin), f"{MOUNT_ROOT}/{top}.py"
    else:
        raise ConfigError(f"verifier {spec!r}: {top} is not Python source ({found.origin}); the verifier runs on "
                          "the grading image's Python and needs its package's source")
    return (str(path.resolve()), target, True)


def report_of(row: Any) -> dict[str, Any]:
    """What a verifier is told of a grade row: the grader's verdict, never the (forgeable) log."""
    return {"status": str(row.status), "reward": row.reward, "resolved": row.resolved,
            "resolution": row.resolution,
            "tests": [{"name": t.name, "kind": t.kind, "status": t.status, "passed": t.passed} for t in row.tests]}
