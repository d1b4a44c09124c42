"""MLX pipeline stages: a model split by layers over processes on mlx.core.distributed, bit for bit.

The MLX counterpart of `engine.torch.stages` (same split, commands, stage files and snapshot
layout: `engine.stage_common`). Rank 0 holds the embedding and layers [0, a) and runs the engine
through `MLXStagedBackend`; stage 1 layers [a, b); ...; the last stage the rest, the final norm and
the head (`stage_worker.run_stage`). Every rank runs its layers through the pieces of
`lanes.forward_lanes` that one process runs (`embed_lanes`, `run_layers`, `head_lanes`), and no
sum crosses ranks inside a row, so each row's logits are the bits one process computes. Only the
architectures `lanes` restates can be staged (llama, qwen2, qwen3; no recurrent layers).

Topology: MLX's `ring` backend connects neighbours, so a pass travels the ring 0 -> 1 -> ... ->
N-1 -> 0 (`stage_wire`): hidden states from stage to stage, float32 logits from the last stage back
to rank 0. A command (hello, save, load, shutdown) goes the same way: each stage handles it and
forwards it with its reply added, so rank 0 reads every stage's reply from rank N-1. A prefill
yields after each of rank 0's layers and once for the ring (one step per stage with two stages).

Lengths: a pass names each cache by an integer id with its start position and rows; every rank
sets its layers' `KVCache.offset` to that start before writing, so rows past a rollback are
overwritten by the next pass, and a rollback or truncate only lowers rank 0's token count. A stage
makes a cache when a pass first names it at start 0; rank 0 frees dropped ones with the next command.

Snapshots: as `engine.torch.stages`: rank 0's layers in the arrays, per other stage a 32-byte
`"<first layer>.stage"` array naming the file it wrote (`<its --stage-dir>/<sha256>.safetensors`);
a missing or altered file raises `CacheLayoutError`, so the session layer prefills.

Loading: every rank loads the whole checkpoint, then drops the layers (and embedding / head) it
does not run before the int8 kernels are installed; peak memory while loading is the whole model's.
"""

from __future__ import annotations

import atexit
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from agentfold.engine.cache_layout import tokens_array, tokens_of
from agentfold.engine.mlx import lanes
from agentfold.engine.mlx.backend import MLXBackend, kv_from_arrays, kv_to_arrays
from agentfold.engine.mlx.loader import LoadedModel
from agentfold.engine.mlx.stage_wire import CONNECT_TIMEOUT_S, RingWire, join_ring
from agentfold.engine.protocol import CacheState, Lane, split_lanes
from agentfold.engine.stage_common import (
    StageError,
    StageLayers,
    StageSetupError,
    cache_id_of,
    check_stage_layout,
    close_at_exit,
    first_line,
    model_fingerprint,
    new_stats,
    put_stage_sha,
    raise_reply,
    split_layers,
    stage_layout,
    stage_sha,
    tokens_digest,
)

__all__ = ["MLXStageOptions", "MLXStagedBackend", "StageError", "StageSetupError", "stage_backend"]


@dataclass(frozen=True)
class MLXStageOptions:
    """How rank 0 joins its stages: their count, the MLX ring hostfile, how long to wait for them."""

    backend: ClassVar[str] = "mlx"
    stages: int
    hostfile: str | None = None  # None with one stage
    timeout: float = CONNECT_TIMEOUT_S


_DONE = object()


# --- a stage's share of the model ---------------------------------------------------------------


class _Elsewhere(nn.Module):
    """A layer (or embedding, or head) another stage holds: no weights here. A decoder layer keeps
    `use_sliding`, which the model's `make_cache` reads."""

    def __init__(self, use_sliding: bool = False) -> None:
        super().__init__()
        self.use_sliding = use_sliding


def fingerprint(loaded: LoadedModel) -> str:
    """What every rank must agree on before pruning (`stage_common.model_fingerprint`)."""
    return model_fingerprint(loaded.config, loaded.dtype, np.array(loaded.model.model.norm.weight.astype(mx.float32)))


