"""A task's canaries: which of its FAIL_TO_PASS tests a grade may mutate (found once per task and host
key, from runs of the task's own gold and empty patches), how a grade splits them between its two
runs, and what a run's mutations were. Why they decide a pass: docs/threat-model.md ("Grading")."""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
import secrets
import threading
from collections.abc import Callable

from legorl.core.paths import cache_dir
from legorl.core.schemas import TaskRow
from legorl.grading.container import GradingContainers, GradingInfraError, Run
from legorl.grading.logparse import TestStatuses, get_parser

FAILING = frozenset({"FAILED", "ERROR"})  # what a canary must be in every run that mutates it
TRIES = 2  # mutations drawn per test when a task's canaries are found (each try: a gold and an empty run)


class Canaries:
    """The canaries of the tasks one grader grades (cached in memory and on disk, per host key)."""

    def __init__(self, containers: GradingContainers, reference: Callable[[TaskRow], TestStatuses | None]):
        self.containers = containers
        self.reference = reference  # the gold patch's statuses
        self._lock = threading.Lock()
        self._found: dict[str, dict[str, dict[str, object]]] = {}

    def of(self, task: TaskRow, seed: str) -> dict[str, dict[str, object]]:
        """The task's canaries under ``seed`` (found once per task and seed, cached): FAIL_TO_PASS test
        id -> ``{"site", "salt"}``, the line where the buggy code fails the test and the salt of the
        mutation kept. A canary is a test whose mutation the gold patch fails, and which the buggy code
        (the empty patch) fails exactly where it fails the real test. A mutation the buggy code meets
        anywhere else — a row it passes, an assertion before the bug, a mixin's method every subclass
        runs — would fail a test that never ran through the patched code, and code watching that would
        tell the canary run apart: such tests are left unmutated."""
        if not (task.patch or "").strip() or not task.FAIL_TO_PASS:
            return {}
        key = hashlib.sha256(f"{self.containers.task_key(task)}\0{seed}".encode()).hexdigest()  # the task key covers the writer
        with self._lock:
            if key in self._found:
                return self._found[key]
        path = cache_dir() / "grading" / "canaries" / f"{key}.json"
        try:
            found = json.loads(path.read_text())
            live = {str(n): dict(spec) for n, spec in found.items()}
        except (OSError, ValueError, TypeError, AttributeError):
            try:
                live = self._find(task, seed)
            except GradingInfraError:  # the task's own patches do not run cleanly: no canaries, this process
                with self._lock:
                    self._found[key] = {}
                return {}
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
            tmp.write_text(json.dumps(live, sort_keys=True))
            os.replace(tmp, path)
        with self._lock:
            self._found[key] = live
        return live

    def forms(self, task: TaskRow) -> tuple[list[str], list[str]]:
        """The task's canaries under this host's seed, as ``(changed values, negations)``: one gold run
        with every canary mutated. Only a changed value checks a pass from outside the test process
        (code that inverts each new test's outcome passes a negation blind; see the threat model)."""
        seed = self.seed(task)
        live = self.of(task, seed)
        if not live:
            return [], []
        run = self.containers.clean_run(task, task.patch or "", "gold patch (canary forms)", seed, live)
        negated = set(run.negated)
        forms = {n: mutation_of(n, run.mutated) for n in live}
        return ([n for n, key in forms.items() if key and key not in negated],
                [n for n, key in forms.items() if key in negated])

    def _find(self, task: TaskRow, seed: str) -> dict[str, dict[str, object]]:
        """Mutate every FAIL_TO_PASS test at its site, keep what passes the checks; retry the rest with
        another salt (a drawn value can be what the buggy code returns, or out of a constructor's range)."""
        gold = self.reference(task)
        parse = get_parser(task.log_parser)
        empty = self.containers.clean_run(task, "", "empty patch")
        before, where_before = empty.statuses(parse).full, empty.where
        sites = {}
        for nodeid in task.FAIL_TO_PASS:
            frames = where_before.get(nodeid)
            real = gold.status(nodeid) if gold is not None else None
            if before.get(nodeid) in FAILING and (real or "MISSING") not in FAILING and isinstance(frames, list) \
                    and frames and isinstance(frames[0], list):
                sites[nodeid] = frames[0]

        live: dict[str, dict[str, object]] = {}
        for salt in range(TRIES):
            tried: dict[str, dict[str, object]] = {
                **live, **{n: {"site": site, "salt": str(salt)} for n, site in sites.items() if n not in live}}
            if len(tried) == len(live):
                break
            gold_canary = self.containers.clean_run(task, task.patch or "", "gold patch (canary run)", seed, tried)
            empty_canary = self.containers.clean_run(task, "", "empty patch (canary run)", seed, tried)
            after, where_after = empty_canary.statuses(parse).full, empty_canary.where
            changed = [n for n in {*before, *after}
                       if before.get(n) != after.get(n) or where_before.get(n) != where_after.get(n)]
            statuses, mutated, negated = gold_canary.statuses(parse).full, gold_canary.mutated, gold_canary.negated
            live = {}
            for nodeid, spec in tried.items():
                key = mutation_of(nodeid, mutated)
                # the buggy code passes a negated assertion: the canary itself may change, nothing else may
                own = {n for n in tried if mutation_of(n, {key: ""})} if key in negated else set()
                if key and statuses.get(nodeid) in FAILING \
                        and not any(mutation_of(n, {key: ""}) for n in changed if n not in own):
                    live[nodeid] = spec
            sites = {n: site for n, site in sites.items() if mutation_of(n, mutated)}  # nothing to mutate: no retry
        return dict(sorted(live.items()))

    def seed(self, task: TaskRow) -> str:
        """The task's canary seed: a keyed hash of the task under a secret kept on this host (0600), so
        nothing the patch can see or compute tells which test was mutated, or to what."""
        path = cache_dir() / "grading" / "canary.key"
        try:
            key = path.read_bytes()
        except FileNotFoundError:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(secrets.token_bytes(32))
            with contextlib.suppress(FileExistsError):
                os.link(tmp, path)  # the first writer wins; everyone reads what it wrote
            tmp.unlink()
            key = path.read_bytes()
        return hmac.new(key, self.containers.task_key(task).encode(), hashlib.sha256).hexdigest()


