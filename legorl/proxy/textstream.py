"""Sampled token ids → text, as they arrive: incremental detokenization, stop strings, and the
content that is safe to stream before a tool call or a stop string could begin.

Stop strings are matched on the decoded text. When one completes, generation is cut after the
token that completed it: the kept ids are exactly what was sampled up to there (their logprobs stay
valid, nothing is re-tokenized), the reply's text ends before the stop string, and the tokens
sampled after the cut are dropped from the capture (the engine is told to stop). So a segment may
hold a stop string's text where the reply does not show it: the segment is what the model saw.
Of the stop strings that complete with the same token, the one that starts first wins (the
shorter of two that start at the same place).

The work per sampled token is bounded whatever the request holds and however long the reply:
stop strings (and the tool-call marker) are matched by one Aho–Corasick automaton that reads each
new character once, and streaming looks only at the text not streamed yet.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence

# Ids in a row that add no decodable text, after which the text moves on anyway: no UTF-8
# character spans more than 4 bytes, so these are invalid bytes (U+FFFD in the final decode too),
# and re-decoding a window that only grows would make each token cost more than the last.
_MAX_PENDING_IDS = 16


class _Automaton:
    """Aho–Corasick over ``patterns``: each state is the longest suffix of the text read so far that
    is a prefix of some pattern; per state, what that suffix ends with (see the fields)."""

    def __init__(self, stops: Sequence[str], marker: str | None) -> None:
        self.goto: list[dict[str, int]] = [{}]
        self.depth = [0]
        stop_len = [0]
        marker_end = [False]
        for pattern, is_stop in [*((s, True) for s in stops), *([(marker, False)] if marker else [])]:
            node = 0
            for ch in pattern:
                nxt = self.goto[node].get(ch)
                if nxt is None:
                    nxt = len(self.goto)
                    self.goto[node][ch] = nxt
                    self.goto.append({})
                    self.depth.append(self.depth[node] + 1)
                    stop_len.append(0)
                    marker_end.append(False)
                node = nxt
            if is_stop:
                stop_len[node] = len(pattern)
            else:
                marker_end[node] = True
        self.fail = [0] * len(self.goto)
        # stop[s]: the longest stop string the state's text ends with (0: none)
        self.stop = stop_len
        # marker[s]: the state's text ends with the tool-call marker
        self.marker = marker_end
        # held[s]: the longest suffix of the state's text that is a proper prefix of a pattern
        self.held = [0] * len(self.goto)
        order = [0]
        for node in order:  # breadth first: a state's fail link is shallower, so done before it
            if self.goto[node]:
                self.held[node] = self.depth[node]
            elif node:
                self.held[node] = self.held[self.fail[node]]
            for ch, child in self.goto[node].items():
                order.append(child)
                if node:
                    self.fail[child] = self.step(self.fail[node], ch)
                f = self.fail[child]
                self.stop[child] = max(self.stop[child], self.stop[f])
                self.marker[child] = self.marker[child] or self.marker[f]

    def step(self, state: int, ch: str) -> int:
        goto, fail = self.goto, self.fail
        while True:
            nxt = goto[state].get(ch)
            if nxt is not None:
                return nxt
            if state == 0:
                return 0
            state = fail[state]

    def walk(self, text: str) -> int:
        state = 0
        for ch in text:
            state = self.step(state, ch)
        return state


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
        self._marker = tool_marker or None
        self._auto = _Automaton(self._stops, self._marker) if (self._stops or self._marker) else None
        self._longest = max((len(p) for p in [*self._stops, self._marker or ""]), default=0)
        self._state = 0
        self.ids: list[int] = []
        # the text, as the pieces each token added and where each ends (nothing is copied per token)
        self._pieces: list[str] = []
        self._ends: list[int] = []
        self._len = 0
        self._prefix = 0
        self._read = 0
        self.stop_sequence: str | None = None
        self.cut: int | None = None  # number of ids kept when a stop string matched
        self._marker_at: int | None = None  # where the tool-call marker first occurs in the text
        self._emitted: list[str] = []
        self._emitted_len = 0
        self._blank_to = 0  # the text from what was streamed up to here is all whitespace
        self._in_tool = False

    @property
    def text(self) -> str:
        if len(self._pieces) > 1:
            self._pieces = ["".join(self._pieces)]
            self._ends = [len(self._pieces[0])]
        return self._pieces[0][: self._len] if self._pieces else ""

    @text.setter
    def text(self, value: str) -> None:
        self._pieces, self._ends, self._len = [value], [len(value)], len(value)

    @property
    def emitted(self) -> str:
        """What :meth:`content_delta` has streamed so far."""
        if len(self._emitted) > 1:
            self._emitted = ["".join(self._emitted)]
        return self._emitted[0] if self._emitted else ""

    def _slice(self, start: int, end: int) -> str:
        """``text[start:end]``, joining only the pieces it spans."""
        if start >= end:
            return ""
        first = bisect.bisect_right(self._ends, start)
        last = bisect.bisect_left(self._ends, end)
        base = self._ends[first - 1] if first else 0
        return "".join(self._pieces[first : last + 1])[start - base : end - base]

    def push(self, token_id: int) -> bool:
        """Add one sampled id; True when a stop string completed (stop generating)."""
        self.ids.append(token_id)
        if token_id in self._stop_ids:
            return False
        prefix_text = self._decode(self.ids[self._prefix : self._read]) if self._read > self._prefix else ""
        new_text = self._decode(self.ids[self._prefix :])
        grew = len(new_text) > len(prefix_text)
        if (not grew or new_text.endswith("\ufffd")) and len(self.ids) - self._read < _MAX_PENDING_IDS:
            return False
        self._prefix = self._read
        self._read = len(self.ids)
        if not grew:
            return False
        added = new_text[len(prefix_text) :]
        before = self._len
        self._pieces.append(added)
        self._len += len(added)
        self._ends.append(self._len)
        return self._match(added, before)

    def _match(self, added: str, before: int) -> bool:
        auto = self._auto
        if auto is None:
            return False
        state = self._state
        goto, fail, stop, marker = auto.goto, auto.fail, auto.stop, auto.marker
        best_start = best_len = -1
        for i, ch in enumerate(added, before):
            while True:  # auto.step, inline: this loop is the per-character cost
                nxt = goto[state].get(ch)
                if nxt is not None:
                    state = nxt
                    break
                if state == 0:
                    break
                state = fail[state]
            if stop[state] and (best_start < 0 or i + 1 - stop[state] < best_start):
                best_len = stop[state]
                best_start = i + 1 - best_len
            if marker[state] and self._marker_at is None:
                assert self._marker is not None
                self._marker_at = i + 1 - len(self._marker)
        self._state = state
        if best_start < 0:
            return False
        self.stop_sequence = self._slice(best_start, best_start + best_len)
        self._len = best_start
        self.cut = len(self.ids)
        return True

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
        end = self._len
        marker = self._marker
        if marker and self._marker_at is not None and self._marker_at + len(marker) <= end:
            self._in_tool = True
            end = self._marker_at
        if self._auto is not None:
            if end == self._len and self.cut is None:
                state = self._state  # the automaton has read exactly this text
            else:  # cut short (a stop string, the marker): once, over what a held tail can span
                state = self._auto.walk(self._slice(max(0, end - self._longest), end))
            end -= self._auto.held[state]
        start = max(self._emitted_len, min(self._blank_to, end))
        fresh = self._slice(start, end).rstrip()
        self._blank_to = max(self._blank_to, end)
        if not fresh:
            return ""
        solid = start + len(fresh)
        delta = self._slice(self._emitted_len, solid)
        self._emitted.append(delta)
        self._emitted_len = solid
        self._blank_to = max(self._blank_to, solid)
        return delta