def stage_plan(loaded: LoadedModel, stages: int) -> list[range]:
    """The split of `loaded` over `stages` ranks; StageSetupError for a model MLX stages cannot run."""
    if not lanes.supports(loaded.model):
        kind = loaded.config.get("model_type", type(loaded.model).__module__)
        raise StageSetupError(f"{loaded.name} is a {kind} model: MLX pipeline stages run llama, qwen2 and qwen3 "
                              "models only (try --backend torch)")
    return split_layers(len(loaded.model.model.layers), stages)


def prune(loaded: LoadedModel, plan: Sequence[range], rank: int) -> None:
    """Drop the decoder layers outside this rank's share, the head before the last stage, and the
    embedding where neither the first stage nor a tied head on the last reads it (before the int8
    kernels replace the linear layers: only what stays is converted)."""
    model, inner = loaded.model, loaded.model.model
    for index, layer in enumerate(inner.layers):
        if index not in plan[rank]:
            inner.layers[index] = _Elsewhere(bool(getattr(layer, "use_sliding", False)))
    last, tied = rank == len(plan) - 1, bool(model.args.tie_word_embeddings)
    if not last and not tied:
        model.lm_head = _Elsewhere()
    if rank > 0 and not (last and tied):
        inner.embed_tokens = _Elsewhere()


def stage_backend(loaded: LoadedModel, quant: str, plan: Sequence[range], rank: int) -> MLXBackend:
    """An `MLXBackend` over rank `rank`'s share of `loaded` (the rest dropped in place)."""
    prune(loaded, plan, rank)
    return MLXBackend(loaded, quant=quant)


def place(caches: Sequence[Any], layers: range, start: int) -> None:
    """Write the next rows of these layers at `start` (rows past it, left by a rollback, are overwritten)."""
    for index in layers:
        caches[index].offset = start


def run_share(model: nn.Module, h: mx.array, passes: Sequence[tuple[list[Any], int, int]], layers: range) -> mx.array:
    """`layers` over the rows `h` of `passes` (caches, start, rows), lazily (the stages' common step)."""
    for caches, start, _ in passes:
        place(caches, layers, start)
    starts = [0]
    for _, _, rows in passes:
        starts.append(starts[-1] + rows)
    return lanes.run_layers(model, h, starts, [caches for caches, _, _ in passes], layers)


def logits_of(model: nn.Module, h: mx.array) -> mx.array:
    """float32 logits [rows, vocab] of all rows of `h` (norm and head are per row: one lane of all)."""
    return lanes.head_lanes(model, h, [0, h.shape[1]])[0].astype(mx.float32)


