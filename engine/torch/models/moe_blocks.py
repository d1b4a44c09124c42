"""Qwen3-MoE's routed experts on a GGUF's own blocks (`kernels.block_linear`), and its router.

llama.cpp stores all experts of a projection as one 3-D tensor, `blk.N.ffn_{gate,up,down}_exps`,
[experts, rows, cols] in numpy order, expert e's rows one contiguous run of blocks. So each expert's
gate / up / down is a `BlockWeight` over its slice of the file's memory map: nothing is converted at
load, and an expert's bytes are read (and, with AVX2, repacked: `BlockWeight.kernel_form`) only the
first time a token is routed to it.

`BlockExperts` runs one routed expert at a time over the rows routed to it, as `ReferenceExperts`
does with float weights: gate and up as one `BlockLinear` (their types may differ), the row-exact
`ops.silu_mul`, then down. The block GEMM gives each row the bits of a one-row call, and
`GroupedExperts` sums a token's k outputs in slot order, so a verify row equals a one-row step
whatever else shares the pass.

The router (`ffn_gate_inp`) is kept in float32 by llama.cpp's quantizer. Rounding it to int8 would
move near ties between experts, so it runs in float (`RowByRowLinear`) unless the file stores it in
a type a block kernel runs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np
import torch

from agentfold.engine.gguf_model import GGUFModel
from agentfold.engine.torch.models import gpt_oss, ops
from agentfold.engine.torch.models.llama import Linear
from agentfold.engine.torch.models.qwen3_moe import GroupedExperts, MoEBlock, combine, moe_blocks
from agentfold.kernels import block_linear, rowwise, torch_cpu
from agentfold.kernels.block_linear import BlockLinear, BlockWeight

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def expert_tensor_name(layer: int, projection: str) -> str:
    """The HF name `gguf_model` gives a layer's stacked experts of one projection."""
    return f"model.layers.{layer}.mlp.switch_mlp.{projection}.weight"


def is_expert_tensor(hf_name: str) -> bool:
    return ".mlp.switch_mlp." in hf_name


