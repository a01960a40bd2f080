"""The pieces of a request the front ends read alike: the ``messages`` array, function tools, the
sampling parameters, and a message's content parts.

The loops over messages stay inline in each front end: a generator yielding each message cost a
few microseconds a request, on the proxy's hot path."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from legorl.proxy.validate import BadRequest, json_schema, obj, opt_num, opt_str, req_str


def messages_array(value: Any) -> list[Any]:
    """The request's ``messages``: a required, non-empty array."""
    if not isinstance(value, list):
        raise BadRequest("messages: required array", "messages")
    if not value:
        raise BadRequest("messages: must not be empty", "messages")
    return value


def tool_specs(value: Any) -> Iterator[tuple[str, dict[str, Any]]]:
    """``(tools[i], tool)`` for each tool of the request's ``tools`` (none when it is null)."""
    if value is None:
        return
    if not isinstance(value, list):
        raise BadRequest("tools: expected an array", "tools")
    for i, tool in enumerate(value):
        w = f"tools[{i}]"
        yield w, obj(tool, w)


def function_tool(spec: dict[str, Any], schema_key: str, where: str) -> dict[str, Any]:
    """The canonical tool of a spec holding ``name``, an optional ``description`` and its
    parameters' JSON schema under ``schema_key``; ``where`` prefixes the spec's fields in errors."""
    fn: dict[str, Any] = {"name": req_str(spec, "name", where)}
    desc = opt_str(spec, "description", where)
    if desc is not None:
        fn["description"] = desc
    fn["parameters"] = json_schema(spec.get(schema_key), where + schema_key)
    return {"type": "function", "function": fn}


def temperature_and_top_p(body: dict[str, Any], max_temperature: float) -> tuple[float, float]:
    """``temperature`` in [0, max_temperature] and ``top_p`` in (0, 1], each 1.0 when absent."""
    temperature = opt_num(body, "temperature", lo=0.0, hi=max_temperature)
    top_p = opt_num(body, "top_p", lo=0.0, hi=1.0, lo_open=True)
    return 1.0 if temperature is None else temperature, 1.0 if top_p is None else top_p


def content_text(value: Any, where: str) -> str:
    """A message's text: a string, or its text parts joined by newlines (images as ``[image]``)."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        parts = []
        for i, part in enumerate(value):
            if isinstance(part, str):
                parts.append(part)
                continue
            p = obj(part, f"{where}[{i}]")
            kind = p.get("type")
            if kind in ("text", "input_text", "output_text"):
                parts.append(req_str(p, "text", f"{where}[{i}]."))
            elif kind in ("image_url", "input_image", "image"):
                parts.append("[image]")
            elif not isinstance(kind, str):
                raise BadRequest(f"{where}[{i}].type: required string", f"{where}[{i}].type")
        return "\n".join(parts)
    raise BadRequest(f"{where}: expected a string or an array of content parts", where)
