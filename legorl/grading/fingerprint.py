"""A grade row's fingerprint: the image and podman's id of it, the hidden-test command as run, and the
grader's version (a digest of every file of :mod:`legorl.grading`). Inspected and hashed once per process."""

from __future__ import annotations

import contextlib
import functools
from pathlib import Path
from typing import Any

from legorl import __version__ as LEGORL_VERSION
from legorl.core.digests import digest, file_digest
from legorl.core.errors import LegorlError
from legorl.core.schemas import GradeFingerprint, TaskRow
from legorl.grading.container import GRADER_VERSION


@functools.cache
def image_digest(image: str) -> str | None:
    """Podman's id of ``image`` (``sha256:...``, the digest of its config); None when podman does not
    have it. Inspected once per name and process."""
    from legorl.sandbox.host import run_podman

    try:
        proc = run_podman(["image", "inspect", "--format", "{{.Id}}", image], timeout=60, check=False)
    except (LegorlError, OSError):
        return None
    found = proc.stdout.decode(errors="replace").strip()
    if proc.returncode != 0 or not found:
        return None
    return found if found.startswith("sha256:") else f"sha256:{found}"


@functools.cache
def grader_version() -> str:
    """``<legorl version>+g<GRADER_VERSION>.<digest>``: the digest covers every file of
    :mod:`legorl.grading` (the host's judgement, the script and the sandboxed judge and runner)."""
    root = Path(__file__).parent
    files = sorted(p for p in root.rglob("*.py") if "__pycache__" not in p.parts)
    listing = "\n".join(f"{p.relative_to(root)} {file_digest(p)}" for p in files)
    return f"{LEGORL_VERSION}+g{GRADER_VERSION}.{digest(listing.encode()).removeprefix('sha256:')[:12]}"


def grade_fingerprint(task: TaskRow, containers: Any = None) -> GradeFingerprint:
    """A grade's fingerprint; ``containers`` (:class:`~legorl.grading.container.GradingContainers`)
    knows the image and command a grade really used, else the task's own are recorded."""
    image, command = task.image, task.test_command
    if containers is not None:
        image = containers.image_for(task)
        # a grade that failed on the command says so; a fingerprint never costs a grade its row
        with contextlib.suppress(Exception):
            command = containers.command_for(task)
    return GradeFingerprint(image=image, image_digest=image_digest(image) if image else None,
                            test_command=command, grader_version=grader_version())
