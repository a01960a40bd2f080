"""Where a stage's jobs run, and which of them this process owns.

A :class:`Shard` is a static slice ``i/n`` of a stage's jobs, chosen by a stable hash of each job's
key (never its position in a list), so ``n`` processes over one run directory — a SLURM array, a
Kubernetes indexed Job — split the work without talking to each other and never overlap.

An :class:`Executor` runs a :class:`Work`'s jobs, at most ``concurrency`` at once, and yields each
result as it finishes; the stage's driver commits it (one part file per row), so resume works the
same whatever ran the job. :class:`LocalExecutor` (threads in this process) is the default;
:class:`RayExecutor` runs each job as a Ray task on a cluster's nodes. A job whose Ray worker or
node was lost goes back to its :class:`Work`, which runs it again or records an infrastructure
failure: a lost worker is never a reward.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, Protocol, TypeVar

from legorl.core.errors import ConfigError, LegorlError

J = TypeVar("J")
R = TypeVar("R")

ExecutorName = Literal["local", "ray"]
RAY_MISSING = "--executor ray needs Ray, which is not installed: pip install 'legorl[ray]'"


@dataclass(frozen=True)
class Shard:
    """Job ``index`` of every ``count`` (0 <= index < count), by a stable hash of the job's key."""

    index: int
    count: int

    def __post_init__(self) -> None:
        if self.count < 1 or not 0 <= self.index < self.count:
            raise ConfigError(f"--shard {self.index}/{self.count}: need 0 <= i < n (e.g. 0/4 ... 3/4)")

    @classmethod
    def parse(cls, text: str) -> Shard:
        """``"i/n"`` as the command line gives it."""
        index, sep, count = text.strip().partition("/")
        if not sep or not index.strip().isdigit() or not count.strip().isdigit():
            raise ConfigError(f"--shard {text!r}: expected i/n with whole numbers, e.g. 0/4")
        return cls(int(index), int(count))

    def owns(self, key: str) -> bool:
        # sha256, not hash(): the same on every host, Python version and PYTHONHASHSEED
        digest = hashlib.sha256(key.encode("utf-8")).digest()
        return int.from_bytes(digest[:8], "big") % self.count == self.index

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"


class Work(ABC, Generic[J, R]):
    """What an executor runs. Ray pickles it to its workers, so it holds plain settings, not live objects."""

    @abstractmethod
    def runner(self) -> Callable[[J, int], R]:
        """Built once per worker process (the local executor: once). It is called with a job and how
        many of that job's attempts were already lost with their worker."""

    @abstractmethod
    def lost(self, job: J, error: str, attempts: int) -> R | None:
        """The job's worker was lost (its ``attempts``-th loss): None to run it again, or the
        (infrastructure failure) result to commit."""

    def backoff_s(self, attempts: int) -> float:
        """How long a lost job waits before it runs again."""
        return 0.0

    def stop(self) -> None:
        """The run is being aborted: end what this process runs for it."""


class Executor(Protocol):
    def map(self, work: Work[J, R], jobs: Iterable[J], concurrency: int) -> Iterator[R]:
        """Results of ``work`` on ``jobs`` as they finish, at most ``concurrency`` in flight."""
        ...


class LocalExecutor:
    """Jobs on a thread pool in this process (the default)."""

    def map(self, work: Work[J, R], jobs: Iterable[J], concurrency: int) -> Iterator[R]:
        run = work.runner()
        pending = iter(jobs)
        pool = ThreadPoolExecutor(max_workers=max(1, concurrency), thread_name_prefix="job")
        running: set[Future[R]] = set()
        try:
            for job in pending:
                running.add(pool.submit(run, job, 0))
                if len(running) >= concurrency:
                    break
            while running:
                finished, running = wait(running, return_when=FIRST_COMPLETED)
                for fut in finished:
                    yield fut.result()
                    nxt = next(pending, None)
                    if nxt is not None:
                        running.add(pool.submit(run, nxt, 0))
        except BaseException:
            work.stop()
            pool.shutdown(wait=False, cancel_futures=True)
            raise
        pool.shutdown(wait=True)


# The runner of the latest run a Ray worker process served: the process is reused across tasks.
_RUNNERS: dict[str, Callable[[Any, int], Any]] = {}


def _run_on_worker(token: str, work: Work[Any, Any], job: Any, lost: int) -> Any:
    run = _RUNNERS.get(token)
    if run is None:
        _RUNNERS.clear()  # an earlier run's (a loop's previous step): not kept for ever
        run = _RUNNERS[token] = work.runner()
    return run(job, lost)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:500]


