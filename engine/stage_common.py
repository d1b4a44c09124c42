"""What pipeline stages share whatever framework runs their layers (`engine.torch.stages` over
torch.distributed, `engine.mlx.stages` over mlx.core.distributed): the split, the errors, the
digests, the stage files and the command loop's bookkeeping. numpy only, so neither backend's
stages import the other's framework.

A stage (rank >= 1) answers rank 0's commands (`StageCommands.handle`): `hello` (model, split,
quantization and dtype agree), `pass` (the backend's), `save` / `load` (this stage's KV of one cache
to / from `<stage_dir>/<sha256>.safetensors`, written with fsync and an atomic rename, read back
checked against its sha), `shutdown`. Any command may carry `free`: caches rank 0 dropped.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import safetensors
import safetensors.numpy

from agentfold.engine.cache_layout import CacheLayoutError, array_name


class StageError(RuntimeError):
    """A stage failed or went away during a pass (the engine cannot go on without its layers)."""


class StageSetupError(ValueError):
    """The stages cannot form a pipeline (a peer that never connects, another model): one readable line."""


def parse_master(master: str) -> tuple[str, int]:
    """`HOST:PORT` (an IPv6 host in brackets) as (host, port)."""
    host, sep, port = master.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise StageSetupError(f"the stage master address must be HOST:PORT (e.g. 127.0.0.1:29500), not {master!r}")
    return host, int(port)


def split_layers(num_layers: int, stages: int) -> list[range]:
    """Layers per stage, split evenly (the first stages take one more when it does not divide)."""
    if stages < 1:
        raise StageSetupError(f"--stages must be >= 1, not {stages}")
    if stages > num_layers:
        raise StageSetupError(f"--stages {stages}: the model has only {num_layers} layers (a stage needs at least one)")
    base, extra = divmod(num_layers, stages)
    plan, begin = [], 0
    for stage in range(stages):
        end = begin + base + (1 if stage < extra else 0)
        plan.append(range(begin, end))
        begin = end
    return plan


def stage_of(plan: Sequence[range], layer: int) -> int:
    return next(stage for stage, layers in enumerate(plan) if layer in layers)


def tokens_digest(tokens: Sequence[int]) -> str:
    return hashlib.sha256(np.asarray(tokens, dtype="<i4").tobytes()).hexdigest()


def arrays_digest(arrays: dict[str, np.ndarray], meta: dict[str, Any]) -> str:
    """sha256 over a stage file's metadata and arrays (names, dtypes, shapes and bytes)."""
    digest = hashlib.sha256(json.dumps(meta, sort_keys=True).encode())
    for name in sorted(arrays):
        array = np.ascontiguousarray(arrays[name])
        digest.update(f"{name}:{array.dtype.str}:{list(array.shape)}".encode())
        digest.update(array.tobytes())
    return digest.hexdigest()


def model_fingerprint(config: Mapping[str, Any], dtype: Any, final_norm: np.ndarray) -> str:
    """What every rank must agree on before pruning: config, dtype and the final norm's float32 bytes."""
    digest = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode())
    digest.update(str(dtype).encode())
    digest.update(np.ascontiguousarray(final_norm, dtype=np.float32).tobytes())
    return digest.hexdigest()


def first_line(error: BaseException) -> str:
    return str(error).splitlines()[0] if str(error) else type(error).__name__


# --- rank 0: a snapshot names each stage's file by its sha ---------------------------------------


def stage_layout(plan: Sequence[range], layer: int, length: int) -> dict[str, Any]:
    """The layout entry of a layer another stage keeps (`cache_to_arrays`)."""
    return {"kind": "stage", "stage": stage_of(plan, layer), "offset": length}


