"""Chat-template rendering of canonical messages into text and token ids.

The proxy renders every request's *whole* conversation with the model's own chat template (as
text), and relies on the template being prefix-preserving to find the part that is new since the
session's last turn; only that suffix is tokenized. Previously sampled assistant turns are never
re-tokenized: the session keeps the exact sampled ids and appends after them.

The seam between a sampled turn and the next prompt is the template's *closing* of an assistant
turn (for ChatML ``<|im_end|>\\n``). When the sampled ids end with the end-of-turn token, only what
follows it in the closing is added (``\\n``); when generation stopped for another reason (length,
a stop string) the whole closing is added, so the model always sees a well-formed turn boundary.

Special tokens come only from the template. Every string of a request (message content, tool-call
names, arguments and ids, tool schemas) is text, whatever it holds: a tool result that contains
``<|im_start|>`` must not forge a turn boundary in what the policy and the trainer see. So the
proxy renders with :meth:`ChatRenderer.render_marked`, which escapes the special token strings (and
the escape character) in every string it is given before the template sees it, and
:meth:`ChatRenderer.encode` turns only the *unescaped* special token strings of that text (the
template's own) into special ids; an escaped one is tokenized as ordinary text, the way the
tokenizer splits it with ``encode_special_tokens``. "Special" means the tokenizer's added tokens
marked special (ChatML's ``<|im_start|>``, ``<|im_end|>``, ``<|endoftext|>``); added tokens that
are not special (Qwen's ``<tool_call>``, ``<think>``) are part of the text in the model's own
tokenizer and stay single ids wherever they appear.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from legorl.core.errors import LegorlError

_PROBE = "\x00LEGORL-PROBE\x00"

# Escapes in marked renders: _ESC + _ESC is a literal _ESC, _ESC + chr(_BASE + i) the i-th special
# token string as text. _ESC is a Unicode noncharacter (reserved for internal use), _BASE starts
# plane 15's private use area.
_ESC = "\ufdd0"
_BASE = 0xF0000


# Prompts longer than this (characters) are tokenized a message at a time (ChatRenderer.encode): a
# 13 MB prompt took the tokenizer 2.2 GB whole.
SPLIT_ABOVE = 1 << 20


class ChatRenderer:
    """Renders canonical (OpenAI-style) messages with a tokenizer's chat template.

    ``tokenizer`` is a transformers fast tokenizer with a ``chat_template``. Rendering uses the
    same compiled jinja template transformers uses (so the text is identical to
    ``apply_chat_template``) without its per-call overhead.
    """

    def __init__(self, tokenizer: Any, chat_template: str | None = None):
        self.tokenizer = tokenizer
        template = chat_template or getattr(tokenizer, "chat_template", None)
        if not isinstance(template, str) or not template:
            raise LegorlError("the tokenizer has no chat template; the proxy needs one to render prompts")
        self.chat_template = template
        try:
            from transformers.utils.chat_template_utils import _compile_jinja_template

            self._compiled: Any = _compile_jinja_template(template)
        except ImportError:  # pragma: no cover - very old / very new transformers
            self._compiled = None
        special = getattr(tokenizer, "special_tokens_map", {}) or {}
        self._template_kwargs = {k: v for k, v in special.items() if isinstance(v, str)}
        self._backend = getattr(tokenizer, "_tokenizer", None)  # the Rust tokenizer, when fast
        self._setup_specials()
        self.eot_id, self.eot_text = self._end_of_turn()
        self.stop_token_ids: tuple[int, ...] = self._stop_ids()
        self.closing = self._assistant_closing()

    # ------------------------------------------------------------------ text

    def render(
        self,
        messages: Sequence[dict[str, Any]],
        tools: Sequence[dict[str, Any]] | None,
        add_generation_prompt: bool,
    ) -> str:
        if self._compiled is None:  # pragma: no cover
            out = self.tokenizer.apply_chat_template(
                list(messages), tools=list(tools) if tools else None, tokenize=False,
                add_generation_prompt=add_generation_prompt,
            )
            return str(out)
        return str(
            self._compiled.render(
                messages=messages,
                tools=list(tools) if tools else None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **self._template_kwargs,
            )
        )

    def render_marked(
        self,
        messages: Sequence[dict[str, Any]],
        tools: Sequence[dict[str, Any]] | None,
        add_generation_prompt: bool,
    ) -> str:
        """:meth:`render` with every special token string of the given strings escaped: the text
        :meth:`encode` takes to give special ids only where the template placed them."""
        if self._escape_re is None:
            return self.render(messages, tools, add_generation_prompt)
        esc_tools = self._escape(list(tools)) if tools else None
        return self.render(self._escape(list(messages)), esc_tools, add_generation_prompt)

    def _escape(self, value: Any) -> Any:
        """``value`` with its strings (and dict keys) escaped; unchanged parts are not copied."""
        if isinstance(value, str):
            assert self._escape_re is not None
            return self._escape_re.sub(self._escape_one, value) if self._escape_re.search(value) else value
        if isinstance(value, dict):
            out, changed = {}, False
            for k, v in value.items():
                k2, v2 = self._escape(k), self._escape(v)
                changed = changed or k2 is not k or v2 is not v
                out[k2] = v2
            return out if changed else value
        if isinstance(value, list | tuple):
            items = [self._escape(v) for v in value]
            return value if all(a is b for a, b in zip(value, items, strict=True)) else items
        return value

    # ------------------------------------------------------------------ tokens

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (plain, or from :meth:`render_marked`): special token strings in
        it become special ids, escaped ones (content) are tokenized as text."""
        if self._special_split is None:
            return self._encode(text)
        if _ESC not in text:
            if len(text) <= SPLIT_ABOVE or not self._splits_exactly:
                return self._encode(text)
            # a long prompt piece by piece: the same ids (the tokenizer splits at special tokens
            # first), the tokenizer's memory that of the longest message, not of the whole prompt
            return [i for piece in self._special_split.split(text) if piece for i in self._encode(piece)]
        ids: list[int] = []
        for i, piece in enumerate(self._special_split.split(text)):
            if i % 2:  # a special token string the template wrote
                ids.extend(self._encode(piece))
            elif piece:
                ids.extend(self._encode_as_text(self._unescape_re.sub(self._unescape_one, piece)))
        return ids

    # The fast tokenizer's encode_batch, not encode: only the batch call lets go of the GIL while it
    # works (a 3.4 MB prompt held every other thread, the event loop's included, for 5 s; batched,
    # the longest pause was 10 ms). Same ids.
    def _encode(self, text: str) -> list[int]:
        if self._backend is not None:
            return list(self._backend.encode_batch([text], add_special_tokens=False)[0].ids)
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _encode_as_text(self, text: str) -> list[int]:
        if self._text_backend is not None:
            return list(self._text_backend.encode_batch([text], add_special_tokens=False)[0].ids)
        return list(self.tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True))

    def decode(self, ids: Sequence[int]) -> str:
        if self._backend is not None:
            return str(self._backend.decode(list(ids), skip_special_tokens=False))
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=False))

    def bridge(self, sampled_ids: Sequence[int]) -> str:
        """Text to add after a sampled turn so it is closed the way the template closes turns."""
        if sampled_ids and sampled_ids[-1] == self.eot_id and self.closing.startswith(self.eot_text):
            return self.closing[len(self.eot_text) :]
        return self.closing

    def _escape_one(self, m: re.Match[str]) -> str:
        return self._escapes[m.group(0)]

    def _unescape_one(self, m: re.Match[str]) -> str:
        c = m.group(1)
        if c == _ESC:
            return _ESC
        i = ord(c) - _BASE
        return self.special_tokens[i] if 0 <= i < len(self.special_tokens) else m.group(0)

    # ------------------------------------------------------------------ setup

    def _setup_specials(self) -> None:
        """The special token strings (added tokens marked special), and a tokenizer that reads them as text."""
        specials: list[str] = []
        if self._backend is not None:
            decoder = self._backend.get_added_tokens_decoder()
            specials = [t.content for _, t in sorted(decoder.items()) if t.special and t.content]
        else:  # pragma: no cover - slow tokenizers
            specials = [t for t in getattr(self.tokenizer, "all_special_tokens", []) if t]
        specials = sorted(set(specials), key=len, reverse=True)  # longest first: regex alternation
        self.special_tokens: tuple[str, ...] = tuple(specials)
        self._text_backend: Any = None
        self._splits_exactly = False
        if not specials:
            self._escape_re: re.Pattern[str] | None = None
            self._special_split: re.Pattern[str] | None = None
            return
        if _ESC in self.chat_template:
            raise LegorlError("the chat template contains U+FDD0, which the proxy reserves for escaping")
        self._escapes = {_ESC: _ESC + _ESC, **{t: _ESC + chr(_BASE + i) for i, t in enumerate(specials)}}
        self._escape_re = re.compile("|".join(re.escape(t) for t in [_ESC, *specials]))
        self._special_split = re.compile("(" + "|".join(re.escape(t) for t in specials) + ")")
        self._unescape_re = re.compile(re.escape(_ESC) + "(.)", re.DOTALL)
        if self._backend is not None:
            self._text_backend = copy.deepcopy(self._backend)
            self._text_backend.encode_special_tokens = True
        # whether encoding a text piece by piece at its special tokens gives the whole text's ids (a
        # tokenizer that prefixes each segment with a space, say, would not)
        probe = f"{specials[0]}x  y\n{specials[-1]}\n z{specials[0]}"
        pieces = [i for piece in self._special_split.split(probe) if piece for i in self._encode(piece)]
        self._splits_exactly = pieces == self._encode(probe)

    def _end_of_turn(self) -> tuple[int, str]:
        tok = self.tokenizer
        for name in ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>"):
            tid = tok.convert_tokens_to_ids(name)
            if isinstance(tid, int) and tid != tok.unk_token_id and tid >= 0:
                return tid, name
        if tok.eos_token_id is None:
            raise LegorlError("the tokenizer has neither an end-of-turn token nor an eos token")
        return int(tok.eos_token_id), str(tok.eos_token)

    def _stop_ids(self) -> tuple[int, ...]:
        ids = [self.eot_id]
        eos = getattr(self.tokenizer, "eos_token_id", None)
        if isinstance(eos, int) and eos not in ids:
            ids.append(eos)
        path = getattr(self.tokenizer, "name_or_path", "")
        gen_config = Path(path) / "generation_config.json" if path else None
        if gen_config is not None and gen_config.is_file():
            try:
                cfg = json.loads(gen_config.read_text())
            except (OSError, ValueError):
                cfg = {}
            extra = cfg.get("eos_token_id")
            for tid in extra if isinstance(extra, list) else [extra]:
                if isinstance(tid, int) and tid not in ids:
                    ids.append(tid)
        return tuple(ids)

    def _assistant_closing(self) -> str:
        """What the template emits after an assistant turn's content (ChatML: ``<|im_end|>\\n``)."""
        msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _PROBE}]
        try:
            text = self.render(msgs, None, add_generation_prompt=False)
        except Exception as exc:  # a template that cannot render a plain exchange is unusable
            raise LegorlError(f"the chat template cannot render a user/assistant exchange: {exc}") from exc
        if _PROBE not in text:
            raise LegorlError("the chat template drops assistant content; the proxy cannot use it")
        return text[text.index(_PROBE) + len(_PROBE) :]
