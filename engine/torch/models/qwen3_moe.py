"""Qwen3-MoE (and Qwen2-MoE's shared expert): the Llama-family decoder with routed experts.

A sparse layer's feed-forward is `MoEBlock`: a softmax router picks each token's top-k experts,
`experts` computes them, and an optional shared expert (Qwen2-MoE) is added under a sigmoid gate.
Which layers are sparse follows `decoder_sparse_step` and `mlp_only_layers`.

`experts` is a swappable object (`engine.offload` replaces it to keep experts in host memory):
any callable `experts(x [n, H], ids [n, k] int64, gates [n, k] float32) -> [n, H]` will do. The
reference computes every token's experts in a way that does not depend on which other tokens are
in the pass, and sums a token's experts in slot order, so routing keeps verify rows exact.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from agentfold.engine.torch.models import ops
from agentfold.engine.torch.models.llama import MLP, DecoderLayer, Linear, ModelArgs, Transformer


@dataclass
class ExpertWeights:
    """All experts of one MoE layer, stacked as loaded (float; may stay in host memory)."""

    gate_proj: torch.Tensor  # [E, I, H]
    up_proj: torch.Tensor  # [E, I, H]
    down_proj: torch.Tensor  # [E, H, I]

    @property
    def num_experts(self) -> int:
        return self.gate_proj.shape[0]


class GroupedExperts:
    """Routed experts computed expert by expert over the rows routed to each, then combined.

    A subclass says how one expert maps its rows (`expert`); that must give each row the bits of
    a one-row call (the rows sent to an expert are whatever subset of the pass routed there).
    Each token's k outputs are then weighted and summed in slot order, never in the order the
    experts ran, so a row's result does not depend on which other tokens share the pass.
    """

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert `e`'s output rows for input rows x [m, H]."""
        raise NotImplementedError

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
        n, k = ids.shape
        outputs = torch.zeros(n, k, x.shape[1], dtype=torch.float32, device=x.device)
        flat = ids.reshape(-1)
        for e in torch.unique(flat).tolist():
            slots = (flat == e).nonzero().squeeze(1)  # (token, slot) pairs routed to e, in order
            outputs.view(n * k, -1)[slots] = self.expert(e, x[slots // k]).float()
        return combine(gates, outputs).to(x.dtype)


def combine(gates: torch.Tensor, outputs: torch.Tensor) -> torch.Tensor:
    """Each token's k expert outputs [n, k, H] weighted by its gates [n, k] and summed in slot order
    (float32): the one expression every path that computes experts ends with."""
    total = gates[:, 0:1] * outputs[:, 0]
    for j in range(1, outputs.shape[1]):
        total = total + gates[:, j : j + 1] * outputs[:, j]
    return total


class ReferenceExperts(GroupedExperts):
    """Float experts (`ExpertWeights`) through the row-exact `ops.linear`."""

    def __init__(self, weights: ExpertWeights) -> None:
        self.weights = weights

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        w = self.weights
        gate, up, down = (p[e].to(x.device, x.dtype) for p in (w.gate_proj, w.up_proj, w.down_proj))
        return ops.linear(ops.silu_mul(ops.linear(x, gate), ops.linear(x, up)), down)


class MoEBlock(nn.Module):
    """Router + `experts` + optional gated shared expert, for decoder layer `layer_index`."""

    def __init__(self, config: dict[str, Any], args: ModelArgs, layer_index: int) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.top_k = int(config["num_experts_per_tok"])
        self.norm_topk_prob = bool(config.get("norm_topk_prob", False))
        experts, hidden, inner = int(config["num_experts"]), args.hidden_size, int(config["moe_intermediate_size"])
        self.gate = Linear(hidden, experts)
        shapes = ((experts, inner, hidden), (experts, inner, hidden), (experts, hidden, inner))
        self.weights = ExpertWeights(*(torch.empty(shape, device="meta") for shape in shapes))  # until loaded
        self.experts = ReferenceExperts(self.weights)
        shared = int(config.get("shared_expert_intermediate_size") or 0)
        self.shared_expert = MLP(hidden, shared) if shared else None
        self.shared_expert_gate = Linear(hidden, 1) if shared else None

    def set_weights(self, weights: ExpertWeights) -> None:
        """Install loaded expert weights (and a reference `experts` over them)."""
        self.weights = weights
        self.experts = ReferenceExperts(weights)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's expert ids [n, k] and normalized gates [n, k] (float32), row by row."""
        probs = ops.softmax(self.gate(x))
        gates, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            total = gates[:, 0:1]
            for j in range(1, self.top_k):  # in slot order, not a reduction kernel's order
                total = total + gates[:, j : j + 1]
            gates = gates / total
        return ids, gates

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, gates = self.route(x)
        out = self.experts(x, ids, gates)
        if self.shared_expert is not None:
            out = out + ops.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


def is_sparse(config: dict[str, Any], layer_index: int) -> bool:
    """Whether decoder layer `layer_index` routes to experts (else it has a dense MLP)."""
    step = int(config.get("decoder_sparse_step", 1) or 1)
    return (layer_index not in (config.get("mlp_only_layers") or [])
            and int(config.get("num_experts", 0)) > 0 and (layer_index + 1) % step == 0)


def build(config: dict[str, Any]) -> Transformer:
    """A Qwen3-MoE / Qwen2-MoE model with uninitialized weights."""
    args = ModelArgs.from_config(config)
    layers = []
    for i in range(args.num_hidden_layers):
        if is_sparse(config, i):
            mlp: nn.Module = MoEBlock(config, args, i)
        else:
            mlp = MLP(args.hidden_size, args.intermediate_size)
        layers.append(DecoderLayer(args, mlp))
    return Transformer(args, layers)


def moe_blocks(model: nn.Module) -> list[MoEBlock]:
    """The model's MoE blocks, in layer order."""
    return [module for module in model.modules() if isinstance(module, MoEBlock)]
