"""Sandbox backend choice, measured: the podman CLI (what legorl uses) vs podman-py over a private
``podman system service`` socket, on the same image and container options.

    .venv/bin/python benchmarks/sandbox.py [--starts 5] [--execs 20] [--copies 10] [--reader-only]

Prints per-operation medians and the ratios CLI / podman-py and CLI / legorl's hybrid backend
(> 1: the CLI is slower); "exec 10MB" is a command printing 10 MB (legorl keeps at most
MAX_EXEC_OUTPUT of it, streamed through bounded buffers on either path).
Needs podman and the base image (`legorl setup`).

First, without podman: what reading a child's output through legorl's bounded reader
(:mod:`legorl.sandbox.bounded`) costs against ``subprocess.run(capture_output=True)``.
"""

from __future__ import annotations

import argparse
import io
import statistics
import subprocess
import tarfile
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from legorl.sandbox import PodmanBackend, SandboxSpec, base_image, bounded
from legorl.sandbox.host import podman_env, podman_path, require_image
from legorl.sandbox.podman_container import EXEC_OUTPUT, STDERR

PAYLOAD = bytes(range(256)) * 4096  # 1 MiB
BIG = ["head", "-c", "10000000", "/dev/zero"]  # 10 MB of output


def timed(fn: Callable[[], Any], n: int) -> list[float]:
    out = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def bench_reader(n: int) -> None:
    """bounded.run against subprocess.run(capture_output=True) on the same commands."""
    cases = {"small (echo)": ["echo", "hello"], "10 MB": BIG, "100 MB (90 MB dropped)": ["head", "-c", "100000000", "/dev/zero"]}
    print(f"{'reader (median)':<24}{'subprocess ms':>15}{'bounded ms':>12}{'bounded/subprocess':>20}")
    for name, argv in cases.items():
        plain = timed(lambda argv=argv: subprocess.run(argv, capture_output=True), n)  # type: ignore[misc]
        capped = timed(lambda argv=argv: bounded.run(argv, stdout=EXEC_OUTPUT, stderr=STDERR), n)  # type: ignore[misc]
        p, b = statistics.median(plain), statistics.median(capped)
        print(f"{name:<24}{p * 1000:>15.1f}{b * 1000:>12.1f}{b / p:>20.2f}")


def bench_backend(api: str, image: str, starts: int, execs: int, copies: int) -> dict[str, list[float]]:
    backend = PodmanBackend(api=api)  # type: ignore[arg-type]
    spec = SandboxSpec(image=image, labels={"run": "bench"})
    res: dict[str, list[float]] = {"start": [], "remove": []}
    for _ in range(starts):
        t = time.perf_counter()
        box = backend.create(spec)
        res["start"].append(time.perf_counter() - t)
        t = time.perf_counter()
        box.remove()
        res["remove"].append(time.perf_counter() - t)
    with backend.create(spec) as box:
        res["exec"] = timed(lambda: box.exec(["true"]), execs)
        res["exec+timeout"] = timed(lambda: box.exec(["true"], timeout=60), execs)
        res["exec 10MB"] = timed(lambda: box.exec(BIG), execs)
        res["copy-in 1MiB"] = timed(lambda: box.put_file("/tmp/payload.bin", PAYLOAD), copies)
        assert box.get_file("/tmp/payload.bin") == PAYLOAD
    return res


def bench_podman_py(image: str, starts: int, execs: int, copies: int) -> tuple[dict[str, list[float]], float]:
    from podman import PodmanClient

    with tempfile.TemporaryDirectory() as tmp:
        sock = Path(tmp) / "podman.sock"
        t0 = time.perf_counter()
        service = subprocess.Popen([podman_path(), "system", "service", "--time=0", f"unix://{sock}"],
                                   env=podman_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            client = PodmanClient(base_url=f"unix://{sock}")
            while True:
                try:
                    client.ping()
                    break
                except Exception:
                    if time.perf_counter() - t0 > 30:
                        raise
                    time.sleep(0.02)
            service_start = time.perf_counter() - t0
            kwargs: dict[str, Any] = dict(detach=True, network_mode="none", init=True, mem_limit="4g", pids_limit=1024,
                          labels={"legorl": "1", "legorl.run": "bench-py"}, working_dir="/testbed")

            def start() -> Any:
                return client.containers.run(image, ["sleep", "infinity"], **kwargs)

            res: dict[str, list[float]] = {"start": [], "remove": []}
            for _ in range(starts):
                t = time.perf_counter()
                ctr = start()
                res["start"].append(time.perf_counter() - t)
                t = time.perf_counter()
                ctr.remove(force=True)
                res["remove"].append(time.perf_counter() - t)
            ctr = start()
            try:
                def one_exec() -> None:
                    code, _out = ctr.exec_run(["true"], demux=True)
                    assert code == 0

                res["exec"] = timed(one_exec, execs)
                res["exec+timeout"] = timed(lambda: ctr.exec_run(["timeout", "60", "true"], demux=True), execs)
                res["exec 10MB"] = timed(lambda: ctr.exec_run(BIG, demux=True), execs)

                def copy_in() -> None:
                    buf = io.BytesIO()
                    with tarfile.open(fileobj=buf, mode="w") as tar:
                        info = tarfile.TarInfo("payload.bin")
                        info.size = len(PAYLOAD)
                        tar.addfile(info, io.BytesIO(PAYLOAD))
                    assert ctr.put_archive("/tmp", buf.getvalue())

                res["copy-in 1MiB"] = timed(copy_in, copies)
            finally:
                ctr.remove(force=True)
            return res, service_start
        finally:
            service.terminate()
            service.wait(timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--starts", type=int, default=5)
    parser.add_argument("--execs", type=int, default=20)
    parser.add_argument("--copies", type=int, default=10)
    parser.add_argument("--reader-only", action="store_true", help="only the bounded reader against subprocess.run")
    args = parser.parse_args()
    bench_reader(args.execs)
    if args.reader_only:
        return
    image = base_image()
    require_image(image)
    cli = bench_backend("cli", image, args.starts, args.execs, args.copies)
    auto = bench_backend("auto", image, args.starts, args.execs, args.copies)
    py, service_start = bench_podman_py(image, args.starts, args.execs, args.copies)
    print(f"podman-py: starting a private `podman system service`: {service_start * 1000:.0f} ms (once per process)")
    print("CLI = PodmanBackend(api='cli'); legorl = PodmanBackend() (CLI for start/remove, the API service for "
          "exec/copy); podman-py = raw podman-py calls, no legorl wrapper")
    print(f"{'operation (median)':<20}{'CLI ms':>9}{'podman-py ms':>14}{'legorl ms':>11}{'CLI/podman-py':>15}"
          f"{'CLI/legorl':>12}")
    for key in cli:
        c, p, a = (statistics.median(d[key]) for d in (cli, py, auto))
        print(f"{key:<20}{c * 1000:>9.0f}{p * 1000:>14.0f}{a * 1000:>11.0f}{c / p:>15.2f}{c / a:>12.2f}")


if __name__ == "__main__":
    main()
