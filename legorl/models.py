"""Offline models: a tokenizer + Qwen3 (dense or MoE) model built locally, in seconds, without network.

No pretrained causal-LM weights are reachable offline, so every test (and a new user) builds one:

* a byte-level BPE tokenizer (full 256-byte alphabet, so no input is ever unknown) trained on the
  Python standard library's own sources, with Qwen's special tokens;
* Qwen3-Instruct-2507's chat template, byte-identical to the copy TRL ships
  (``trl/chat_templates/qwen3_instruct_2507.jinja``), so TRL recognises it (response schema, tool
  calling) — it renders tools, ``<tool_call>`` JSON and ``<tool_response>`` turns, the generation
  prompt is ``<|im_start|>assistant\\n``, and it never re-renders earlier turns (prefix-preserving
  across turns);
* a ``Qwen3ForCausalLM`` or ``Qwen3MoeForCausalLM`` (8 experts, top-2) with random weights.

``warmup`` then trains it briefly on local code (and chat-formatted tool-call examples) so its
distributions are peaked rather than uniform.
"""

from __future__ import annotations

import json
import math
import random
import sysconfig
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from legorl.core.errors import ConfigError

#: Bump when anything below changes what ``init_model`` produces (caches key on it).
MODEL_RECIPE_VERSION = 1

IM_START, IM_END, EOT = "<|im_start|>", "<|im_end|>", "<|endoftext|>"
#: Control tokens: never shown in decoded text with ``skip_special_tokens=True``.
SPECIAL_TOKENS = (EOT, IM_START, IM_END)
#: Format tokens: single ids, but part of the text (as in Qwen's tokenizer), so tool-call parsers see them.
FORMAT_TOKENS = (
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
)

_CORPUS_BYTES = 3_000_000  # tokenizer training text: ~2 s on one core


@dataclass(frozen=True)
class ModelSize:
    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    moe_ffn: int  # per-expert intermediate size


SIZES: dict[str, ModelSize] = {
    # ~5 M dense / ~7.6 M MoE parameters
    "tiny": ModelSize(vocab=8192, hidden=256, layers=4, heads=4, kv_heads=2, ffn=768, moe_ffn=192),
    # ~26 M dense / ~37 M MoE parameters
    "small": ModelSize(vocab=8192, hidden=512, layers=8, heads=8, kv_heads=4, ffn=1280, moe_ffn=320),
}
MAX_POSITIONS = 32768
NUM_EXPERTS, EXPERTS_PER_TOKEN = 8, 2


def chat_template() -> str:
    """The chat template text shipped with legorl (Qwen3-Instruct-2507's, as TRL ships it)."""
    return resources.files("legorl").joinpath("chat_template.jinja").read_text(encoding="utf-8")


def stdlib_python_files() -> list[Path]:
    """The standard library's ``.py`` files, sorted (deterministic order), tests excluded."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [
        p
        for p in root.rglob("*.py")
        if "site-packages" not in p.parts and "test" not in p.parts and "tests" not in p.parts
    ]
    if not files:
        raise ConfigError(f"no Python sources under {root}: cannot train the offline tokenizer")
    return sorted(files)


def local_code(max_bytes: int, *, skip_bytes: int = 0) -> Iterator[str]:
    """Yield source files from the stdlib until ``max_bytes`` are produced (after skipping ``skip_bytes``)."""
    seen = produced = 0
    for path in stdlib_python_files():
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        seen += len(text)
        if seen <= skip_bytes:
            continue
        yield text
        produced += len(text)
        if produced >= max_bytes:
            return


def build_tokenizer(vocab_size: int = 8192) -> Any:
    """Train the byte-level BPE tokenizer and wrap it as a transformers fast tokenizer."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(SPECIAL_TOKENS) - len(FORMAT_TOKENS),
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(local_code(_CORPUS_BYTES), trainer=trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in FORMAT_TOKENS])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=EOT,
        chat_template=chat_template(),
        model_max_length=MAX_POSITIONS,
        clean_up_tokenization_spaces=False,
    )


