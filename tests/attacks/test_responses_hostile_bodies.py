"""The proxy's OpenAI Responses API under hostile bodies, through the real app and the official
client: client errors, never a dead server, a lost capture, a spliced replay or another session's socket.

From a red team that saw only the threat model and the code (docs/threat-model.md).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]

# the proxy tests' helpers and fixtures (tests/proxy_support.py)
sys.path.insert(0, str(ROOT / "tests"))
import proxy_support  # noqa: E402
from proxy_support import TOOLS, call_bash, oa, say  # noqa: E402

from legorl.core.schemas import SegmentReason  # noqa: E402

tokenizer, proxy = proxy_support.tokenizer, proxy_support.proxy
BASH = {"type": "function", "name": "bash", "description": "Run a shell command.",
        "parameters": TOOLS[0]["function"]["parameters"], "strict": False}


def _responses(proxy: Any, sid: str, body: Any, timeout: float = 120) -> httpx.Response:
    return httpx.post(proxy.openai_base_url(sid) + "/responses", json=body, timeout=timeout)


def _sampled(cap: Any) -> list[list[int]]:
    """Each segment's loss-masked (sampled) token ids: what training would learn from."""
    return [[t for t, m in zip(s.token_ids, s.loss_mask, strict=True) if m] for s in cap.segments]


@pytest.mark.parametrize("alter", ["output_text", "function_call arguments", "function_call name"])
def test_an_altered_replay_of_a_sampled_turn_forks_never_splices(proxy: Any, tokenizer: Any, alter: str) -> None:
    """The agent replays the policy's turn with one thing changed: the proxy must not record the
    altered turn as sampled (it forks a REWRITE segment), and the sampled tokens stay the policy's."""
    sid = proxy.new_session()
    client = oa(proxy, sid)
    first = [{"role": "user", "content": call_bash("cat a.py") if alter != "output_text" else say("Fixed it.")}]
    r = client.responses.create(model="m", instructions="sys", input=first, tools=[BASH])
    out = [item.model_dump(exclude_none=True) for item in r.output]
    before = _sampled(proxy.capture(sid))
    if alter == "output_text":
        out[0]["content"][0]["text"] = "Fixed it!"
        follow = [*first, *out, {"role": "user", "content": say("ok")}]
    else:
        key, value = ("arguments", json.dumps({"command": "cat b.py"})) if alter.endswith("arguments") else ("name", "sh")
        out[0][key] = value
        follow = [*first, *out, {"type": "function_call_output", "call_id": out[0]["call_id"], "output": "x"}]
    client.responses.create(model="m", instructions="sys", input=follow, tools=[BASH])
    cap = proxy.capture(sid)
    assert [s.reason for s in cap.segments] == [SegmentReason.MAIN, SegmentReason.REWRITE], alter
    assert _sampled(cap)[0] == before[0]  # the first segment is untouched
    altered = {"output_text": "Fixed it!", "function_call arguments": "cat b.py", "function_call name": '"sh"'}[alter]
    assert altered in tokenizer.decode(cap.segments[1].token_ids)  # the altered turn is in the prompt...
    assert altered not in tokenizer.decode(_sampled(cap)[1]), "the altered turn was recorded as sampled"


