"""Fuzzing every proxy route (issue #12): request bodies and headers, property-based (hypothesis) and
schema-driven. Every response is a 2xx or a 4xx with a JSON error naming what is wrong, never a
5xx; the server keeps serving; another session's capture never changes."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import httpx
import pytest
from conftest import API_KEY
from fuzz_values import ANTHROPIC_BASE, JSON, OPENAI_BASE, encode, mutate
from hypothesis import given
from hypothesis import strategies as st
from proxy_support import oa, say

from legorl.proxy.server import ProxyServer

MODEL_ROUTES = {"/v1/chat/completions": "openai", "/chat/completions": "openai", "/v1/messages": "anthropic",
                "/v1/messages/count_tokens": "anthropic"}


def error_message(resp: httpx.Response, api: str) -> str:
    """The message (and parameter) of an error response, asserting its shape; every error is JSON."""
    assert resp.status_code < 500, (resp.status_code, resp.text[:500])
    assert resp.headers["content-type"] == "application/json", resp.headers
    err = resp.json()
    if api == "anthropic":
        assert err["type"] == "error" and isinstance(err["error"]["message"], str), err
        return str(err["error"]["message"])
    assert isinstance(err["error"]["message"], str) and err["error"]["message"], err
    return f"{err['error']['message']} (param {err['error']['param']})"


class Bystander:
    """A session with one finished call whose capture no other request may change."""

    def __init__(self, proxy: ProxyServer, sid: str, headers: dict[str, str] | None = None):
        self.proxy, self.sid = proxy, sid
        if proxy.core.get(sid) is None:
            proxy.core.new_session(session_id=sid)
            client = oa(proxy, sid).with_options(default_headers=headers or {})
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": say("stable")}])
        self.before = proxy.capture(sid).to_json()

    def unchanged(self) -> None:
        assert self.proxy.capture(self.sid).to_json() == self.before
        assert httpx.get(self.proxy.base_url + "/health", timeout=30).status_code == 200


def test_fuzzed_model_requests_are_2xx_or_4xx_and_leave_others_alone(
        open_proxy: ProxyServer, fuzz_settings: Any, fuzzed: Counter[str]) -> None:
    """Mutated valid bodies (odd number literals, lone surrogates, wrong types), arbitrary JSON and
    bytes, on every model route, under random content types."""
    bystander = Bystander(open_proxy, "bystander")
    http = httpx.Client(timeout=60)

    @fuzz_settings(500)
    @given(data=st.data())
    def run(data: st.DataObject) -> None:
        route = data.draw(st.sampled_from(sorted(MODEL_ROUTES)))
        api = MODEL_ROUTES[route]
        mode = data.draw(st.sampled_from(["mutate", "mutate", "mutate", "json", "bytes", "huge"]))
        if mode == "bytes":
            content = data.draw(st.binary(max_size=64))
        elif mode == "json":
            content = encode(data.draw(JSON), data)
        elif mode == "huge":  # over the proxy's body cap (256 KiB here): a 413
            content = b'{"messages": "' + b"x" * (300 << 10) + b'"}'
        else:
            content = encode(mutate(OPENAI_BASE if api == "openai" else ANTHROPIC_BASE, data), data)
        headers = {"content-type": data.draw(st.sampled_from(
            ["application/json", "text/plain", "application/x-www-form-urlencoded", "", "application/json; charset=latin-1"]))}
        sid = data.draw(st.sampled_from(["fuzz-a", "fuzz-b"]))
        resp = http.post(open_proxy.session_url(sid) + route, content=content, headers=headers)
        fuzzed["proxy_model_requests"] += 1
        if resp.status_code >= 400:
            error_message(resp, api)
        if mode == "huge":
            assert resp.status_code == 413

    with http:
        run()
    bystander.unchanged()


_ROUTE_TEMPLATES = ["/health", "/v1/models", "/models", "/sessions", "/sess/{sid}/v1/chat/completions",
                    "/sess/{sid}/chat/completions", "/sess/{sid}/v1/messages", "/sess/{sid}/v1/messages/count_tokens",
                    "/sess/{sid}/v1/models", "/sess/{sid}/trajectory", "/sess/{sid}/finish", "/sess/{sid}",
                    "/sess/{sid}/", "/v1/chat/completions", "/v1/messages", "/{sid}", "/sess/{sid}/{sid}"]
_SIDS = ["fz-1", "fz-2", "unknown-session", "a%20b", "x" * 200, "%00", "..", "", "%C3%A9", "%ED%A0%80"]


def _header_value(raw: bytes) -> bytes:
    """``raw`` as a header value HTTP/1.1 clients will send: visible bytes and inner spaces
    (obs-text, 0x80-0xff, included)."""
    return bytes(b for b in raw if b >= 0x20 and b != 0x7F).strip(b" ") or b"\xff"


def test_fuzzed_routes_methods_and_headers(keyed_proxy: ProxyServer, fuzz_settings: Any,
                                           fuzzed: Counter[str]) -> None:
    """Any method on any route (sessions made, read, finished, unknown or malformed), with or without
    the API key (Bearer or x-api-key, wrong, binary), odd headers and bodies. Without the key every
    route but /health is a 401."""
    auth = {"authorization": f"Bearer {API_KEY}"}
    bystander = Bystander(keyed_proxy, "keyed-bystander", auth)
    good = json.dumps({**OPENAI_BASE, "tools": None}).encode()
    http = httpx.Client(timeout=60)

    @fuzz_settings(500)
    @given(data=st.data())
    def run(data: st.DataObject) -> None:
        path = data.draw(st.sampled_from(_ROUTE_TEMPLATES)).replace("{sid}", data.draw(st.sampled_from(_SIDS)))
        if data.draw(st.booleans()):
            path += "?" + data.draw(st.sampled_from(["beta=true", "a=%ff", "x", "=&&="]))
        method = data.draw(st.sampled_from(["GET", "POST", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"]))
        key = data.draw(st.sampled_from(["bearer", "x-api-key", "lower-bearer", "none", "wrong", "binary", "empty"]))
        headers: list[tuple[bytes, bytes]] = {
            "bearer": [(b"authorization", f"Bearer {API_KEY}".encode())],
            "lower-bearer": [(b"authorization", f"bearer {API_KEY}".encode())],
            "x-api-key": [(b"x-api-key", API_KEY.encode())],
            "none": [], "wrong": [(b"authorization", b"Bearer nope")],
            "binary": [(b"x-api-key", _header_value(data.draw(st.binary(min_size=1, max_size=16))))],
            "empty": [(b"authorization", b"Bearer")],
        }[key]
        headers.append((b"content-type", data.draw(st.sampled_from(
            [b"application/json", b"text/plain", b"\xff\xfe", b"multipart/form-data; boundary=x"]))))
        headers.append((b"x-" + data.draw(st.sampled_from([b"a", b"stainless-retry-count", b"anthropic-version"])),
                        data.draw(st.sampled_from([b"1", b"\xe9\xff", b"x" * 4000, b"-0", b"NaN"]))))
        body = data.draw(st.sampled_from(["none", "good", "json", "bytes"]))
        content = {"none": b"", "good": good, "json": encode(data.draw(JSON), data),
                   "bytes": data.draw(st.binary(max_size=32))}[body]
        resp = http.request(method, keyed_proxy.base_url + path, content=content, headers=headers)
        fuzzed["proxy_route_requests"] += 1
        assert resp.status_code < 500, (method, path, resp.status_code, resp.text[:300])
        if path.split("?")[0] != "/health" and key in ("none", "wrong", "binary", "empty"):
            assert resp.status_code == 401, (method, path, key, resp.status_code)
        if resp.status_code >= 400 and method != "HEAD":
            error_message(resp, "anthropic" if "/messages" in path else "openai")

    with http:
        run()
    bystander.unchanged()


# ------------------------------------------------------------------ schema-driven

BAD_VALUES = ["1e308", "-1e308", "1e999", "-0", "NaN", "Infinity", '"NaN"', '"\\ud800"', "123456789012345678901234567890",
              "-5", "0.5", "true", "[]", "{}", '[1, "x"]', '{"a": {"b": []}}', '""']
OPENAI_FIELDS = ["model", "messages", "tools", "tool_choice", "stream", "stream_options", "max_tokens",
                 "max_completion_tokens", "temperature", "top_p", "top_k", "seed", "stop", "n", "logprobs",
                 "top_logprobs", "return_token_ids", "parallel_tool_calls", "user", "metadata", "response_format",
                 "frequency_penalty", "presence_penalty", "logit_bias", "reasoning_effort"]
ANTHROPIC_FIELDS = ["model", "messages", "system", "tools", "tool_choice", "stream", "max_tokens", "temperature",
                    "top_p", "top_k", "stop_sequences", "thinking", "metadata"]
MESSAGE_FIELDS = ["role", "content", "tool_calls", "tool_call_id", "name"]
BUDGETS = ["max_turns", "max_total_tokens", "max_context", "max_wall_s", "max_tokens_per_call", "context_overflow"]


def _splice(base: dict[str, Any], path: list[str | int], literal: str) -> bytes:
    body = json.loads(json.dumps(base))
    node: Any = body
    for step in path[:-1]:
        node = node[step]
    node[path[-1]] = "\u2063"
    return json.dumps(body).replace('"\\u2063"', literal).encode()


def _named(message: str, name: str) -> bool:
    return name in message


@pytest.mark.parametrize("api", ["openai", "anthropic"])
def test_every_known_field_with_a_bad_value_is_accepted_or_a_400_naming_it(
        open_proxy: ProxyServer, api: str, fuzzed: Counter[str]) -> None:
    base, fields, route = ((OPENAI_BASE, OPENAI_FIELDS, "/v1/chat/completions") if api == "openai"
                           else (ANTHROPIC_BASE, ANTHROPIC_FIELDS, "/v1/messages"))
    cases: list[tuple[list[str | int], str]] = [([f], f) for f in fields]
    cases += [(["messages", len(base["messages"]) - 1, f], f) for f in MESSAGE_FIELDS]
    unnamed = []
    http = httpx.Client(timeout=60)
    for path, name in cases:
        for literal in BAD_VALUES:
            resp = http.post(open_proxy.session_url(f"schema-{api}") + route, content=_splice(base, path, literal))
            fuzzed[f"proxy_schema_{api}"] += 1
            if resp.status_code >= 400 and not _named(error_message(resp, api), name):
                unnamed.append((name, literal, resp.status_code, error_message(resp, api)))
    http.close()
    assert not unnamed, unnamed


def test_session_budgets_with_bad_values_are_accepted_or_a_400_naming_the_budget(
        open_proxy: ProxyServer, fuzzed: Counter[str]) -> None:
    """A non-finite number is never a budget (NaN compares false: a NaN wall budget never ran out)."""
    bad = []
    for budget in BUDGETS:
        for literal in BAD_VALUES:
            content = f'{{"budgets": {{"{budget}": {literal}}}, "metadata": {{"k": "v"}}}}'.encode()
            resp = httpx.post(open_proxy.base_url + "/sessions", content=content, timeout=60)
            fuzzed["proxy_schema_sessions"] += 1
            if resp.status_code == 200:
                if literal in ("NaN", "Infinity", "1e999"):
                    bad.append((budget, literal, "accepted"))
            elif not _named(error_message(resp, "openai"), f"budgets.{budget}"):
                bad.append((budget, literal, resp.text))
    for literal in BAD_VALUES:
        resp = httpx.post(open_proxy.base_url + "/sessions", content=f'{{"metadata": {literal}}}'.encode(), timeout=60)
        fuzzed["proxy_schema_sessions"] += 1
        if resp.status_code != 200 and not _named(error_message(resp, "openai"), "metadata"):
            bad.append(("metadata", literal, resp.text))
    assert not bad, bad
