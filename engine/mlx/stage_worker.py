"""An MLX pipeline stage (rank >= 1): run the commands that come around the ring on this rank's layers.

The commands are `engine.stage_common.StageCommands`' (hello, pass, save, load, shutdown, and
`free` on any of them), over MLX `KVCache`s named by id. A message comes from the previous rank;
this stage adds its reply under its rank (`replies`) and sends the message on to the next rank, with
its hidden states, or float32 logits from the last stage. A command that fails is answered with its
error and the stage goes on (a pass that failed upstream is forwarded untouched); the loop ends on
`shutdown` or when the ring breaks (rank 0, or a neighbour, went away).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache

from agentfold.engine.mlx.backend import kv_from_arrays, kv_to_arrays
from agentfold.engine.mlx.loader import LoadedModel
from agentfold.engine.mlx.stage_wire import CONNECT_TIMEOUT_S, RingWire, join_ring
from agentfold.engine.mlx.stages import fingerprint, logits_of, run_share, stage_backend, stage_plan
from agentfold.engine.stage_common import StageCommands, StageSetupError, check_rank


class MLXStageWorker(StageCommands):
    """This rank's layers of the model and the KV caches rank 0 named, by id."""

    def __init__(self, loaded: LoadedModel, quant: str, rank: int, world: int, stage_dir: str | Path) -> None:
        check_rank(rank, world)
        self.rank, self.world = rank, world
        self.plan = stage_plan(loaded, world)
        self.fingerprint = fingerprint(loaded)
        self.own = self.plan[rank]
        self.last = rank == world - 1
        self.backend = stage_backend(loaded, quant, self.plan, rank)
        self.model = self.backend.model
        self.quant, self.dtype = self.backend.quant, str(loaded.dtype)
        self.open_stage_dir(stage_dir)

    def run_pass(self, header: dict[str, Any], h: mx.array | None) -> tuple[dict[str, Any], mx.array | None]:
        passes = self.named_caches(header, h, lambda: self.backend.new_cache().layers)
        began = time.perf_counter()
        out = run_share(self.model, h, passes, self.own)
        states = [caches[i].state for caches, _, _ in passes for i in self.own]
        if self.last:
            out = None if header.get("prefill") else logits_of(self.model, out)
        mx.eval(states if out is None else [states, out])
        return {"seconds": time.perf_counter() - began, "sent": 0 if out is None else out.nbytes}, out

    def layer_arrays(self, caches: list[KVCache], length: int) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        arrays: dict[str, np.ndarray] = {}
        specs = {str(i): kv_to_arrays(arrays, i, caches[i], length) for i in self.own}
        return arrays, specs

    def caches_from(self, arrays: Mapping[str, np.ndarray], specs: Mapping[str, Any], length: int) -> list[KVCache]:
        caches = self.backend.new_cache().layers
        for i in self.own:
            kv_from_arrays(arrays, i, specs[str(i)], caches[i])
        return caches


def serve_ring(worker: MLXStageWorker, wire: RingWire) -> str:
    """Handle and forward the ring's messages until shutdown or until the ring breaks; returns why it ended."""
    while True:
        try:
            header, array, _ = wire.recv()
        except (RuntimeError, ValueError):  # a lost connection (or a message that is not ours)
            return "rank 0 went away"
        replies = header.setdefault("replies", {})
        op, out = header.get("op"), None
        if op == "pass" and any("error" in reply for reply in replies.values()):
            worker.free(header)  # an earlier stage failed: nothing to run, the message goes on
        else:
            replies[str(worker.rank)], out = worker.answer(header, array)
        try:
            wire.send(header, out)
        except RuntimeError:
            return "rank 0 went away"
        if op == "shutdown":
            return "shut down by rank 0"
        if op == "hello" and "error" in replies.get(str(worker.rank), {}):
            raise StageSetupError(replies[str(worker.rank)]["error"])


def run_stage(loaded: LoadedModel, rank: int, world: int, hostfile: str | Path, stage_dir: str | Path,
              quant: str = "auto", timeout: float = CONNECT_TIMEOUT_S, say: Callable[[str], None] | None = None) -> str:
    """Rank `rank` of a `world`-stage MLX pipeline: join the ring in `hostfile`, serve until it is done."""
    say = say or (lambda message: None)
    worker = MLXStageWorker(loaded, quant, rank, world, stage_dir)
    say(f"stage {rank} of {world}: layers {worker.own.start}..{worker.own.stop - 1} of {worker.plan[-1].stop}; "
        f"joining the MLX ring in {hostfile}")
    wire = RingWire(join_ring(rank, world, hostfile, timeout))
    say(f"stage {rank}: joined, KV snapshots in {worker.stage_dir}")
    return serve_ring(worker, wire)
