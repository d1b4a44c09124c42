"""What the decode loop, the self-check and the session store need of a backend.

`Backend` is a structural protocol: `engine.backend.MLXBackend` (mlx-lm models, Metal or CPU)
and `engine.torch_backend.TorchBackend` (CUDA or CPU) implement it without inheriting from it.
This module imports neither MLX nor torch, so the session layer can name caches and backends
without loading a framework.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np

if TYPE_CHECKING:  # the loader imports MLX; the protocol must not
    from agentfold.engine.mlx.loader import LoadedModel


@dataclass
class CacheState:
    """A conversation's cache: the backend's per-layer state and the tokens it holds."""

    layers: list[Any]
    tokens: list[int] = field(default_factory=list)

    @property
    def length(self) -> int:
        return len(self.tokens)

    def nbytes(self) -> int:
        return sum(int(getattr(layer, "nbytes", 0)) for layer in self.layers)


@dataclass
class Checkpoint:
    """What a pass may have to undo: recurrent layers' state (by layer index) and the token count."""

    length: int
    recurrent: dict[int, list[Any]]


@runtime_checkable
class Backend(Protocol):
    """One model on one framework: caches, passes over rows, exact rollback, snapshots as numpy.

    Every row of `forward` must be computed independently of the others (row-exactness): the
    decode loop's exactness rests on it, and `engine.selfcheck` measures it at start-up.
    """

    name: str  # "mlx" | "torch": part of the snapshot key
    loaded: LoadedModel
    vocab_size: int | None
    has_recurrent_state: bool  # recurrent layers cannot be trimmed: rollback replays kept rows

    def new_cache(self) -> CacheState: ...

    def forward(self, tokens: Sequence[int], cache: CacheState) -> np.ndarray:
        """Logits (float32, one row per token) of `tokens` appended to `cache`."""

    # Optional (see `forward_lanes`): def forward_many(self, lanes: Sequence[Lane]) -> list[np.ndarray]
    # runs several sequences' passes as one pass (lanes): the rows of all of them share the linear
    # layers, each lane attends only to its own cache, and row r of lane i has the bits it has when
    # lane i runs alone by `forward`. Such a backend says `shares_passes = True`: the self-check then
    # verifies lanes too (`ExactnessReport.lanes`) and the scheduler puts replies in one pass.
    # A backend whose prefill is row-exact at every width too says `prefill_rows_exact = True` and
    # takes `forward_many(lanes, logits=[...])`: lanes marked False are prompt rows whose logits
    # nobody reads (an empty array comes back for them); the self-check verifies that
    # (`ExactnessReport.prefill_lanes`) before the scheduler puts prompt rows in shared passes.

    def prefill(self, tokens: Sequence[int], cache: CacheState, boundaries: Sequence[int] = ()) -> None:
        """Append `tokens` in chunks cut at absolute `boundaries`, computing no logits."""

    def prefill_steps(self, tokens: Sequence[int], cache: CacheState) -> Iterator[None]:
        """Append one chunk of `tokens` (no logits), yielding after each layer's share of the work:
        the chunk is in the cache once the iterator is exhausted, bit for bit what `prefill` gives."""

    def checkpoint(self, cache: CacheState) -> Checkpoint: ...

    def rollback(self, cache: CacheState, checkpoint: Checkpoint, keep: int) -> None:
        """Keep the first `keep` rows appended since `checkpoint`, as if only they had been run."""

    def truncate(self, cache: CacheState, length: int) -> None: ...

    def cache_to_arrays(self, cache: CacheState) -> tuple[dict[str, np.ndarray], list[dict[str, Any]]]:
        """The valid rows as numpy arrays and their layout (`engine.cache_layout`)."""

    def arrays_to_cache(self, arrays: Mapping[str, np.ndarray], layout: list[dict[str, Any]]) -> CacheState:
        """A cache holding copies of `arrays`; `CacheLayoutError` when they do not fit this model."""

    def describe(self) -> dict[str, Any]:
        """Kernels, quantization and device: what changes a cache's bytes (snapshot key) and the report."""


Lane = tuple[Sequence[int], CacheState]  # one sequence's rows of a shared pass: its tokens and its cache


def forward_lanes(backend: Backend, lanes: Sequence[Lane], logits: Sequence[bool] | None = None) -> list[np.ndarray]:
    """Each lane's logits, the lanes run as one pass where the backend can (`forward_many`), else one
    `forward` per lane: the same bits either way (each row's arithmetic ignores the other rows).
    `logits` (only for a backend with `prefill_rows_exact`): False for lanes of prompt rows whose
    logits are not wanted (they get an empty array)."""
    many = getattr(backend, "forward_many", None)
    if logits is not None and not all(logits):
        return many(lanes, logits=logits)
    if many is not None and len(lanes) > 1:
        return many(lanes)
    return [backend.forward(tokens, cache) for tokens, cache in lanes]


def split_lanes(logits: np.ndarray, lanes: Sequence[Lane], wanted: Sequence[bool] | None = None) -> list[np.ndarray]:
    """A shared pass's logits [rows, vocab] (of the lanes `wanted`, all by default) cut into each
    lane's rows, each lane's tokens now in its cache (what `forward` does for one); a lane not
    wanted gets no rows."""
    out, begin = [], 0
    for index, (tokens, cache) in enumerate(lanes):
        cache.tokens.extend(int(t) for t in tokens)
        count = len(tokens) if wanted is None or wanted[index] else 0
        out.append(logits[begin : begin + count])
        begin += count
    return out


def prefill_in_chunks(backend: Backend, tokens: Sequence[int], cache: CacheState, boundaries: Sequence[int] = ()) -> None:
    """`Backend.prefill` for any backend: the chunks between `boundaries`, each through its
    `prefill_steps`, so a stepped prefill and a one-call one run the same code."""
    start = cache.length
    end = start + len(tokens)
    offset = start
    for cut in sorted({b for b in boundaries if start < b < end} | {end}):
        for _ in backend.prefill_steps(tokens[offset - start : cut - start], cache):
            pass
        offset = cut
