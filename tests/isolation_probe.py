"""Runs INSIDE a trial container as a stand-in harness (tests/test_trial_isolation.py), playing the
adversary: probes the network, its own proxy session and other sessions, then plants links and a
fifo in the trial folder. Usage: ``python3 -I isolation_probe.py CONFIG.json``; writes
``probe.json`` next to the config. Standard library only: it runs on the task image's python3.
Its relay client (:func:`request`) also serves the agents of tests/test_trial_container_attacks.py,
which import this file from their trial folder.
"""

import http.client
import json
import os
import socket
import sys
import time


def connect(host, port):
    try:
        socket.create_connection((host, port), timeout=3).close()
        return "connected"
    except OSError as exc:
        return f"{type(exc).__name__}:{exc.errno}"


class UnixConnection(http.client.HTTPConnection):
    def __init__(self, path, timeout=30):
        super().__init__("localhost", timeout=timeout)
        self.unix_path = path

    def connect(self):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(self.unix_path)


def request(cfg, method, path, body=None, unix=False, timeout=30):
    """One JSON request through the relay (or straight at the session socket); (status, text)."""
    if unix:
        conn = UnixConnection(cfg["socket"], timeout)
    else:
        conn = http.client.HTTPConnection("127.0.0.1", cfg["port"], timeout=timeout)
    data = json.dumps(body).encode() if body is not None else None
    conn.request(method, path, body=data, headers={"content-type": "application/json"})
    resp = conn.getresponse()
    text = resp.read().decode(errors="replace")
    conn.close()
    return resp.status, text


def chat(cfg, session, **extra):
    body = {"model": "any", "messages": [{"role": "user", "content": "say hello"}], "max_tokens": 16}
    body.update(extra)
    return request(cfg, "POST", f"/sess/{session}/v1/chat/completions", body)


def probe(cfg, here):
    out = {}
    # (a) no route out, (b) the host's loopback listener is not this loopback
    with open("/proc/net/route") as handle:
        out["routes"] = handle.read().splitlines()[1:]
    out["interfaces"] = sorted(os.listdir("/sys/class/net"))
    out["outside"] = {host: connect(host, port) for host, port in
                      [("1.1.1.1", 53), ("8.8.8.8", 443), ("10.0.2.2", cfg["host_port"])]}
    out["host_loopback"] = connect("127.0.0.1", cfg["host_port"])

    # (c) its own session, through the relay: a plain call and a streamed one
    own = cfg["session"]
    status, text = chat(cfg, own)
    out["chat"] = [status, json.loads(text)["choices"][0]["message"]["content"] if status == 200 else text]
    conn = http.client.HTTPConnection("127.0.0.1", cfg["port"], timeout=30)
    body = {"model": "any", "stream": True, "messages": [{"role": "user", "content": "stream hello"}], "max_tokens": 16}
    conn.request("POST", f"/sess/{own}/v1/chat/completions", body=json.dumps(body).encode(),
                 headers={"content-type": "application/json"})
    resp = conn.getresponse()
    events, first_at, start = [], None, time.time()
    for raw in resp:
        line = raw.decode().strip()
        if line.startswith("data:"):
            first_at = first_at if first_at is not None else time.time() - start
            events.append(line[5:].strip())
    conn.close()
    out["stream"] = {"status": resp.status, "content_type": resp.getheader("content-type"), "events": events}

    # (d) everything else, through the relay and straight at the socket
    other = cfg["other"]
    anthropic = {"model": "any", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    attempts = [
        ("POST", f"/sess/{other}/v1/chat/completions", {"model": "any", "messages": [{"role": "user", "content": "x"}]}),
        ("POST", f"/sess/{other}/v1/messages", anthropic),
        ("GET", f"/sess/{other}/trajectory", None),
        ("POST", f"/sess/{other}/finish", None),
        ("DELETE", f"/sess/{other}", None),
        ("GET", f"/sess/{own}/trajectory", None),
        ("POST", f"/sess/{own}/finish", None),
        ("POST", "/sessions", {}),
        ("POST", "/v1/chat/completions", {"model": "any", "messages": [{"role": "user", "content": "x"}]}),
        ("POST", "/v1/messages", anthropic),
        ("GET", "/health", None),
        ("GET", "/v1/models", None),
        ("POST", f"/sess/{own}/v1/../../{other}/v1/chat/completions", {"model": "any", "messages": []}),
        ("POST", f"/sess/{own}X/v1/chat/completions", {"model": "any", "messages": [{"role": "user", "content": "x"}]}),
    ]
    out["others"] = {}
    for method, path, body in attempts:
        for unix in (False, True):
            status, _ = request(cfg, method, path, body, unix=unix)
            out["others"][f"{method} {path}{' (socket)' if unix else ''}"] = status

    # (e) plant links and a fifo where the host reads
    os.symlink(cfg["host_secret"], os.path.join(here, "result.json"))
    os.symlink("/proc/self/environ", os.path.join(here, "environ.json"))
    os.mkfifo(os.path.join(here, "events.fifo"))
    os.symlink(cfg["host_log"], os.path.join(here, "harness.log.new"))
    os.replace(os.path.join(here, "harness.log.new"), os.path.join(here, "harness.log"))

    with open(os.path.join(here, "probe.json"), "w") as handle:
        json.dump(out, handle, indent=1)


if __name__ == "__main__":
    with open(sys.argv[1]) as handle:
        config = json.load(handle)
    probe(config, os.path.dirname(sys.argv[1]))
