"""What the load suite checks in each finished session's capture (the JSON ``/finish`` returns).

- isolation: the tokens and messages hold exactly one nonce, the session's own;
- shape: the calls and segments the client style produces, and the capture is what the chat
  template renders for the conversation (token identity with the scripted engine);
- fidelity (real model): an independent forward pass over each segment reproduces the logprob
  recorded for every loss-masked token, as tests/test_proxy_fidelity.py checks.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import torch
from load_traffic import NONCE, prompts
from proxy_support import TOOLS

from legorl.engines.embedded import process_logits
from legorl.proxy.render import ChatRenderer


def nonces_seen(capture: dict[str, Any], renderer: ChatRenderer) -> set[str]:
    """Every session nonce in the capture's tokens (decoded) and its messages."""
    seen: set[str] = set()
    for seg in capture["segments"]:
        seen |= set(NONCE.findall(renderer.decode(seg["token_ids"])))
    seen |= set(NONCE.findall(json.dumps(capture["messages"], ensure_ascii=False)))
    return seen


def check_shape(capture: dict[str, Any], kind: str, nonce: str, renderer: ChatRenderer, tools: bool,
                exact: bool) -> None:
    """The calls, segments and conversation this client style must leave (see load_traffic.KINDS)."""
    calls, segs, msgs = capture["calls"], capture["segments"], capture["messages"]
    where = (kind, nonce)
    masked = sum(sum(s["loss_mask"]) for s in segs)
    assert masked == sum(c["completion_tokens"] for c in calls) > 0, where
    if kind == "disconnect":  # the dropped call, its retry (a rewrite: it drops the reply), turn two
        assert len(calls) == 3 and [c["segment"] for c in calls] == [0, 1, 1], (where, calls)
        assert [s["reason"] for s in segs] == ["main", "rewrite"], where
    else:
        assert len(calls) == 2 and [c["segment"] for c in calls] == [0, 0], (where, calls)
        assert [s["reason"] for s in segs] == ["main"], where
    seg = segs[-1]
    assert f"Session {nonce}:" in msgs[1]["content"] and msgs[-1]["role"] == "assistant", where
    rendered = renderer.render(msgs, TOOLS if tools else None, add_generation_prompt=False)
    # A random model may end a turn with <|endoftext|> (also a stop token): the segment keeps it
    # (it is what was sampled) and the proxy closes the turn with <|im_end|> as the template does.
    text = renderer.decode(seg["token_ids"]).replace("<|endoftext|><|im_end|>", "<|im_end|>")
    text = text.removesuffix("<|endoftext|>")
    at = next((k for k, (a, b) in enumerate(zip(rendered, text, strict=False)) if a != b), len(text))
    assert rendered.startswith(text) and rendered[len(text):] in ("\n", "<|im_end|>\n"), (
        where, at, text[at - 30 : at + 30], rendered[at - 30 : at + 30])
    if exact:  # scripted replies: the tool call, then the text the tool result asked for
        p = prompts(nonce)
        assert "tool_calls" in msgs[2], (where, msgs[2])
        assert msgs[2]["tool_calls"][0]["function"]["arguments"] == json.dumps({"command": p.expected_command})
        assert msgs[-1]["content"] == p.expected_reply, where
        assert seg["token_ids"] == renderer.encode(rendered)[: len(seg["token_ids"])], where
        assert all(lp == 0.0 for s in segs for lp, m in zip(s["logprobs"], s["loss_mask"], strict=True) if m)


def recomputed_logprobs(model: Any, segments: list[dict[str, Any]]) -> tuple[np.ndarray, np.ndarray]:
    """(forward-pass logprob, recorded logprob) of every loss-masked token of ``segments`` (sampled
    at temperature 1, top-p 1: the load traffic sets neither)."""
    ours, recorded = [], []
    for seg in segments:
        ids = torch.tensor([seg["token_ids"]])
        with torch.no_grad():
            logits = model(ids).logits[0]
        lp = process_logits(logits[:-1], 1.0, 0, 1.0).gather(1, ids[0, 1:, None])[:, 0].numpy()
        mask = np.array(seg["loss_mask"][1:], dtype=bool)
        ours.append(lp[mask].astype(np.float64))
        recorded.append(np.array(seg["logprobs"][1:], dtype=np.float64)[mask])
    return np.concatenate(ours), np.concatenate(recorded)
