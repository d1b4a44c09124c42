"""A GGUF model on its own blocks: every linear layer multiplies the file's blocks (`kernels.block_linear`).

Nothing is converted at load: the linear weights are views of the file's memory map (llama's q / k
rows, which llama.cpp permutes, are copied once into Hugging Face's order), the embedding
dequantizes the rows a pass looks up (`BlockEmbedding`, the gguf package's reference values), and
only the norms and biases are read as floats. So a 1.1 GB Q4_K_M file starts in seconds, holds
about its own size in memory, and a token reads the bytes llama.cpp reads.

Used where every linear weight's type has a block kernel (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K,
Q6_K); a tied output head whose type has none is rounded to int8 as before. Other files take the
int8 path (`quantize.int8_weights`, through the converted-weights cache). Qwen3-MoE's routed experts
run on their blocks too, and its router in float where the file keeps it so (`moe_blocks`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from agentfold.engine.gguf_model import GGUFModel
from agentfold.engine.torch.models import build as build_model
from agentfold.engine.torch.models import moe_blocks
from agentfold.engine.torch.models.llama import MLP, Attention, Fused, Linear, Transformer, attach_layer_kernels
from agentfold.engine.torch.models.qwen3_moe import MoEBlock
from agentfold.kernels import block_linear
from agentfold.kernels.block_linear import BlockLinear, BlockWeight
from agentfold.kernels.int8_linear import quantize_weight

EMBEDDING = "model.embed_tokens.weight"


class BlockEmbedding(nn.Module):
    """Token id -> the embedding row, dequantized from the file's blocks when looked up (the gguf
    package's reference values, bit for bit the rows a float table would hold). `weight` is an empty
    float32 [0, hidden] tensor: it says the dtype and device the model computes in."""

    def __init__(self, model: GGUFModel, gguf_name: str) -> None:
        super().__init__()
        info = model.file.tensors[gguf_name]
        self.rows, self.hidden = info.shape
        self.kind = info.type_name
        self.raw = model.file.raw(gguf_name).reshape(self.rows, -1)
        self.weight = nn.Parameter(torch.empty(0, self.hidden), requires_grad=False)

    def values(self, ids: np.ndarray) -> np.ndarray:
        """float32 rows [len(ids), hidden] of the table."""
        from gguf.constants import GGMLQuantizationType
        from gguf.quants import dequantize

        picked = self.raw[ids]
        if self.kind in ("F32", "F16"):
            return picked.view(np.float32 if self.kind == "F32" else np.float16).astype(np.float32)
        return np.asarray(dequantize(picked, GGMLQuantizationType[self.kind]), dtype=np.float32)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        ids = tokens.detach().cpu().numpy().astype(np.int64)
        unique, where = np.unique(ids, return_inverse=True)  # a prefill repeats tokens: each row once
        return torch.from_numpy(self.values(unique)[where.reshape(-1)])


def block_weight(model: GGUFModel, hf_name: str) -> BlockWeight | None:
    """The HF weight's blocks (rows in HF's order), or None where no block kernel runs its type."""
    if not block_weight_ok(model, hf_name):
        return None
    info = model.file.tensors[model.names[hf_name]]
    n, k = info.shape
    rows = model.file.raw(model.names[hf_name]).reshape(n, -1)
    ordered = model.rows_in_hf_order(hf_name, rows)  # llama's q / k: a permuted copy; else the map itself
    return BlockWeight(info.type_name, np.ascontiguousarray(ordered).reshape(-1), n, k)


def unsupported_types(model: GGUFModel) -> list[str]:
    """The types of the linear weights no block kernel runs here (empty: the model runs on its blocks).
    MoE routers do not count: one whose type has no block kernel runs in float."""
    linears, routers = _linear_names(model.config)
    found = {model.source_type(name) for name in linears
             if name in model.names and name not in routers and not block_weight_ok(model, name)}
    return sorted(found | moe_blocks.unsupported_expert_types(model))


def block_weight_ok(model: GGUFModel, hf_name: str) -> bool:
    info = model.file.tensors[model.names[hf_name]]
    return len(info.shape) == 2 and block_linear.supported(info.type_name, info.shape[1])


def _linear_names(config: dict[str, Any]) -> tuple[list[str], set[str]]:
    """The weight names of the config's linear layers, and which of them are MoE routers."""
    with torch.device("meta"):
        skeleton = build_model(config)
    return ([f"{name}.weight" for name, module in skeleton.named_modules() if isinstance(module, Linear)],
            _router_weights(skeleton))


def _router_weights(net: nn.Module) -> set[str]:
    return {f"{name}.gate.weight" for name, module in net.named_modules() if isinstance(module, MoEBlock)}


def load(model: GGUFModel, dtype: torch.dtype) -> nn.Module:
    """The torch model of `model`'s config with block linears, a block embedding and float norms."""
    net = build_model(model.config)
    linears = {name: module for name, module in net.named_modules() if isinstance(module, Linear)}
    routers = _router_weights(net)
    params = dict(net.named_parameters())
    for hf_name in model.names:
        module_name = hf_name.rsplit(".", 1)[0]
        if hf_name == EMBEDDING or (module_name in linears and hf_name.endswith(".weight")) or \
                moe_blocks.is_expert_tensor(hf_name):
            continue
        if hf_name not in params:
            raise ValueError(f"{hf_name}: not a parameter of the {model.config['model_type']} model")
        params[hf_name].data = torch.from_numpy(np.ascontiguousarray(model.tensor(hf_name))).to(dtype)
    total = 0
    for name, linear in linears.items():
        weight = block_weight(model, f"{name}.weight")
        if weight is None and f"{name}.weight" in routers:  # a float router: its own rows, in float
            parent, _, attribute = name.rpartition(".")
            values = torch.from_numpy(np.ascontiguousarray(model.tensor(f"{name}.weight")))
            setattr(net.get_submodule(parent), attribute, moe_blocks.float_router(values, dtype, linear.bias))
            continue
        if weight is None:
            raise ValueError(f"{name}: no block kernel for {model.source_type(name + '.weight')}")
        linear.quantized = BlockLinear([weight])
        linear.weight = nn.Parameter(torch.empty(0, weight.k), requires_grad=False)
        total += weight.nbytes()
    total += moe_blocks.attach_experts(net, model)
    _fuse(net)
    if isinstance(net, Transformer):
        attach_layer_kernels(net)
    embedding = BlockEmbedding(model, model.names[EMBEDDING])
    net.model.embed_tokens = embedding
    if net.lm_head is not None:
        net.head_quantized = net.lm_head.quantized
    else:
        head = block_weight(model, EMBEDDING)
        net.head_quantized = BlockLinear([head]) if head is not None else quantize_weight(
            torch.from_numpy(embedding.values(np.arange(embedding.rows))))
        total += net.head_quantized.nbytes()
    net.quantized, net.quantized_bytes = "blocks", total
    net.eval()
    return net


def _fuse(net: nn.Module) -> None:
    """q / k / v and gate / up as one call each (their blocks side by side, types may differ)."""
    for module in list(net.modules()):
        if isinstance(module, Attention):
            module.qkv = _fused([module.q_proj, module.k_proj, module.v_proj])
        elif isinstance(module, MLP):
            module.gate_up = _fused([module.gate_proj, module.up_proj])


def _fused(parts: list[Linear]) -> Fused:
    fused = Fused(parts, BlockLinear([w for part in parts for w in part.quantized.weights]))
    for part in parts:
        part.quantized = None
    return fused
