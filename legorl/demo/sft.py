"""A short supervised warm-up on a harness's exact conversation for the demo tasks.

Each example is the conversation one harness holds for one demo task, rendered with the model's own
chat template and the harness's own system prompt, first message and tool — the same tokens the
proxy will render at rollout time. Two formats (:class:`AgentFormat`):

- ``simple`` (legorl's driver): system (+ the bash tool) → user: the statement → assistant:
  ``bash {"command": "sed -i 's/a [-+] b/a + b/' calc.py"}`` → tool: exit code 0 → assistant: DONE;
- ``mini-swe-agent`` (unmodified, driven by a config file such as
  ``examples/cpu-demo/mini-swe-agent.yaml``): its system and instance templates rendered the way
  it renders them (Jinja, StrictUndefined), its own ``bash`` tool schema read from the installed
  harness, and one tool call that edits and submits: ``sed ... && echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT``.

The loss is on the assistant turns only. The demonstrator is deliberately imperfect: a
``Confusion`` says, per (kind, wanted operator) cell, how often it writes the wrong operator; that
sets the solve rate the RL loop starts from (see ``examples/cpu-demo/README.md``).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from legorl.core.errors import ConfigError
from legorl.demo.taskgen import DemoTask
from legorl.harnesses.simple import BASH_TOOL, SYSTEM_PROMPT, tool_result
from legorl.models import supervised_steps

FINAL_ANSWER = "DONE"
SUBMIT = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"  # mini-swe-agent ends the episode on this output


def _call(command: str) -> dict[str, Any]:
    return {"id": "call_0", "type": "function",
            "function": {"name": "bash", "arguments": json.dumps({"command": command})}}


@dataclass(frozen=True)
class AgentFormat:
    """How a harness holds a demo conversation: its system prompt, its first user message for a
    statement, its tools, and whether a demonstration submits inside its one command."""

    harness: str
    system: str
    instance: str  # the first user message, with "{task}" where the statement goes
    tools: tuple[dict[str, Any], ...]
    submit_in_command: bool  # mini-swe-agent: `CMD && echo COMPLETE_...`; simple: a final "DONE" reply

    def first_messages(self, statement: str) -> list[dict[str, Any]]:
        return [{"role": "system", "content": self.system},
                {"role": "user", "content": self.instance.replace("{task}", statement)}]

    def conversation(self, task: DemoTask, command: str | None = None) -> list[dict[str, Any]]:
        """The conversation for ``task`` when the model runs ``command`` (default: the fix)."""
        command = command or task.fix_command
        if self.submit_in_command:
            return [*self.first_messages(task.statement),
                    {"role": "assistant", "content": "", "tool_calls": [_call(f"{command} && {SUBMIT}")]}]
        return [*self.first_messages(task.statement),
                {"role": "assistant", "content": "", "tool_calls": [_call(command)]},
                {"role": "tool", "tool_call_id": "call_0", "content": tool_result(0, "")},
                {"role": "assistant", "content": FINAL_ANSWER}]


SIMPLE = AgentFormat("simple", SYSTEM_PROMPT, "{task}", (BASH_TOOL,), submit_in_command=False)


def mini_swe_agent_format(config: Path, python: str | None = None) -> AgentFormat:
    """mini-swe-agent's conversation under ``config`` (its YAML): the templates rendered as the agent
    renders them, and the tool schema of the installed harness (``python`` = its interpreter)."""
    import jinja2
    import yaml

    try:
        agent = (yaml.safe_load(Path(config).read_text()) or {})["agent"]
        jinja = jinja2.Environment(undefined=jinja2.StrictUndefined)
        system = jinja.from_string(agent["system_template"]).render()
        marker = "\x00TASK\x00"
        instance = jinja.from_string(agent["instance_template"]).render(task=marker).replace(marker, "{task}")
    except (OSError, KeyError, TypeError, yaml.YAMLError, jinja2.TemplateError) as e:
        raise ConfigError(f"{config}: not a mini-swe-agent config the demo can render "
                          f"(agent.system_template / agent.instance_template using only {{{{task}}}}): {e}") from e
    if python is None:
        from legorl.harnesses.install import require

        python = require("mini-swe-agent").python
    probe = ("import json; from minisweagent.models.utils.actions_toolcall import BASH_TOOL; "
             "print(json.dumps(BASH_TOOL))")
    env = dict(os.environ, MSWEA_SILENT_STARTUP="1", LITELLM_LOCAL_MODEL_COST_MAP="True")
    out = subprocess.run([python or "python", "-c", probe], capture_output=True, text=True, timeout=120, env=env)
    lines = out.stdout.strip().splitlines()
    if out.returncode != 0 or not lines:
        raise ConfigError(f"could not read mini-swe-agent's bash tool from {python}: {out.stderr.strip()[-300:]}")
    return AgentFormat("mini-swe-agent", system, instance, (json.loads(lines[-1]),), submit_in_command=True)


def conversation(task: DemoTask, command: str | None = None) -> list[dict[str, Any]]:
    """The ``simple`` driver's conversation for ``task`` when the model runs ``command`` (default: the fix)."""
    return SIMPLE.conversation(task, command)


