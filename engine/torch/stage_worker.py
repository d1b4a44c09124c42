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
import hashlib
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import safetensors
import safetensors.numpy
import torch

from agentfold.engine.cache_layout import CacheLayoutError
from agentfold.engine.mlx.loader import LoadedModel
from agentfold.engine.torch.backend import kv_from_arrays, kv_to_arrays
from agentfold.engine.torch.models.cache import LayerCache
from agentfold.engine.torch.models.llama import SequencePass
from agentfold.engine.torch.stage_wire import CONNECT_TIMEOUT_S, IDLE_TIMEOUT, StageSetupError, Wire, connect
from agentfold.engine.torch.stages import fingerprint, split_layers, stage_backend
from agentfold.kernels import torch_cpu


def arrays_digest(arrays: dict[str, np.ndarray], meta: dict[str, Any]) -> str:
    """sha256 over a stage file's metadata and arrays (names, dtypes, shapes and bytes)."""
    digest = hashlib.sha256(json.dumps(meta, sort_keys=True).encode())
    for name in sorted(arrays):
        array = np.ascontiguousarray(arrays[name])
        digest.update(f"{name}:{array.dtype.str}:{list(array.shape)}".encode())
        digest.update(array.tobytes())
    return digest.hexdigest()


class StageWorker:
    """This rank's layers of the model and the KV caches rank 0 named, by id."""

    def __init__(self, loaded: LoadedModel, quant: str, rank: int, world: int, stage_dir: str | Path) -> None:
        if not 1 <= rank < world:
            raise StageSetupError(f"--rank must be in 1..{world - 1} for --stages {world} (rank 0 is `agentfold serve`)")
        self.rank, self.world = rank, world
        self.fingerprint = fingerprint(loaded)
        self.plan = split_layers(len(loaded.model.model.layers), world)
        self.own = self.plan[rank]
        self.last = rank == world - 1
        self.backend = stage_backend(loaded, quant, self.plan, rank)
        self.model, self.device = self.backend.model, self.backend.device
        self.stage_dir = Path(stage_dir).expanduser()
        self.stage_dir.mkdir(parents=True, exist_ok=True)
        self.caches: dict[int, list[LayerCache]] = {}

    def handle(self, header: dict[str, Any], tensor: torch.Tensor | None) -> tuple[dict[str, Any], torch.Tensor | None]:
        for cache_id in header.get("free", ()):
            self.caches.pop(int(cache_id), None)
        op = header.get("op")
        if op == "pass":
            return self.run_pass(header, tensor)
        if op == "save":
            return self.save(header), None
        if op == "load":
            return self.load(header), None
        if op == "hello":
            return self.hello(header), None
        if op == "shutdown":
            return {"ok": True}, None
        raise ValueError(f"unknown command {op!r}")

    def hello(self, header: dict[str, Any]) -> dict[str, Any]:
        mine = {"world": self.world, "plan": [[r.start, r.stop] for r in self.plan], "fingerprint": self.fingerprint,
                "quant": self.backend.quant, "dtype": str(self.backend.loaded.dtype)}
        for key, value in mine.items():
            if header.get(key) != value:
                what = "model (config or weights)" if key == "fingerprint" else key
                raise StageSetupError(f"rank {self.rank} has another {what} than rank 0: {value} here, "
                                      f"{header.get(key)} there (start every rank with the same --model, --stages, "
                                      "--dtype and --quant)")
        return {"describe": self.backend.describe(), "layers": [self.own.start, self.own.stop]}

    def run_pass(self, header: dict[str, Any], h: torch.Tensor | None) -> tuple[dict[str, Any], torch.Tensor | None]:
        if h is None:
            raise ValueError("a pass without hidden states")
        passes = []
        for cache_id, start, rows in header["passes"]:
            caches = self.caches.get(cache_id)
            if caches is None:
                if start:
                    raise ValueError(f"cache {cache_id} is not on stage {self.rank} (was it restarted?)")
                caches = self.caches[cache_id] = self.model.make_cache()
            passes.append(SequencePass(caches, int(start), int(rows)))
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

    def _file(self, sha: str) -> Path:
        if len(sha) != 64 or any(c not in "0123456789abcdef" for c in sha):
            raise CacheLayoutError(f"stage {self.rank}: {sha!r} is not a sha256")
        return self.stage_dir / f"{sha}.safetensors"

    def save(self, header: dict[str, Any]) -> dict[str, Any]:
        """Write this stage's layers of one cache (its first `length` rows) to `<sha>.safetensors`."""
        caches = self.caches.get(header["cache"])
        if caches is None:
            raise ValueError(f"cache {header['cache']} is not on stage {self.rank}")
        n = int(header["length"])
        arrays, specs = {}, {}
        for i in self.own:
            specs[str(i)] = kv_to_arrays(arrays, i, caches[i], n)
        meta = {"tokens": header["tokens"], "length": n, "layers": [self.own.start, self.own.stop], "specs": specs}
        sha = arrays_digest(arrays, meta)
        path = self._file(sha)
        if not path.exists():
            temp = path.with_name(f".{sha}.{os.getpid()}.tmp.safetensors")
            try:
                with open(temp, "wb") as handle:
                    handle.write(safetensors.numpy.save(arrays, metadata={"meta": json.dumps(meta)}))
                    handle.flush()
                    os.fsync(handle.fileno())
                os.replace(temp, path)
            finally:
                temp.unlink(missing_ok=True)
        return {"sha": sha, "bytes": path.stat().st_size}

    def load(self, header: dict[str, Any]) -> dict[str, Any]:
        """Put `<sha>.safetensors` into a new cache under the id rank 0 named (checked first)."""
        sha, n = str(header["sha"]), int(header["length"])
        path = self._file(sha)
        try:
            with safetensors.safe_open(path, framework="numpy") as data:
                arrays = {name: data.get_tensor(name) for name in data.keys()}  # noqa: SIM118 (not a dict)
                meta = json.loads((data.metadata() or {})["meta"])
        except FileNotFoundError:
            raise CacheLayoutError(f"stage {self.rank}: no {path.name} in {self.stage_dir}") from None
        except (OSError, ValueError, KeyError, safetensors.SafetensorError) as error:
            raise CacheLayoutError(f"stage {self.rank}: {path.name} is unreadable ({error})") from None
        if arrays_digest(arrays, meta) != sha:
            raise CacheLayoutError(f"stage {self.rank}: {path.name} does not match its checksum")
        wanted = {"tokens": header["tokens"], "length": n, "layers": [self.own.start, self.own.stop]}
        if any(meta.get(k) != v for k, v in wanted.items()):
            raise CacheLayoutError(f"stage {self.rank}: {path.name} holds other tokens or layers")
        caches = self.model.make_cache()
        for i in self.own:
            kv_from_arrays(arrays, i, meta["specs"][str(i)], caches[i], n)
        self.caches[int(header["cache"])] = caches
        return {"ok": True}


def serve_commands(worker: StageWorker, wire: Wire) -> str:
    """Answer rank 0's commands until it says shutdown or goes away; returns why the loop ended."""
    while True:
        try:
            header, tensor, _ = wire.recv(0, IDLE_TIMEOUT)
        except (RuntimeError, ValueError):  # closed connection (or a message that is not ours)
            return "rank 0 went away"
        reply: dict[str, Any]
        out = None
        try:
            reply, out = worker.handle(header, tensor)
        except CacheLayoutError as error:
            reply = {"error": str(error), "layout": True}
        except StageSetupError as error:
            reply = {"error": str(error)}
        except Exception as error:  # noqa: BLE001  (answered to rank 0, which raises it; this stage goes on)
            reply = {"error": f"{type(error).__name__}: {error}"}
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
