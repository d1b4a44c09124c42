"""Turn a loaded torch model's linear layers into int8 weights (`kernels.int8_linear`).

Every `Linear` gets its int8 weight and drops the float one; linears that read the same input
(q / k / v, gate / up) are fused into one GEMM, so the input row is quantized once and the int8
weights are read in one pass; the output head (tied to the embedding or not) gets its own int8
copy while the embedding table stays float for the token lookup. Each int8 weight is then packed
for the C GEMM (`int8_linear.pack`). Routed MoE experts keep their own int8 path (`engine.moe`).
"""

from __future__ import annotations

import torch
from torch import nn

from agentfold.engine.torch.models.llama import MLP, Attention, Fused, Linear
from agentfold.kernels.int8_linear import Int8Weight, concat, pack, quantize_weight

MODES = ("int8", "none")


def int8_weights(model: nn.Module) -> int:
    """Quantize `model` in place (once: a second call changes nothing); returns its int8 weight bytes."""
    if getattr(model, "quantized", None) == "int8":
        return model.int8_bytes
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    for linear in linears:
        linear.int8 = quantize_weight(linear.weight)
        linear.weight = nn.Parameter(torch.empty(0, linear.weight.shape[1]), requires_grad=False)
    total = sum(linear.int8.nbytes() for linear in linears)
    for module in list(model.modules()):
        if isinstance(module, Attention):
            module.qkv = _fuse([module.q_proj, module.k_proj, module.v_proj])
        elif isinstance(module, MLP):
            module.gate_up = _fuse([module.gate_proj, module.up_proj])
    if model.lm_head is not None:
        model.head_int8 = model.lm_head.int8
    else:
        model.head_int8 = quantize_weight(model.model.embed_tokens.weight)
        total += model.head_int8.nbytes()
    for weight in {id(w): w for w in _int8_weights(model)}.values():
        pack(weight)
    model.quantized, model.int8_bytes = "int8", total
    return total


def _int8_weights(model: nn.Module) -> list[Int8Weight]:
    """Every int8 weight a pass multiplies by: the linears' (fused ones included) and the head."""
    found = [m.int8 for m in model.modules() if isinstance(m, Linear) and m.int8 is not None]
    found += [m.weight for m in model.modules() if isinstance(m, Fused) and isinstance(m.weight, Int8Weight)]
    return [*found, model.head_int8]


def _fuse(parts: list[Linear]) -> Fused:
    """One GEMM for `parts`; their own int8 copies are released (the fused one replaces them)."""
    fused = Fused(parts, concat([part.int8 for part in parts]))
    for part in parts:
        part.int8 = None
    return fused
