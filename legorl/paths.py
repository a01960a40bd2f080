"""Where things live: the run directory layout and the user cache."""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path


def cache_dir() -> Path:
    """legorl's cache (base image recipe, harness installs, built models): $LEGORL_CACHE or XDG."""
    root = os.environ.get("LEGORL_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "legorl"
    )
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive advisory lock on ``path`` (created if missing): serialises builds of one
    cached thing (an image, a harness install) between concurrent processes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@dataclass(frozen=True)
class RunDir:
    """A run directory: the only place stages meet.

    ``runs/demo/`` holds ``tasks/ rollouts/ grades/ train/ eval/``; each dataset is a folder of
    ``part-*.parquet`` files.
    """

    root: Path

    @classmethod
    def at(cls, path: str | os.PathLike[str]) -> RunDir:
        return cls(Path(path))

    @property
    def tasks(self) -> Path:
        return self.root / "tasks"

    @property
    def rollouts(self) -> Path:
        return self.root / "rollouts"

    @property
    def grades(self) -> Path:
        return self.root / "grades"

    @property
    def train(self) -> Path:
        return self.root / "train"

    @property
    def metrics(self) -> Path:
        return self.root / "train" / "metrics"

    @property
    def checkpoints(self) -> Path:
        return self.root / "train" / "checkpoints"

    @property
    def eval(self) -> Path:
        return self.root / "eval"

    @property
    def proxy_sessions(self) -> Path:
        """Sessions captured by a standalone ``serve-proxy --run``."""
        return self.root / "proxy"