@dataclass
class Example:
    token_ids: list[int]
    loss_mask: list[int]  # 1 on assistant tokens (what the policy samples)


def render(tokenizer: Any, messages: list[dict[str, Any]], tools: Sequence[dict[str, Any]] = (BASH_TOOL,)) -> Example:
    """Token ids of the whole conversation and a mask over its assistant turns.

    Assistant spans are found by rendering each prefix that ends just before an assistant turn with
    the generation prompt: the assistant's tokens are what lies between that and the next prefix
    (its ``<|im_end|>`` included, the newline after it not: the proxy puts that in the next prompt).
    """
    ids: list[int] = tokenizer.apply_chat_template(messages, tools=list(tools), tokenize=True, return_dict=False)
    mask = [0] * len(ids)
    end_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start = len(tokenizer.apply_chat_template(messages[:i], tools=list(tools), tokenize=True,
                                                  return_dict=False, add_generation_prompt=True))
        stop = ids.index(end_id, start) + 1
        for j in range(start, stop):
            mask[j] = 1
    return Example(list(ids), mask)


@dataclass(frozen=True)
class Confusion:
    """How often the demonstrator writes the wrong operator: ``rate`` in the ``confused`` cells
    (``(kind, wanted operator)`` pairs, e.g. ``("flip", "+")``), never elsewhere. A crisp lookup with
    a few cells mostly reversed is what a short warm-up learns reliably (a uniform error rate over
    every cell leaves only a weak word-operator correlation, measured: choices near 50/50)."""

    confused: frozenset[tuple[str, str]] = frozenset()
    rate: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.rate <= 1.0:
            raise ConfigError(f"the demonstrator's wrong rate must be in [0, 1], got {self.rate}")

    def wrong_rate(self, task: DemoTask) -> float:
        return self.rate if (task.kind, task.right) in self.confused else 0.0

    @classmethod
    def pick(cls, cells: int, rate: float, seed: int) -> Confusion:
        """``cells`` of the four (kind, operator) cells, chosen by ``seed``."""
        from legorl.demo.taskgen import CELLS

        if not 0 <= cells <= len(CELLS):
            raise ConfigError(f"confused cells must be between 0 and {len(CELLS)}, got {cells}")
        return cls(frozenset(random.Random(seed).sample(CELLS, cells)), rate)


def examples(tokenizer: Any, tasks: Sequence[DemoTask], confusion: Confusion = Confusion(), seed: int = 0,
             fmt: AgentFormat = SIMPLE) -> list[Example]:
    """One example per task; ``confusion`` says which demonstrate the edit in the wrong direction."""
    rng = random.Random(seed)
    return [render(tokenizer, fmt.conversation(t, t.reversed_command if rng.random() < confusion.wrong_rate(t)
                                                else None), fmt.tools) for t in tasks]