def build_config(tokenizer: Any, *, moe: bool, size: str) -> Any:
    """The Qwen3 / Qwen3-MoE config for ``size`` with the tokenizer's exact vocabulary.

    The vocabulary is not padded: a random model must never sample an id the tokenizer cannot decode.
    """
    from transformers import Qwen3Config, Qwen3MoeConfig

    if size not in SIZES:
        raise ConfigError(f"unknown model size {size!r}: choose one of {', '.join(SIZES)}")
    s = SIZES[size]
    common: dict[str, Any] = dict(
        vocab_size=len(tokenizer),
        hidden_size=s.hidden,
        num_hidden_layers=s.layers,
        num_attention_heads=s.heads,
        num_key_value_heads=s.kv_heads,
        head_dim=s.hidden // s.heads,
        max_position_embeddings=MAX_POSITIONS,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.convert_tokens_to_ids(IM_END),
        pad_token_id=tokenizer.convert_tokens_to_ids(EOT),
        torch_dtype="float32",
    )
    if moe:
        return Qwen3MoeConfig(
            **common,
            intermediate_size=s.ffn,
            moe_intermediate_size=s.moe_ffn,
            num_experts=NUM_EXPERTS,
            num_experts_per_tok=EXPERTS_PER_TOKEN,
            norm_topk_prob=True,  # as in the released Qwen3-MoE models
            decoder_sparse_step=1,
            mlp_only_layers=[],
        )
    return Qwen3Config(**common, intermediate_size=s.ffn)


def init_model(out_dir: Path, *, moe: bool = False, size: str = "tiny", seed: int = 0) -> Path:
    """Build tokenizer + chat template + random-weight model into ``out_dir`` (seconds, no network)."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    out_dir = Path(out_dir)
    if size not in SIZES:
        raise ConfigError(f"unknown model size {size!r}: choose one of {', '.join(SIZES)}")
    tokenizer = build_tokenizer(SIZES[size].vocab)
    config = build_config(tokenizer, moe=moe, size=size)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(
        eos_token_id=[config.eos_token_id, config.pad_token_id],
        pad_token_id=config.pad_token_id,
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(tmp)
    model.save_pretrained(tmp)
    (tmp / "legorl_model.json").write_text(
        json.dumps({"recipe_version": MODEL_RECIPE_VERSION, "moe": moe, "size": size, "seed": seed,
                    "parameters": sum(p.numel() for p in model.parameters()), "warmup_steps": 0})
    )
    # Move files in place last, config.json at the very end: its presence marks a complete model.
    for f in sorted(tmp.iterdir(), key=lambda p: p.name == "config.json"):
        f.replace(out_dir / f.name)
    tmp.rmdir()
    return out_dir


def model_info(model_dir: Path) -> dict[str, Any]:
    """legorl's notes about a model it built (empty for models from elsewhere)."""
    p = Path(model_dir) / "legorl_model.json"
    return json.loads(p.read_text()) if p.exists() else {}


# ---------------------------------------------------------------------------------------------------
# warmup: brief next-token training so distributions are not uniform


_TOOL = {
    "type": "function",
    "function": {
        "name": "bash",
        "description": "Run a shell command and return its output.",
        "parameters": {
            "type": "object",
            "properties": {"command": {"type": "string", "description": "the command"}},
            "required": ["command"],
        },
    },
}
_COMMANDS = ["ls", "pwd", "cat README.md", "python -m pytest -q", "git status", "grep -rn TODO .",
             "ls src", "cat setup.py", "python main.py", "head -n 20 app.py"]
_ASKS = ["Fix the failing test.", "What files are here?", "Run the tests please.",
         "Find the bug in app.py.", "Show me the README.", "Make the tests pass."]


def chat_examples(tokenizer: Any, n: int, rng: random.Random) -> list[list[int]]:
    """Synthetic tool-calling conversations rendered with the chat template, as token ids."""
    out = []
    for _ in range(n):
        messages: list[dict[str, Any]] = [{"role": "user", "content": rng.choice(_ASKS)}]
        for turn in range(rng.randint(1, 3)):
            cmd = rng.choice(_COMMANDS)
            call_id = f"call_{turn}"
            messages.append({"role": "assistant", "content": "", "tool_calls": [
                {"id": call_id, "type": "function",
                 "function": {"name": "bash", "arguments": json.dumps({"command": cmd})}}]})
            messages.append({"role": "tool", "tool_call_id": call_id, "content": f"$ {cmd}\nok"})
        messages.append({"role": "assistant", "content": "Done."})
        ids = tokenizer.apply_chat_template(messages, tools=[_TOOL], tokenize=True, return_dict=False)
        out.append(list(ids))
    return out


