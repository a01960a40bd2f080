"""Routing in the trainer's forwards: the recorded expert choices replayed, or only watched.

A MoE model's router may choose other experts in the trainer than it did in the engine (other
weights, dtype or batch shape). With replay on, the forwards inside :func:`routed` take the recorded
choices (:func:`legorl.routing.replay_routing`); with it off, the router chooses and the choices that
differ from the recorded ones are counted (:class:`RoutingWatch`), the health figure of how much
replay would change.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from legorl.core.errors import LegorlError
from legorl.routing import capture_routing, replay_routing, routing_shape


@dataclass
class RoutingWatch:
    """Routing decisions the trainer's own router would make differently from the recorded ones."""

    flips: int = 0
    decisions: int = 0


@contextmanager
def routed(model: Any, routing: torch.Tensor, *, replay: bool, watch: RoutingWatch | None = None) -> Iterator[None]:
    """Replay ``routing`` [B, T, layers, top_k] (-1: not recorded) in ``model``'s forwards inside (with
    ``replay``), else only watch how the router's own choices differ from it."""
    recorded = (routing >= 0).all(-1).reshape(-1, routing.shape[-2])  # [tokens, layers]
    if replay:
        with replay_routing(model, routing) as replaying:
            yield
        if watch is not None:
            watch.flips += replaying.flips
            watch.decisions += int(recorded.sum())
        return
    with capture_routing(model) as capture:
        yield
    if watch is not None:
        natural = torch.from_numpy(capture.take()).to(routing.device).long()
        forced = routing.reshape(-1, *routing.shape[-2:])
        differs = (natural.sort(-1).values != forced.sort(-1).values).any(-1)
        watch.flips += int((differs & recorded).sum())
        watch.decisions += int(recorded.sum())


def replay_setting(model: Any, has_routing: bool, setting: str) -> tuple[bool, bool]:
    """``(uses, replays)``: whether the trainer's forwards see the recorded routing at all (a MoE
    ``model`` and segments that carry it, ``has_routing``) and whether they replay it (``setting``,
    ``routing_replay``: on, off or auto); ``on`` where there is nothing to replay is refused."""
    moe = routing_shape(model) is not None
    if setting == "on" and (not moe or not has_routing):
        raise LegorlError(
            "routing replay is on but " + ("the model is not MoE" if not moe else "the segments carry no routed_experts")
        )
    uses = moe and has_routing
    return uses, uses and setting != "off"
