"""Pipeline stages across processes: a model split by layers over ranks, logits bit for bit.

Rank 0 (the driver) holds the embedding and layers [0, a); stage 1 layers [a, b); ...; the last
stage the remaining layers, the final norm and the head. Rank 0 runs the engine (decode loop,
sessions, HTTP) through `StagedBackend`, a `TorchBackend` whose passes leave the process after
its own layers; every other rank runs `stage_worker.run_stage`. No sum crosses ranks inside a
row's arithmetic (a stage runs whole layers, `Transformer.stage_steps`), so each row's logits are
the bits one process running the whole model computes.

Topology: a star around rank 0. A pass sends the hidden states to stage 1, which answers with its
own; rank 0 sends those to stage 2, and so on; the last stage answers with float32 logits. For two
stages this is the chain 0 -> 1 -> 0; for more, each stage boundary costs one more hop, in exchange
every exchange is one request and one reply between rank 0 and one stage (errors and timings are
per stage, a prefill yields after each stage, and replies can never arrive out of order).

Lengths: a pass names each sequence's cache by an integer id (allocated here) with its start
position and row count, and a stage writes its rows at that start and attends to [0, start +
rows). So a stage never tracks a length: a rollback or truncate only lowers rank 0's token count
(as on `TorchBackend`), and the next pass overwrites the rows past it on every stage. A stage
creates a cache when a pass first names it at start 0; rank 0 tells the stages to free the caches
it has dropped (piggy-backed on the next exchange).

Snapshots: each stage keeps the KV of its own layers (`stage_worker`). `cache_to_arrays` returns
rank 0's layers as `TorchBackend` does, a `{"kind": "stage"}` layout entry for each other layer,
and per stage a 32-byte array `"<first layer>.stage"`: the sha256 of the arrays that stage wrote
to `<its --stage-dir>/<sha>.safetensors`. `arrays_to_cache` asks each stage to load its file by that sha
(checked); a missing or altered file raises `CacheLayoutError`, so the session layer prefills.

Loading: every rank loads the whole checkpoint (`load_torch_model`: GGUF and safetensors alike),
then drops the layers other stages hold before quantizing, and the embedding / head it does not
use after. Peak memory while loading is the whole model's; resident after that, its share.

Wire (`stage_wire`): a JSON header and a tensor's raw bytes per message, over `torch.distributed`
point-to-point calls (gloo on CPU, the tested transport; `nccl` for CUDA is written, not run).
"""

from __future__ import annotations

import atexit
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn

