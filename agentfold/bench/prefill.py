"""`bench agent`'s prefill rates: AgentFold's engine next to stock mlx-lm on the same prompt ids.

A coding agent's first request (and every cache miss) is a long prefill, so its speed decides how
long the agent waits before anything streams. The scheduler now runs prefill one decoder layer of
one chunk at a time (so other clients keep decoding); this section checks what the engine's
prefill costs on its own against the engine people would otherwise run, in-process, without HTTP:

- AgentFold: `build_engine(path, backend="auto")` as `agentfold serve` builds it, one reply of
  `max_tokens=1` with drafting off; rate = prefilled tokens / the engine's own prefill clock.
- mlx-lm: its `stream_generate(..., max_tokens=1)` on the float MLX model (`float_mlx_model`),
  under mlx-lm's own attention; rate = its reported `prompt_tps` (prompt tokens over the time to
  its first token).

Prompts are stdlib source text cut to exactly 1K, 4K and 16K tokens. A context beyond the bench
model's window runs on Gemma 3 270M (torch has no gemma3, so its engine runs the MLX backend),
or is skipped with the reason recorded.
"""

from __future__ import annotations

import gc
import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from agentfold.bench.rates import ratio, rounded

PREFILL_CONTEXTS = (1024, 4096, 16384)
QUICK_CONTEXTS = (256,)  # CI runs the quick bench: mlx_lm prefills ~10 tok/s on a 2-core Linux CPU
ROOM = 8  # tokens of the window left free beyond the prompt (the one reply token and margin)
WARM_TOKENS = 64  # a short prompt through both engines first: first-call costs stay out of the rates


def stdlib_text(seed: int, key: str, chars: int) -> str:
    """At least `chars` characters of stdlib source (when the stdlib has them), files in a seeded order per `key`.

    Real code, as an agent's context holds; the order differs per key so two prompts share no prefix.
    """
    from agentfold.bench.workloads import filler_files

    parts: list[str] = []
    size = 0
    for path in filler_files(seed, key, ()):
        text = f"\n### {path.name}\n{path.read_text(encoding='utf-8')}"
        parts.append(text)
        size += len(text)
        if size >= chars:
            break
    return "".join(parts)


def prompt_ids(tokenizer: Any, tokens: int, seed: int, key: str) -> list[int]:
    """Exactly `tokens` ids of stdlib source text (raw text, no chat template: prefill does not care)."""
    ids = list(tokenizer.encode(stdlib_text(seed, key, 6 * tokens), add_special_tokens=False))
    if len(ids) < tokens:
        raise ValueError(f"the stdlib text has only {len(ids)} tokens, fewer than {tokens}")
    return ids[:tokens]


def engine_rate(engine: Any, ids: Sequence[int]) -> dict[str, Any]:
    """One `max_tokens=1` reply without drafting: the engine's own prefill clock and counts."""
    from agentfold.engine.decode import GenerationConfig

    began = time.perf_counter()
    completion = engine.generate(list(ids), GenerationConfig(max_tokens=1, draft=False))
    wall = time.perf_counter() - began
    stats = completion.stats
    tps = stats.prefilled_tokens / stats.prefill_seconds if stats.prefill_seconds > 0 else None
    return {"tokens": stats.prefilled_tokens, "seconds": rounded(stats.prefill_seconds, 4), "tps": rounded(tps, 1),
            "ttft_seconds": rounded(stats.ttft_seconds, 4), "wall_seconds": rounded(wall, 4)}


def mlx_lm_rate(model: Any, tokenizer: Any, ids: Sequence[int]) -> dict[str, Any]:
    """mlx-lm's `stream_generate` with `max_tokens=1`: its own `prompt_tps` and prompt count."""
    import mlx.core as mx
    from mlx_lm.generate import stream_generate

    began = time.perf_counter()
    last = None
    for response in stream_generate(model, tokenizer, mx.array(list(ids)), max_tokens=1):
        last = response
    wall = time.perf_counter() - began
    assert last is not None
    tps = float(last.prompt_tps)
    return {"tokens": int(last.prompt_tokens), "seconds": rounded(last.prompt_tokens / tps, 4) if tps else None,
            "tps": rounded(tps, 1), "wall_seconds": rounded(wall, 4)}


