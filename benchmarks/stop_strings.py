"""Per-token cost of stop-string matching (and streaming's held-back tail): the proxy's matcher vs the
one it replaced (kept below as ``OldAssembler``, verbatim in behaviour).

    .venv/bin/python benchmarks/stop_strings.py [--model DIR] [--tokens 2000]

A streamed reply of ``--tokens`` tokens is pushed through each matcher one token at a time, with
``content_delta()`` after each (what a streamed call does on the proxy's event loop), for 4 and 64
stop strings of two kinds: short ones like harnesses send (``</function``, ``\\nObservation:``) and
long ones (256 characters each: 64 of them is the default cap of 16384 characters) that never
match, the old matcher's worst case. Printed: microseconds per token and the old/new ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from legorl.proxy.textstream import TextAssembler


class OldAssembler:
    """The matcher before issue #25: each pattern's partial tail checked by slicing (O(L^2) per
    pattern per token) and the whole text copied per token."""

    def __init__(self, decode: Callable[[Sequence[int]], str], stop_token_ids: Sequence[int],
                 stop_strings: Sequence[str] = (), tool_marker: str | None = None):
        self._decode = decode
        self._stop_ids = frozenset(stop_token_ids)
        self._stops = [s for s in stop_strings if s]
        self._marker = tool_marker
        self.ids: list[int] = []
        self.text = ""
        self._prefix = 0
        self._read = 0
        self.stop_sequence: str | None = None
        self.emitted = ""
        self._in_tool = False

    def push(self, token_id: int) -> bool:
        self.ids.append(token_id)
        if token_id in self._stop_ids:
            return False
        before = len(self.text)
        prefix_text = self._decode(self.ids[self._prefix : self._read]) if self._read > self._prefix else ""
        new_text = self._decode(self.ids[self._prefix :])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            self.text += new_text[len(prefix_text) :]
            self._prefix = self._read
            self._read = len(self.ids)
        if self._stops and len(self.text) > before:
            hits = [(pos, s) for s in self._stops if (pos := self.text.find(s, max(0, before - len(s) + 1))) >= 0]
            if hits:
                pos, s = min(hits)
                self.text = self.text[:pos]
                self.stop_sequence = s
                return True
        return False

    def content_delta(self) -> str:
        if self._in_tool:
            return ""
        safe = self.text
        if self._marker:
            at = safe.find(self._marker)
            if at >= 0:
                self._in_tool = True
                safe = safe[:at]
        safe = safe[: len(safe) - self._partial_tail(safe)]
        safe = safe.rstrip()
        if len(safe) <= len(self.emitted) or not safe.startswith(self.emitted):
            return ""
        delta = safe[len(self.emitted) :]
        self.emitted = safe
        return delta

    def _partial_tail(self, text: str) -> int:
        longest = 0
        for pattern in ([self._marker] if self._marker else []) + self._stops:
            for n in range(min(len(pattern) - 1, len(text)), longest, -1):
                if text.endswith(pattern[:n]):
                    longest = n
                    break
        return longest


def per_token_us(cls: Any, decode: Callable[[Sequence[int]], str], ids: list[int], stops: list[str],
                 repeats: int) -> float:
    times = []
    for _ in range(repeats):
        asm = cls(decode, [], stops, "<tool_call>")
        t0 = time.perf_counter()
        for t in ids:
            if asm.push(t):
                raise SystemExit("a benchmark stop string matched: pick others")
            asm.content_delta()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) / len(ids) * 1e6


def stop_sets(n: int) -> dict[str, list[str]]:
    short = ["</function", "\nObservation:", "```\n", "<|im_end|>", "\nUser:", "</tool_call>", "\n\n\n"]
    return {"short": [short[i % len(short)] + ("#" * (i // len(short))) for i in range(n)],
            "256-char": [(f"~{i}|" + "zq" * 128)[:256] for i in range(n)]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path, help="tokenizer directory (default: the tests' tiny model)")
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    from transformers import AutoTokenizer

    if args.model is None:
        from legorl.core.paths import cache_dir
        from legorl.models import MODEL_RECIPE_VERSION, init_model

        args.model = cache_dir() / "test-models" / f"dense-v{MODEL_RECIPE_VERSION}"
        if not (args.model / "config.json").exists():
            init_model(args.model, moe=False, size="tiny", seed=0)
    tok = AutoTokenizer.from_pretrained(args.model)
    words = "Let me look at the parser first: grep -rn 'def parse' src/ shows three matches, so "
    ids = list(tok.encode(words * (args.tokens // 10 + 1)))[: args.tokens]

    def decode(x: Sequence[int]) -> str:
        return tok.decode(x)

    print(f"{len(ids)} tokens, streamed (push + content_delta per token); µs per token, median of {args.repeats}")
    print(f"{'stops':>6} {'kind':>9} {'old':>10} {'new':>10} {'old/new':>8}")
    for n in (0, 4, 64):
        for kind, stops in stop_sets(n).items():
            if n == 0 and kind != "short":
                continue
            old = per_token_us(OldAssembler, decode, ids, stops, args.repeats)
            new = per_token_us(TextAssembler, decode, ids, stops, args.repeats)
            print(f"{n:>6} {kind:>9} {old:>10.1f} {new:>10.1f} {old / new:>8.2f}")
    # does the cost per token grow with the reply? (the old one copies the whole text per token)
    long_ids = ids * 8
    stops = stop_sets(4)["short"]
    for cls in (OldAssembler, TextAssembler):
        first = per_token_us(cls, decode, ids, stops, 1)
        whole = per_token_us(cls, decode, long_ids, stops, 1)
        print(f"{cls.__name__}: {first:.1f} µs/token over {len(ids)} tokens, {whole:.1f} over {len(long_ids)}")


if __name__ == "__main__":
    main()
