"""What a backend's snapshot arrays look like, for whoever stores them (`sessions.snapshots`).

`cache_to_arrays(cache)` gives `(arrays, layout)`: numpy arrays named `"tokens"` (int32 token
ids) and `"LAYER.PART"` (a layer's keys, values or recurrent state), and one layout entry (a
JSON-able dict) per layer saying how to put them back. numpy has no bfloat16, so a bfloat16
array travels as its raw uint16 bits and its layer's entry notes it: `{"bits": {"keys":
"bfloat16", ...}}`. `arrays_to_cache(arrays, layout)` raises `CacheLayoutError` when the arrays
do not fit the model's cache; the store turns that into its own error.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

BITS = {"bfloat16": np.uint16}  # dtypes numpy lacks: carried as raw bits of this numpy dtype


class CacheLayoutError(ValueError):
    """Snapshot arrays that do not fit this model's cache (layer count, kinds, shapes, dtypes)."""


def array_name(layer: int, part: str | int) -> str:
    return f"{layer}.{part}"


def split_name(name: str) -> tuple[int, str] | None:
    """`(layer, part)` of a `"LAYER.PART"` array name; None for `"tokens"` or anything else."""
    layer, dot, part = name.partition(".")
    return (int(layer), part) if dot and layer.isdigit() and part else None


def mark_bits(spec: dict[str, Any], part: str | int, dtype: str) -> None:
    """Note in a layer's layout entry that its array `part` holds the raw bits of `dtype`."""
    spec.setdefault("bits", {})[str(part)] = dtype


def bits_dtype(spec: Mapping[str, Any], part: str | int, array: np.ndarray) -> str | None:
    """The dtype whose bits `array` carries (per its layout entry), or None for a plain array."""
    dtype = spec.get("bits", {}).get(str(part))
    if dtype is None:
        return None
    if BITS.get(dtype) != array.dtype:
        expected = np.dtype(BITS[dtype]).name if dtype in BITS else "(unknown)"
        raise CacheLayoutError(f"array {part!r}: {dtype} bits must be {expected}, not {array.dtype}")
    return dtype


def tokens_array(tokens: Sequence[int]) -> np.ndarray:
    return np.asarray(tokens, dtype=np.int32)


def tokens_of(arrays: Mapping[str, np.ndarray]) -> list[int]:
    """The token ids a snapshot's arrays hold."""
    tokens = arrays.get("tokens")
    if tokens is None or tokens.ndim != 1 or tokens.dtype.kind not in "iu":
        raise CacheLayoutError("the snapshot holds no 1-D integer `tokens` array")
    return [int(t) for t in tokens.tolist()]
