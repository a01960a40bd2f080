"""Chat-template rendering of canonical messages into text and token ids.

The proxy renders every request's *whole* conversation with the model's own chat template (as
text), and relies on the template being prefix-preserving to find the part that is new since the
session's last turn; only that suffix is tokenized. Previously sampled assistant turns are never
re-tokenized: the session keeps the exact sampled ids and appends after them.

The seam between a sampled turn and the next prompt is the template's *closing* of an assistant
turn (for ChatML ``<|im_end|>\\n``). When the sampled ids end with the end-of-turn token, only what
follows it in the closing is added (``\\n``); when generation stopped for another reason (length,
a stop string) the whole closing is added, so the model always sees a well-formed turn boundary.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from legorl.errors import LegorlError

_PROBE = "\x00LEGORL-PROBE\x00"


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

    # ------------------------------------------------------------------ tokens

    def encode(self, text: str) -> list[int]:
        if self._backend is not None:
            return list(self._backend.encode(text, add_special_tokens=False).ids)
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        if self._backend is not None:
            return str(self._backend.decode(list(ids), skip_special_tokens=False))
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=False))

    def bridge(self, sampled_ids: Sequence[int]) -> str:
        """Text to add after a sampled turn so it is closed the way the template closes turns."""
        if sampled_ids and sampled_ids[-1] == self.eot_id and self.closing.startswith(self.eot_text):
            return self.closing[len(self.eot_text) :]
        return self.closing

    # ------------------------------------------------------------------ setup

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
