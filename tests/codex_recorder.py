"""A loopback stand-in for an OpenAI Responses API server that records what a client sends.

Each ``POST .../responses`` is kept (path, headers, JSON body) and answered with a short streamed
(SSE) or plain response: a scripted list of replies, each either assistant text or a function call.
Used to pin down exactly what Codex sends, and by its tests until the proxy serves the endpoint.
"""

from __future__ import annotations

import json
import socketserver
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any


@dataclass
class Recorded:
    method: str
    path: str
    headers: dict[str, str]
    body: Any


@dataclass
class Recorder:
    """Replies in order: ``str`` = assistant text, ``(name, arguments_json)`` = one function call,
    ``int`` = that HTTP error status with an OpenAI-style error body."""

    replies: list[str | tuple[str, str] | int]
    requests: list[Recorded] = field(default_factory=list)

    def next_reply(self) -> str | tuple[str, str] | int:
        n = sum(1 for r in self.requests if r.path.endswith("/responses")) - 1
        return self.replies[n] if n < len(self.replies) else "Done."


def _item(reply: str | tuple[str, str]) -> dict[str, Any]:
    if isinstance(reply, str):
        return {"type": "message", "id": f"msg_{uuid.uuid4().hex}", "role": "assistant", "status": "completed",
                "content": [{"type": "output_text", "text": reply, "annotations": []}]}
    name, args = reply
    return {"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": f"call_{uuid.uuid4().hex}",
            "name": name, "arguments": args, "status": "completed"}


def _response(model: str, item: dict[str, Any]) -> dict[str, Any]:
    return {"id": f"resp_{uuid.uuid4().hex}", "object": "response", "status": "completed", "model": model,
            "output": [item], "usage": {"input_tokens": 10, "output_tokens": 5, "total_tokens": 15,
                                        "input_tokens_details": {"cached_tokens": 0},
                                        "output_tokens_details": {"reasoning_tokens": 0}}}


def sse_events(model: str, reply: str | tuple[str, str]) -> Iterator[dict[str, Any]]:
    item = _item(reply)
    final = _response(model, item)
    yield {"type": "response.created", "response": final | {"status": "in_progress", "output": []}}
    yield {"type": "response.output_item.added", "output_index": 0, "item": item}
    if item["type"] == "message":
        yield {"type": "response.output_text.delta", "output_index": 0, "content_index": 0,
               "item_id": item["id"], "delta": item["content"][0]["text"]}
    yield {"type": "response.output_item.done", "output_index": 0, "item": item}
    yield {"type": "response.completed", "response": final}


class _Handler(BaseHTTPRequestHandler):
    recorder: Recorder

    def log_message(self, *args: object) -> None:
        return None

    def _record(self) -> Any:
        raw = self.rfile.read(int(self.headers.get("content-length") or 0))
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = raw.decode(errors="replace")
        self.recorder.requests.append(Recorded(self.command, self.path, dict(self.headers.items()), body))
        return body

    def do_GET(self) -> None:
        self._record()
        data = json.dumps({"object": "list", "data": [], "models": []}).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self) -> None:
        body = self._record()
        if not self.path.endswith("/responses") or not isinstance(body, dict):
            self.send_error(404)
            return
        reply = self.recorder.next_reply()
        if isinstance(reply, int):
            data = json.dumps({"error": {"message": f"recorded error {reply}", "type": "invalid_request_error",
                                         "code": None, "param": None}}).encode()
            self.send_response(reply)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            return
        model = str(body.get("model", "m"))
        if body.get("stream"):
            self.send_response(200)
            self.send_header("content-type", "text/event-stream")
            self.end_headers()
            for event in sse_events(model, reply):
                self.wfile.write(f"event: {event['type']}\ndata: {json.dumps(event)}\n\n".encode())
                self.wfile.flush()
            self.close_connection = True
            return
        data = json.dumps(_response(model, _item(reply))).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


class _UnixHTTPServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True


class _UnixHandler(_Handler):
    def address_string(self) -> str:  # a unix peer has no host
        return "unix"


class RecordingServer:
    """``with RecordingServer(recorder) as url:`` serves on 127.0.0.1 (a free port) until exit, or
    on the unix socket ``unix_path`` (a trial channel's, reached through the container's relay)."""

    def __init__(self, recorder: Recorder, unix_path: Path | None = None) -> None:
        self.server: socketserver.BaseServer
        if unix_path is None:
            self.server = ThreadingHTTPServer(("127.0.0.1", 0), type("Handler", (_Handler,), {"recorder": recorder}))
        else:
            handler = type("Handler", (_UnixHandler,), {"recorder": recorder, "client_address": ("unix", 0)})
            self.server = _UnixHTTPServer(str(unix_path), handler)
            unix_path.chmod(0o666)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        address = self.server.server_address
        if isinstance(address, tuple):
            return f"http://{address[0]!s}:{address[1]}"
        return f"unix:{address!s}"

    def __enter__(self) -> str:
        self.thread.start()
        return self.url

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
