"""What the MoE GGUF tests (qwen3moe, gpt-oss) share: a block backend on a file, serial greedy
decoding, and a recorder of the experts each pass routed its rows to."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from agentfold.engine.torch.backend import TorchBackend
from agentfold.engine.torch.loader import load_torch_model


def blocks_backend(path: Path) -> TorchBackend:
    return TorchBackend(load_torch_model(path, device="cpu", quant="blocks"), quant="blocks")


def greedy(backend: TorchBackend, prompt: list[int], count: int) -> list[int]:
    """Serial greedy decoding, one token a pass (ties to the lowest id, as the sampler's T = 0)."""
    cache = backend.new_cache()
    logits = backend.forward(prompt, cache)
    tokens: list[int] = []
    for _ in range(count):
        tokens.append(int(np.argmax(logits[-1])))
        logits = backend.forward([tokens[-1]], cache)
    return tokens


class RoutingRecorder:
    """Wraps a block's experts and keeps the expert ids each pass routed its rows to."""

    def __init__(self, experts: object) -> None:
        self.experts = experts
        self.ids: list[torch.Tensor] = []

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
        self.ids.append(ids.clone())
        return self.experts(x, ids, gates)
