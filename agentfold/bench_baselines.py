"""Baselines for `agentfold bench all`, run in the bench process on the prompts the server answered.

A tok/s figure means little alone, so every one is put next to other engines decoding the same
prompt ids (read back from the server's telemetry) for the same number of tokens, greedily, in
the same run: stock `mlx_lm` on the same MLX weights, `transformers` `generate` on torch CPU from
the same float32 weights, AgentFold's torch backend when this tree has one, and the roofline (one
full read of the weights per token at the measured copy bandwidth). A baseline that cannot run
here is recorded as skipped with the reason, never left out silently.
"""

from __future__ import annotations

import importlib.util
import inspect
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import agentfold  # noqa: F401  (fast BLAS before mlx)

from .bench import _completion_row, mlx_lm_decode, steady_tps


def _round(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(float(value), digits)


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
    from .engine.loader import convert_gguf
    from .models import cache_dir

    stat = gguf.stat()
    out = cache_dir() / f"{gguf.stem}-{dtype}-{stat.st_size}-{int(stat.st_mtime)}"
    if not (out / "config.json").exists():
        convert_gguf(gguf, out, dtype)
    return out


def mlx_lm_rows(model: Any, tokenizer: Any, prompts: dict[str, dict[str, Any]],
                say: Callable[[str], None]) -> dict[str, Any]:
    """`mlx_lm.generate.stream_generate` (stock attention) on each prompt; equal when the token hashes are."""
    rows = {}
    for name, job in prompts.items():
        say(f"baseline mlx_lm: {name} ({len(job['prompt'])} prompt tokens)")
        row = mlx_lm_decode(model, tokenizer, job["prompt"], job["max_tokens"])
        row["identical_to_serial"] = row["token_sha"] == job["reply_sha"]
        row["max_tokens"] = job["max_tokens"]
        rows[name] = row
    return rows


class _TokenClock:
    """A transformers streamer that records when each generated token arrives (the first put is the prompt)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.tokens: list[int] = []
        self._prompt_seen = False

    def put(self, value: Any) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        now = time.perf_counter()
        for token in value.reshape(-1).tolist():
            self.times.append(now)
            self.tokens.append(int(token))

    def end(self) -> None:
        pass


def transformers_rows(folder: Path, prompts: dict[str, dict[str, Any]], eos: set[int],
                      say: Callable[[str], None]) -> dict[str, Any]:
    """`transformers` greedy `generate` on torch CPU (float32) for each prompt, timed per token."""
    import torch
    from transformers import AutoModelForCausalLM

    began = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    model.eval()
    load = time.perf_counter() - began
    rows: dict[str, Any] = {"_setup": {"folder": str(folder), "load_seconds": round(load, 3),
                                       "torch": torch.__version__, "threads": torch.get_num_threads()}}
    warm = next(iter(prompts.values()))["prompt"][:16]
    with torch.no_grad():
        model.generate(torch.tensor([warm]), attention_mask=torch.ones(1, len(warm), dtype=torch.long),
                       max_new_tokens=2, do_sample=False, pad_token_id=min(eos))
    for name, job in prompts.items():
        say(f"baseline transformers: {name} ({len(job['prompt'])} prompt tokens)")
        ids = torch.tensor([list(job["prompt"])])
        clock = _TokenClock()
        started = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=job["max_tokens"],
                           do_sample=False, eos_token_id=sorted(eos), pad_token_id=min(eos), streamer=clock)
        times = clock.times
        rows[name] = {
            "max_tokens": job["max_tokens"],
            "completion_tokens": len(clock.tokens),
            "steady_tps": _round(steady_tps(times, 1)),
            "ttft_seconds": _round(times[0] - started, 4) if times else None,
            "total_seconds": _round((times[-1] if times else time.perf_counter()) - started, 4),
            **agreement(clock.tokens, job["reply"], eos),
        }
    del model
    return rows


def torch_backend_rows(model_path: Path, prompts: dict[str, dict[str, Any]], eos: set[int], dtype: str,
                       say: Callable[[str], None]) -> dict[str, Any]:
    """AgentFold's own engine on its torch backend, serial and drafted, when this tree has one."""
    from .engine.decode import GenerationConfig
    from .engine.factory import build_engine

    if "backend" not in inspect.signature(build_engine).parameters:
        return {"skipped": "build_engine has no backend= parameter in this tree (no torch backend yet)"}
    if importlib.util.find_spec("agentfold.engine.torch_backend") is None:
        return {"skipped": "agentfold.engine.torch_backend is not importable in this tree"}
    began = time.perf_counter()
    try:
        engine = build_engine(model_path, dtype=dtype, backend="torch", progress=say)
    except Exception as error:  # another helper's work in progress: say why, keep the other baselines
        return {"skipped": f"building the torch engine failed: {type(error).__name__}: {error}"[:300]}
    rows: dict[str, Any] = {"_setup": {"load_seconds": round(time.perf_counter() - began, 3),
                                       "exactness": engine.exactness.describe() if engine.exactness else None}}
    for name, job in prompts.items():
        say(f"baseline agentfold torch backend: {name}")
        serial = engine.generate(job["prompt"], GenerationConfig(max_tokens=job["max_tokens"], draft=False))
        drafted = engine.generate(job["prompt"], GenerationConfig(max_tokens=job["max_tokens"], draft=True))
        rows[name] = {"max_tokens": job["max_tokens"],
                      "serial": {**_completion_row(serial), **agreement(serial.tokens, job["reply"], eos)},
                      "drafted": _completion_row(drafted), "identical": serial.tokens == drafted.tokens}
    return rows


def mlx_lm_speculative_row(draft_model: str | None) -> dict[str, Any]:
    """mlx-lm's speculative decoding needs a draft model sharing the tokenizer; none ships for these models."""
    if draft_model:
        return {"skipped": "a --draft-model was given, but the suite measures mlx-lm speculative decoding only in "
                           "`agentfold bench decode --draft-model` (same prompts would need a second model load)"}
    return {"skipped": "no draft model sharing the tokenizer is installed for SmolLM2-135M or Gemma 3 270M "
                       "(they are the smallest of their families here); mlx-lm speculative decoding needs one"}


def safe(step: str, run: Callable[[], dict[str, Any]], say: Callable[[str], None]) -> dict[str, Any]:
    """Run a baseline; a failure becomes a skipped row with the error, so the other baselines still report."""
    try:
        return run()
    except Exception as error:  # noqa: BLE001 - recorded in the JSON, printed on stderr
        say(f"baseline {step} failed: {type(error).__name__}: {error}")
        print(f"[agentfold] baseline {step} failed: {error!r}", file=sys.stderr)
        return {"skipped": f"{type(error).__name__}: {error}"[:300]}
