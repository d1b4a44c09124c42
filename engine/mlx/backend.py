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
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache

from agentfold.engine.cache_layout import CacheLayoutError, array_name, bits_dtype, mark_bits, tokens_array, tokens_of
from agentfold.engine.mlx import lanes as lanes_mod
from agentfold.engine.mlx.loader import LoadedModel
from agentfold.engine.protocol import CacheState, Checkpoint, Lane, prefill_in_chunks
from agentfold.kernels import attention, mlx_int8

__all__ = ["CacheState", "Checkpoint", "MLXBackend", "resolve_quant"]


class MLXBackend:
    """Runs an mlx-lm model row-exactly (see `kernels.attention`)."""

    name = "mlx"

    def __init__(self, loaded: LoadedModel, row_exact_attention: bool = True, quant: str = "auto") -> None:
        self.loaded = loaded
        self.model = loaded.model
        self.quant = resolve_quant(quant, self.model)
        if self.quant == "int8":
            mlx_int8.install(self.model)
            self.model.agentfold_quant = "int8"
        self.patched = attention.install(self.model) if row_exact_attention else []
        probe = self.new_cache()
        self.recurrent_layers = [i for i, layer in enumerate(probe.layers) if isinstance(layer, ArraysCache)]
        # whether `forward_many` runs lanes as one pass (else one `forward` per lane): decided once
        self.shares_passes = lanes_mod.supports(self.model) and not self.recurrent_layers
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

    def forward_many(self, lanes: Sequence[Lane]) -> list[np.ndarray]:
        """`forward` of each lane, the lanes run as one pass (`engine.mlx.lanes`): the same bits, the
        weights read once. Other models, other caches, empty or shared lanes: one `forward` each."""
        caches = [cache for _, cache in lanes]
        if (len(lanes) < 2 or not self.shares_passes or len({id(c) for c in caches}) < len(caches)
                or not all(tokens and lanes_mod.plain_kv(c.layers) for tokens, c in lanes)):
            return [self.forward(tokens, cache) for tokens, cache in lanes]
        logits = lanes_mod.forward_lanes(self.model, [(tokens, cache.layers) for tokens, cache in lanes])
        logits = [lane.astype(mx.float32) for lane in logits]
        mx.eval(logits)
        for tokens, cache in lanes:
            cache.tokens.extend(int(t) for t in tokens)
        return [np.array(lane, copy=False) for lane in logits]

    def prefill(self, tokens: Sequence[int], cache: CacheState, boundaries: Sequence[int] = ()) -> None:
        """Append `tokens` in chunks cut at absolute `boundaries`; logits are never computed."""
        prefill_in_chunks(self, tokens, cache, boundaries)

    def prefill_steps(self, tokens: Sequence[int], cache: CacheState) -> Iterator[None]:
        """Append one chunk of `tokens`, evaluating one layer's cache per step and yielding between.

        The chunk's graph is built lazily in one call; evaluating layer i's keys and values runs
        the layers up to it, so each step adds about one layer of work, and a scheduler can run
        other replies' passes in between. Evaluation order does not change what an array holds.
        Closed early, the cache is still whole: its remaining arrays are lazy and compute on use.
        """
        if not tokens:
            return
        self._run(tokens, cache)  # graph only: nothing is computed yet, the logits never are
        for layer in cache.layers:
            mx.eval(layer.state)
            yield
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

    # --- snapshots (sessions.snapshots; engine.cache_layout) ---

    def cache_to_arrays(self, cache: CacheState) -> tuple[dict[str, np.ndarray], list[dict[str, Any]]]:
        """The arrays that make up `cache`, as numpy (bfloat16 as uint16 bits, see `cache_layout`), and a
        per-layer layout that says how to put them back."""
        arrays: dict[str, np.ndarray] = {"tokens": tokens_array(cache.tokens)}
        layout: list[dict[str, Any]] = []
        for i, layer in enumerate(cache.layers):
            if isinstance(layer, ArraysCache):
                if layer.left_padding is not None or layer.lengths is not None:
                    raise CacheLayoutError(f"layer {i}: batched recurrent state is not supported")
                present = [j for j, a in enumerate(layer.cache) if a is not None]
                spec: dict[str, Any] = {"kind": "arrays", "size": len(layer.cache), "present": present}
                for j in present:
                    _put(arrays, spec, i, j, layer.cache[j])
            elif type(layer) is KVCache:
                spec = kv_to_arrays(arrays, i, layer, layer.offset if layer.keys is not None else 0)
            else:
                raise CacheLayoutError(f"layer {i}: {type(layer).__name__} caches cannot be snapshotted")
            layout.append(spec)
        return arrays, layout

    def arrays_to_cache(self, arrays: Mapping[str, np.ndarray], layout: list[dict[str, Any]]) -> CacheState:
        """A new cache holding `arrays` (as `cache_to_arrays` gives them). They are copied into MLX, so
        the cache's in-place updates (`keys[...] = ...`) can never reach the caller's copy (the store's
        hot LRU). Raises CacheLayoutError when they do not fit this model's cache."""
        cache = self.new_cache()
        if len(cache.layers) != len(layout):
            raise CacheLayoutError(f"the snapshot has {len(layout)} layers, the model {len(cache.layers)}")

        for i, (layer, spec) in enumerate(zip(cache.layers, layout, strict=True)):
            if spec.get("kind") == "arrays" and isinstance(layer, ArraysCache):
                state = [None] * spec["size"]
                for j in spec["present"]:
                    state[j] = _get(arrays, spec, i, j)
                layer.cache, layer.left_padding, layer.lengths = state, None, None
            elif spec.get("kind") == "kv" and type(layer) is KVCache:
                kv_from_arrays(arrays, i, spec, layer)
            else:
                raise CacheLayoutError(f"layer {i}: snapshot holds {spec.get('kind')}, "
                                       f"the model {type(layer).__name__}")
        cache.tokens = tokens_of(arrays)
        return cache

    def describe(self) -> dict[str, Any]:
        """Kernel identity and library versions: what, besides the weights, decides the bytes."""
        import mlx_lm

        kernels = []  # which mlx-lm modules run the row-exact attention (it decides short prefill chunks)
        for cls in type(self.model).__mro__:
            sdpa = getattr(sys.modules.get(cls.__module__), "scaled_dot_product_attention", None)
            if sdpa is not None:
                kernels.append((cls.__module__, bool(getattr(sdpa, "agentfold_row_exact", False))))
        linear = f"mlx_int8/{mlx_int8.VERSION}" if self.quant == "int8" else "float"
        return {"backend": self.name, "attention": [kernels, attention.PER_ROW_LIMIT], "linear": linear,
                "mlx": mx.__version__, "mlx_lm": mlx_lm.__version__}


