"""Calibrate the warm-up without containers: how often does the model's first command fix a task?

A quick offline stand-in for the real loop, used only to choose the warm-up length (the demo's
rewards come from ``learn.py``'s real rollouts and graded tests): sample the first assistant turn
with transformers at temperature 1, run the bash command it asked for in a scratch copy of the
repository, and run the hidden tests with the host's Python.

    python examples/cpu-demo/calibrate.py --model runs/cal/model --tasks 64 --samples 2
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from legorl.demo.sft import conversation
from legorl.demo.taskgen import DemoTask, generate
from legorl.harnesses.simple import BASH_TOOL

_CALL = re.compile(r"<tool_call>\s*(\{.*\})\s*</tool_call>", re.DOTALL)


def solved(task: DemoTask, text: str) -> bool:
    match = _CALL.search(text)
    if not match:
        return False
    try:
        command = json.loads(match.group(1))["arguments"]["command"]
    except (ValueError, KeyError, TypeError):
        return False
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / task.filename).write_text(task.source)
        (Path(tmp) / task.test_filename).write_text(task.tests)
        subprocess.run(["bash", "-c", command], cwd=tmp, capture_output=True, timeout=10)
        check = ("import sys; sys.path.insert(0, '.'); import " + task.test_filename[:-3] + " as t\n"
                 "[getattr(t, n)() for n in dir(t) if n.startswith('test_')]")
        return subprocess.run([sys.executable, "-c", check], cwd=tmp, capture_output=True, timeout=10).returncode == 0


def solve_rate(model_dir: Path, tasks: list[DemoTask], samples: int, seed: int = 0) -> float:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    torch.manual_seed(seed)
    wins = total = 0
    for task in tasks:
        ids = tok.apply_chat_template(conversation(task)[:2], tools=[BASH_TOOL], add_generation_prompt=True,
                                      tokenize=True, return_dict=False)
        prompt = torch.tensor([list(ids)])
        with torch.no_grad():
            out = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), do_sample=True,
                                 temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=80,
                                 num_return_sequences=samples)
        for row in out:
            text = str(tok.decode(row[prompt.shape[1]:], skip_special_tokens=False))
            wins += solved(task, text)
            total += 1
    return wins / total


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--tasks", type=int, default=48)
    ap.add_argument("--task-seed", type=int, default=1)
    ap.add_argument("--samples", type=int, default=2)
    args = ap.parse_args()
    t0 = time.time()
    rate = solve_rate(args.model, generate(args.tasks, args.task_seed), args.samples)
    print(json.dumps({"solve_rate": rate, "seconds": round(time.time() - t0, 1)}))


if __name__ == "__main__":
    main()
