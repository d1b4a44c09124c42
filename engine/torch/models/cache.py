"""A static KV cache indexed by position: preallocated per layer, rolled back by lowering a length.

Each layer holds keys and values as [kv_heads, capacity, head_dim]; a pass writes its rows at
positions start..start+m and attention reads [:, :start+m]. Capacity grows by reallocation in
whole blocks, so rollback never moves memory: the caller only lowers the length it reads up to.
"""

from __future__ import annotations

import torch

BLOCK = 256  # capacity is always a multiple of this many positions


class LayerCache:
    """One attention layer's keys and values; rows past the owner's length are garbage."""

    def __init__(self, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        self.keys = torch.empty(kv_heads, 0, head_dim, dtype=dtype, device=device)
        self.values = torch.empty_like(self.keys)

    @property
    def capacity(self) -> int:
        return self.keys.shape[1]

    @property
    def nbytes(self) -> int:
        return self.keys.numel() * self.keys.element_size() * 2

    def reserve(self, length: int) -> None:
        """Room for `length` positions: at least double, rounded up to whole blocks."""
        if length <= self.capacity:
            return
        size = max(length, 2 * self.capacity)
        size = -(-size // BLOCK) * BLOCK
        for name in ("keys", "values"):
            old = getattr(self, name)
            new = torch.empty(old.shape[0], size, old.shape[2], dtype=old.dtype, device=old.device)
            new[:, : old.shape[1]] = old
            setattr(self, name, new)

    def write(self, start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store keys / values [kv_heads, m, head_dim] at positions start..start+m."""
        end = start + keys.shape[1]
        self.reserve(end)
        self.keys[:, start:end] = keys
        self.values[:, start:end] = values

    def read(self, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of positions 0..end (views, no copy)."""
        return self.keys[:, :end], self.values[:, :end]
