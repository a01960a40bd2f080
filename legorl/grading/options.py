"""How grades are run: the options `legorl grade`, `eval` and `loop` take, declared once."""

from __future__ import annotations

from dataclasses import dataclass, field

from legorl.core.errors import ConfigError
from legorl.grading.verifier import check_spec


@dataclass
class GradeOptions:
    """How grades are run (``legorl grade``, ``eval`` and ``loop`` take the documented fields as options)."""

    concurrency: int = field(default=2, metadata={"help": "Grading containers at once (the grade stage's pool)."})
    test_timeout: float = field(default=600.0, metadata={"aliases": ["--timeout"], "help": (
        "Seconds the hidden tests may run (longer: tests_timeout, reward 0).")})
    default_image: str | None = field(default=None, metadata={"aliases": ["--image"], "help": (
        "Image for tasks without one (default: the sandbox base image of `legorl setup`).")})
    memory: str = field(default="4g", metadata={"help": "Memory limit of a grading container (podman's --memory)."})
    cpus: float | None = field(default=None, metadata={"help": "CPU limit of a grading container (podman's --cpus)."})
    confirm: bool = field(default=False, metadata={"help": (
        "Re-run a grade of 1 in a fresh container before trusting it: a pass the rerun does not reproduce "
        "scores 0 (confirmed false); a rerun that fails as infrastructure makes the grade infrastructure.")})
    canaries: bool = field(default=True, metadata={"help": (
        "Mutate the task's canaries (tests every honest patch fails once their expectation is changed), half "
        "in each of a pass's two runs: a patch that passes a canary forged the run (tampered, 0). Off: one run, "
        "and only the in-process tripwires stand.")})
    verifier: str | None = field(default=None, metadata={"help": (
        "A reward plug-in, package.module:function(task, patch, report) -> reward [, reasons]: run in its own "
        "sandbox on every grade the hidden tests judged; its reward replaces theirs (kept as tests_reward). "
        "See legorl.grading.verifier.")})
    verifier_timeout: float = field(default=60.0, metadata={"help": "Seconds the --verifier may take per grade."})
    labels: dict[str, str] = field(default_factory=dict)
    run_empty: bool = False  # also run the tests for an empty patch (task validation)
    # Harbor tasks (their test.sh decides; no runner, no canaries): False lets a pass the screen flags keep
    # its reward (findings still recorded)
    suspicious_scores_zero: bool = True

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise ConfigError(f"--concurrency must be at least 1, got {self.concurrency}")
        if not self.test_timeout > 0:
            raise ConfigError(f"--timeout must be positive, got {self.test_timeout}")
        if not self.verifier_timeout > 0:
            raise ConfigError(f"--verifier-timeout must be positive, got {self.verifier_timeout}")
        if self.verifier:
            check_spec(self.verifier)


# The grading options the composed commands (`legorl eval`, `legorl loop`) take, as --grade-…: one list for both.
GRADE_FIELDS = ("concurrency", "test_timeout", "confirm", "verifier")
