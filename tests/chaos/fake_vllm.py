"""A stand-in for `vllm serve` that the chaos tests can kill in the middle of a generation.

``python fake_vllm.py PORT STATE_DIR TOKEN_IDS`` serves ``/v1/models`` and ``/v1/completions``,
streamed or not (token ids + logprobs, as legorl's vLLM client asks for). Every completion is
``TOKEN_IDS`` (comma-separated), finishing with ``stop``; but while ``STATE_DIR/hang`` exists, a
request streams the first N of them (N: the file's content, 0 if empty), touches
``STATE_DIR/inflight`` and never finishes, so the test knows a call is in flight when it kills
this process.
"""

from __future__ import annotations

import json
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

STATE = Path(sys.argv[2])
TOKENS = [int(t) for t in sys.argv[3].split(",")]


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass

    def _json(self, body: object) -> None:
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        self._json({"object": "list", "data": [{"id": "fake", "object": "model", "max_model_len": 8192}]})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
        hang = STATE / "hang"
        if not body.get("stream"):
            if hang.exists():
                self._hang()
            self._json({"choices": [self._choice(TOKENS, "stop")], "usage": {"completion_tokens": len(TOKENS)}})
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        if hang.exists():
            sent = int(hang.read_text().strip() or 0)
            for token in TOKENS[:sent]:
                self._event({"choices": [self._choice([token], None)]})
            self._hang()
        self._event({"choices": [self._choice(TOKENS, "stop")]})
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()

    @staticmethod
    def _choice(tokens: list[int], finish: str | None) -> dict[str, object]:
        return {"index": 0, "text": "", "token_ids": tokens, "finish_reason": finish,
                "logprobs": {"token_logprobs": [-0.5] * len(tokens)}}

    def _event(self, chunk: object) -> None:
        self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        self.wfile.flush()

    @staticmethod
    def _hang() -> None:
        (STATE / "inflight").touch()
        time.sleep(3600)


if __name__ == "__main__":
    ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