def _deep(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


@pytest.mark.parametrize("label, body", [
    ("deep metadata", b'{"model": "m", "input": "x", "metadata": ' + _deep(200_000) + b"}"),
    ("deep tool schema", b'{"model": "m", "input": "x", "tools": [{"type": "function", "name": "bash", '
     b'"parameters": {"type": "object", "properties": {"a": ' + b'{"items": ' * 50_000 + b"{}" + b"}" * 50_000
     + b"}}}]}"),
    ("deep content", b'{"model": "m", "input": [{"role": "user", "content": ' + _deep(100_000) + b"}]}"),
    ("non-string function name", b'{"model": "m", "input": [{"type": "function_call", "call_id": "c", '
     b'"name": {"$ne": 1}, "arguments": "{}"}]}'),
    ("numeric tool name", b'{"model": "m", "input": "x", "tools": [{"type": "function", "name": 7}]}'),
    ("list call_id", b'{"model": "m", "input": [{"type": "function_call_output", "call_id": ["c"], "output": "x"}]}'),
    ("null role", b'{"model": "m", "input": [{"role": null, "content": "x"}]}'),
    ("non-string model", b'{"model": {"a": 1}, "input": "x"}'),
    ("body is a list", b"[1, 2, 3]"),
    ("NaN temperature", b'{"model": "m", "input": "x", "temperature": NaN}'),
    ("huge integer", b'{"model": "m", "input": "x", "max_output_tokens": 1' + b"0" * 5000 + b"}"),
])
def test_hostile_bodies_are_client_errors_and_the_server_lives(proxy: Any, label: str, body: bytes) -> None:
    sid = proxy.new_session()
    r = httpx.post(proxy.openai_base_url(sid) + "/responses", content=body,
                   headers={"content-type": "application/json"}, timeout=120)
    assert r.status_code == 400, (label, r.status_code, r.text[:300])
    assert r.json()["error"]["type"] == "invalid_request_error"
    assert proxy.capture(sid).calls == []
    ok = _responses(proxy, sid, {"model": "m", "input": say("alive")})  # the session still serves
    assert ok.status_code == 200 and ok.json()["output"][0]["content"][0]["text"] == "alive"


def test_huge_arrays_and_unicode_edges_answer_and_keep_the_capture(proxy: Any) -> None:
    sid = proxy.new_session()
    odd = "\x00\ufeff\u202e\uffff\U0010ffff e\u0301 \U0001f600"
    items: list[dict[str, Any]] = [{"role": "user", "content": odd} for _ in range(20_000)]
    items += [{"type": "function_call", "call_id": odd * 50, "name": "bash", "arguments": json.dumps({"command": odd})},
              {"type": "function_call_output", "call_id": odd * 50, "output": odd},
              {"role": "user", "content": say("still here")}]
    r = _responses(proxy, sid, {"model": "m", "input": items, "tools": [BASH], "metadata": {odd: odd}}, timeout=300)
    assert r.status_code in (200, 400), r.text[:300]
    if r.status_code == 200:
        text = r.json()["output"][0]["content"][0]["text"]  # the reply, or the budget's context-limit stop
        assert text == "still here" or "context length" in text
    ok = _responses(proxy, sid, {"model": "m", "input": say("alive")})
    assert ok.status_code == 200
    cap = proxy.capture(sid)
    assert len(cap.calls) == (2 if r.status_code == 200 else 1) and all(len(s.token_ids) == len(s.loss_mask)
                                                                       for s in cap.segments)


@pytest.mark.parametrize("path", [
    "/sess/{other}/v1/responses", "/sess/{sid}/../{other}/v1/responses", "/sess/{sid}/v1/../../{other}/v1/responses",
    "/sess/{sid}%2F..%2F{other}/v1/responses", "//sess/{other}/v1/responses", "/sess/{sid}/v1/responses/../../../{other}/v1/responses",
    "/sess/{sid}/v1/responses?x=/sess/{other}", "/sess/{sid}/v1//responses", "/sess/{sid}/v1/responses/",
    "/sess/{sid}/trajectory", "/sess/{sid}/finish", "/v1/responses", "/sess/{sid}{other}/v1/responses",
])
def test_the_session_socket_never_reaches_another_session(proxy: Any, tmp_path: Path, path: str) -> None:
    """Raw HTTP on a trial's session-bound socket: only its own session's model routes answer."""
    import socket

    sid, other = proxy.new_session(), proxy.new_session()
    sock_path = Path(f"/tmp/legorl-rt-{os.getpid()}-{abs(hash(path)) % 10**8}.sock")
    served = proxy.serve_session(sid, sock_path)
    try:
        body = json.dumps({"model": "m", "input": say("crossed")}).encode()
        target = path.format(sid=sid, other=other)
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(60)
            s.connect(str(sock_path))
            s.sendall(f"POST {target} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
            reply = b""
            while chunk := s.recv(65536):
                reply += chunk
        status = int(reply.split(b" ", 2)[1])
        own = target.split("?")[0] == f"/sess/{sid}/v1/responses"
        assert status == (200 if own else 404), (target, reply[:300])
        assert proxy.capture(other).calls == []
        assert len(proxy.capture(sid).calls) == (1 if own else 0)
    finally:
        served.close()