def check_stage_layout(plan: Sequence[range], layout: Sequence[Mapping[str, Any]], length: int) -> None:
    """CacheLayoutError unless `layout` keeps each layer where this pipeline does, at `length` tokens."""
    if len(layout) != plan[-1].stop:
        raise CacheLayoutError(f"the snapshot has {len(layout)} layers, the model {plan[-1].stop}")
    for i, spec in enumerate(layout):
        stage = stage_of(plan, i)
        expected = {"kind": "stage", "stage": stage} if stage else {"kind": "kv"}
        if any(spec.get(k) != v for k, v in expected.items()) or spec.get("offset") != length:
            raise CacheLayoutError(f"layer {i}: snapshot holds {spec}, this pipeline keeps it on stage {stage} "
                                   f"({length} tokens)")


def put_stage_sha(arrays: dict[str, np.ndarray], plan: Sequence[range], stage: int, sha: str) -> None:
    arrays[array_name(plan[stage].start, "stage")] = np.frombuffer(bytes.fromhex(sha), dtype=np.uint8).copy()


def stage_sha(arrays: Mapping[str, np.ndarray], plan: Sequence[range], stage: int) -> str:
    ref = arrays.get(array_name(plan[stage].start, "stage"))
    if ref is None or ref.dtype != np.uint8 or ref.size != 32:
        raise CacheLayoutError(f"stage {stage}: the snapshot names no file for its layers")
    return bytes(ref).hex()


class StageLayers(list):
    """A cache's per-layer state on rank 0 (other stages' layers stay empty there), named `cache_id`
    on every stage."""

    cache_id: int


def cache_id_of(cache: Any) -> int:
    """The id a `CacheState` of a staged backend is known by on every stage."""
    cache_id = getattr(cache.layers, "cache_id", None)
    if cache_id is None:
        raise StageError("this cache was not made by this staged backend")
    return cache_id


def close_at_exit(ref: Any) -> None:
    """atexit: close the staged backend behind a weak reference, if it is still alive."""
    backend = ref()
    if backend is not None:
        backend.close()


def new_stats(plan: Sequence[range]) -> list[dict[str, Any]]:
    """`stage_stats()` entries: per stage passes, compute seconds, bytes sent (and round trips)."""
    stats = [{"stage": s, "layers": [r.start, r.stop], "passes": 0, "seconds": 0.0, "bytes_sent": 0}
             for s, r in enumerate(plan)]
    for entry in stats[1:]:
        entry["round_trip_seconds"] = 0.0
    return stats


def raise_reply(stage: int, reply: Mapping[str, Any], setup: bool = False) -> None:
    """A stage's error reply as rank 0's exception: setup, snapshot layout, or a failed pass."""
    if "error" in reply:
        error_class = StageSetupError if setup else CacheLayoutError if reply.get("layout") else StageError
        raise error_class(f"stage {stage}: {reply['error']}")


# --- a stage (rank >= 1) ---------------------------------------------------------------------------