def kv_to_arrays(arrays: dict[str, np.ndarray], i: int, layer: KVCache, length: int) -> dict[str, Any]:
    """Layer `i`'s keys and values of its first `length` positions into `arrays` (numpy copies,
    bfloat16 as bits); its layout entry."""
    spec: dict[str, Any] = {"kind": "kv", "offset": length}
    if length:
        _put(arrays, spec, i, "keys", layer.keys[..., :length, :])
        _put(arrays, spec, i, "values", layer.values[..., :length, :])
    return spec


def kv_from_arrays(arrays: Mapping[str, np.ndarray], i: int, spec: dict[str, Any], layer: KVCache) -> None:
    """Layer `i`'s snapshot keys and values into an empty `layer` (copied into MLX)."""
    if spec["offset"]:
        layer.keys, layer.values = _get(arrays, spec, i, "keys"), _get(arrays, spec, i, "values")
        layer.offset = spec["offset"]


def _put(arrays: dict[str, np.ndarray], spec: dict[str, Any], i: int, part: str | int, array: mx.array) -> None:
    if array.dtype == mx.bfloat16:
        mark_bits(spec, part, "bfloat16")
        array = array.view(mx.uint16)
    arrays[array_name(i, part)] = np.array(array)


def _get(arrays: Mapping[str, np.ndarray], spec: dict[str, Any], i: int, part: str | int) -> mx.array:
    found = arrays.get(array_name(i, part))
    if found is None:
        raise CacheLayoutError(f"layer {i}: the snapshot has no {array_name(i, part)!r} array")
    return mx.array(found).view(mx.bfloat16) if bits_dtype(spec, part, found) else mx.array(found)


QUANT_MODES = ("int8", "none")


def resolve_quant(quant: str, model: Any) -> str:
    """`auto` and `int8`: linear layers on int8 arithmetic, row-exact by construction (`kernels.mlx_int8`);
    `none`: the model's own float weights, row-exact only as wide as the BLAS happens to be."""
    if quant not in ("auto", *QUANT_MODES):
        raise ValueError(f"quant must be auto, {', '.join(QUANT_MODES)}, not {quant!r}")
    done = getattr(model, "agentfold_quant", None)
    if done == "int8" and quant == "none":
        raise ValueError("this model's linear layers were already replaced by int8 ones (load it again for float)")
    return "none" if quant == "none" else "int8"


def _copy_state(state: Sequence[Any]) -> list[Any]:
    """A snapshot of an `ArraysCache` state that later passes cannot change.

    `ArraysCache.state` is (cache, left_padding, lengths), where `cache` is the very list the
    layer assigns its new conv / recurrent arrays into (`cache[i] = ...`). MLX arrays themselves
    are immutable values, but that list must be copied, both when taking the snapshot and when
    restoring it (a checkpoint may be restored more than once).
    """
    return [list(part) if isinstance(part, list) else part for part in state]
