"""MoE routing capture (at generation) and replay (in the training forward pass), a.k.a. R3.

Works with routers that follow transformers' ``TopKRouter`` interface (verified here against
transformers 5.2x ``Qwen3MoeTopKRouter``; Qwen2-MoE and OLMoE routers share it):
``model.model.layers[i].mlp.gate(hidden_states) -> (router_logits, router_scores, router_indices)``,
where ``router_logits`` is ``[tokens, experts]``, the scores are the softmax probabilities of the
top-k experts (renormalised over the k when ``norm_topk_prob``), and ``router_indices`` is
``[tokens, top_k]``. ``tokens`` is the flattened ``[batch, seq]`` of the forward's input.

Arrays of routing decisions are ``[tokens, moe_layers, top_k]`` int16 (``moe_layers`` counts only
layers with a router, in model order), the shape vLLM returns with ``--enable-return-routed-experts``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from torch import nn

from legorl.core.errors import LegorlError


def moe_routers(model: nn.Module) -> list[nn.Module]:
    """The router module of each MoE layer, in layer order (empty for a dense model)."""
    inner = getattr(model, "model", model)
    layers = getattr(inner, "layers", None)
    if layers is None:
        return []
    routers = []
    for layer in layers:
        gate = getattr(getattr(layer, "mlp", None), "gate", None)
        if gate is not None and hasattr(gate, "top_k") and hasattr(gate, "weight"):
            routers.append(gate)
    return routers


def routing_shape(model: nn.Module) -> tuple[int, int] | None:
    """``(moe_layers, top_k)`` or None for a dense model."""
    routers = moe_routers(model)
    if not routers:
        return None
    return len(routers), int(routers[0].top_k)  # type: ignore[arg-type]


class RoutingCapture:
    """Collects each router's ``router_indices`` per forward pass; ``take()`` returns and clears them."""

    def __init__(self, n_layers: int):
        self._per_layer: list[list[torch.Tensor]] = [[] for _ in range(n_layers)]

    def _record(self, layer: int, indices: torch.Tensor) -> None:
        self._per_layer[layer].append(indices.detach().to("cpu", torch.int16))

    def take(self) -> np.ndarray:
        """``[tokens, layers, top_k]`` int16 for every forward since the last ``take`` (in order)."""
        if not self._per_layer or not self._per_layer[0]:
            return np.zeros((0, len(self._per_layer), 0), dtype=np.int16)
        per_layer = [torch.cat(chunks, 0) for chunks in self._per_layer]
        for chunks in self._per_layer:
            chunks.clear()
        return torch.stack(per_layer, dim=1).numpy()


@contextmanager
def capture_routing(model: nn.Module) -> Iterator[RoutingCapture]:
    """Record the experts every token is routed to while the context is open.

    Yields a :class:`RoutingCapture` (with no layers for a dense model). Rows follow the flattened
    ``[batch, seq]`` order of each forward's input.
    """
    routers = moe_routers(model)
    cap = RoutingCapture(len(routers))

    def hook_for(i: int, _router: nn.Module) -> Callable[..., None]:
        return lambda _m, _inp, out: cap._record(i, out[2])

    with _router_hooks(routers, hook_for):
        yield cap