class RayExecutor:
    """Each job a Ray task (``num_cpus`` each) on the cluster at ``address``.

    ``address`` is what ``ray.init`` takes: ``"auto"`` (the cluster this machine belongs to),
    ``HOST:PORT``, ``ray://HOST:PORT``, or None (what ``ray.init()`` finds: ``RAY_ADDRESS``, a
    cluster ``ray start`` began on this machine; else a Ray started here for this run, stopped at
    its end). Ray's own task retries are off: a lost task goes back to the :class:`Work`, which
    decides (and the stage counts it against its retries).
    """

    def __init__(self, address: str | None = None, num_cpus: float = 1.0):
        self.address = address
        self.num_cpus = num_cpus

    @staticmethod
    def _ray() -> Any:
        try:
            import ray
        except ImportError:
            raise LegorlError(RAY_MISSING) from None
        return ray

    def map(self, work: Work[J, R], jobs: Iterable[J], concurrency: int) -> Iterator[R]:
        ray = self._ray()
        from ray.exceptions import RayError, RayTaskError

        owned = not ray.is_initialized()
        if owned:
            try:
                # log_to_driver off: the workers' and raylets' lines would land in this process's
                # stdout (a --json answer); they stay in the cluster's log files
                ray.init(address=self.address, logging_level=logging.WARNING, log_to_driver=False)
            except (ConnectionError, ValueError, RuntimeError) as exc:
                raise LegorlError(f"--address {self.address or '(none)'}: cannot join a Ray cluster "
                                  f"({_first_line(exc)})") from None
        remote = ray.remote(num_cpus=self.num_cpus, max_retries=0)(_run_on_worker)
        token = uuid.uuid4().hex
        shipped = ray.put(work)
        pending = iter(jobs)
        exhausted = False
        running: dict[Any, tuple[J, int]] = {}  # object ref -> (job, attempts lost so far)
        waiting: list[tuple[float, J, int]] = []  # lost jobs, until their backoff has passed
        try:
            while True:
                now = time.monotonic()
                while len(running) < concurrency:
                    due = next((w for w in waiting if w[0] <= now), None)
                    if due is not None:
                        waiting.remove(due)
                        job, lost = due[1], due[2]
                    elif not exhausted and (nxt := next(pending, None)) is not None:
                        job, lost = nxt, 0
                    else:
                        exhausted = True
                        break
                    running[remote.remote(token, shipped, job, lost)] = (job, lost)
                if not running and not waiting:
                    return
                if not running:
                    time.sleep(max(0.0, min(w[0] for w in waiting) - now))
                    continue
                ready, _ = ray.wait(list(running), num_returns=1, timeout=1.0)
                for ref in ready:
                    job, lost = running.pop(ref)
                    try:
                        result = ray.get(ref)
                    except RayTaskError as exc:  # the job's own code raised: a bug, as with the local executor
                        raise exc.as_instanceof_cause() from None
                    except RayError as exc:  # the worker, its node or its object went away
                        lost += 1
                        final = work.lost(job, f"ray worker lost ({_first_line(exc)})", lost)
                        if final is None:
                            waiting.append((time.monotonic() + work.backoff_s(lost), job, lost))
                            continue
                        result = final
                    yield result
        except BaseException:
            for ref in running:
                with contextlib.suppress(Exception):  # already finished, or its worker already gone
                    ray.cancel(ref, force=True)
            work.stop()
            raise
        finally:
            if owned:
                ray.shutdown()


@dataclass(kw_only=True)
class ExecutorOptions:
    """Where a stage's jobs run and which of them this process runs (``legorl rollout`` and ``grade``)."""

    executor: ExecutorName = field(default="local", metadata={"help": (
        "Where the jobs run: local (threads in this process) or ray (Ray tasks on a cluster's nodes; "
        "needs legorl's ray extra).")})
    address: str | None = field(default=None, metadata={"help": (
        "Ray cluster for --executor ray: auto, HOST:PORT or ray://HOST:PORT (default: RAY_ADDRESS or a "
        "cluster started on this machine, else a Ray started here for this run).")})
    shard: Shard | None = field(default=None, metadata={"parse": Shard.parse, "help": (
        "Only shard i of n (i/n, 0 <= i < n) of the jobs, by a stable hash of each job's key: n processes "
        "over one run directory (a SLURM array, a Kubernetes indexed Job) split it without overlap.")})

    def check_placement(self) -> None:
        if self.executor not in ("local", "ray"):
            raise ConfigError(f"--executor {self.executor!r}: expected local or ray")
        if self.address is not None and self.executor != "ray":
            raise ConfigError("--address is for --executor ray")

    def __post_init__(self) -> None:
        self.check_placement()

    def owns(self, key: str) -> bool:
        """Whether this process runs the job with ``key`` (always, without a shard)."""
        return self.shard is None or self.shard.owns(key)

    def make_executor(self) -> Executor:
        return RayExecutor(self.address) if self.executor == "ray" else LocalExecutor()