def train_format(
    model_dir: Path,
    tasks: Sequence[DemoTask],
    *,
    steps: int = 150,
    batch_size: int = 16,
    lr: float = 2e-3,
    confusion: Confusion = Confusion(),
    seed: int = 0,
    progress: Callable[[int, float], None] | None = None,
    fmt: AgentFormat = SIMPLE,
) -> dict[str, float]:
    """Supervised training on ``fmt``'s conversation for ``tasks``; saves the model in place.

    ``confusion`` makes the demonstrator imperfect: the model learns the format and the lookup from
    words to operators, mostly reversed in the confused cells — only the hidden tests' rewards say
    which operator is right.

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
    data = examples(tokenizer, tasks, confusion, seed, fmt)
    rng = random.Random(seed)
    torch.manual_seed(seed)
    pad = int(tokenizer.pad_token_id)
    stats = supervised_steps(
        model, lambda: batch_loss(model, [data[rng.randrange(len(data))] for _ in range(batch_size)], pad),
        steps=steps, lr=lr, progress=progress,
    )
    first, last, seconds = stats["first_loss"], stats["last_loss"], stats["seconds"]
    model.save_pretrained(model_dir)
    info_path = model_dir / "legorl_model.json"
    info = json.loads(info_path.read_text()) if info_path.exists() else {}
    info["demo_sft"] = {"harness": fmt.harness, "steps": steps, "batch_size": batch_size, "lr": lr, "seed": seed, "examples": len(data),
                        "confused": sorted(map(list, confusion.confused)), "wrong_rate": confusion.rate,
                        "last_loss": last}
    info_path.write_text(json.dumps(info))
    return {"first_loss": first, "last_loss": last, "seconds": seconds, "steps": steps, "examples": len(data)}


def shared_prefix(batch: Sequence[Example]) -> int:
    """How many leading tokens every example of ``batch`` shares, stopping before the first token
    that is trained on (its logit must come from the batched part)."""
    first = min(e.loss_mask.index(1) for e in batch)
    n = 0
    head = batch[0].token_ids
    while n < first - 1 and all(e.token_ids[n] == head[n] for e in batch):
        n += 1
    return n


def batch_loss(model: Any, batch: Sequence[Example], pad: int) -> Any:
    """Mean next-token loss over the masked tokens of ``batch``: the same number as a padded full
    forward pass, but the prefix every example shares (system prompt and tool schema, ~3/4 of each
    example) runs once and its KV cache is repeated across the batch, gradient included."""
    import torch

    p = shared_prefix(batch)
    b = len(batch)
    prefix = torch.tensor([batch[0].token_ids[:p]])
    out = model(input_ids=prefix, use_cache=True)
    cache = out.cache if "cache" in out else out.past_key_values  # transformers >= 5.2x names it `cache`
    cache.batch_repeat_interleave(b)
    rest = [e.token_ids[p:] for e in batch]
    width = max(len(r) for r in rest)
    x = torch.tensor([r + [pad] * (width - len(r)) for r in rest])
    attention = torch.tensor([[1] * (p + len(r)) + [0] * (width - len(r)) for r in rest])
    positions = torch.arange(p, p + width).unsqueeze(0).expand(b, -1)
    kwarg = "cache" if "cache" in out else "past_key_values"
    logits = model(input_ids=x, attention_mask=attention, position_ids=positions, use_cache=True,
                   **{kwarg: cache}).logits.float()
    # logits[:, i] predicts token p + i + 1
    mask = torch.tensor([e.loss_mask[p + 1:] + [0] * (width - len(e.token_ids) + p) for e in batch],
                        dtype=torch.float32)
    targets = torch.cat([x[:, 1:], torch.full((b, 1), pad)], dim=1)
    mask = torch.cat([mask, torch.zeros(b, 1)], dim=1)[:, :width]
    nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                            reduction="none").reshape(b, width)
    return (nll * mask).sum() / mask.sum()
