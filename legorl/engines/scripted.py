"""The scripted engine: fixed completion texts replayed through the Engine interface.

For harness and pipeline tests that need a deterministic success path (the right tool call, then a
final answer) without a trained model. Texts are tokenized with the model's tokenizer and returned
as token ids with logprob 0.0; the real engines are tested separately.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from legorl.core.errors import ConfigError, LegorlError
from legorl.engines.base import Generation, SamplingParams, TokenChunk


@dataclass(frozen=True)
class ScriptedCall:
    """What a completion function sees: the call's position, its prompt ids and their text."""

    index: int
    prompt_ids: list[int]
    prompt_text: str


Completions = Sequence[str] | Callable[[ScriptedCall], str]


class ScriptedEngine:
    """Replays ``completions`` in order (or asks a function for each call).

    A completion that does not end with an EOS token gets the tokenizer's EOS appended (so the
    proxy sees a normal ``stop``); ``max_tokens`` truncates (``length``). Running past the end of a
    list raises unless ``cycle=True``.
    """

    def __init__(
        self,
        tokenizer: Any,
        completions: Completions,
        *,
        name: str = "scripted",
        max_context: int | None = None,
        cycle: bool = False,
    ):
        if isinstance(tokenizer, str | Path):
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(tokenizer)
        if not callable(completions) and len(completions) == 0:
            raise ConfigError("scripted engine needs at least one completion")
        self.tokenizer = tokenizer
        self.completions = completions
        self.name = name
        limit = getattr(tokenizer, "model_max_length", None) or 32768
        self.max_context = int(max_context or min(int(limit), 1 << 20))
        self.cycle = cycle
        self.calls: list[ScriptedCall] = []
        self.loaded: list[str] = []
        self.eos_token_ids: tuple[int, ...] = (tokenizer.eos_token_id,)

    def _text(self, call: ScriptedCall) -> str:
        if callable(self.completions):
            return self.completions(call)
        n = len(self.completions)
        if call.index >= n and not self.cycle:
            raise LegorlError(f"scripted engine ran out of completions: call {call.index + 1}, {n} scripted")
        return self.completions[call.index % n]

    def _generation(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        call = ScriptedCall(len(self.calls), list(prompt_ids), self.tokenizer.decode(prompt_ids))
        self.calls.append(call)
        ids = list(self.tokenizer.encode(self._text(call), add_special_tokens=False))
        stops = set(params.stop_token_ids) | set(self.eos_token_ids)
        if not ids or ids[-1] not in stops:
            ids.append(self.tokenizer.eos_token_id)
        for i, t in enumerate(ids):  # stop at the first stop token, as a real engine would
            if t in stops:
                ids = ids[: i + 1]
                break
        budget = min(params.max_tokens, self.max_context - len(prompt_ids))
        reason = "stop"
        if len(ids) > budget:
            ids, reason = ids[: max(budget, 0)], "length"
        return Generation(token_ids=ids, logprobs=[0.0] * len(ids), finish_reason=reason,
                          prompt_tokens=len(prompt_ids))

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        return self._generation(prompt_ids, params)

    async def stream(self, prompt_ids: list[int], params: SamplingParams) -> AsyncIterator[TokenChunk]:
        gen = self._generation(prompt_ids, params)
        for i, t in enumerate(gen.token_ids):
            last = i == len(gen.token_ids) - 1
            yield TokenChunk(token_ids=[t], logprobs=[0.0], final=gen if last else None)
        if not gen.token_ids:
            yield TokenChunk(token_ids=[], logprobs=[], final=gen)

    async def load_weights(self, path: str) -> None:
        self.loaded.append(path)

    async def close(self) -> None:
        return None
