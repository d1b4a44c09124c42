"""The MLX backend: forward passes over rows of tokens, caches, and exact rollback.

A backend owns the model and knows how to (1) make an empty cache, (2) run a pass of rows and
return their logits, (3) prefill without computing logits, and (4) take a cache back to an
earlier length. Attention caches are trimmed. Recurrent state (mlx-lm `ArraysCache`: gated
DeltaNet, Mamba) cannot be trimmed, so a pass that may be rolled back first snapshots it; a
rollback restores the snapshot and replays the kept rows, which by row-exactness gives the state
serial decoding reaches.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache

from ..kernels import attention
from .loader import LoadedModel


@dataclass
class CacheState:
    """A conversation's cache: per-layer mlx-lm caches and the tokens they hold."""

    layers: list[Any]
    tokens: list[int] = field(default_factory=list)

    @property
    def length(self) -> int:
        return len(self.tokens)

    def nbytes(self) -> int:
        return sum(int(getattr(layer, "nbytes", 0)) for layer in self.layers)


@dataclass
class Checkpoint:
    """What a pass may have to undo: the recurrent layers' arrays and the token count."""

    length: int
    recurrent: dict[int, list[Any]]


class MLXBackend:
    """Runs an mlx-lm model row-exactly (see `kernels.attention`)."""

    name = "mlx"

    def __init__(self, loaded: LoadedModel, row_exact_attention: bool = True) -> None:
        self.loaded = loaded
        self.model = loaded.model
        self.patched = attention.install(self.model) if row_exact_attention else []
        probe = self.new_cache()
        self.recurrent_layers = [i for i, layer in enumerate(probe.layers) if isinstance(layer, ArraysCache)]
        self.vocab_size = int(self.model.args.vocab_size) if hasattr(self.model, "args") else None

    @property
    def has_recurrent_state(self) -> bool:
        return bool(self.recurrent_layers)

    def new_cache(self) -> CacheState:
        """Fresh caches; sliding-window layers get a full KV cache so every layer can be trimmed."""
        if hasattr(self.model, "make_cache"):
            layers = self.model.make_cache()
        else:
            layers = [KVCache() for _ in self.model.layers]
        layers = [KVCache() if isinstance(layer, RotatingKVCache) else layer for layer in layers]
        return CacheState(layers)

    def _run(self, tokens: Sequence[int], cache: CacheState) -> mx.array:
        logits = self.model(mx.array([list(tokens)], dtype=mx.int32), cache=cache.layers)
        cache.tokens.extend(int(t) for t in tokens)
        return logits[0]

    def forward(self, tokens: Sequence[int], cache: CacheState) -> np.ndarray:
        """Logits (float32, [rows, vocab]) of a pass that appends `tokens` to `cache`."""
        logits = self._run(tokens, cache).astype(mx.float32)
        mx.eval(logits)
        return np.array(logits, copy=False)

    def prefill(self, tokens: Sequence[int], cache: CacheState, boundaries: Sequence[int] = ()) -> None:
        """Append `tokens` in chunks cut at absolute `boundaries`; logits are never computed."""
        if not tokens:
            return
        start = cache.length
        end = start + len(tokens)
        cuts = sorted({b for b in boundaries if start < b < end} | {end})
        offset = start
        for cut in cuts:
            self._run(tokens[offset - start : cut - start], cache)
            mx.eval([layer.state for layer in cache.layers])
            offset = cut

    def checkpoint(self, cache: CacheState) -> Checkpoint:
        return Checkpoint(cache.length, {i: _copy_state(cache.layers[i].state) for i in self.recurrent_layers})

    def rollback(self, cache: CacheState, checkpoint: Checkpoint, keep: int) -> None:
        """Keep the first `keep` tokens appended since `checkpoint`; drop the rest exactly."""
        appended = cache.length - checkpoint.length
        if keep >= appended:
            return
        if not self.recurrent_layers:
            self._trim(cache, appended - keep)
            return
        replay = cache.tokens[checkpoint.length : checkpoint.length + keep]
        self._trim(cache, appended)
        for i, state in checkpoint.recurrent.items():
            cache.layers[i].state = _copy_state(state)
        if replay:
            self._run(replay, cache)
            mx.eval([layer.state for layer in cache.layers])

    def truncate(self, cache: CacheState, length: int) -> None:
        """Cut a trimmable cache back to `length` tokens (recurrent models cannot go back)."""
        if self.recurrent_layers and length < cache.length:
            raise ValueError("recurrent state cannot be truncated; restore a snapshot instead")
        self._trim(cache, cache.length - length)

    def _trim(self, cache: CacheState, count: int) -> None:
        if count <= 0:
            return
        for i, layer in enumerate(cache.layers):
            if i not in self.recurrent_layers:
                layer.trim(count)
        del cache.tokens[len(cache.tokens) - count :]

    # --- snapshots (sessions.store) ---

    def cache_to_arrays(self, cache: CacheState) -> tuple[dict[str, mx.array], list[dict[str, Any]]]:
        """The arrays that make up `cache`, and a per-layer layout that says how to put them back."""
        arrays: dict[str, mx.array] = {"tokens": mx.array(np.asarray(cache.tokens, dtype=np.int32))}
        layout: list[dict[str, Any]] = []
        for i, layer in enumerate(cache.layers):
            if isinstance(layer, ArraysCache):
                if layer.left_padding is not None or layer.lengths is not None:
                    raise ValueError(f"layer {i}: batched recurrent state is not supported")
                present = [j for j, a in enumerate(layer.cache) if a is not None]
                arrays.update({f"{i}.{j}": layer.cache[j] for j in present})
                layout.append({"kind": "arrays", "size": len(layer.cache), "present": present})
            elif type(layer) is KVCache:
                if layer.keys is None:
                    layout.append({"kind": "kv", "offset": 0})
                    continue
                n = layer.offset
                arrays[f"{i}.keys"] = layer.keys[..., :n, :]
                arrays[f"{i}.values"] = layer.values[..., :n, :]
                layout.append({"kind": "kv", "offset": n})
            else:
                raise ValueError(f"layer {i}: {type(layer).__name__} caches cannot be snapshotted")
        return arrays, layout

    def arrays_to_cache(self, arrays: dict[str, mx.array], layout: list[dict[str, Any]]) -> CacheState:
        """A new cache holding `arrays`. Each array is a new Python object, so the cache's in-place
        updates (`keys[...] = ...`) can never reach the caller's copy (the store's hot LRU)."""
        cache = self.new_cache()
        if len(cache.layers) != len(layout):
            raise ValueError(f"the snapshot has {len(layout)} layers, the model {len(cache.layers)}")
        for i, (layer, spec) in enumerate(zip(cache.layers, layout, strict=True)):
            if spec["kind"] == "arrays" and isinstance(layer, ArraysCache):
                state = [None] * spec["size"]
                for j in spec["present"]:
                    state[j] = mx.array(arrays[f"{i}.{j}"])
                layer.cache, layer.left_padding, layer.lengths = state, None, None
            elif spec["kind"] == "kv" and type(layer) is KVCache:
                if spec["offset"]:
                    layer.keys, layer.values = mx.array(arrays[f"{i}.keys"]), mx.array(arrays[f"{i}.values"])
                    layer.offset = spec["offset"]
            else:
                raise ValueError(f"layer {i}: snapshot holds {spec['kind']}, the model {type(layer).__name__}")
        cache.tokens = [int(t) for t in np.array(arrays["tokens"])]
        return cache

    def describe(self) -> dict[str, Any]:
        """Kernel identity and library versions: what, besides the weights, decides the bytes."""
        import mlx_lm

        kernels = []  # which mlx-lm modules run the row-exact attention (it decides short prefill chunks)
        for cls in type(self.model).__mro__:
            sdpa = getattr(sys.modules.get(cls.__module__), "scaled_dot_product_attention", None)
            if sdpa is not None:
                kernels.append((cls.__module__, bool(getattr(sdpa, "agentfold_row_exact", False))))
        return {"backend": self.name, "attention": [kernels, attention.PER_ROW_LIMIT],
                "mlx": mx.__version__, "mlx_lm": mlx_lm.__version__}


def _copy_state(state: Sequence[Any]) -> list[Any]:
    """A snapshot of an `ArraysCache` state that later passes cannot change.

    `ArraysCache.state` is (cache, left_padding, lengths), where `cache` is the very list the
    layer assigns its new conv / recurrent arrays into (`cache[i] = ...`). MLX arrays themselves
    are immutable values, but that list must be copied, both when taking the snapshot and when
    restoring it (a checkpoint may be restored more than once).
    """
    return [list(part) if isinstance(part, list) else part for part in state]
