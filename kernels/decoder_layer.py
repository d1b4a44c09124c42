"""A Llama-family decoder layer on a GGUF's blocks in one C call (csrc/decoder_layer.c).

A decode or verify pass of a small model spends more time between its kernels than in them:
SmolLM2-135M's one-row pass took ~10 ms on 2 cores with ~4 ms in the block kernels, the rest in
the ~10 module calls, views, splits and ctypes calls a layer makes. `LayerKernel` runs the same
kernels (rms_norm, block_linear, rope, lane_attention, silu_mul) with the same arguments from C,
so a row's bits are the ones the modules give: row-exact by construction, as each kernel is.

It holds what a layer keeps between passes (norm weights, the block weights' addresses, sizes) in a
C struct made once per library; a pass hands it the rows, positions, RoPE tables and the pass's
`LaneTable` (this layer's caches).
"""

from __future__ import annotations

import ctypes

import torch

from agentfold.kernels import native
from agentfold.kernels.block_linear import BlockLinear
from agentfold.kernels.torch_cpu import LaneTable

_I64, _PTR, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int


class _BlockGemm(ctypes.Structure):
    _fields_ = [("data", _PTR), ("types", _PTR), ("ns", _PTR), ("bias", _PTR), ("n", _I64), ("nseg", _I64)]


class _Layer(ctypes.Structure):
    _fields_ = [("input_norm", _PTR), ("post_norm", _PTR), ("eps", ctypes.c_float), ("scale", ctypes.c_float),
                ("hidden", _I64), ("heads", _I64), ("kv_heads", _I64), ("head_dim", _I64), ("intermediate", _I64),
                ("window", _I64), ("qkv", _BlockGemm), ("o", _BlockGemm), ("gate_up", _BlockGemm),
                ("down", _BlockGemm)]


SIGNATURES = {"decoder_layer": ([_PTR, _PTR, _PTR, _I64, _PTR, _PTR, _PTR, _I64, _I64, _PTR, _PTR, _PTR, _PTR, _PTR,
                                 _PTR, _I64, _I64, _INT], _INT)}


def library() -> ctypes.CDLL | None:
    return native.load(SIGNATURES)


def _float_rows(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach().float().contiguous()


class LayerKernel:
    """One layer's weights as csrc/decoder_layer.c reads them; `run` is the layer over a pass's rows."""

    def __init__(self, input_norm: torch.Tensor, post_norm: torch.Tensor, eps: float, heads: int, kv_heads: int,
                 head_dim: int, scale: float, window: int | None, qkv: BlockLinear, qkv_bias: torch.Tensor | None,
                 o: BlockLinear, o_bias: torch.Tensor | None, gate_up: BlockLinear, down: BlockLinear) -> None:
        hidden = o.n
        if qkv.n != (heads + 2 * kv_heads) * head_dim or qkv.k != hidden or o.k != heads * head_dim or \
                gate_up.n != 2 * down.k or gate_up.k != hidden or down.n != hidden:
            raise ValueError("a decoder layer's weights that do not fit together")
        self.tensors = [_float_rows(t) for t in (input_norm, post_norm, qkv_bias, o_bias)]  # kept alive
        self.eps, self.scale, self.window = eps, scale, window or 0
        self.heads, self.kv_heads, self.head_dim, self.hidden = heads, kv_heads, head_dim, hidden
        self.linears = (qkv, o, gate_up, down)
        self._layers: dict[str, _Layer] = {}

    def _layer_for(self, lib: ctypes.CDLL) -> _Layer:
        """The C struct for `lib` (the block weights in the form that library multiplies)."""
        if lib._name not in self._layers:
            input_norm, post_norm, qkv_bias, o_bias = self.tensors
            gemms = []
            for linear, bias in zip(self.linears, (qkv_bias, o_bias, None, None), strict=True):
                data, types, ns = linear.segments(lib)
                gemms.append(_BlockGemm(ctypes.addressof(data), ctypes.addressof(types), ctypes.addressof(ns),
                                        bias.data_ptr() if bias is not None else None, linear.n, len(linear.weights)))
            self._layers[lib._name] = _Layer(input_norm.data_ptr(), post_norm.data_ptr(), self.eps, self.scale,
                                             self.hidden, self.heads, self.kv_heads, self.head_dim,
                                             self.linears[3].k, self.window, *gemms)
        return self._layers[lib._name]

    def run(self, h: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, table: LaneTable,
            slot: int) -> torch.Tensor:
        """The layer over h [m, hidden] (float32, contiguous, the rows of `table`'s lanes in turn) at
        `positions` (int64 [m]) with RoPE tables cos / sin [length, head_dim] -> [m, hidden]; stores
        the rows' keys and values in layer `slot`'s caches of `table`."""
        lib = library()
        if lib is None:
            raise RuntimeError("decoder_layer: no C compiler here")
        out = torch.empty_like(h)
        capacity, keys, values, half, _, blocked = table.layers[slot]
        status = lib.decoder_layer(ctypes.byref(self._layer_for(lib)), h.data_ptr(), out.data_ptr(), h.shape[0],
                                   positions.data_ptr(), cos.data_ptr(), sin.data_ptr(), cos.shape[0], table.count,
                                   table.begin, table.lengths, table.start, capacity, keys, values, half, blocked,
                                   torch.get_num_threads())
        if status == -2:
            raise MemoryError(f"decoder_layer: no memory for {h.shape[0]} rows")
        if status:
            raise ValueError("decoder_layer: a position outside the RoPE tables or a weight the block kernels cannot run")
        return out
