"""The toy configs the config-to-CLI tests (test_cli_options.py, test_cli_config.py) build commands
from: a run's fields of every kind an option can have, and a second config that needs a prefix."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from legorl.core.errors import ConfigError


@dataclass
class SampleFields:
    """The fields both tests' ``Sample`` start with; each adds its own after them."""

    run: Path = field(metadata={"help": "Run directory."})
    samples: int = field(default=1, metadata={"help": "Trials per task."})
    temperature: float | None = field(default=1.0, metadata={"help": "Sampling temperature."})
    loss: Literal["grpo", "gspo"] = field(default="grpo", metadata={"help": "Policy loss."})
    learning_rate: float = field(default=1e-6, metadata={"help": "Learning rate.", "aliases": ["--lr"]})
    names: list[str] = field(default_factory=lambda: ["a", "b"], metadata={"help": "Names, comma-separated."})

    def __post_init__(self) -> None:
        if self.samples < 1:
            raise ConfigError(f"--samples must be >= 1 (got {self.samples})")


@dataclass
class Grading:
    timeout: float = field(default=600.0, metadata={"help": "Seconds the hidden tests may run."})
    samples: int = field(default=3, metadata={"help": "Reruns; clashes with Sample.samples without a prefix."})