class StageCommands:
    """A stage's commands over its caches (by id), whatever framework holds them. A subclass sets
    rank, world, plan, own, stage_dir, fingerprint, caches and `identity`, and gives `run_pass`,
    `describe`, `layer_arrays` and `caches_from`."""

    rank: int
    world: int
    plan: list[range]
    own: range
    stage_dir: Path
    fingerprint: str
    caches: dict[int, Any]
    quant: str
    dtype: str
    backend: Any  # the framework's backend over this stage's layers

    def open_stage_dir(self, stage_dir: str | Path) -> None:
        self.stage_dir = Path(stage_dir).expanduser()
        self.stage_dir.mkdir(parents=True, exist_ok=True)
        self.caches = {}

    def named_caches(self, header: dict[str, Any], tensor: Any, make: Any) -> list[tuple[Any, int, int]]:
        """A pass's (caches, start, rows) per sequence; a cache named first at start 0 is made (`make()`)."""
        if tensor is None:
            raise ValueError("a pass without hidden states")
        passes = []
        for cache_id, start, rows in header["passes"]:
            caches = self.cache(cache_id, start)
            if caches is None:
                caches = self.caches[int(cache_id)] = make()
            passes.append((caches, int(start), int(rows)))
        return passes

    def run_pass(self, header: dict[str, Any], tensor: Any) -> tuple[dict[str, Any], Any]:
        raise NotImplementedError

    def describe(self) -> dict[str, Any]:
        return self.backend.describe()

    def layer_arrays(self, caches: Any, length: int) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """This stage's layers of a cache, first `length` rows: (arrays, layout spec per layer)."""
        raise NotImplementedError

    def caches_from(self, arrays: Mapping[str, np.ndarray], specs: Mapping[str, Any], length: int) -> Any:
        """A new cache of this stage's layers holding `arrays` (CacheLayoutError when they do not fit)."""
        raise NotImplementedError

    def free(self, header: dict[str, Any]) -> None:
        for cache_id in header.get("free", ()):
            self.caches.pop(int(cache_id), None)

    def handle(self, header: dict[str, Any], tensor: Any) -> tuple[dict[str, Any], Any]:
        self.free(header)
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

    def answer(self, header: dict[str, Any], tensor: Any) -> tuple[dict[str, Any], Any]:
        """`handle`, a failure turned into an error reply (rank 0 raises it; this stage goes on)."""
        try:
            return self.handle(header, tensor)
        except CacheLayoutError as error:
            return {"error": str(error), "layout": True}, None
        except StageSetupError as error:
            return {"error": str(error)}, None
        except Exception as error:  # noqa: BLE001  (answered to rank 0, which raises it; this stage goes on)
            return {"error": f"{type(error).__name__}: {error}"}, None

    def identity(self) -> dict[str, Any]:
        return {"world": self.world, "plan": [[r.start, r.stop] for r in self.plan], "fingerprint": self.fingerprint,
                "quant": self.quant, "dtype": self.dtype}

    def hello(self, header: dict[str, Any]) -> dict[str, Any]:
        for key, value in self.identity().items():
            if header.get(key) != value:
                what = "model (config or weights)" if key == "fingerprint" else key
                raise StageSetupError(f"rank {self.rank} has another {what} than rank 0: {value} here, "
                                      f"{header.get(key)} there (start every rank with the same --model, --stages, "
                                      "--dtype and --quant)")
        return {"describe": self.describe(), "layers": [self.own.start, self.own.stop]}

    def cache(self, cache_id: int, start: int = 0) -> Any:
        """The caches rank 0 named `cache_id` (made when a pass names a new one at start 0)."""
        caches = self.caches.get(int(cache_id))
        if caches is None and start:
            raise ValueError(f"cache {cache_id} is not on stage {self.rank} (was it restarted?)")
        return caches

    def save(self, header: dict[str, Any]) -> dict[str, Any]:
        """Write this stage's layers of one cache (its first `length` rows) to `<sha>.safetensors`."""
        caches = self.cache(header["cache"])
        if caches is None:
            raise ValueError(f"cache {header['cache']} is not on stage {self.rank}")
        n = int(header["length"])
        arrays, specs = self.layer_arrays(caches, n)
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
        sha = str(header["shas"][str(self.rank)] if "shas" in header else header["sha"])  # one per stage on a ring
        n = int(header["length"])
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
        self.caches[int(header["cache"])] = self.caches_from(arrays, meta["specs"], n)
        return {"ok": True}

    def _file(self, sha: str) -> Path:
        if len(sha) != 64 or any(c not in "0123456789abcdef" for c in sha):
            raise CacheLayoutError(f"stage {self.rank}: {sha!r} is not a sha256")
        return self.stage_dir / f"{sha}.safetensors"


def check_rank(rank: int, world: int) -> None:
    if not 1 <= rank < world:
        raise StageSetupError(f"--rank must be in 1..{world - 1} for --stages {world} (rank 0 is `agentfold serve`)")
