"""Rollout routing replay (R3): the experts vLLM chose for every token, as a batch tensor for the trainer.

vLLM returns, per sample, an array [prompt + completion - 1, decoder layers, top_k] (rollout/client.py
`Sample.routed_experts`): row i holds the experts of position i, i.e. of the forward that took token i
as input and produced the distribution of token i + 1. The trainer's forward over prompt + completion
uses the same positions, so row i drives position i of the batch; the last position (it predicts no
trained token) and padding have no row and are marked -1 (the trainer's own routing). With partial
rollouts a position's row was computed by the weights that sampled the next token, which is the
version the behaviour log-prob of that token belongs to.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from rollout.client import Sample


class MissingRoutingError(ValueError):
    """A sample has no routed experts where the run needs them."""


def routing_batch(samples: Sequence[Sample], length: int, layer_ids: Sequence[int], top_k: int) -> torch.Tensor:
    """[B, length, len(layer_ids), top_k] int16 expert ids (-1 where unknown) of samples whose token rows
    (prompt + completion) are right-padded to `length`; `layer_ids` are the decoder layers that are MoE."""
    out = torch.full((len(samples), length, len(layer_ids), top_k), -1, dtype=torch.int16)
    for b, s in enumerate(samples):
        rows = s.routed_experts
        if rows is None:
            raise MissingRoutingError(
                f"sample {b} came back without routed experts; the workers must run with "
                "rollout.return_routed_experts = true (vLLM's --enable-return-routed-experts)"
            )
        if rows.shape[1] <= max(layer_ids) or rows.shape[2] != top_k:
            raise MissingRoutingError(
                f"routed experts of shape {rows.shape} do not fit the trainer's model (MoE layers {list(layer_ids)}, "
                f"top_k {top_k}): the workers serve another model shape"
            )
        picked = np.ascontiguousarray(rows[:, list(layer_ids)]).astype(np.int16)
        out[b, : len(picked)] = torch.from_numpy(picked)
    return out
