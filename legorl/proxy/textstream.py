"""Sampled token ids → text, as they arrive: incremental detokenization, stop strings, and the
content that is safe to stream before a tool call or a stop string could begin.

Stop strings are matched on the decoded text. When one completes, generation is cut after the
token that completed it: the kept ids are exactly what was sampled up to there (their logprobs stay
valid, nothing is re-tokenized), the reply's text ends before the stop string, and the tokens
sampled after the cut are dropped from the capture (the engine is told to stop). So a segment may
hold a stop string's text where the reply does not show it: the segment is what the model saw.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


class TextAssembler:
    def __init__(
        self,
        decode: Callable[[Sequence[int]], str],
        stop_token_ids: Sequence[int],
        stop_strings: Sequence[str] = (),
        tool_marker: str | None = None,
    ):
        self._decode = decode
        self._stop_ids = frozenset(stop_token_ids)
        self._stops = [s for s in stop_strings if s]
        self._marker = tool_marker
        self.ids: list[int] = []
        self.text = ""
        self._prefix = 0
        self._read = 0
        self.stop_sequence: str | None = None
        self.cut: int | None = None  # number of ids kept when a stop string matched
        self.emitted = ""
        self._in_tool = False

    def push(self, token_id: int) -> bool:
        """Add one sampled id; True when a stop string completed (stop generating)."""
        self.ids.append(token_id)
        if token_id in self._stop_ids:
            return False
        before = len(self.text)
        window = self.ids[self._prefix :]
        prefix_text = self._decode(self.ids[self._prefix : self._read]) if self._read > self._prefix else ""
        new_text = self._decode(window)
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            self.text += new_text[len(prefix_text) :]
            self._prefix = self._read
            self._read = len(self.ids)
        if self._stops and len(self.text) > before:
            hits = [
                (pos, s)
                for s in self._stops
                if (pos := self.text.find(s, max(0, before - len(s) + 1))) >= 0
            ]
            if hits:
                pos, s = min(hits)
                self.text = self.text[:pos]
                self.stop_sequence = s
                self.cut = len(self.ids)
                return True
        return False

    def kept_ids(self) -> list[int]:
        return self.ids if self.cut is None else self.ids[: self.cut]

    def finish(self) -> str:
        """The final text of the reply (complete decode of the kept ids, end-of-turn excluded)."""
        ids = self.kept_ids()
        if ids and ids[-1] in self._stop_ids:
            ids = ids[:-1]
        full = self._decode(ids)
        if self.stop_sequence is not None:
            pos = full.find(self.stop_sequence)
            full = full[:pos] if pos >= 0 else self.text
        self.text = full
        return full

    def content_delta(self) -> str:
        """New reply text that can be streamed now as content.

        Held back: anything from the start of a tool call on, a tail that could be the start of a
        tool-call marker or a stop string, and trailing whitespace (a parser strips it before a
        call). What was streamed is always a prefix of the final content.
        """
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
