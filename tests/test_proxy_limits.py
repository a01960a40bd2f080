"""One session cannot exhaust what every session of the proxy shares (issue #25): its process's file
descriptors, its one event loop, its memory.

Each attack runs through the attacker's own session socket (as a trial's agent reaches it) beside
an honest victim session on the same proxy, which must not notice; the real proxy on the scripted
engine, the official clients, real unix sockets. Then the stop-string matcher's exact semantics and
its bounded per-token cost.
"""

from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import proxy_support
import pytest
from proxy_support import say, scripted_proxy

from legorl.core.errors import ConfigError
from legorl.proxy.limits import ProxyLimits
from legorl.proxy.server import ProxyServer
from legorl.proxy.session_socket import SessionSocket
from legorl.proxy.textstream import TextAssembler

tokenizer = proxy_support.tokenizer

# small where a test must reach a cap with little traffic; the stop-string caps are the defaults
LIMITS = ProxyLimits(max_connections=32, max_inflight_calls=4, max_inflight_body_mb=1, max_body_mb=1,
                     max_tools=64, max_messages=500, max_content_parts=1000)


@pytest.fixture(scope="module")
def proxy(tokenizer: Any) -> Iterator[ProxyServer]:
    with scripted_proxy(tokenizer, limits=LIMITS) as server:
        yield server


@pytest.fixture
def sockets(proxy: ProxyServer) -> Iterator[Callable[..., tuple[str, SessionSocket]]]:
    """Makes a new session served on its own socket: (session id, socket)."""
    folder = Path(tempfile.mkdtemp(prefix="lim-", dir="/tmp"))  # short: a socket path holds 107 bytes
    opened: list[SessionSocket] = []

    def make(limits: ProxyLimits | None = None) -> tuple[str, SessionSocket]:
        sid = proxy.new_session()
        assert proxy.loop is not None
        sock = SessionSocket(proxy.app.bound_to(sid), folder / f"{len(opened)}.sock", proxy.loop,
                             limits=limits or LIMITS)
        opened.append(sock)
        return sid, sock

    yield make
    for sock in opened:
        sock.close()
    shutil.rmtree(folder, ignore_errors=True)


def oa(sid: str, sock: SessionSocket, timeout: float = 30) -> openai.OpenAI:
    http = httpx.Client(transport=httpx.HTTPTransport(uds=str(sock.path)), timeout=timeout)
    return openai.OpenAI(base_url=f"http://trial/sess/{sid}/v1", api_key="x", max_retries=0, http_client=http)


def an(sid: str, sock: SessionSocket) -> anthropic.Anthropic:
    import httpx2  # what this anthropic SDK is built on

    http = httpx2.Client(transport=httpx2.HTTPTransport(uds=str(sock.path)), timeout=30)
    return anthropic.Anthropic(base_url=f"http://trial/sess/{sid}", api_key="x", max_retries=0, http_client=http)


def victim_call(client: openai.OpenAI) -> float:
    """One honest 4-token call; its latency in seconds."""
    t0 = time.monotonic()
    out = client.chat.completions.create(model="m", max_tokens=4,
                                         messages=[{"role": "user", "content": "hi " + say("a b c d")}])
    assert out.choices[0].message.content
    return time.monotonic() - t0


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


# ----------------------------------------------------------------------------- (a) connections

FLOOD = r"""
import errno, resource, socket, sys
resource.setrlimit(resource.RLIMIT_NOFILE, (8192, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
held, refused = [], 0
for _ in range(int(sys.argv[2])):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.setblocking(False)
    if s.connect_ex(sys.argv[1]) == 0:
        held.append(s)
    else:
        refused += 1
        s.close()
print(len(held), refused, flush=True)
sys.stdin.read()  # hold them all until told
"""


