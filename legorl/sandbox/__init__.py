"""Sandboxes: one fresh container per trial or grading run.

```python
from legorl.sandbox import PodmanBackend, SandboxSpec, base_image, install_testbed

with PodmanBackend().create(SandboxSpec(image=base_image(), labels={"run": "demo", "trial": "t1"})) as box:
    install_testbed(box, "repos/lib.bundle", base_commit)
    box.exec("pytest -q", timeout=300)
    diff = box.patch()
```
"""

from legorl.sandbox.base import ExecResult, Sandbox, SandboxSpec
from legorl.sandbox.errors import SandboxError
from legorl.sandbox.host import base_image, podman_env, require_image
from legorl.sandbox.live import live_sandboxes
from legorl.sandbox.podman import PodmanBackend
from legorl.sandbox.podman_container import PodmanSandbox
from legorl.sandbox.reaper import Reaped, reap
from legorl.sandbox.testbed import TestbedError, install_testbed, prepare_repo, strip_history

__all__ = [
    "ExecResult",
    "PodmanBackend",
    "PodmanSandbox",
    "Reaped",
    "Sandbox",
    "SandboxError",
    "SandboxSpec",
    "TestbedError",
    "base_image",
    "install_testbed",
    "live_sandboxes",
    "podman_env",
    "prepare_repo",
    "reap",
    "require_image",
    "strip_history",
]
