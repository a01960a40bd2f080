"""The offline model: tokenizer, chat template, config, warmup — all on the real tiny model."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from transformers import AutoConfig, AutoTokenizer

from legorl.core.errors import ConfigError
from legorl.models import (
    FORMAT_TOKENS,
    MODEL_RECIPE_VERSION,
    SPECIAL_TOKENS,
    chat_template,
    model_info,
    warmup,
)

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "bash",
            "description": "Run a command",
            "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]},
        },
    }
]


def conversation() -> list[dict]:
    return [
        {"role": "system", "content": "You are a coding agent."},
        {"role": "user", "content": "List the files, then read README.md."},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "bash", "arguments": json.dumps({"command": "ls"})}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "README.md\nsetup.py"},
        {
            "role": "assistant",
            "content": "Reading it.",
            "tool_calls": [
                {"id": "c2", "type": "function",
                 "function": {"name": "bash", "arguments": json.dumps({"command": "cat README.md"})}},
                {"id": "c3", "type": "function", "function": {"name": "bash", "arguments": {"command": "pwd"}}},
            ],
        },
        {"role": "tool", "tool_call_id": "c2", "content": "# Demo"},
        {"role": "tool", "tool_call_id": "c3", "content": "/repo"},
        {"role": "assistant", "content": "The README says: Demo. ünïcødé ✓"},
        {"role": "user", "content": "Thanks!"},
    ]


@pytest.fixture(scope="module")
def tok(tiny_model: Path):
    return AutoTokenizer.from_pretrained(tiny_model)


def test_special_tokens_are_single_ids_and_bytes_never_unknown(tok) -> None:
    for t in SPECIAL_TOKENS + FORMAT_TOKENS:
        ids = tok.encode(t, add_special_tokens=False)
        assert len(ids) == 1, t
        assert tok.convert_ids_to_tokens(ids[0]) == t
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    assert tok.eos_token_id != tok.pad_token_id
    weird = "naïve 日本語 \x00\x7f 🚀 \t\r\n tabs\u200b"
    assert tok.decode(tok.encode(weird, add_special_tokens=False)) == weird
    # Format tokens survive skip_special_tokens (tool-call parsers need them), control tokens do not.
    text = '<tool_call>\n{"name": "bash"}\n</tool_call><|im_end|>'
    assert tok.decode(tok.encode(text, add_special_tokens=False), skip_special_tokens=True) == text.replace(
        "<|im_end|>", ""
    )


def test_chat_template_renders_tools_and_tool_calls(tok) -> None:
    text = tok.apply_chat_template(conversation(), tools=TOOLS, tokenize=False)
    assert text.startswith("<|im_start|>system\nYou are a coding agent.\n\n# Tools")
    assert json.dumps(TOOLS[0], ensure_ascii=False) in text or '"name": "bash"' in text
    assert '<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call><|im_end|>' in text
    assert '<tool_call>\n{"name": "bash", "arguments": {"command": "pwd"}}\n</tool_call>' in text
    # consecutive tool results share one user turn, as in Qwen's own template
    assert "<|im_start|>user\n<tool_response>\n# Demo\n</tool_response>\n<tool_response>\n/repo\n</tool_response><|im_end|>" in text
    gen = tok.apply_chat_template(conversation()[:2], tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert gen.endswith("<|im_start|>assistant\n")


def test_chat_template_is_prefix_preserving_across_turns(tok) -> None:
    """Every request's prompt + the assistant reply is a token prefix of every later request's prompt."""
    msgs = conversation()
    full = tok.apply_chat_template(msgs, tools=TOOLS, tokenize=True, return_dict=False)
    for i, m in enumerate(msgs):
        if m["role"] != "assistant":
            continue
        prompt = tok.apply_chat_template(msgs[:i], tools=TOOLS, tokenize=True, add_generation_prompt=True,
                                         return_dict=False)
        with_reply = tok.apply_chat_template(msgs[: i + 1], tools=TOOLS, tokenize=True, return_dict=False)
        assert with_reply[: len(prompt)] == prompt
        assert full[: len(with_reply)] == with_reply
        # the reply as the model would sample it ends with <|im_end|>, then the template adds "\n"
        assert tok.decode(with_reply[len(prompt):]).endswith("<|im_end|>\n")


def test_template_is_trls_qwen3_and_trl_parses_tool_calls(tok) -> None:
    from trl.chat_template_utils import add_response_schema, qwen3_instruct_2507_chat_template

    assert chat_template() == qwen3_instruct_2507_chat_template
    assert tok.chat_template == qwen3_instruct_2507_chat_template
    add_response_schema(tok)
    reply = '<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call><|im_end|>'
    parsed = tok.parse_response(reply, prefix="<|im_start|>assistant\n")
    assert parsed["tool_calls"][0]["function"] == {"name": "bash", "arguments": {"command": "ls"}}


def test_model_config(tiny_model: Path, tiny_moe_model: Path, tok) -> None:
    dense = AutoConfig.from_pretrained(tiny_model)
    moe = AutoConfig.from_pretrained(tiny_moe_model)
    assert dense.model_type == "qwen3" and moe.model_type == "qwen3_moe"
    for c in (dense, moe):
        assert c.vocab_size == len(tok)  # never samples an id the tokenizer cannot decode
        assert c.max_position_embeddings >= 8192
        assert c.tie_word_embeddings
        assert c.eos_token_id == tok.eos_token_id
    assert (dense.hidden_size, dense.num_hidden_layers, dense.num_attention_heads, dense.num_key_value_heads,
            dense.intermediate_size) == (256, 4, 4, 2, 768)
    assert (moe.num_experts, moe.num_experts_per_tok, moe.norm_topk_prob) == (8, 2, True)
    info = model_info(tiny_model)
    assert info["recipe_version"] == MODEL_RECIPE_VERSION and 4e6 < info["parameters"] < 7e6


def test_unknown_size_is_a_one_line_error(tmp_path: Path) -> None:
    from legorl.models import init_model

    with pytest.raises(ConfigError, match="unknown model size 'huge'"):
        init_model(tmp_path / "m", size="huge")


def test_warmup_lowers_the_loss(tiny_model: Path, tmp_path: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    model_dir = tmp_path / "m"
    shutil.copytree(tiny_model, model_dir)
    before = AutoModelForCausalLM.from_pretrained(model_dir).model.embed_tokens.weight.clone()
    stats = warmup(model_dir, steps=8, batch_size=2, seq_len=96, lr=5e-3)
    assert stats["last_loss"] < stats["first_loss"] - 0.3, stats
    after = AutoModelForCausalLM.from_pretrained(model_dir).model.embed_tokens.weight
    assert not torch.equal(before, after)
    assert model_info(model_dir)["warmup_steps"] == 8 == stats["steps"]
