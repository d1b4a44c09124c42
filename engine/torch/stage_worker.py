"""A pipeline stage (rank >= 1): run rank 0's commands on this rank's layers and KV caches.

Commands (`stages.Wire` messages from rank 0, each answered once): `hello` (the pipeline agrees on
model, split, quantization and dtype), `pass` (hidden states in; this stage's layers over each
named cache at its start position; hidden states out, or float32 logits from the last stage),
`save` / `load` (this stage's KV of one cache to / from `<stage_dir>/<sha>.safetensors`), `shutdown`. Any
message may carry `free`: caches rank 0 dropped. A command that fails is answered with its error
and the stage goes on; the loop ends on `shutdown` or when rank 0's connection closes.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from agentfold.engine.mlx.loader import LoadedModel
from agentfold.engine.stage_common import StageCommands, arrays_digest, check_rank
from agentfold.engine.torch.backend import kv_from_arrays, kv_to_arrays
from agentfold.engine.torch.models.cache import LayerCache
from agentfold.engine.torch.models.llama import SequencePass
from agentfold.engine.torch.stage_wire import CONNECT_TIMEOUT_S, IDLE_TIMEOUT, StageSetupError, Wire, connect
from agentfold.engine.torch.stages import fingerprint, split_layers, stage_backend
from agentfold.kernels import torch_cpu

__all__ = ["StageWorker", "arrays_digest", "run_stage", "serve_commands"]


class StageWorker(StageCommands):
    """This rank's layers of the model and the KV caches rank 0 named, by id (`StageCommands`)."""

    def __init__(self, loaded: LoadedModel, quant: str, rank: int, world: int, stage_dir: str | Path) -> None:
        check_rank(rank, world)
        self.rank, self.world = rank, world
        self.fingerprint = fingerprint(loaded)
        self.plan = split_layers(len(loaded.model.model.layers), world)
        self.own = self.plan[rank]
        self.last = rank == world - 1
        self.backend = stage_backend(loaded, quant, self.plan, rank)
        self.model, self.device = self.backend.model, self.backend.device
        self.quant, self.dtype = self.backend.quant, str(self.backend.loaded.dtype)
        self.open_stage_dir(stage_dir)

    def run_pass(self, header: dict[str, Any], h: torch.Tensor | None) -> tuple[dict[str, Any], torch.Tensor | None]:
        passes = [SequencePass(*named) for named in self.named_caches(header, h, self.model.make_cache)]
        prefill = bool(header.get("prefill"))
        began, final = time.perf_counter(), []
        with torch.inference_mode(), torch_cpu.prefill_chunk() if prefill else contextlib.nullcontext():
            for _ in self.model.stage_steps(h.to(self.device), passes, self.own, final):
                pass
            out = final[0]
            if self.last:
                out = None if prefill else self.model.logits(out).float()
        if out is not None and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return {"seconds": time.perf_counter() - began}, out

    def layer_arrays(self, caches: list[LayerCache], length: int) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        arrays: dict[str, np.ndarray] = {}
        specs = {str(i): kv_to_arrays(arrays, i, caches[i], length) for i in self.own}
        return arrays, specs

    def caches_from(self, arrays: Mapping[str, np.ndarray], specs: Mapping[str, Any], length: int) -> list[LayerCache]:
        caches = self.model.make_cache()
        for i in self.own:
            kv_from_arrays(arrays, i, specs[str(i)], caches[i], length)
        return caches


def serve_commands(worker: StageWorker, wire: Wire) -> str:
    """Answer rank 0's commands until it says shutdown or goes away; returns why the loop ended."""
    while True:
        try:
            header, tensor, _ = wire.recv(0, IDLE_TIMEOUT)
        except (RuntimeError, ValueError):  # closed connection (or a message that is not ours)
            return "rank 0 went away"
        reply, out = worker.answer(header, tensor)
        try:
            wire.send(0, reply, out)
        except RuntimeError:
            return "rank 0 went away"
        if header.get("op") == "shutdown":
            return "shut down by rank 0"
        if header.get("op") == "hello" and "error" in reply:
            raise StageSetupError(reply["error"])


def run_stage(loaded: LoadedModel, rank: int, world: int, master: str, stage_dir: str | Path, quant: str = "auto",
              transport: str = "gloo", timeout: float = CONNECT_TIMEOUT_S,
              say: Callable[[str], None] | None = None) -> str:
    """Rank `rank` of a `world`-stage pipeline: connect to rank 0 at `master`, serve until it is done."""
    say = say or (lambda message: None)
    worker = StageWorker(loaded, quant, rank, world, stage_dir)
    say(f"stage {rank} of {world}: layers {worker.own.start}..{worker.own.stop - 1} of {worker.plan[-1].stop}; "
        f"waiting for rank 0 at {master}")
    store, group = connect(rank, world, master, transport, timeout)
    wire = Wire(group, torch.device("cuda" if transport == "nccl" else "cpu"))
    say(f"stage {rank}: connected, KV snapshots in {worker.stage_dir}")
    try:
        return serve_commands(worker, wire)
    finally:
        del wire, group, store
