"""Baselines for `agentfold bench all`, run in the bench process on the prompts the server answered.

A tok/s figure means little alone, so every one is put next to other engines decoding the same
prompt ids (read back from the server's telemetry) for the same number of tokens, greedily, in
the same run: stock `mlx_lm` on the same MLX weights, `transformers` `generate` on torch CPU from
the same float32 weights, AgentFold's own engine on its torch backend when this tree has one, and
the roofline (one full read of the weights per token at the measured copy bandwidth). Each
workload's baselines run right after the server answered it, while the server sits idle, so a
machine whose load drifts (a shared CI box) treats the engines of one workload alike. A baseline
that cannot run here is recorded as skipped with the reason, never left out silently.
"""

from __future__ import annotations

import importlib.util
import inspect
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from agentfold.bench.harness import TokenClock
from agentfold.bench.machine import loadavg
from agentfold.bench.mlx_baseline import mlx_lm_decode
from agentfold.bench.rates import completion_row, rounded, steady_tps

SPECULATIVE_SKIPPED = ("no draft model sharing the tokenizer is installed for SmolLM2-135M or Gemma 3 270M (they "
                       "are the smallest of their families here); mlx-lm speculative decoding needs one")


def agreement(tokens: Sequence[int], reference: Sequence[int], eos: set[int]) -> dict[str, Any]:
    """How far `tokens` follows the reference reply: common prefix length, and equality up to a final EOS."""
    a, b = list(tokens), list(reference)
    same = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        same += 1
    strip = (lambda s: s[:-1] if s and s[-1] in eos else s)  # noqa: E731
    return {"agree_tokens": same, "reference_tokens": len(b), "identical_to_serial": strip(a) == strip(b)}


def converted_folder(gguf: Path, dtype: str = "float32") -> Path:
    """The float32 MLX / Hugging Face folder of a GGUF in the model cache (tests share the cache key)."""
    from agentfold.engine.mlx.loader import convert_gguf
    from agentfold.serve.models import cache_dir

    stat = gguf.stat()
    out = cache_dir() / f"{gguf.stem}-{dtype}-{stat.st_size}-{int(stat.st_mtime)}"
    if not (out / "config.json").exists():
        convert_gguf(gguf, out, dtype)
    return out


class TransformersEngine:
    """`transformers` `AutoModelForCausalLM` on torch CPU, float32, greedy `generate` timed per token."""

    def __init__(self, folder: Path, eos: set[int]) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        began = time.perf_counter()
        self.model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
        self.model.eval()
        self.eos = eos
        self.setup = {"folder": str(folder), "load_seconds": round(time.perf_counter() - began, 3),
                      "torch": torch.__version__, "threads": torch.get_num_threads()}
        self._generate([1, 2, 3, 4], 2)  # warm-up

    def _generate(self, prompt: Sequence[int], max_tokens: int) -> tuple[TokenClock, float]:
        import torch

        ids = torch.tensor([list(prompt)])
        clock = TokenClock()
        started = time.perf_counter()
        with torch.no_grad():
            self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False,
                                eos_token_id=sorted(self.eos), pad_token_id=min(self.eos), streamer=clock)
        return clock, started

    def run(self, job: dict[str, Any]) -> dict[str, Any]:
        clock, started = self._generate(job["prompt"], job["max_tokens"])
        times = clock.times
        return {"max_tokens": job["max_tokens"], "loadavg": loadavg(), "completion_tokens": len(clock.tokens),
                "steady_tps": rounded(steady_tps(times, 1)),
                "ttft_seconds": rounded(times[0] - started, 4) if times else None,
                "total_seconds": rounded((times[-1] if times else time.perf_counter()) - started, 4),
                **agreement(clock.tokens, job["reply"], self.eos)}


