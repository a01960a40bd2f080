"""Shared pieces of the proxy tests: a scripted engine steered by the prompt, tools, replies, and
the proxies they run against (import a fixture by name into a test module to use it there)."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from legorl.engines.scripted import ScriptedCall, ScriptedEngine
from legorl.proxy.server import ProxyServer

BASH = {
    "type": "function",
    "function": {
        "name": "bash",
        "description": "Run a shell command.",
        "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]},
    },
}
TOOLS = [BASH]
ANTHROPIC_TOOLS = [{"name": "bash", "description": "Run a shell command.",
                    "input_schema": BASH["function"]["parameters"]}]

_DIRECTIVE = re.compile(r"<<reply:(.*?):reply>>", re.DOTALL)


def say(text: str, times: int = 1) -> str:
    """A directive for the scripted engine: the reply to a prompt ending with it is ``text * times``."""
    return "<<reply:" + json.dumps(text if times == 1 else [text, times]) + ":reply>>"


def tool_call_text(name: str, args: dict[str, Any], content: str = "") -> str:
    """What the Qwen template renders for an assistant tool call (so token identity can hold)."""
    call = '<tool_call>\n{"name": "' + name + '", "arguments": ' + json.dumps(args) + "}\n</tool_call>"
    return (content + "\n" + call) if content else call


def call_bash(command: str, content: str = "") -> str:
    return say(tool_call_text("bash", {"command": command}, content))


def _reply(call: ScriptedCall) -> str:
    found = _DIRECTIVE.findall(call.prompt_text)
    if not found:
        return "ok"
    value = json.loads(found[-1])
    return value if isinstance(value, str) else value[0] * value[1]


def scripted_engine(tokenizer: Any, name: str = "scripted", max_context: int | None = None) -> ScriptedEngine:
    """Replies with the text of the last ``say(...)`` directive in the prompt (else ``ok``)."""
    return ScriptedEngine(tokenizer, _reply, name=name, max_context=max_context)


def oa(proxy: Any, sid: str) -> Any:
    """The official OpenAI client on one session of a ProxyServer (no retries: errors show at once)."""
    import openai

    return openai.OpenAI(base_url=proxy.openai_base_url(sid), api_key="x", max_retries=0)


def an(proxy: Any, sid: str) -> Any:
    """The official Anthropic client on one session of a ProxyServer."""
    import anthropic

    return anthropic.Anthropic(base_url=proxy.anthropic_base_url(sid), api_key="x", max_retries=0)


@contextmanager
def scripted_proxy(tokenizer: Any, **options: Any) -> Iterator[ProxyServer]:
    """A running ProxyServer on :func:`scripted_engine`."""
    with ProxyServer(scripted_engine(tokenizer), tokenizer, **options) as server:
        yield server


@contextmanager
def embedded_proxy(model: Path) -> Iterator[ProxyServer]:
    """A running ProxyServer on the embedded engine running ``model`` (closed after it)."""
    from legorl.engines.embedded import EmbeddedEngine

    engine = EmbeddedEngine(model)
    with ProxyServer(engine, model) as server:
        yield server
    asyncio.run(engine.close())


@pytest.fixture(scope="module")
def tokenizer(tiny_model: Path) -> Any:
    return AutoTokenizer.from_pretrained(tiny_model)


@pytest.fixture(scope="module")
def proxy(tokenizer: Any) -> Iterator[ProxyServer]:
    """The proxy on the scripted engine."""
    with scripted_proxy(tokenizer) as server:
        yield server


@pytest.fixture(scope="module")
def real_proxy(tiny_model: Path) -> Iterator[ProxyServer]:
    """The proxy on the embedded tiny model."""
    with embedded_proxy(tiny_model) as server:
        yield server