@contextmanager
def _router_hooks(routers: list[nn.Module], hook_for: Callable[[int, nn.Module], Callable[..., Any]]) -> Iterator[None]:
    """Register ``hook_for(layer, router)`` as each router's forward hook while the context is open."""
    handles = [router.register_forward_hook(hook_for(i, router)) for i, router in enumerate(routers)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _renormalises(router: nn.Module, model: nn.Module) -> bool:
    if hasattr(router, "norm_topk_prob"):
        return bool(router.norm_topk_prob)
    return bool(getattr(model.config, "norm_topk_prob", True))


class RoutingReplay:
    """State of an open :func:`replay_routing` context.

    ``set()`` swaps in the decisions for the next forward; after a forward, ``flips`` holds how many
    (token, layer) decisions the router would have made differently on its own (its natural top-k
    set vs the forced set) and ``decisions`` how many were forced.
    """

    def __init__(self, n_layers: int, top_k: int):
        self.n_layers = n_layers
        self.top_k = top_k
        self._forced: torch.Tensor | None = None
        self.flips = 0
        self.decisions = 0

    def set(self, routed_experts: torch.Tensor | np.ndarray) -> None:
        """Decisions ``[B, T, layers, top_k]`` (or ``[tokens, layers, top_k]``); -1 rows = router's own choice."""
        t = torch.as_tensor(np.asarray(routed_experts) if isinstance(routed_experts, np.ndarray) else routed_experts)
        if t.shape[-2:] != (self.n_layers, self.top_k):
            raise LegorlError(
                f"routed_experts has shape {tuple(t.shape)}; expected [..., {self.n_layers}, {self.top_k}] "
                "(moe layers, top_k) for this model"
            )
        self._forced = t.reshape(-1, self.n_layers, self.top_k).to(torch.long)
        self.flips = 0
        self.decisions = 0

    def _apply(self, layer: int, router: nn.Module, renorm: bool, out: Any) -> Any:
        logits, _scores, natural = out
        if self._forced is None:
            return out
        forced = self._forced[:, layer].to(natural.device)
        if forced.shape[0] != natural.shape[0]:
            raise LegorlError(
                f"routed_experts covers {forced.shape[0]} tokens but the forward pass has {natural.shape[0]} "
                "(pass [batch, seq, layers, top_k] matching input_ids)"
            )
        free = (forced < 0).any(-1, keepdim=True)
        forced = torch.where(free, natural, forced)
        # Flips: the forced set differs from the router's own set (order within the top-k ignored).
        same = (forced.sort(-1).values == natural.sort(-1).values).all(-1)
        self.flips += int((~same).sum())
        self.decisions += int(same.numel())
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)
        scores = probs.gather(-1, forced)
        if renorm:
            scores = scores / scores.sum(dim=-1, keepdim=True)
        return logits, scores.to(logits.dtype), forced.to(natural.dtype)


@contextmanager
def replay_routing(model: nn.Module, routed_experts: torch.Tensor | np.ndarray | None = None) -> Iterator[RoutingReplay]:
    """Force the recorded experts in forward passes run inside the context.

    ``routed_experts`` is ``[B, T, layers, top_k]`` matching the forward's ``input_ids`` (call
    ``replay.set`` to change it between forwards). Scores are re-gathered from the *current* router
    logits (softmax, renormalised over the k when the router does), so the router still receives
    gradient and the mixing weights follow the current parameters; only the discrete choice is fixed.
    Entries of -1 (e.g. padding) leave that token to the router's own choice.
    """
    routers = moe_routers(model)
    if not routers:
        raise LegorlError(f"{type(model).__name__} has no MoE routers: nothing to replay")
    replay = RoutingReplay(len(routers), int(routers[0].top_k))  # type: ignore[arg-type]
    if routed_experts is not None:
        replay.set(routed_experts)

    def hook_for(i: int, router: nn.Module) -> Callable[..., Any]:
        renorm = _renormalises(router, model)
        return lambda m, _inp, out: replay._apply(i, m, renorm, out)

    with _router_hooks(routers, hook_for):
        yield replay


def count_flips(a: np.ndarray, b: np.ndarray) -> tuple[int, int]:
    """``(flips, decisions)`` between two ``[..., layers, top_k]`` routings: (token, layer) pairs whose
    expert *sets* differ (order within the top-k ignored)."""
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape:
        raise LegorlError(f"routing shapes differ: {a.shape} vs {b.shape}")
    same = (np.sort(a, axis=-1) == np.sort(b, axis=-1)).all(-1)
    return int((~same).sum()), int(same.size)