from agentfold.engine.cache_layout import tokens_array
from agentfold.engine.mlx.loader import LoadedModel
from agentfold.engine.protocol import CacheState, Lane, split_lanes
from agentfold.engine.stage_common import (
    StageLayers,
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
from agentfold.engine.torch.backend import TorchBackend, kv_from_arrays, kv_to_arrays
from agentfold.engine.torch.models.llama import SequencePass
from agentfold.engine.torch.stage_wire import (
    CONNECT_TIMEOUT_S,
    IDLE_TIMEOUT,
    REPLY_TIMEOUT,
    TRANSPORTS,
    StageError,
    StageSetupError,
    Wire,
    connect,
    parse_master,
)
from agentfold.kernels import torch_cpu

__all__ = ["CONNECT_TIMEOUT_S", "IDLE_TIMEOUT", "TRANSPORTS", "StageError", "StageOptions", "StageSetupError",
           "StagedBackend", "Wire", "connect", "parse_master", "split_layers"]


@dataclass(frozen=True)
class StageOptions:
    """How rank 0 reaches its stages: their count, the address it listens on, the transport."""

    backend: ClassVar[str] = "torch"
    stages: int
    master: str = "127.0.0.1:29500"
    transport: str = "gloo"
    timeout: float = CONNECT_TIMEOUT_S  # seconds to wait for every rank to connect


_DONE = object()


# --- a stage's share of the model ---------------------------------------------------------------


class _Elsewhere(nn.Module):
    """A decoder layer another stage holds: no weights here (`stage_steps` never reaches it)."""


def fingerprint(loaded: LoadedModel) -> str:
    """What every rank must agree on before pruning (`stage_common.model_fingerprint`)."""
    return model_fingerprint(loaded.config, loaded.dtype, loaded.model.model.norm.weight.detach().float().cpu().numpy())


def drop_layers(model: nn.Module, own: range) -> None:
    """Release the decoder layers outside `own` (before quantizing: only this stage's are quantized)."""
    layers = model.model.layers
    for index in range(len(layers)):
        if index not in own:
            layers[index] = _Elsewhere()


def drop_ends(model: nn.Module, first: bool, last: bool) -> None:
    """Release the head a stage before the last never runs, and the embedding only the first and a
    tied float head read (after quantizing: the int8 head is a copy)."""
    if not last:
        model.head_quantized = None
        model.lm_head = None
    tied_float_head = last and model.lm_head is None and getattr(model, "head_quantized", None) is None
    if not first and not tied_float_head:
        weight = model.model.embed_tokens.weight
        model.model.embed_tokens.weight = nn.Parameter(weight.new_empty(0, weight.shape[1]), requires_grad=False)


def stage_backend(loaded: LoadedModel, quant: str, plan: Sequence[range], rank: int) -> TorchBackend:
    """A `TorchBackend` over rank `rank`'s layers of `plan` only (the others dropped)."""
    drop_layers(loaded.model, plan[rank])
    backend = TorchBackend(loaded, quant=quant)
    drop_ends(backend.model, first=rank == 0, last=rank == len(plan) - 1)
    return backend


class StagedBackend(TorchBackend):
    """Rank 0 of a pipeline: the Backend protocol over its layers and the stages' (see the module).

    `loaded` is taken over: the layers other stages hold are dropped from its model in place. With
    `options.stages` 1 it is a `TorchBackend` with another describe(); with more, the constructor
    waits (up to `options.timeout`) for every stage to connect and agree on model and split.
    """

    def __init__(self, loaded: LoadedModel, quant: str = "auto", options: StageOptions | None = None,
                 progress: Callable[[str], None] | None = None) -> None:
        self.options = options or StageOptions(1)
        self.plan = split_layers(len(loaded.model.model.layers), self.options.stages)
        self.own = self.plan[0]
        self._fingerprint = fingerprint(loaded)
        drop_layers(loaded.model, self.own)
        super().__init__(loaded, quant=quant)
        self.prefill_rows_exact = False  # its forward_many runs lanes through the stages, every lane's logits
        drop_ends(self.model, first=True, last=len(self.plan) == 1)
        self._lock = threading.Lock()  # one exchange at a time (request, then its reply)
        self._ids = iter(range(1 << 62))
        self._frees: list[deque[int]] = [deque() for _ in self.plan]
        self._broken: str | None = None  # why the pipeline is down, and which stage's exchange broke
        self._broken_stage = 0
        self._stats = new_stats(self.plan)
        self.wire: Wire | None = None
        self.remote: list[dict[str, Any]] = []
        if len(self.plan) > 1:
            say = progress or (lambda message: None)
            say(f"pipeline: waiting for {len(self.plan) - 1} stage(s) at {self.options.master}")
            self._store, group = connect(0, len(self.plan), self.options.master, self.options.transport,
                                         self.options.timeout)
            self.wire = Wire(group, torch.device("cuda" if self.options.transport == "nccl" else "cpu"))
            atexit.register(close_at_exit, weakref.ref(self))
            self.remote = [self._hello(stage) for stage in range(1, len(self.plan))]
            say("pipeline: " + ", ".join(f"{'rank 0' if s == 0 else f'stage {s}'} layers {r.start}..{r.stop - 1}"
                                         for s, r in enumerate(self.plan)) + f" over {self.options.transport}")

    def _hello(self, stage: int) -> dict[str, Any]:
        reply, _ = self._exchange(stage, {"op": "hello", "world": len(self.plan), "fingerprint": self._fingerprint,
                                          "plan": [[r.start, r.stop] for r in self.plan], "quant": self.quant,
                                          "dtype": str(self.loaded.dtype)}, setup=True)
        return reply["describe"]

    # --- exchanges ---

    def _exchange(self, stage: int, header: dict[str, Any], tensor: torch.Tensor | None = None,
                  setup: bool = False, timeout: timedelta = REPLY_TIMEOUT,
                  closing: bool = False) -> tuple[dict[str, Any], torch.Tensor | None]:
        """Send one command to `stage` and wait for its reply (under the lock: nothing interleaves)."""
        if self.wire is None or (self._broken is not None and not closing):
            raise StageError(f"the pipeline is down ({self._broken or 'closed'})")
        frees = self._frees[stage]
        gone = [frees.popleft() for _ in range(len(frees))]
        if gone:
            header = {**header, "free": gone}
        began, failed = time.perf_counter(), None
        if not self._lock.acquire(timeout=10.0 if closing else -1):  # at exit, a pass may hold it for long
            raise StageError(f"stage {stage}: busy with another exchange")
        try:
            sent = self.wire.send(stage, header, tensor)
            reply, out, received = self.wire.recv(stage, timeout)
        except BaseException as error:  # a half-done exchange leaves the wire out of step: stop using it
            self._broken, self._broken_stage = f"stage {stage} stopped answering: {first_line(error)}", stage
            if not isinstance(error, Exception):
                raise
            failed = self._broken
        finally:
            self._lock.release()
        if failed is not None:  # raised here, not in `except`: no traceback keeps the group (and its sockets) alive
            raise StageError(failed)
        stats = self._stats[stage]
        stats["round_trip_seconds"] += time.perf_counter() - began
        stats["seconds"] += float(reply.get("seconds", 0.0))
        stats["bytes_sent"] += received
        self._stats[0]["bytes_sent"] += sent
        raise_reply(stage, reply, setup)
        return reply, out

    def _forget(self, cache_id: int) -> None:
        """A cache was dropped: the stages free its KV with the next exchange (called by GC)."""
        for frees in self._frees[1:]:
            frees.append(cache_id)

    def new_cache(self) -> CacheState:
        layers = StageLayers(self.model.make_cache())
        layers.cache_id = next(self._ids)
        weakref.finalize(layers, self._forget, layers.cache_id)
        return CacheState(layers)

    # --- passes ---

    def _own_layers(self, ids: torch.Tensor, passes: list[SequencePass]) -> torch.Tensor:
        began, final = time.perf_counter(), []
        for _ in self.model.stage_steps(self.model.embed(ids), passes, self.own, final):
            pass
        self._stats[0]["seconds"] += time.perf_counter() - began
        self._stats[0]["passes"] += 1
        return final[0]

    def _stage_pass(self, stage: int, h: torch.Tensor, described: list[list[int]], prefill: bool) -> torch.Tensor | None:
        """Stage `stage`'s layers over h: its hidden states, the last stage's logits (None in a prefill)."""
        reply, out = self._exchange(stage, {"op": "pass", "passes": described, "prefill": prefill}, h)
        self._stats[stage]["passes"] += 1
        return None if out is None else out.to(self.device)

    def forward(self, tokens: Sequence[int], cache: CacheState) -> np.ndarray:
        return self.forward_many([(tokens, cache)])[0]

    def forward_many(self, lanes: Sequence[Lane]) -> list[np.ndarray]:
        """Each lane's logits, all lanes' rows in one pass on every stage (`TorchBackend.forward_many`)."""
        with torch.inference_mode():
            ids = torch.tensor([int(t) for tokens, _ in lanes for t in tokens], dtype=torch.long, device=self.device)
            passes = [SequencePass(cache.layers, cache.length, len(tokens)) for tokens, cache in lanes]
            described = [[cache_id_of(cache), cache.length, len(tokens)] for tokens, cache in lanes]
            h = self._own_layers(ids, passes)
            for stage in range(1, len(self.plan)):
                h = self._stage_pass(stage, h, described, prefill=False)
            logits = self.model.logits(h) if len(self.plan) == 1 else h
            logits = logits.float().cpu().numpy()
        return split_lanes(logits, lanes)

    def prefill_steps(self, tokens: Sequence[int], cache: CacheState) -> Iterator[None]:
        """One chunk: a yield after each of rank 0's layers, then one after each stage's share; the
        cache holds the chunk once exhausted (closed early: unchanged, the rows written are unread)."""
        if not tokens:
            return
        ids = torch.tensor([int(t) for t in tokens], dtype=torch.long, device=self.device)
        passes = [SequencePass(cache.layers, cache.length, len(tokens))]
        described = [[cache_id_of(cache), cache.length, len(tokens)]]
        final: list[torch.Tensor] = []
        with torch.inference_mode(), torch_cpu.prefill_chunk():
            steps = self.model.stage_steps(self.model.embed(ids), passes, self.own, final)
        while True:
            began = time.perf_counter()
            with torch.inference_mode(), torch_cpu.prefill_chunk():
                step = next(steps, _DONE)
            self._stats[0]["seconds"] += time.perf_counter() - began
            if step is _DONE:
                break
            yield
        self._stats[0]["passes"] += 1
        h = final[0]
        for stage in range(1, len(self.plan)):
            h = self._stage_pass(stage, h, described, prefill=True)
            yield
        cache.tokens.extend(int(t) for t in tokens)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # --- snapshots: rank 0's layers here, each stage's in its own directory ---

    def cache_to_arrays(self, cache: CacheState) -> tuple[dict[str, np.ndarray], list[dict[str, Any]]]:
        arrays: dict[str, np.ndarray] = {"tokens": tokens_array(cache.tokens)}
        layout: list[dict[str, Any]] = []
        n = cache.length
        for i, layer in enumerate(cache.layers):
            layout.append(kv_to_arrays(arrays, i, layer, n) if i in self.own else stage_layout(self.plan, i, n))
        header = {"op": "save", "cache": cache_id_of(cache), "length": n, "tokens": tokens_digest(cache.tokens)}
        for stage in range(1, len(self.plan)):
            reply, _ = self._exchange(stage, header)
            put_stage_sha(arrays, self.plan, stage, reply["sha"])
        return arrays, layout

    def arrays_to_cache(self, arrays: Mapping[str, np.ndarray], layout: list[dict[str, Any]]) -> CacheState:
        """A new cache: rank 0's layers from `arrays`, each stage's from its file (CacheLayoutError
        when any of them is missing, altered or does not fit)."""
        cache, tokens = self._cache_for(arrays, layout)
        n = len(tokens)
        check_stage_layout(self.plan, layout, n)
        for i in self.own:
            kv_from_arrays(arrays, i, layout[i], cache.layers[i], n)
        for stage in range(1, len(self.plan)):
            self._exchange(stage, {"op": "load", "cache": cache_id_of(cache), "sha": stage_sha(arrays, self.plan, stage),
                                   "length": n, "tokens": tokens_digest(tokens)})
        cache.tokens = tokens
        return cache

    # --- report and shutdown ---

    def describe(self) -> dict[str, Any]:
        """`TorchBackend.describe` plus the split and every stage's kernels (all of them decide the bytes)."""
        return {**super().describe(), "stages": [[r.start, r.stop] for r in self.plan],
                "stage_transport": self.options.transport, "stage_kernels": self.remote}

    def stage_stats(self) -> dict[str, Any]:
        """Per stage: passes, compute seconds, bytes it sent (measured on rank 0; rank 0's to all
        stages), and for the others the round trip seen from rank 0 (network + compute)."""
        return {"transport": self.options.transport, "stages": [dict(entry) for entry in self._stats]}

    def close(self) -> None:
        """Tell every stage to exit (it also exits by itself once rank 0's connections close)."""
        if self.wire is None:
            return
        for stage in range(1, len(self.plan)):
            if stage == self._broken_stage:
                continue  # its wire is out of step (or it is gone): dropping the group below ends it
            try:
                self._exchange(stage, {"op": "shutdown"}, timeout=timedelta(seconds=10), closing=True)
            except StageError:
                pass
        self.wire, self._store, self._broken = None, None, "closed"
