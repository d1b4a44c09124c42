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

MODES = ("int8", "blocks", "none")  # blocks: a GGUF's own blocks (`gguf_blocks`, attached at load)


HEAD = "head"  # the key of a tied output head's int8 weight in `given` / `record`


def int8_weights(model: nn.Module, given: dict[str, Int8Weight] | None = None,
                 record: dict[str, Int8Weight] | None = None) -> int:
    """Quantize `model` in place (once: a second call changes nothing); returns its int8 weight bytes.

    `given` maps a Linear's module name (and HEAD, for a tied head) to its int8 weight, quantized
    before (the converted-weights cache, `engine.torch.weight_cache`): those linears' float weights
    are never read. `record`, if given, receives every linear's own int8 weight by the same names,
    before fusing, for that cache to store.
    """
    if getattr(model, "quantized", None) == "int8":
        return model.quantized_bytes
    if getattr(model, "quantized", None) == "blocks":  # already on the file's own blocks
        return model.quantized_bytes
    given = given or {}
    linears = [(name, m) for name, m in model.named_modules() if isinstance(m, Linear)]
    for name, linear in linears:
        linear.quantized = given[name] if name in given else quantize_weight(linear.weight)
        if record is not None:
            record[name] = linear.quantized
        linear.weight = nn.Parameter(torch.empty(0, linear.weight.shape[1]), requires_grad=False)
    linears = [linear for _, linear in linears]
    total = sum(linear.quantized.nbytes() for linear in linears)
    for module in list(model.modules()):
        if isinstance(module, Attention):
            module.qkv = _fuse([module.q_proj, module.k_proj, module.v_proj])
        elif isinstance(module, MLP):
            module.gate_up = _fuse([module.gate_proj, module.up_proj])
    if model.lm_head is not None:
        model.head_quantized = model.lm_head.quantized
    else:
        model.head_quantized = given.get(HEAD) or quantize_weight(model.model.embed_tokens.weight)
        if record is not None:
            record[HEAD] = model.head_quantized
        total += model.head_quantized.nbytes()
    for weight in {id(w): w for w in _int8_weights(model)}.values():
        pack(weight)
    model.quantized, model.quantized_bytes = "int8", total
    return total


def _int8_weights(model: nn.Module) -> list[Int8Weight]:
    """Every int8 weight a pass multiplies by: the linears' (fused ones included) and the head."""
    found = [m.quantized for m in model.modules() if isinstance(m, Linear) and m.quantized is not None]
    found += [m.weight for m in model.modules() if isinstance(m, Fused) and isinstance(m.weight, Int8Weight)]
    return [*found, model.head_quantized]


def _fuse(parts: list[Linear]) -> Fused:
    """One GEMM for `parts`; their own int8 copies are released (the fused one replaces them)."""
    fused = Fused(parts, concat([part.quantized for part in parts]))
    for part in parts:
        part.quantized = None
    return fused
