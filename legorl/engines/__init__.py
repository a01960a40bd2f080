"""Inference engines: token ids in, sampled token ids + logprobs (+ MoE routing) out."""

from legorl.engines.base import Engine, Generation, SamplingParams

__all__ = ["Engine", "Generation", "SamplingParams"]