class MLXStagedBackend(MLXBackend):
    """Rank 0 of an MLX pipeline: the Backend protocol over its layers and the stages' (see the module).

    `loaded` is taken over (other stages' layers dropped in place). With one stage it is an
    `MLXBackend` with another describe(); with more, the constructor joins the ring (up to
    `options.timeout`) and checks that every stage agrees on model and split.
    """

    def __init__(self, loaded: LoadedModel, quant: str = "auto", options: MLXStageOptions | None = None,
                 progress: Callable[[str], None] | None = None) -> None:
        self.options = options or MLXStageOptions(1)
        self.plan = stage_plan(loaded, self.options.stages)
        self.own = self.plan[0]
        self._fingerprint = fingerprint(loaded)
        self._ids = iter(range(1 << 62))
        self._frees: deque[int] = deque()
        prune(loaded, self.plan, 0)
        super().__init__(loaded, quant=quant)
        self.shares_passes = True  # every pass runs its lanes as one (`lanes`), on every stage
        self._lock = threading.Lock()  # one message around the ring at a time
        self._broken: str | None = None
        self._stats = new_stats(self.plan)
        self.wire: RingWire | None = None
        self.remote: list[dict[str, Any]] = []
        if len(self.plan) > 1:
            if not self.options.hostfile:
                raise StageSetupError("MLX stages need a hostfile (--hostfile FILE)")
            say = progress or (lambda message: None)
            say(f"pipeline: joining the MLX ring of {len(self.plan)} ranks in {self.options.hostfile}")
            self.wire = RingWire(join_ring(0, len(self.plan), self.options.hostfile, self.options.timeout))
            atexit.register(close_at_exit, weakref.ref(self))
            replies, _ = self._exchange({"op": "hello", "world": len(self.plan), "fingerprint": self._fingerprint,
                                         "plan": [[r.start, r.stop] for r in self.plan], "quant": self.quant,
                                         "dtype": str(loaded.dtype)}, setup=True)
            self.remote = [replies[str(stage)]["describe"] for stage in range(1, len(self.plan))]
            say("pipeline: " + ", ".join(f"{'rank 0' if s == 0 else f'stage {s}'} layers {r.start}..{r.stop - 1}"
                                         for s, r in enumerate(self.plan)) + " over the MLX ring")

    # --- the ring ---

    def _exchange(self, header: dict[str, Any], array: mx.array | None = None, setup: bool = False,
                  closing: bool = False) -> tuple[dict[str, Any], mx.array | None]:
        """Send one message around the ring and wait for it (under the lock: nothing interleaves);
        returns every stage's reply by stage number, and the array the last stage sent back."""
        if self.wire is None or (self._broken is not None and not closing):
            raise StageError(f"the pipeline is down ({self._broken or 'closed'})")
        gone = [self._frees.popleft() for _ in range(len(self._frees))]
        header = {**header, "replies": {}, **({"free": gone} if gone else {})}
        began, failed = time.perf_counter(), None
        if not self._lock.acquire(timeout=10.0 if closing else -1):  # at exit, a pass may hold it for long
            raise StageError("the MLX ring is busy with another message")
        try:
            sent = self.wire.send(header, array)
            back, out, received = self.wire.recv()
        except BaseException as error:  # a half-done message leaves the ring out of step: stop using it
            self._broken = f"the MLX ring broke: {first_line(error)}"
            if not isinstance(error, Exception):
                raise
            failed = self._broken
        finally:
            self._lock.release()
        if failed is not None:
            raise StageError(failed)
        replies = back.get("replies", {})
        took = time.perf_counter() - began
        self._stats[0]["bytes_sent"] += sent
        for stage in range(1, len(self.plan)):
            reply, stats = replies.get(str(stage), {}), self._stats[stage]
            stats["round_trip_seconds"] += took  # one round trip covers every stage of the ring
            stats["seconds"] += float(reply.get("seconds", 0.0))
            stats["bytes_sent"] += received if stage == len(self.plan) - 1 else int(reply.get("sent", 0))
        for stage in range(1, len(self.plan)):
            raise_reply(stage, replies.get(str(stage), {"error": "skipped (an earlier stage failed)"}), setup)
        return replies, out

    def new_cache(self) -> CacheState:
        layers = StageLayers(super().new_cache().layers)
        layers.cache_id = next(self._ids)
        weakref.finalize(layers, self._frees.append, layers.cache_id)  # the stages free it with the next message
        return CacheState(layers)

    # --- passes ---

    def _own_share(self, lanes_: Sequence[Lane]) -> tuple[mx.array, list[list[int]]]:
        """Rank 0's layers over the lanes' rows (lazy), and the pass as the stages are told it."""
        h, _ = lanes.embed_lanes(self.model, [tokens for tokens, _ in lanes_])
        passes = [(cache.layers, cache.length, len(tokens)) for tokens, cache in lanes_]
        described = [[cache_id_of(cache), cache.length, len(tokens)] for tokens, cache in lanes_]
        return run_share(self.model, h, passes, self.own), described

    def _stages(self, h: mx.array, described: list[list[int]], prefill: bool) -> mx.array | None:
        """The other stages' layers over h: the last stage's float32 logits (None in a prefill)."""
        _, out = self._exchange({"op": "pass", "passes": described, "prefill": prefill}, h)
        for stats in self._stats[1:]:
            stats["passes"] += 1
        return out

    def forward(self, tokens: Sequence[int], cache: CacheState) -> np.ndarray:
        return self.forward_many([(tokens, cache)])[0]

    def forward_many(self, lanes_: Sequence[Lane]) -> list[np.ndarray]:
        """Each lane's logits, all lanes' rows in one pass on every stage (`MLXBackend.forward_many`)."""
        began = time.perf_counter()
        h, described = self._own_share(lanes_)
        out = logits_of(self.model, h) if len(self.plan) == 1 else h
        mx.eval(out)
        self._stats[0]["seconds"] += time.perf_counter() - began
        self._stats[0]["passes"] += 1
        logits = out if len(self.plan) == 1 else self._stages(h, described, prefill=False)
        return split_lanes(np.array(logits, copy=False), lanes_)

    def prefill_steps(self, tokens: Sequence[int], cache: CacheState) -> Iterator[None]:
        """One chunk: a yield after each of rank 0's layers, then one after the ring's round trip;
        the cache holds the chunk once exhausted (closed early: unchanged, the rows written are unread)."""
        if not tokens:
            return
        h, described = self._own_share([(tokens, cache)])
        for index in self.own:
            began = time.perf_counter()
            mx.eval(cache.layers[index].state)
            self._stats[0]["seconds"] += time.perf_counter() - began
            yield
        mx.eval(h)
        self._stats[0]["passes"] += 1
        if len(self.plan) > 1:
            self._stages(h, described, prefill=True)
            yield
        cache.tokens.extend(int(t) for t in tokens)

    # --- snapshots: rank 0's layers here, each stage's in its own directory ---

    def cache_to_arrays(self, cache: CacheState) -> tuple[dict[str, np.ndarray], list[dict[str, Any]]]:
        arrays: dict[str, np.ndarray] = {"tokens": tokens_array(cache.tokens)}
        n = cache.length
        layout = [kv_to_arrays(arrays, i, layer, n) if i in self.own else stage_layout(self.plan, i, n)
                  for i, layer in enumerate(cache.layers)]
        if len(self.plan) > 1:
            replies, _ = self._exchange({"op": "save", "cache": cache_id_of(cache), "length": n,
                                         "tokens": tokens_digest(cache.tokens)})
            for stage in range(1, len(self.plan)):
                put_stage_sha(arrays, self.plan, stage, replies[str(stage)]["sha"])
        return arrays, layout

    def arrays_to_cache(self, arrays: Mapping[str, np.ndarray], layout: list[dict[str, Any]]) -> CacheState:
        """A new cache: rank 0's layers from `arrays`, each stage's from its file (CacheLayoutError
        when any of them is missing, altered or does not fit)."""
        cache, tokens = self.new_cache(), tokens_of(arrays)
        n = len(tokens)
        check_stage_layout(self.plan, layout, n)
        for i in self.own:
            kv_from_arrays(arrays, i, layout[i], cache.layers[i])
        if len(self.plan) > 1:
            shas = {str(stage): stage_sha(arrays, self.plan, stage) for stage in range(1, len(self.plan))}
            self._exchange({"op": "load", "cache": cache_id_of(cache), "shas": shas, "length": n,
                            "tokens": tokens_digest(tokens)})
        cache.tokens = tokens
        return cache

    # --- report and shutdown ---

    def describe(self) -> dict[str, Any]:
        """`MLXBackend.describe` plus the split and every stage's kernels (all of them decide the bytes)."""
        return {**super().describe(), "stages": [[r.start, r.stop] for r in self.plan], "stage_transport": "ring",
                "stage_kernels": self.remote}

    def stage_stats(self) -> dict[str, Any]:
        """Per stage: passes, compute seconds, bytes it sent (rank 0's to stage 1; a middle stage's
        arrays; the last stage's messages back), and the ring's round trip seen from rank 0."""
        return {"transport": "ring", "stages": [dict(entry) for entry in self._stats]}

    def close(self) -> None:
        """Send shutdown around the ring (each stage exits after forwarding it; they also exit by
        themselves when rank 0's process ends). MLX cannot close a ring: this process keeps it."""
        if self.wire is None:
            return
        if self._broken is None:
            try:
                self._exchange({"op": "shutdown"}, closing=True)
            except StageError:
                pass
        self.wire, self._broken = None, "closed"
