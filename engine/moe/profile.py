"""Routing profiles: how often each layer routes to each expert over a calibration text.

`record_routing(model)` wraps every MoE block's `experts` with a counter for as long as the
context is open; the counts seed `ExpertPlacement` (`save_profile` / `load_profile`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from agentfold.engine.torch.models.qwen3_moe import moe_blocks


class RoutingCounter:
    """An `experts` callable that counts the experts each row is routed to, then delegates."""

    def __init__(self, inner: Any, counts: np.ndarray) -> None:
        self.inner = inner
        self.counts = counts

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
        self.counts += np.bincount(ids.reshape(-1).cpu().numpy(), minlength=self.counts.size)
        return self.inner(x, ids, gates)


@contextmanager
def record_routing(model: torch.nn.Module) -> Iterator[dict[int, np.ndarray]]:
    """Per layer index, routed-row counts per expert of every pass run inside the block."""
    blocks = moe_blocks(model)
    if not blocks:
        raise ValueError("the model has no MoE blocks: nothing to profile")
    counts = {b.layer_index: np.zeros(b.weights.num_experts, dtype=np.int64) for b in blocks}
    originals = [b.experts for b in blocks]
    for block in blocks:
        block.experts = RoutingCounter(block.experts, counts[block.layer_index])
    try:
        yield counts
    finally:
        for block, original in zip(blocks, originals, strict=True):
            block.experts = original
