"""A stand-in for `vllm serve` that the chaos tests can kill in the middle of a generation.

``python fake_vllm.py PORT STATE_DIR TOKEN_IDS`` serves ``/v1/models`` and non-streaming
``/v1/completions`` (token ids + logprobs, as legorl's vLLM client asks for). While
``STATE_DIR/hang`` exists, a completion request touches ``STATE_DIR/inflight`` and never answers,
so the test knows a call is in flight when it kills this process. Otherwise every completion is
``TOKEN_IDS`` (comma-separated), finishing with ``stop``.
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
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if (STATE / "hang").exists():
            (STATE / "inflight").touch()
            time.sleep(3600)
        self._json({"choices": [{"index": 0, "text": "", "token_ids": TOKENS, "finish_reason": "stop",
                                 "logprobs": {"token_logprobs": [-0.5] * len(TOKENS)}}],
                    "usage": {"completion_tokens": len(TOKENS)}})


if __name__ == "__main__":
    ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