def supervised_steps(
    model: Any, next_loss: Callable[[], Any], *, steps: int, lr: float, max_seconds: float | None = None,
    progress: Callable[[int, float], None] | None = None,
) -> dict[str, float]:
    """The supervised loop warm-ups share: AdamW, 10-step linear warm-up then cosine decay, gradient
    clipping at 1. ``next_loss()`` draws a batch and returns its loss. Leaves the model in eval mode.

    Returns ``{"first_loss", "last_loss", "seconds", "steps"}`` (steps actually taken)."""
    import torch

    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda i: min(1.0, (i + 1) / 10) * 0.5 * (1 + math.cos(math.pi * i / steps))
    )
    t0 = time.perf_counter()
    first = last = float("nan")
    done = 0
    for step in range(steps):
        if max_seconds is not None and step > 0 and time.perf_counter() - t0 > max_seconds:
            break
        loss = next_loss()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        last = float(loss.detach())
        if step == 0:
            first = last
        done = step + 1
        if progress is not None:
            progress(done, last)
    model.eval()
    return {"first_loss": first, "last_loss": last, "seconds": time.perf_counter() - t0, "steps": done}


def warmup(
    model_dir: Path,
    *,
    steps: int = 200,
    seq_len: int = 256,
    batch_size: int = 8,
    lr: float = 1e-3,
    chat_fraction: float = 0.25,
    seed: int = 0,
    max_seconds: float | None = None,
    progress: Callable[[int, float], None] | None = None,
) -> dict[str, float]:
    """Next-token training on local code (+ ``chat_fraction`` of tool-call chats); saves in place.

    Stops after ``steps`` or once ``max_seconds`` have passed, whichever is first. Returns
    ``{"first_loss", "last_loss", "seconds", "tokens", "steps"}``. CPU: ~0.5–3 k tokens/s for tiny.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model_dir = Path(model_dir)
    if steps < 1:
        raise ConfigError(f"warmup steps must be >= 1, got {steps}")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    rng = random.Random(seed)
    torch.manual_seed(seed)

    need = steps * batch_size * seq_len
    code: list[int] = []
    eot: int = tokenizer.pad_token_id  # <|endoftext|> separates documents
    for text in local_code(max_bytes=max(need * 4, 200_000), skip_bytes=_CORPUS_BYTES):
        code.extend(tokenizer(text, add_special_tokens=False)["input_ids"])
        code.append(eot)
        if len(code) >= need:
            break
    chats = chat_examples(tokenizer, 256, rng)
    pad = tokenizer.pad_token_id

    def batch() -> tuple[torch.Tensor, torch.Tensor]:
        rows, labels = [], []
        for _ in range(batch_size):
            if rng.random() < chat_fraction:
                ids = rng.choice(chats)[:seq_len]
                lab = ids + [-100] * (seq_len - len(ids))
                ids = ids + [pad] * (seq_len - len(ids))
            else:
                start = rng.randrange(0, max(1, len(code) - seq_len))
                ids = code[start : start + seq_len]
                ids = ids + [pad] * (seq_len - len(ids))
                lab = list(ids)
            rows.append(ids)
            labels.append(lab)
        return torch.tensor(rows), torch.tensor(labels)

    def next_loss() -> torch.Tensor:
        x, y = batch()
        return model(input_ids=x, labels=y).loss

    stats = supervised_steps(model, next_loss, steps=steps, lr=lr, max_seconds=max_seconds, progress=progress)
    first, last, seconds, done = stats["first_loss"], stats["last_loss"], stats["seconds"], int(stats["steps"])
    model.save_pretrained(model_dir)
    info = model_info(model_dir)
    info["warmup_steps"] = int(info.get("warmup_steps", 0)) + done
    info["warmup_loss"] = last
    (model_dir / "legorl_model.json").write_text(json.dumps(info))
    return {"first_loss": first, "last_loss": last, "seconds": seconds, "tokens": done * batch_size * seq_len,
            "steps": done}
