"""What one container leaves in the kernel's caches of the image's files, the next cannot read.

A red team kept notes between grading containers by looking up made-up names in the image's folders
and timing the same lookups later: a name the kernel had already found missing answered faster. With
``cache_isolation`` a container runs from a copy of the image in memory (``memory_rootfs``), where a
missing name is never cached. The probe below is theirs: it stats names in one container, and times the
same names against fresh ones in the next.
"""

from __future__ import annotations

import json
import secrets

import pytest

from legorl.sandbox import memory_rootfs
from legorl.sandbox.base import SandboxSpec
from legorl.sandbox.podman import PodmanBackend

pytestmark = pytest.mark.podman

PROBE = r"""
import encodings, json, os, statistics, sys, time
mode, tag = sys.argv[1], sys.argv[2]
folders = [os.path.dirname(encodings.__file__) + "/", "/usr/lib/python3/dist-packages/", "/etc/", "/usr/bin/"]
def took(path):
    start = time.perf_counter_ns()
    try:
        os.stat(path)
    except OSError:
        pass
    return time.perf_counter_ns() - start
out = {}
for folder in folders:
    names = [f"{folder}q{tag}{i}.py" for i in range(300)]
    if mode == "mark":
        for name in names:
            took(name)
    else:
        fresh = [f"{folder}q{tag}x{os.getpid()}{i}.py" for i in range(300)]
        seen, new = zip(*[(took(a), took(b)) for a, b in zip(names, fresh)])
        out[folder] = statistics.median(seen) / statistics.median(new)
print("RATIOS " + json.dumps(out))
"""
SEEN = 0.85  # a marked name answering this much faster than a fresh one carries the mark


def _ratios(image: str, isolated: bool) -> dict[str, float]:
    backend = PodmanBackend()
    spec = SandboxSpec(image=image, read_only=True, cache_isolation=isolated, tmpfs=(("/tmp", "size=64m"),),
                       labels={"role": "test"})
    tag = secrets.token_hex(6)
    for mode in ("mark", "read"):
        res = backend.run_once(spec, ["python3", "-c", PROBE, mode, tag], timeout=120)
        assert res.exit_code == 0, res.output[-2000:]
    line = next(ln for ln in res.output.splitlines() if ln.startswith("RATIOS "))
    return {k: float(v) for k, v in json.loads(line[len("RATIOS "):]).items()}


def test_names_looked_up_in_one_container_are_not_seen_in_the_next(base_image: str) -> None:
    assert memory_rootfs.usable(), "this host cannot hold the image in memory (podman rootless, or swap)"
    ratios = _ratios(base_image, isolated=True)
    assert ratios and all(r > SEEN for r in ratios.values()), ratios


def test_the_probe_sees_names_through_the_images_layers(base_image: str) -> None:
    """The same probe without the copy in memory: the channel the red team used is there."""
    ratios = _ratios(base_image, isolated=False)
    assert min(ratios.values()) < SEEN, ratios


def test_the_copy_runs_the_image_as_podman_would(base_image: str) -> None:
    """Its environment and working folder are the image's; it cannot be written to, and no container
    changes it."""
    backend = PodmanBackend()
    script = "echo ENV=$LANG:$PIP_DISABLE_PIP_VERSION_CHECK; pwd; touch /usr/x 2>/dev/null && echo WROTE; echo done"
    ro = backend.run_once(SandboxSpec(image=base_image, read_only=True, cache_isolation=True), ["sh", "-c", script])
    assert "ENV=C.UTF-8:1" in ro.output and "/testbed" in ro.output and "WROTE" not in ro.output, ro.output
    rw = backend.run_once(SandboxSpec(image=base_image, cache_isolation=True), ["sh", "-c", script])
    assert "WROTE" in rw.output, rw.output  # writable through an overlay of its own
    with memory_rootfs.held(base_image) as copy:
        assert copy is not None and not (copy.path / "usr" / "x").exists()
