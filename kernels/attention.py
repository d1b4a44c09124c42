"""Row-exact attention for verify passes.

MLX's attention takes a different path for one query row than for several, so row j of a k-row
verify pass does not reproduce the bits of a one-row decode step. Here each row of a small pass
attends on its own, through the same one-row call a decode step makes, over exactly the keys that
step would see (its own position and everything before it). Large passes (prefill chunks) keep
MLX's batched kernel: they are the same for fresh and resumed prompts by the prefill plan.
"""

from __future__ import annotations

import sys
from typing import Any

import mlx.core as mx

PER_ROW_LIMIT = 64  # passes wider than this are prefill chunks: batched attention
_installed: dict[str, Any] = {}


def row_exact_sdpa(original: Any) -> Any:
    def attention(queries, keys, values, cache=None, scale=1.0, mask=None, sinks=None, **kwargs):
        rows = queries.shape[2]
        if rows == 1 or rows > PER_ROW_LIMIT or sinks is not None or kwargs:
            return original(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks, **kwargs)
        start = keys.shape[2] - rows  # keys before this pass
        outputs = []
        for j in range(rows):
            seen = start + j + 1
            row_mask = mask[..., j : j + 1, :seen] if isinstance(mask, mx.array) else None
            outputs.append(
                mx.fast.scaled_dot_product_attention(
                    queries[:, :, j : j + 1], keys[:, :, :seen], values[:, :, :seen], scale=scale, mask=row_mask
                )
            )
        return mx.concatenate(outputs, axis=2)

    attention.agentfold_row_exact = True
    return attention


def install(model: Any) -> list[str]:
    """Route the attention of `model`'s mlx-lm module(s) through the row-exact version."""
    patched = []
    for cls in type(model).__mro__:
        module = sys.modules.get(cls.__module__)
        if module is None or not cls.__module__.startswith("mlx_lm.models."):
            continue
        current = getattr(module, "scaled_dot_product_attention", None)
        if current is None or getattr(current, "agentfold_row_exact", False):
            continue
        _installed[module.__name__] = current
        module.scaled_dot_product_attention = row_exact_sdpa(current)
        patched.append(module.__name__)
    return patched


def uninstall() -> None:
    """Restore MLX-LM's own attention (for baselines and the negative self-check)."""
    for name, original in _installed.items():
        sys.modules[name].scaled_dot_product_attention = original
    _installed.clear()