class BlockExperts(GroupedExperts):
    """One MoE layer's experts as the file's blocks: expert e is `gate_up[e]` (gate and up side by
    side, one GEMM over the rows routed to e) and `down[e]`. `gated` joins an expert's gate and up
    rows (SwiGLU unless told: gpt-oss's clamped one); `biases` (gpt-oss): float32 [experts, width]
    for gate and up, [experts, hidden] for down, added by the GEMM to each output."""

    def __init__(self, gate: list[BlockWeight], up: list[BlockWeight], down: list[BlockWeight],
                 gated: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = ops.silu_mul,
                 biases: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> None:
        if not len(gate) == len(up) == len(down):
            raise ValueError(f"experts: {len(gate)} gate, {len(up)} up, {len(down)} down projections")
        self.width = gate[0].n
        self.gate_up = [BlockLinear([g, u]) for g, u in zip(gate, up, strict=True)]
        self.down = [BlockLinear([d]) for d in down]
        self.gated = gated
        self.gate_up_bias: list[torch.Tensor | None] = [None] * len(down)
        self.down_bias: list[torch.Tensor | None] = [None] * len(down)
        if biases is not None:
            gate_bias, up_bias, down_bias = biases
            self.gate_up_bias = [torch.cat([g, u]).contiguous() for g, u in zip(gate_bias, up_bias, strict=True)]
            self.down_bias = [d.contiguous() for d in down_bias]

    @property
    def num_experts(self) -> int:
        return len(self.down)

    def nbytes(self) -> int:
        return sum(linear.nbytes() for linear in (*self.gate_up, *self.down))

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        gate, up = torch.split(ops.linear(x, self.gate_up[e], self.gate_up_bias[e]), (self.width, self.width), dim=-1)
        return ops.linear(self.gated(gate, up), self.down[e], self.down_bias[e])

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
        if x.shape[0] != 1:
            return super().__call__(x, ids, gates)
        return self._one_row(x, ids, gates)

    def _one_row(self, x: torch.Tensor, ids: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
        """A decode step's row: its k experts' gate / up in one block GEMM (they read the same row,
        and an output's integer sums and float chain are its own whatever else the call holds: the
        bits of k separate calls), the activation over the k rows at once (row by row by
        construction), then the k down projections in one call, expert j's on hidden row j
        (`BlockLinear.linear_rows`: each the one-row call's bits), and the slot-order sum the other
        rows take. A decode token's ~2k kernel calls a layer become 2: on Qwen3-Coder-30B-A3B's 48
        layers of 8 experts, ~670 fewer calls (and their Python) a token."""
        chosen = ids[0].tolist()
        width = self.width
        fused = BlockLinear([w for e in chosen for w in self.gate_up[e].weights])
        both = ops.linear(x, fused, _joined([self.gate_up_bias[e] for e in chosen])).view(len(chosen), 2 * width)
        hidden = self.gated(both[:, :width], both[:, width:])
        down = BlockLinear([self.down[e].weights[0] for e in chosen])
        outputs = down.linear_rows(hidden.float(), _joined([self.down_bias[e] for e in chosen])).view(len(chosen), -1)
        return combine(gates, outputs.unsqueeze(0)).to(x.dtype)


def _joined(biases: list[torch.Tensor | None]) -> torch.Tensor | None:
    """The chosen experts' biases side by side, as their fused call's outputs lie (None: unbiased)."""
    return torch.cat(biases) if biases[0] is not None else None  # type: ignore[arg-type]


class RowByRowLinear(Linear):
    """A float linear layer (no bias) that computes every row by the GEMM call a one-row pass makes.

    Exact by construction: a row's bits are those of the same [1, in] call whatever the pass's width,
    where a vendor GEMM over many rows switches kernels at widths of its own (`kernels.torch_cpu`).
    On the CPU every row runs in one C call (`kernels.rowwise.float_rows`: each output's sum in
    order over the inputs); elsewhere, or without the C library, one GEMM call a row.
    Meant for small weights such as a router ([experts, hidden]): the calls are cheap next to the
    experts they choose.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = rowwise.float_rows(x, self.weight.t(), self.bias)  # one C call (None off the CPU / not 2-D)
        if out is not None:
            return out
        rows = [torch_cpu.aligned_mm(x[i : i + 1].contiguous(), self.weight) for i in range(x.shape[0])]
        out = rows[0] if len(rows) == 1 else torch.cat(rows)
        return out + self.bias if self.bias is not None else out  # (an add per element: the same bits)


def float_router(values: torch.Tensor, dtype: torch.dtype, bias: torch.Tensor | None = None) -> RowByRowLinear:
    """A `RowByRowLinear` holding the router's float values [experts, hidden] (and gpt-oss's bias
    [experts]), stored transposed (the layout in which the CPU GEMM is fastest for a few rows, as
    `loader.place` stores linears)."""
    experts, hidden = values.shape
    router = RowByRowLinear(hidden, experts, bias=bias is not None)
    router.weight.data = values.to(dtype).t().contiguous().t()
    if bias is not None:
        router.bias.data = bias.to(dtype)
    return router


def expert_block_weights(model: GGUFModel, hf_name: str) -> list[BlockWeight]:
    """Each expert's [rows, cols] weight of a stacked expert tensor, as views of the file's blocks."""
    info = model.file.tensors[model.names[hf_name]]
    experts, rows, cols = info.shape
    per_expert = model.file.raw(model.names[hf_name]).reshape(experts, -1)  # expert e's rows are contiguous
    return [BlockWeight(info.type_name, per_expert[e], rows, cols) for e in range(experts)]


def expert_weights_ok(model: GGUFModel, hf_name: str) -> bool:
    """Whether a block kernel runs this stacked expert tensor's type and width here."""
    info = model.file.tensors[model.names[hf_name]]
    return len(info.shape) == 3 and block_linear.supported(info.type_name, info.shape[2])


def unsupported_expert_types(model: GGUFModel) -> set[str]:
    """The types of the file's expert tensors no block kernel runs here."""
    return {model.source_type(name) for name in model.names
            if is_expert_tensor(name) and name.endswith(".weight") and not expert_weights_ok(model, name)}


def attach_experts(net: torch.nn.Module, model: GGUFModel) -> int:
    """Give every MoE block of `net` its `BlockExperts` over `model`'s blocks; returns their bytes."""
    total = 0
    for block in moe_blocks(net):
        total += attach_block(block, model)
    return total


def attach_block(block: MoEBlock, model: GGUFModel) -> int:
    """Replace `block`'s experts with `BlockExperts` over its layer's three expert tensors, after
    checking them against the config (its float `weights` stay empty placeholders); returns their bytes."""
    parts: dict[str, list[BlockWeight]] = {}
    for projection, expected in zip(PROJECTIONS, (block.weights.gate_proj.shape, block.weights.up_proj.shape,
                                                  block.weights.down_proj.shape), strict=True):
        name = expert_tensor_name(block.layer_index, projection)
        if name not in model.names:
            raise ValueError(f"layer {block.layer_index}: no {projection} experts in the file")
        shape = model.file.tensors[model.names[name]].shape
        if tuple(shape) != tuple(expected):
            raise ValueError(f"{name}: experts are {list(shape)}, the config says {list(expected)}")
        if not expert_weights_ok(model, name):
            raise ValueError(f"{name}: no block kernel for {model.source_type(name)}")
        parts[projection] = expert_block_weights(model, name)
    biases = [expert_tensor_name(block.layer_index, projection).removesuffix("weight") + "bias"
              for projection in PROJECTIONS]
    gated: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = ops.silu_mul
    if isinstance(block, gpt_oss.MoE):
        if not all(name in model.names for name in biases):
            raise ValueError(f"layer {block.layer_index}: gpt-oss experts without their biases")
        gated = functools.partial(gpt_oss.swiglu, limit=block.swiglu_limit, alpha=block.swiglu_alpha)
    loaded = tuple(torch.from_numpy(np.ascontiguousarray(model.tensor(name))) for name in biases
                   if name in model.names)
    block.experts = BlockExperts(parts["gate_proj"], parts["up_proj"], parts["down_proj"], gated,
                                 loaded if len(loaded) == 3 else None)  # type: ignore[arg-type]
    return block.experts.nbytes()
