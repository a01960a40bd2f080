"""Where things live: the run directory layout and the user cache."""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from legorl.core.schemas import Kind

RUN_HELP = "Run directory; the stage derives its inputs and outputs from it."  # --run, as every stage takes it
INFO_FILE = "legorl_train.json"  # in a checkpoint: what went in, the step's metrics


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


# Where each kind lives inside a run directory (what `legorl inspect` lists and compaction merges).
RUN_DATASETS: tuple[tuple[str, Kind], ...] = (
    ("tasks", Kind.TASKS),
    ("rollouts", Kind.ROLLOUTS),
    ("grades", Kind.GRADES),
    ("train/metrics", Kind.METRICS),
    ("eval/rollouts", Kind.ROLLOUTS),
    ("eval/grades", Kind.GRADES),
    ("proxy", Kind.ROLLOUTS),
)


@dataclass(frozen=True)
class RunDir:
    """A run directory: the only place stages meet.

    ``runs/demo/`` holds ``tasks/ rollouts/ grades/ train/ eval/``; each dataset is a folder of
    ``part-*.parquet`` files. ``logs/`` holds what is kept for reading, not training (each rollout
    trial's folder under ``logs/rollout/``).
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
        """The run's checkpoint folder; :class:`Checkpoints` names what is inside."""
        return self.root / "train" / "checkpoints"

    @property
    def eval(self) -> Path:
        return self.root / "eval"

    @property
    def proxy_sessions(self) -> Path:
        """Sessions captured by a standalone ``serve-proxy --run``."""
        return self.root / "proxy"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def rollout_logs(self) -> Path:
        """The parent of the rollout stage's trial folders (one per trial attempt)."""
        return self.root / "logs" / "rollout"


@dataclass(frozen=True)
class Checkpoints:
    """A checkpoint folder (``RUN/train/checkpoints`` or ``legorl train --out``) and its layout.

    ``step-<S>/`` is the policy after training on the rollouts of step S (a Hugging Face model
    folder plus the trainer's state and :data:`INFO_FILE`); ``latest`` names the newest one. While
    step S trains, ``step-<S>.partial/`` holds TRL's saves (``checkpoint-<N>/``) and what the step
    started from (``legorl_init.json``), for resume; the finished checkpoint is written to
    ``.step-<S>.tmp/`` and renamed into place, then ``latest`` is replaced atomically.
    """

    root: Path

    LATEST = "latest"
    INIT_FILE = "legorl_init.json"
    METRICS_DIR = "metrics"  # in step-<S>/: the step's metrics rows, published to RUN/train/metrics once

    def step(self, step: int) -> Path:
        return self.root / f"step-{step}"

    def partial(self, step: int) -> Path:
        return self.root / f"step-{step}.partial"

    def staging(self, step: int) -> Path:
        return self.root / f".step-{step}.tmp"

    # What a whole TRL save holds; the Trainer writes trainer_state.json last, and a kill inside a
    # save (or inside the rotation that deletes the previous one) leaves a folder missing some.
    SAVE_FILES = ("config.json", "optimizer.pt", "trainer_state.json")

    def partial_saves(self, step: int) -> list[Path]:
        """TRL's complete saves of an interrupted step, oldest first (a torn one is skipped)."""
        partial = self.partial(step)
        if not partial.is_dir():
            return []
        saves = [path for path in partial.glob("checkpoint-*")
                 if all((path / name).exists() for name in self.SAVE_FILES) and any(path.glob("*.safetensors"))]
        return sorted(saves, key=lambda path: int(path.name.rsplit("-", 1)[-1]))

    def latest(self) -> Path | None:
        """The checkpoint ``latest`` names, if it is a complete model folder."""
        pointer = self.root / self.LATEST
        if not pointer.exists():
            return None
        target = self.root / pointer.read_text().strip()
        return target if (target / "config.json").exists() else None

    def set_latest(self, checkpoint: Path) -> None:
        tmp = self.root / f".{self.LATEST}.tmp"
        tmp.write_text(checkpoint.name + "\n")
        os.replace(tmp, self.root / self.LATEST)