def _measure_model(path: Path, contexts: Sequence[int], dtype: str, seed: int,
                   say: Callable[[str], None]) -> list[dict[str, Any]]:
    """Every context in `contexts` on one model: the engine first, then mlx-lm on the float MLX model."""
    from agentfold.bench.mlx_baseline import float_mlx_model, stock_attention
    from agentfold.engine.factory import build_engine
    from agentfold.serve.models import verdict_file

    say(f"bench prefill: building the engine for {path.name} (backend auto)")
    engine = build_engine(path, dtype=dtype, backend="auto", verdicts=verdict_file(), progress=say)
    backend = engine.backend
    name = path.stem if path.is_file() else path.name
    prompts = {c: prompt_ids(engine.tokenizer, c, seed, f"prefill:{c}") for c in contexts}
    engine_rate(engine, prompt_ids(engine.tokenizer, WARM_TOKENS, seed, "prefill:warm"))
    rows = []
    for context in contexts:
        say(f"bench prefill: agentfold ({backend.name}) {context} tokens on {name}")
        row = {"context": context, "model": name,
               "agentfold": {"backend": backend.name, "quant": getattr(backend, "quant", None),
                             **engine_rate(engine, prompts[context])}}
        say(f"bench prefill: agentfold {context} tokens: {row['agentfold']['tps']} tok/s")
        rows.append(row)
    baseline = float_mlx_model(path, dtype, backend, say)
    patched = [backend.model] if backend.name == "mlx" else []
    with stock_attention(patched):
        mlx_lm_rate(baseline.model, baseline.tokenizer, prompt_ids(engine.tokenizer, WARM_TOKENS, seed, "prefill:warm"))
        for row in rows:
            say(f"bench prefill: mlx_lm {row['context']} tokens on {name}")
            row["mlx_lm"] = {"backend": "mlx", "dtype": baseline.dtype,
                             **mlx_lm_rate(baseline.model, baseline.tokenizer, prompts[row["context"]])}
            row["ratio"] = ratio(row["agentfold"]["tps"], row["mlx_lm"]["tps"])
            say(f"bench prefill: mlx_lm {row['context']} tokens: {row['mlx_lm']['tps']} tok/s "
                f"(agentfold / mlx_lm {row['ratio']})")
    del engine, backend, baseline
    gc.collect()
    return rows


def _long_model(dtype: str) -> tuple[Path | None, str | None]:
    """Gemma 3 270M as a float MLX folder (as the suite converts it), or the reason it is unavailable."""
    from agentfold.bench.baselines import converted_folder
    from agentfold.serve.models import ModelNotFound, gemma3_path

    try:
        return converted_folder(gemma3_path(), dtype), None
    except (ModelNotFound, FileNotFoundError, ValueError, ImportError) as error:
        return None, f"Gemma 3 270M is not available: {error}"


def _window(folder: Path) -> int:
    """A converted model folder's context window from its config.json (as `weights.context_length` reads it),
    without loading the weights only to learn it."""
    from types import SimpleNamespace

    from agentfold.bench.weights import context_length

    return context_length(SimpleNamespace(config=json.loads((folder / "config.json").read_text())))


def bench_prefill(path: Path, context_length: int, contexts: Sequence[int] = PREFILL_CONTEXTS, dtype: str = "float32",
                  seed: int = 0, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """The `prefill` section: rows per context (bench model where it fits, else Gemma 3 270M), skips with reasons."""
    say = progress or (lambda message: None)
    fits = [c for c in contexts if c + ROOM <= context_length]
    beyond = [c for c in contexts if c + ROOM > context_length]
    rows, skipped = (_measure_model(path, fits, dtype, seed, say) if fits else []), []
    if beyond:
        long_path, reason = _long_model(dtype)
        window = _window(long_path) if long_path is not None else 0
        runnable = [c for c in beyond if c + ROOM <= window]
        for c in beyond:
            if c not in runnable:
                skipped.append({"context": c, "reason": reason or f"exceeds {path.name}'s {context_length} and "
                                                                   f"{long_path.name}'s {window} tokens"})
        if runnable:
            rows += _measure_model(long_path, runnable, dtype, seed, say)
    return {"contexts": list(contexts), "rows": rows, "skipped": skipped, "method": METHOD}


METHOD = {
    "prompts": "stdlib source text cut to exactly the context's tokens (no chat template), a different file order "
               "per context; one warm-up of 64 tokens per engine first",
    "agentfold": "build_engine(path, backend='auto') as `agentfold serve` builds it; generate(max_tokens=1, "
                 "draft=False); tps = stats.prefilled_tokens / stats.prefill_seconds (the engine's own clock)",
    "mlx_lm": "mlx_lm.generate.stream_generate(max_tokens=1) on the float MLX model with mlx-lm's own attention; "
              "tps = its reported prompt_tps (prompt tokens over the time to its first token)",
    "models": "the bench model where the context fits its window; Gemma 3 270M beyond it (MLX backend: torch has "
              "no gemma3), skipped with the reason when it is not installed",
}
