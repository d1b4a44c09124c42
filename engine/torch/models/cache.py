"""A static KV cache indexed by position: preallocated per layer, rolled back by lowering a length.

Each layer holds values as [kv_heads, capacity, head_dim] and keys the same, or (`blocked`, where
the C lane attention reads them: every pass on the CPU path) in blocks of 16 positions,
[kv_heads, capacity / 16, head_dim, 16]: a block is the operand of the kernel's scores as it
lies (key t of the block in vector lane t), so the kernel no longer transposes every block it
reads (a fifth of a key's work for a verify pass's few queries). A pass writes its rows at
positions start..start+m and attention reads [:, :start+m]; `read` gives every caller the plain
[kv_heads, length, head_dim] layout. Capacity grows by reallocation in whole blocks, so rollback
never moves memory: the caller only lowers the length it reads up to.
"""

from __future__ import annotations

import torch

BLOCK = 256  # capacity is always a multiple of this many positions
KEY_BLOCK = 16  # positions per block of blocked keys


class LayerCache:
    """One attention layer's keys and values; rows past the owner's length are garbage."""

    def __init__(self, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                 blocked: bool = False) -> None:
        self.blocked = blocked
        self.values = torch.empty(kv_heads, 0, head_dim, dtype=dtype, device=device)
        self._hold(self._new_keys(0) if blocked else torch.empty_like(self.values), self.values)

    def _hold(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Keep `keys` and `values` (contiguous, fresh from `torch.empty`), and what the C lane
        attention's table reads of them (`addresses`: capacity, keys' and values' addresses), noted
        here where the tensors change: a pass's table then reads three ints per layer and lane, not
        the tensors' attributes (~0.7 ms a pass of 8 lanes, in Python)."""
        self.keys, self.values = keys, values
        self.addresses = (values.shape[1], keys.data_ptr(), values.data_ptr())

    def _new_keys(self, capacity: int) -> torch.Tensor:
        kv_heads, _, head_dim = self.values.shape
        shape = (kv_heads, capacity // KEY_BLOCK, head_dim, KEY_BLOCK) if self.blocked else (kv_heads, capacity, head_dim)
        return torch.empty(shape, dtype=self.values.dtype, device=self.values.device)

    @property
    def capacity(self) -> int:
        return self.values.shape[1]

    @property
    def nbytes(self) -> int:
        return self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size()

    def reserve(self, length: int) -> None:
        """Room for `length` positions: at least double, rounded up to whole blocks."""
        if length <= self.capacity:
            return
        size = max(length, 2 * self.capacity)
        size = -(-size // BLOCK) * BLOCK
        old = self.capacity
        values = torch.empty(self.values.shape[0], size, self.values.shape[2], dtype=self.values.dtype,
                             device=self.values.device)
        values[:, :old] = self.values
        keys = self._new_keys(size)
        keys[:, : self.keys.shape[1]] = self.keys  # (blocked: old // KEY_BLOCK whole blocks)
        self._hold(keys, values)

    def write(self, start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store keys / values [kv_heads, m, head_dim] at positions start..start+m."""
        end = start + keys.shape[1]
        self.reserve(end)
        self.values[:, start:end] = values
        if not self.blocked:
            self.keys[:, start:end] = keys
            return
        positions = torch.arange(start, end, device=keys.device)
        spots = keys.transpose(0, 1).to(self.keys.dtype)  # [m, kv, d], the positions' spots (as a slice rounds)
        self.keys[:, positions // KEY_BLOCK, :, positions % KEY_BLOCK] = spots

    def read(self, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of positions 0..end as [kv_heads, end, head_dim] (views; blocked keys: a copy)."""
        if not self.blocked:
            return self.keys[:, :end], self.values[:, :end]
        blocks = -(-end // KEY_BLOCK)
        keys = self.keys[:, :blocks].transpose(2, 3).reshape(self.keys.shape[0], blocks * KEY_BLOCK, -1)
        return keys[:, :end], self.values[:, :end]
