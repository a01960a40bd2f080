"""A short supervised warm-up on the ``simple`` driver's exact conversation.

Each example is the conversation the driver holds for one demo task, rendered with the model's own
chat template and the driver's own system prompt and tool — the same tokens the proxy will render
at rollout time:

    system (+ the bash tool)  →  user: problem statement
    assistant: <tool_call> bash {"command": "sed -i 's/OLD/NEW/' FILE"} </tool_call>
    tool: exit code 0
    assistant: DONE

The loss is on the assistant turns only. A few hundred steps teach the format and, imperfectly,
the copying of file name and code out of the statement; how many steps decides the solve rate
the RL loop starts from (see ``examples/cpu-demo/README.md``).
"""

from __future__ import annotations

import json
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from legorl.demo.taskgen import DemoTask
from legorl.errors import ConfigError
from legorl.harnesses.simple import BASH_TOOL, SYSTEM_PROMPT, tool_result

FINAL_ANSWER = "DONE"


def conversation(task: DemoTask, command: str | None = None) -> list[dict[str, Any]]:
    """The driver's conversation for ``task`` when the model runs ``command`` (default: the fix)."""
    command = command or task.fix_command
    call = {"id": "call_0", "type": "function",
            "function": {"name": "bash", "arguments": json.dumps({"command": command})}}
    return [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": task.statement},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_0", "content": tool_result(0, "")},
        {"role": "assistant", "content": FINAL_ANSWER},
    ]


@dataclass
class Example:
    token_ids: list[int]
    loss_mask: list[int]  # 1 on assistant tokens (what the policy samples)


def render(tokenizer: Any, messages: list[dict[str, Any]]) -> Example:
    """Token ids of the whole conversation and a mask over its assistant turns.

    Assistant spans are found by rendering each prefix that ends just before an assistant turn with
    the generation prompt: the assistant's tokens are what lies between that and the next prefix
    (its ``<|im_end|>`` included, the newline after it not: the proxy puts that in the next prompt).
    """
    ids: list[int] = tokenizer.apply_chat_template(messages, tools=[BASH_TOOL], tokenize=True, return_dict=False)
    mask = [0] * len(ids)
    end_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start = len(tokenizer.apply_chat_template(messages[:i], tools=[BASH_TOOL], tokenize=True,
                                                  return_dict=False, add_generation_prompt=True))
        stop = ids.index(end_id, start) + 1
        for j in range(start, stop):
            mask[j] = 1
    return Example(list(ids), mask)


def examples(tokenizer: Any, tasks: Sequence[DemoTask]) -> list[Example]:
    return [render(tokenizer, conversation(t)) for t in tasks]


def train_format(
    model_dir: Path,
    tasks: Sequence[DemoTask],
    *,
    steps: int = 150,
    batch_size: int = 16,
    lr: float = 2e-3,
    seed: int = 0,
    progress: Callable[[int, float], None] | None = None,
) -> dict[str, float]:
    """Supervised training on the driver's conversation for ``tasks``; saves the model in place.

    Returns ``{"first_loss", "last_loss", "seconds", "steps", "examples"}``.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    if steps < 1 or batch_size < 1:
        raise ConfigError(f"warm-up steps and batch size must be >= 1, got {steps} and {batch_size}")
    hf_logging.disable_progress_bar()
    model_dir = Path(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    data = examples(tokenizer, tasks)
    rng = random.Random(seed)
    torch.manual_seed(seed)
    pad = tokenizer.pad_token_id
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda i: min(1.0, (i + 1) / 10) * 0.5 * (1 + math.cos(math.pi * i / steps)))
    t0 = time.perf_counter()
    first = last = float("nan")
    for step in range(steps):
        batch = [data[rng.randrange(len(data))] for _ in range(batch_size)]
        width = max(len(e.token_ids) for e in batch)
        x = torch.tensor([e.token_ids + [pad] * (width - len(e.token_ids)) for e in batch])
        labels = torch.tensor([[t if m else -100 for t, m in zip(e.token_ids, e.loss_mask, strict=True)]
                               + [-100] * (width - len(e.token_ids)) for e in batch])
        attention = torch.tensor([[1] * len(e.token_ids) + [0] * (width - len(e.token_ids)) for e in batch])
        loss = model(input_ids=x, attention_mask=attention, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        last = float(loss.detach())
        if step == 0:
            first = last
        if progress is not None:
            progress(step + 1, last)
    seconds = time.perf_counter() - t0
    model.eval()
    model.save_pretrained(model_dir)
    info_path = model_dir / "legorl_model.json"
    info = json.loads(info_path.read_text()) if info_path.exists() else {}
    info["demo_sft"] = {"steps": steps, "batch_size": batch_size, "lr": lr, "seed": seed, "examples": len(data),
                        "last_loss": last}
    info_path.write_text(json.dumps(info))
    return {"first_loss": first, "last_loss": last, "seconds": seconds, "steps": steps, "examples": len(data)}