def halves(canaries: dict[str, dict[str, object]], seed: str) -> tuple[dict[str, dict[str, object]], dict[str, dict[str, object]]]:
    """Split a task's canaries between a grade's two runs by the secret seed, a test function (every
    row and class of it, which may share one mutation) on one side. Each run mutates its half and
    checks the other's real pass, so neither run is "the ordinary one": code that carries a mark from
    one run to the next (a red team did, through the host's kernel keyring and page cache) still meets
    canaries in the first run, where no mark exists yet, and must guess which tests they are."""
    def side(nodeid: str) -> int:
        function = nodeid.split("::")[-1].partition("[")[0]
        return hmac.new(seed.encode(), function.encode(), hashlib.sha256).digest()[0] & 1

    first = {n: spec for n, spec in canaries.items() if side(n) == 0}
    return first, {n: spec for n, spec in canaries.items() if n not in first}


def value_canaries(run: Run) -> bool:
    """Whether the run mutated a canary's expected value (not only negated assertions)."""
    return bool(set(run.mutated) - set(run.negated))


def mutation_of(nodeid: str, mutated: dict[str, str]) -> str | None:
    """Which of a canary run's mutations (:mod:`.sandboxed.canary`'s keys) a test runs: its row's own
    value (``name[id]``), else its function's body (``name``: every row, and every class that has it)."""
    last = nodeid.split("::")[-1]
    for key in (last, last.partition("[")[0]):
        if key in mutated:
            return key
    return None
