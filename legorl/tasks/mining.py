"""Mine a library for bugs: sampled one-span mutations run against its suite in network-less
containers, kept when they break 1–10 baseline-passing tests (step 2 of :mod:`legorl.tasks.builder`)."""

from __future__ import annotations

import queue
import shlex
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

from legorl.grading.logparse import parse_pytest
from legorl.sandbox.base import Sandbox, SandboxSpec
from legorl.tasks.library import BuildError, Library
from legorl.tasks.mutate import Mutation, find_mutations, sample

if TYPE_CHECKING:
    from legorl.tasks.build_options import BuildOptions

MIN_BROKEN, MAX_BROKEN = 1, 10
_PASSING = ("PASSED", "XFAIL")


@dataclass
class Mined:
    mutation: Mutation
    broken: dict[str, str]  # test id -> failure message


def _run_suite(box: Sandbox, lib: Library, timeout: float) -> tuple[dict[str, str], dict[str, str], bool]:
    """(statuses, failure messages, timed out) of the whole suite in a mining container."""
    files = " ".join(shlex.quote(f) for f in lib.test_files)
    command = lib.test_command.replace("--tb=no", "--tb=line").replace("{test_files}", files)
    res = box.exec(f"cd /testbed && timeout -k 2 {timeout:g} bash -c {shlex.quote(command)}", timeout=timeout + 30)
    if res.timed_out or res.exit_code in (124, 137):
        return {}, {}, True
    statuses = parse_pytest(res.output).full
    messages: dict[str, str] = {}
    for line in res.output.splitlines():
        if line.startswith("FAILED ") and " - " in line:
            test_id, _, message = line[len("FAILED ") :].partition(" - ")
            messages[test_id.strip()] = message.strip()
    return statuses, messages, False


def mine(lib: Library, create: Callable[[SandboxSpec], Sandbox], image: str, opts: BuildOptions) -> list[Mined]:
    """Try sampled mutations in ``opts.concurrency`` containers; keep those breaking 1–10 tests."""
    candidates = [m for path in lib.source_files for m in find_mutations(path, (lib.root / path).read_text())]
    work: queue.Queue[Mutation] = queue.Queue()
    for m in sample(candidates, opts.attempts, opts.seed):
        work.put(m)
    kept: list[Mined] = []
    lock = threading.Lock()
    baseline: dict[str, str] = {}
    opts.log(f"{lib.name}: {len(candidates)} candidate mutations, trying up to {work.qsize()}")

    def worker(index: int) -> None:
        spec = SandboxSpec(image=image, labels={"role": "task-build", "trial": f"{lib.name}-{index}"},
                           network=False, deadline_s=3600)
        box = create(spec)
        try:
            box.put_dir(str(lib.root), "/testbed")
            statuses, _, timed_out = _run_suite(box, lib, opts.timeout)
            passing = {t for t, s in statuses.items() if s in _PASSING}
            if timed_out or not passing:
                raise BuildError(f"{lib.name}: the clean test suite does not pass in {image}")
            with lock:
                baseline.update(statuses)
            while True:
                with lock:
                    if len(kept) >= opts.per_library:
                        return
                try:
                    m = work.get_nowait()
                except queue.Empty:
                    return
                original = (lib.root / m.path).read_text()
                box.put_file(f"/testbed/{m.path}", m.apply(original).encode())
                after, messages, timed_out = _run_suite(box, lib, opts.timeout)
                box.put_file(f"/testbed/{m.path}", original.encode())
                if timed_out:
                    continue
                broken = {t: messages.get(t, "") for t in passing if after.get(t) not in _PASSING}
                file_level = any("::" not in t for t, s in after.items() if s in ("ERROR", "FAILED"))
                if (MIN_BROKEN <= len(broken) <= MAX_BROKEN and not file_level
                        and not any(any(c.isspace() for c in t) for t in broken)):
                    with lock:
                        if len(kept) < opts.per_library:
                            kept.append(Mined(m, broken))
                            opts.log(f"{lib.name}: kept {m.describe()} ({len(broken)} failing)")
        finally:
            box.remove()

    with ThreadPoolExecutor(max_workers=opts.concurrency) as pool:
        for future in [pool.submit(worker, i) for i in range(opts.concurrency)]:
            future.result()
    return kept
