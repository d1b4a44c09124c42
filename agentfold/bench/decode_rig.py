"""The engines one `agentfold bench decode` run measures, loaded once, and the roofline they run under.

Every workload of the run goes through the same engines, so they are loaded here once: the engine
as `agentfold generate` builds it (`build_engine` with the backend, quant and device asked for),
its twin with a draft model when one is given, and the float MLX models stock mlx-lm runs. The
roofline (`Roofline`) puts each rate against the bytes the chosen backend reads per token at the
copy bandwidth measured in the same run, and measures the read bandwidth at the backend's threads
(`bus.read_bandwidth`), the ceiling `bench decode`'s bus section puts a pass's parts against.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentfold.bench.bus import QUICK_READ_REPEATS, READ_REPEATS, read_bandwidth, read_line
from agentfold.bench.machine import copy_bandwidth, thread_info
from agentfold.bench.mlx_baseline import float_mlx_model
from agentfold.bench.weights import backend_bytes, model_bytes, model_path


@dataclass(frozen=True)
class Choice:
    """What the run was asked to decode with (`build_engine`'s choice) and where `auto` keeps its verdicts."""

    backend: str
    quant: str
    device: str
    dtype: str | None
    verdicts: Path | None


@dataclass
class Rig:
    """The engines one run decodes with: the engine (and its draft-model twin), and the float models
    stock mlx-lm runs; `patched_models` are the MLX models running the engine's row-exact attention."""

    path: Path
    engine: Any
    weights: dict[str, Any]
    baseline: Any
    patched_models: list[Any] = field(default_factory=list)
    draft_path: Path | None = None
    draft_backend: Any = None
    draft_engine: Any = None
    baseline_draft: Any = None

    @property
    def target(self) -> Any:
        return self.engine.backend

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def eos(self) -> Any:
        return self.engine.backend.loaded.eos_token_ids


@dataclass
class Roofline:
    """The copy bandwidth and the rates it allows (the chosen backend's weights, and mlx-lm's float
    model's), and the read bandwidth at the backend's threads (`read`: >= 1 GiB, past every cache,
    with the rate it allows; `read_weights_size`: over as many bytes as a token reads, which a small
    model's weights may find in the last-level cache)."""

    bandwidth: dict[str, Any]
    weights: dict[str, Any]
    mlx_lm_bytes: int
    tps: float = 0.0
    mlx_lm_tps: float = 0.0
    read: dict[str, Any] = field(default_factory=dict)
    read_weights_size: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def measure(cls, rig: Rig, quick: bool, say: Callable[[str], None], threads: int = 1) -> Roofline:
        """Both bandwidths; `threads`: the count the backend decodes with (the read runs on as many)."""
        mlx_lm_bytes, _ = model_bytes(rig.baseline.model)
        say("bench: measuring copy bandwidth")
        bandwidth = copy_bandwidth(megabytes=128 if quick else 256, repeats=2 if quick else 4)
        roofline = cls(bandwidth, rig.weights, mlx_lm_bytes)
        roofline.tps = bandwidth["bandwidth_gbs"] * 1e9 / rig.weights["bytes_per_token"]
        roofline.mlx_lm_tps = bandwidth["bandwidth_gbs"] * 1e9 / mlx_lm_bytes  # a tied float head reads it all
        repeats = QUICK_READ_REPEATS if quick else READ_REPEATS
        roofline.read = read_bandwidth(threads, repeats=repeats)
        say(f"bench: read bandwidth: {read_line(roofline.read)}")
        token_mib = -(-rig.weights["bytes_per_token"] // (1 << 20))
        roofline.read_weights_size = read_bandwidth(threads, mebibytes=token_mib, repeats=2 * repeats)
        say(f"bench: read bandwidth over a token's bytes: {read_line(roofline.read_weights_size)}")
        return roofline

    def fraction(self, rate: float | None, mlx_lm: bool = False) -> float | None:
        """`rate` over the ceiling (mlx-lm's when `mlx_lm`), to 4 digits."""
        return round(rate / (self.mlx_lm_tps if mlx_lm else self.tps), 4) if rate else None

    def section(self) -> dict[str, Any]:
        return {
            **self.bandwidth,
            "model_bytes": self.weights["resident_bytes"],
            "bytes_per_token": self.weights["bytes_per_token"],
            "bytes_basis": self.weights["basis"],
            "tps": round(self.tps, 3),
            "mlx_lm_bytes_per_token": self.mlx_lm_bytes,
            "mlx_lm_tps": round(self.mlx_lm_tps, 3),
            "note": ("one read of the bytes a serial token reads (bytes_per_token, the chosen backend's weights as "
                     "it holds them) at the measured copy bandwidth; mlx_lm's from the float model's bytes"),
            "read_bandwidth": self.read,
            "read_bandwidth_weights_size": self.read_weights_size,
            "read_tps": (round(self.read["best_gbs"] * 1e9 / self.weights["bytes_per_token"], 3)
                         if self.read.get("best_gbs") else None),
        }


def load_rig(path: Path, draft_model: str | None, choice: Choice, machine: dict[str, Any],
              say: Callable[[str], None]) -> Rig:
    """The engine as `agentfold generate` builds it, the draft-model engine, the float mlx-lm models."""
    from agentfold.engine.decode import Engine
    from agentfold.engine.drafters import DraftModelDrafter
    from agentfold.engine.factory import _loader, build_engine

    say(f"bench: loading model {path} (backend {choice.backend}, quant {choice.quant})")
    engine = build_engine(path, dtype=choice.dtype, drafter="suffix", progress=say, backend=choice.backend,
                          quant=choice.quant, device=choice.device, verdicts=choice.verdicts)
    target = engine.backend
    weights = backend_bytes(target)
    machine["threads"] = thread_info(target)
    say(f"bench: running {target.name}, quant {target.quant}, {machine['threads']['backend']} threads")

    draft_path = draft_backend = draft_engine = None
    if draft_model:
        draft_path = model_path(draft_model)
        say(f"bench: loading draft model {draft_path}")
        load, backend_class = _loader(target.name, choice.dtype, choice.device, say)  # the target's backend, same quant
        draft_backend = backend_class(load(draft_path), quant=target.quant)
        # same target backend and the self-check already done: only the drafter differs
        draft_engine = Engine(target, engine.tokenizer, target.loaded.eos_token_ids,
                              drafter=DraftModelDrafter(draft_backend), exactness=engine.exactness)
    # MLX models running the engine's row-exact attention (stock attention is swapped in around baselines)
    patched = [b.model for b in (target, draft_backend) if b is not None and b.name == "mlx"]
    baseline = float_mlx_model(path, choice.dtype, target, say)
    baseline_draft = float_mlx_model(draft_path, choice.dtype, draft_backend, say) if draft_path else None
    return Rig(path, engine, weights, baseline, patched, draft_path, draft_backend, draft_engine, baseline_draft)