class TorchBackendEngine:
    """AgentFold's engine on its torch backend (`build_engine(..., backend="torch")`), serial and drafted."""

    def __init__(self, path: Path, dtype: str, eos: set[int], say: Callable[[str], None]) -> None:
        from agentfold.engine.factory import build_engine

        if "backend" not in inspect.signature(build_engine).parameters:
            raise Unavailable("build_engine has no backend= parameter in this tree (no torch backend yet)")
        if importlib.util.find_spec("agentfold.engine.torch.backend") is None:
            raise Unavailable("agentfold.engine.torch.backend is not importable in this tree")
        began = time.perf_counter()
        self.engine = build_engine(path, dtype=dtype, backend="torch", progress=say)
        self.eos = eos
        exactness = self.engine.exactness
        self.setup = {"load_seconds": round(time.perf_counter() - began, 3),
                      "exactness": exactness.describe() if exactness else None}

    def run(self, job: dict[str, Any]) -> dict[str, Any]:
        from agentfold.engine.decode import GenerationConfig

        serial = self.engine.generate(job["prompt"], GenerationConfig(max_tokens=job["max_tokens"], draft=False))
        drafted = self.engine.generate(job["prompt"], GenerationConfig(max_tokens=job["max_tokens"], draft=True))
        return {"max_tokens": job["max_tokens"], "loadavg": loadavg(),
                "serial": {**completion_row(serial), **agreement(serial.tokens, job["reply"], self.eos)},
                "drafted": completion_row(drafted), "identical": serial.tokens == drafted.tokens}


class Unavailable(RuntimeError):
    """A baseline this machine or tree cannot run; the message is the reason recorded."""


class Baselines:
    """The baseline engines, each loaded on first use, run on one workload's job at a time.

    `quick` runs stock mlx-lm only (a torch load and 1K-token prefill cost tens of seconds).
    A baseline that fails is recorded as skipped with its error and not tried again.
    """

    def __init__(self, path: Path, loaded: Any, dtype: str, quick: bool, say: Callable[[str], None]) -> None:
        self.path, self.loaded, self.dtype, self.quick, self.say = path, loaded, dtype, quick, say
        self.eos = set(loaded.eos_token_ids)
        self.rows: dict[str, dict[str, Any]] = {"mlx_lm": {}, "transformers": {}, "torch_backend": {}}
        self.setup: dict[str, dict[str, Any]] = {}
        self.skipped: dict[str, str] = {}
        self.engines: dict[str, Any] = {}
        if quick:
            reason = "--quick: a torch load and a 1K-token prefill on torch CPU take tens of seconds here; the full run measures it"
            self.skipped.update(transformers=reason, torch_backend=reason)

    def _engine(self, key: str) -> Any:
        if key not in self.engines:
            self.say(f"baseline {key}: loading")
            if key == "transformers":
                folder = self.path if self.path.is_dir() else converted_folder(self.path)
                self.engines[key] = TransformersEngine(folder, self.eos)
            else:
                self.engines[key] = TorchBackendEngine(self.path, self.dtype, self.eos, self.say)
            self.setup[key] = self.engines[key].setup
        return self.engines[key]

    def run(self, kind: str, job: dict[str, Any]) -> None:
        """Every baseline on `job` (prompt and reply ids, max_tokens, reply_sha)."""
        for key in ("mlx_lm", "transformers", "torch_backend"):
            if key in self.skipped:
                continue
            self.say(f"baseline {key}: {kind} ({len(job['prompt'])} prompt tokens, {job['max_tokens']} max tokens)")
            try:
                if key == "mlx_lm":
                    row = mlx_lm_decode(self.loaded.model, self.loaded.tokenizer, job["prompt"], job["max_tokens"])
                    row.update(identical_to_serial=row["token_sha"] == job["reply_sha"], max_tokens=job["max_tokens"],
                               loadavg=loadavg())
                else:
                    row = self._engine(key).run(job)
            except Unavailable as reason:
                self.skipped[key] = str(reason)
                continue
            except Exception as error:  # noqa: BLE001 - another helper's work in progress must not sink the run
                self.say(f"baseline {key} failed: {type(error).__name__}: {error}")
                self.skipped[key] = f"{type(error).__name__}: {error}"[:300]
                continue
            self.rows[key][kind] = row

    def close(self) -> None:
        self.engines.clear()

    def result(self) -> dict[str, Any]:
        """The JSON's `baselines`: per engine its rows (and `_setup`), or `skipped` with the reason."""
        out: dict[str, Any] = {}
        for key, rows in self.rows.items():
            if key in self.skipped and not rows:
                out[key] = {"skipped": self.skipped[key]}
            else:
                out[key] = {**({"_setup": self.setup[key]} if key in self.setup else {}), **rows}
                if key in self.skipped:
                    out[key]["_stopped"] = self.skipped[key]
        out["mlx_lm_speculative"] = {"skipped": SPECULATIVE_SKIPPED}
        return out