def test_a_connection_flood_holds_no_descriptors_and_the_victim_is_served(
        sockets: Callable[..., tuple[str, SessionSocket]]) -> None:
    attacker_sid, attacker = sockets()
    victim_sid, victim = sockets()
    victim_client = oa(victim_sid, victim)
    victim_call(victim_client)  # the client's connection is open before the flood
    before = open_fds()
    flood = subprocess.Popen([sys.executable, "-c", FLOOD, str(attacker.path), "3000"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert flood.stdout is not None
        connected = flood.stdout.readline().split()
        assert connected, "the flooding process died"
        time.sleep(0.5)  # let the proxy accept what it will
        during = open_fds()
        latencies = [victim_call(victim_client) for _ in range(5)]
        # SAFE: the attacker's thousands of connections hold at most the cap of descriptors here
        assert attacker.connections <= LIMITS.max_connections
        assert during - before <= LIMITS.max_connections + 8, (
            f"{during - before} more descriptors open with {connected[0]} connections held")
        assert max(latencies) < 3.0, latencies
        print(f"flood: {connected[0]} connected ({connected[1]} refused by the kernel), "
              f"+{during - before} fds here; victim latency max {max(latencies) * 1000:.0f} ms")
    finally:
        assert flood.stdin is not None
        flood.stdin.close()
        flood.wait(30)
    # the attacker's own session works again once it lets go
    deadline = time.monotonic() + 10
    while attacker.connections >= LIMITS.max_connections and time.monotonic() < deadline:
        time.sleep(0.05)
    victim_call(oa(attacker_sid, attacker, timeout=10))


def test_a_connection_that_sends_no_request_is_closed(sockets: Callable[..., tuple[str, SessionSocket]]) -> None:
    sid, sock = sockets(ProxyLimits(idle_timeout_s=0.5))
    idle = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    idle.settimeout(10)
    idle.connect(str(sock.path))
    slow = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    slow.settimeout(10)
    slow.connect(str(sock.path))
    slow.sendall(b"POST /sess/" + sid.encode() + b"/v1/chat/completions HTTP/1.1\r\nhost: x\r\n")  # never ends
    t0 = time.monotonic()
    assert idle.recv(100) == b"" and slow.recv(100) == b""
    assert time.monotonic() - t0 < 5
    idle.close()
    slow.close()
    # one that sent its request is served, however long the call takes to come
    victim_call(oa(sid, sock))


# ----------------------------------------------------------------------------- (b) stop strings


def test_too_many_or_too_long_stop_strings_are_a_400_naming_the_parameter(
        sockets: Callable[..., tuple[str, SessionSocket]]) -> None:
    sid, sock = sockets()
    client = oa(sid, sock)
    msgs: Any = [{"role": "user", "content": "hi"}]
    cases = [["x" * 200 + str(i) for i in range(5000)],  # the red team's: thousands of long ones
             [f"s{i}" for i in range(LIMITS.max_stop_strings + 1)],
             ["y" * (LIMITS.max_stop_chars // 2), "z" * (LIMITS.max_stop_chars // 2 + 1)]]
    for stop in cases:
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model="m", messages=msgs, stop=stop, stream=True)
        assert err.value.param == "stop" and "stop" in err.value.message, err.value.message
    with pytest.raises(anthropic.BadRequestError) as aerr:
        an(sid, sock).messages.create(model="m", max_tokens=8, messages=msgs, stop_sequences=cases[0])
    assert "stop_sequences" in str(aerr.value)
    # at the caps: served
    stop = [f"{i:03d}" + "q" * (LIMITS.max_stop_chars // LIMITS.max_stop_strings - 3)
            for i in range(LIMITS.max_stop_strings)]
    assert sum(map(len, stop)) == LIMITS.max_stop_chars
    out = client.chat.completions.create(model="m", messages=msgs, stop=stop)
    assert out.choices[0].message.content == "ok"


def test_stop_strings_at_the_cap_do_not_stall_the_victim(
        sockets: Callable[..., tuple[str, SessionSocket]]) -> None:
    attacker_sid, attacker = sockets()
    victim_sid, victim = sockets()
    victim_client = oa(victim_sid, victim)
    victim_call(victim_client)
    # the matcher's worst case: long stops the reply never completes, partly matching all the time
    each = LIMITS.max_stop_chars // LIMITS.max_stop_strings
    stop = [("ab " * each)[: each - 4] + f"#{i:03d}" for i in range(LIMITS.max_stop_strings)]
    reply = "ab " * 3000
    done = threading.Event()
    latencies: list[float] = []

    def attack() -> None:
        client = oa(attacker_sid, attacker, timeout=120)
        try:
            for _ in range(2):
                stream = client.chat.completions.create(
                    model="m", stream=True, stop=stop, messages=[{"role": "user", "content": say(reply)}])
                text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
                assert text == reply
        finally:
            done.set()

    t0 = time.monotonic()
    attacker_thread = threading.Thread(target=attack)
    attacker_thread.start()
    while not done.is_set():
        latencies.append(victim_call(victim_client))
    attacker_thread.join()
    took = time.monotonic() - t0
    print(f"stops at the cap: the attacker's 2 x 3000-token streams took {took:.1f} s; victim's 4-token "
          f"calls: {len(latencies)}, max {max(latencies) * 1000:.0f} ms, median "
          f"{sorted(latencies)[len(latencies) // 2] * 1000:.0f} ms")
    # SAFE: an honest session's call never waits long on another session's stop strings
    assert max(latencies) < 1.5, latencies


# ----------------------------------------------------------------------------- (c) calls in flight


def stalled_upload(sock: SessionSocket, sid: str, declared: int, sent: int) -> socket.socket:
    """A call whose body never finishes arriving."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(str(sock.path))
    s.sendall(f"POST /sess/{sid}/v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
              f"content-length: {declared}\r\n\r\n".encode() + b" " * sent)
    return s


def test_calls_in_flight_past_the_cap_are_a_429(sockets: Callable[..., tuple[str, SessionSocket]]) -> None:
    attacker_sid, attacker = sockets()
    victim_sid, victim = sockets()
    victim_client = oa(victim_sid, victim)
    stalled = [stalled_upload(attacker, attacker_sid, 100_000, 100) for _ in range(LIMITS.max_inflight_calls)]
    try:
        time.sleep(0.3)
        with pytest.raises(openai.RateLimitError) as err:
            victim_call(oa(attacker_sid, attacker))
        assert err.value.status_code == 429 and "max_inflight_calls" in err.value.message
        with pytest.raises(anthropic.RateLimitError) as aerr:
            an(attacker_sid, attacker).messages.create(model="m", max_tokens=4,
                                                       messages=[{"role": "user", "content": "hi"}])
        assert aerr.value.body["error"]["type"] == "rate_limit_error"  # type: ignore[index]
        latencies = [victim_call(victim_client) for _ in range(3)]
        assert max(latencies) < 2.0, latencies
    finally:
        for s in stalled:
            s.close()
    deadline = time.monotonic() + 5
    while True:  # the proxy sees them go, then the session is served again
        try:
            victim_call(oa(attacker_sid, attacker))
            break
        except openai.RateLimitError:
            assert time.monotonic() < deadline
            time.sleep(0.05)


def test_body_bytes_in_flight_past_the_cap_are_a_429(sockets: Callable[..., tuple[str, SessionSocket]]) -> None:
    attacker_sid, attacker = sockets()
    victim_sid, victim = sockets()
    part = 600 << 10  # two of them pass the session's 1 MiB in flight
    first = stalled_upload(attacker, attacker_sid, part + 10, part)
    time.sleep(0.3)
    second = stalled_upload(attacker, attacker_sid, part + 10, part)
    try:
        answer = b""
        while b"}" not in answer:
            got = second.recv(4096)
            assert got, answer
            answer += got
        answer = answer.decode()
        assert answer.startswith("HTTP/1.1 429"), answer
        assert "max_inflight_body_mb" in answer
        assert max(victim_call(oa(victim_sid, victim)) for _ in range(3)) < 2.0
    finally:
        first.close()
        second.close()


def test_complexity_caps_name_the_parameter(sockets: Callable[..., tuple[str, SessionSocket]]) -> None:
    sid, sock = sockets()
    client = oa(sid, sock)
    tool = proxy_support.BASH
    msg: Any = {"role": "user", "content": "hi"}
    big = LIMITS
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="m", messages=[msg], tools=[tool] * (big.max_tools + 1))
    assert err.value.param == "tools"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="m", messages=[msg] * (big.max_messages + 1))
    assert err.value.param == "messages" and "max_messages" in err.value.message
    parts: Any = [{"type": "text", "text": "x"}] * (big.max_content_parts + 1)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": parts}])
    assert err.value.param == "messages" and "max_content_parts" in err.value.message
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model="m", input=[{"role": "user", "content": "x"}] * (big.max_messages + 1))
    assert err.value.param == "input"
    with pytest.raises(ConfigError, match="max_connections"):
        ProxyLimits(max_connections=0)


def test_a_body_of_millions_of_tiny_values_is_refused_before_it_is_parsed(tokenizer: Any) -> None:
    """Parsed, 16 MB of ``{},`` is ~400 MB of dicts and seconds of the GIL: a 400 naming the limit,
    answered in well under the time a parse takes, and the session goes on."""
    limits = ProxyLimits(max_json_items=100_000)
    with scripted_proxy(tokenizer, limits=limits) as server:
        sid = server.new_session()
        bomb = b'{"model":"m","x":[' + b"{}," * 1_000_000 + b'0],"messages":[{"role":"user","content":"hi"}]}'
        with httpx.Client(base_url=server.base_url, timeout=60) as client:
            t0 = time.monotonic()
            answer = client.post(f"/sess/{sid}/v1/chat/completions", content=bomb,
                                 headers={"content-type": "application/json"})
            took = time.monotonic() - t0
            assert answer.status_code == 400 and "max_json_items" in answer.text, answer.text
            assert took < 1.0, took
            ok = client.post(f"/sess/{sid}/v1/chat/completions",
                             json={"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
            assert ok.status_code == 200, ok.text


# ----------------------------------------------------------------------------- (d) the stop matcher

VOCAB = ["", "a", "b", "c", " ", "\n", "<", "ab", "bc", "a b", "<t", "t>", "é", "日本", "STOP", "ST", "OP", "\ufffd"]


def char_decode(ids: Sequence[int]) -> str:
    return "".join(VOCAB[i] for i in ids)


def spec(pieces: list[str], stops: list[str], marker: str | None) -> tuple[str | None, int | None, str, str]:
    """What the matcher must do, written plainly: after each token, of the stop strings whose end is
    in the new text, the one starting first (then the shortest) cuts there; streamed text is the
    text minus anything from the marker on, minus the longest tail that begins a pattern, right-
    stripped, and only ever extended. Returns (stop, tokens kept, text, streamed)."""
    text, streamed, stopped, kept, in_tool = "", "", None, None, False
    for n, piece in enumerate(pieces, 1):
        before = len(text)
        text += piece
        hits = [(p, s) for s in stops if s and (p := text.find(s, max(0, before - len(s) + 1))) >= 0]
        if hits and piece:
            pos, stopped = min(hits)
            text, kept = text[:pos], n
        if in_tool:
            if kept is not None:
                break
            continue
        safe = text
        if marker and (at := safe.find(marker)) >= 0:
            safe, in_tool = safe[:at], True
        tail = max([k for p in [*([marker] if marker else []), *[s for s in stops if s]]
                    for k in range(1, min(len(p) - 1, len(safe)) + 1) if safe.endswith(p[:k])], default=0)
        safe = safe[: len(safe) - tail].rstrip()
        if len(safe) > len(streamed) and safe.startswith(streamed):
            streamed = safe
        if kept is not None:
            break
    return stopped, kept, text, streamed


def run(ids: list[int], stops: list[str], marker: str | None,
        decode: Callable[[Sequence[int]], str] = char_decode) -> tuple[str | None, int | None, str, str]:
    asm = TextAssembler(decode, [], stops, marker)
    streamed = ""
    for t in ids:
        stop = asm.push(t)
        streamed += asm.content_delta()
        if stop:
            break
    assert streamed == asm.emitted
    return asm.stop_sequence, asm.cut, asm.text, streamed


@pytest.mark.parametrize(("pieces", "stops", "stop", "kept", "text"), [
    (["a", "b", "c"], ["abc"], "abc", 3, ""),  # across three tokens
    (["ST", "OP", "a"], ["STOP"], "STOP", 2, ""),
    (["a b", "c"], ["bc", "a bc"], "a bc", 2, ""),  # both complete with one token: the earlier start
    (["ab"], ["b", "ab"], "ab", 1, ""),
    (["a", "bc"], ["abc", "ab"], "ab", 2, ""),  # same start: the shorter one
    (["c", "a", "bc", "c"], ["bcc", "ab"], "ab", 3, "c"),  # the first to complete, not the first to start
    (["日本", "é"], ["本é"], "本é", 2, "日"),  # multibyte characters
    (["a", "a", "a"], ["aa"], "aa", 2, ""),
])
def test_the_stop_matcher_cuts_where_the_spec_says(pieces: list[str], stops: list[str], stop: str, kept: int,
                                                    text: str) -> None:
    ids = [VOCAB.index(p) for p in pieces]
    got = run(ids, stops, None)
    assert got[:3] == (stop, kept, text)
    assert got == spec(pieces, stops, None)


def test_the_stop_matcher_agrees_with_the_spec_on_random_replies() -> None:
    rng = random.Random(25)
    usable = [i for i, p in enumerate(VOCAB) if p != "\ufffd"]
    for _ in range(3000):
        ids = [rng.choice(usable) for _ in range(rng.randrange(1, 20))]
        stops = ["".join(rng.choice("abc <\n") for _ in range(rng.randrange(1, 5))) for _ in range(rng.randrange(5))]
        marker = rng.choice([None, "<t", "ab", "<tt>"])
        assert run(ids, stops, marker) == spec([VOCAB[i] for i in ids], stops, marker), (ids, stops, marker)


def test_a_stop_string_split_inside_a_multibyte_character(tokenizer: Any) -> None:
    """Byte-level tokens: a stop string is matched on characters, after a character is whole."""
    table = {b: c for c, b in tokenizer.byte_decoder.items()} if hasattr(tokenizer, "byte_decoder") else None
    if table is None:
        from test_proxy_units import _gpt2_bytes_to_unicode

        table = _gpt2_bytes_to_unicode()
    byte_ids = [tokenizer.convert_tokens_to_ids(table[b]) for b in "xé!".encode()]
    asm = TextAssembler(tokenizer.decode, [], ["é!"])
    assert [asm.push(t) for t in byte_ids] == [False, False, False, True]
    assert asm.stop_sequence == "é!" and asm.text == "x" and asm.cut == 4
    asm = TextAssembler(tokenizer.decode, [], ["é"], "<tool_call>")
    assert not asm.push(byte_ids[0]) and asm.content_delta() == "x"
    assert not asm.push(byte_ids[1]) and asm.content_delta() == ""  # half a character: nothing yet
    assert asm.push(byte_ids[2]) and asm.content_delta() == ""


def test_undecodable_tokens_never_grow_the_decoded_window() -> None:
    seen: list[int] = []

    def decode(ids: Sequence[int]) -> str:
        seen.append(len(ids))
        return char_decode(ids)

    asm = TextAssembler(decode, [], ["zz"])
    for _ in range(500):
        asm.push(VOCAB.index("\ufffd"))
    assert max(seen) <= 40, max(seen)


def _per_token_s(stops: list[str], ids: list[int]) -> list[float]:
    """Seconds per token (push + content_delta), for each quarter of ``ids``, best of 3 runs."""
    best: list[float] = []
    for _ in range(3):
        asm = TextAssembler(char_decode, [], stops, "<tool_call>")
        quarters = []
        step = len(ids) // 4
        for q in range(4):
            t0 = time.perf_counter()
            for t in ids[q * step:(q + 1) * step]:
                assert not asm.push(t)
                asm.content_delta()
            quarters.append((time.perf_counter() - t0) / step)
        best = quarters if not best else [min(a, b) for a, b in zip(best, quarters, strict=True)]
    return best


def test_per_token_cost_does_not_grow_with_the_reply_or_the_stop_strings() -> None:
    ids = [VOCAB.index(p) for p in ["a b", " ", "bc", "\n", "a", " "]] * 2000  # 12000 tokens
    few = _per_token_s(["STOP"], ids)
    # 64 stops of 256 characters (the default caps), each partly matching the reply all the time
    many = _per_token_s([("a b bc\na " * 40)[:252] + f"#{i:03d}" for i in range(64)], ids)
    print(f"µs per token by quarter of 12000 tokens: 1 stop {[round(x * 1e6, 1) for x in few]}, "
          f"64 x 256 chars {[round(x * 1e6, 1) for x in many]}")
    assert many[3] < 3 * many[0] and few[3] < 3 * few[0], "the cost per token grows with the reply"
    assert sum(many) < 4 * sum(few), "the cost per token grows with the stop strings"


# ----------------------------------------------------------------------------- the options


def test_the_limits_are_serve_proxy_options() -> None:
    from typer.testing import CliRunner

    from legorl.cli.app import app

    out = CliRunner().invoke(app, ["serve-proxy", "--help"], terminal_width=200)
    assert out.exit_code == 0
    for flag in ("--max-connections", "--idle-timeout-s", "--max-inflight-calls", "--max-stop-strings",
                 "--max-stop-chars", "--max-tools", "--max-messages", "--max-content-parts"):
        assert flag in out.output, flag
