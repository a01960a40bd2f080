"""Tool-call parsers, one per model family, behind a registry.

A parser turns the text a model sampled into ``content`` plus tool calls. Malformed tool-call
text is never an error for the caller: the whole text comes back as plain content and the
problem is reported in ``error`` (recorded on the call as ``parse_error``).

Adding a family: subclass :class:`ToolParser`, set ``start_marker`` (the text that opens a tool
call, used to hold streamed content back) and register it with :func:`register`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, ClassVar

from legorl.proxy.validate import SURROGATE_ESCAPE, without_lone_surrogates


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any]
    id: str = ""

    def arguments_json(self) -> str:
        return json.dumps(self.arguments, ensure_ascii=False)


@dataclass
class ParsedOutput:
    content: str
    tool_calls: list[ToolCall] = field(default_factory=list)
    error: str | None = None


class ToolParser:
    """Base: no tool calls, everything is content."""

    name: ClassVar[str] = "none"
    start_marker: ClassVar[str | None] = None

    def parse(self, text: str) -> ParsedOutput:
        return ParsedOutput(content=text)


class HermesParser(ToolParser):
    """Qwen / Hermes: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks.

    Content is the text before the first block (a trailing newline, which the template itself
    inserts between content and a call, is removed). Text after the last block is ignored, as in
    vLLM's hermes parser.
    """

    name = "hermes"
    start_marker = "<tool_call>"
    end_marker = "</tool_call>"
    _block = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

    def parse(self, text: str) -> ParsedOutput:
        first = text.find(self.start_marker)
        if first < 0:
            return ParsedOutput(content=text)
        blocks = self._block.findall(text, first)
        opened = text.count(self.start_marker, first)
        if not blocks or len(blocks) != opened:
            return ParsedOutput(content=text, error="unterminated <tool_call> block")
        calls: list[ToolCall] = []
        for i, raw in enumerate(blocks):
            try:
                obj = _loads(raw)
            except ValueError as exc:
                return ParsedOutput(content=text, error=f"tool call {i}: invalid JSON ({exc})")
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
                return ParsedOutput(content=text, error=f"tool call {i}: no string 'name'")
            args = obj.get("arguments", obj.get("parameters", {}))
            if isinstance(args, str):
                try:
                    args = _loads(args)
                except ValueError:
                    return ParsedOutput(content=text, error=f"tool call {i}: arguments are not JSON")
            if args is None:
                args = {}
            if not isinstance(args, dict):
                return ParsedOutput(content=text, error=f"tool call {i}: arguments are not an object")
            calls.append(ToolCall(name=obj["name"], arguments=args))
        content = text[:first]
        if content.endswith("\n"):
            content = content[:-1]
        return ParsedOutput(content=content, tool_calls=calls)


def _loads(raw: str) -> Any:
    """JSON the model sampled, with any lone surrogate it spelled (``\\ud800``) made U+FFFD."""
    obj = json.loads(raw)
    return without_lone_surrogates(obj) if SURROGATE_ESCAPE.search(raw) else obj


_REGISTRY: dict[str, type[ToolParser]] = {}


def register(parser: type[ToolParser], *aliases: str) -> None:
    for key in (parser.name, *aliases):
        _REGISTRY[key] = parser


register(ToolParser)
register(HermesParser, "qwen", "qwen2", "qwen3")


def get_parser(name: str) -> ToolParser:
    try:
        return _REGISTRY[name]()
    except KeyError:
        from legorl.core.errors import ConfigError

        raise ConfigError(f"unknown tool-call parser {name!r}; known: {', '.join(sorted(_REGISTRY))}") from None


def detect_parser(chat_template: str) -> ToolParser:
    """Pick the parser a chat template implies (the template shows the model its call format)."""
    if "<tool_call>" in chat_template:
        return HermesParser()
    return ToolParser()
