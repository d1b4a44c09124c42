"""`agentfold bench quality`: what int8 weights cost in quality, measured against the float32 model.

Int8 weights are what make verify passes row-exact by construction (`kernels.int8_linear`,
`kernels.mlx_int8`), but they are a numeric change to the model, so they only earn the default if
the quantized model stays within 2% perplexity of the float32 one (`DEFAULT_LIMIT_PCT`). The
report measures that on a fixed text: the first tokens of a few Python stdlib files read from the
running interpreter (every install has them, so two machines score the same text), scored with
one forward pass per chunk through the backend's own `forward` (the code path decoding uses).

Greedy replies are reported too, as "identical N / M", but never gated: a 135M model's greedy
reply diverges under any numeric change (a different BLAS, thread count or rounding), so a
different reply is no evidence of lost quality; perplexity is.

Float and int8 are loaded separately per backend: quantizing replaces a model's linear layers in
place, and such a model cannot go back to float. On torch a GGUF is also scored on its own blocks
(`--quant blocks`, the CPU default), and where llama-cpp-python is installed llama.cpp scores the
same token ids from the same file: the blocks multiply as llama.cpp does, so their perplexities
should agree (within 0.5%).
"""

from __future__ import annotations

import gc
import hashlib
import math
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from agentfold.bench.machine import finish_run, machine_info, run_header, utc_timestamp
from agentfold.bench.prompts import encode_chat
from agentfold.bench.weights import model_path

SCHEMA = "agentfold.bench.quality/1"
DEFAULT_LIMIT_PCT = 2.0  # int8 may be the default only within this much perplexity of float32
TEXT_FILES = ("colorsys.py", "bisect.py", "textwrap.py", "sched.py", "heapq.py", "string.py")
TEXT_TOKENS = 1024
CHUNK_TOKENS = 256  # rows per forward pass (the KV cache carries the context across chunks)
QUANTS = ("none", "int8")  # none = the float32 reference
REPLY_PROMPTS = (
    "Write a Python function that returns the n-th Fibonacci number iteratively. Reply with the code only.",
    "Explain in two sentences what a hash table is.",
    "Write a haiku about a compiler.",
)
REPLY_MAX_TOKENS = 48


# -- the fixed text -----------------------------------------------------------------------------


def stdlib_text(files: Sequence[str] = TEXT_FILES) -> dict[str, Any]:
    """The scored text: stdlib files of this Python, each under a `# file:` line, in a fixed order.

    Files missing from this install are skipped (and listed), so the text is the same wherever the
    same Python version runs; its sha256 goes into the report so two reports can be compared.
    """
    stdlib = os.path.dirname(os.__file__)
    parts, used, missing = [], [], []
    for name in files:
        path = os.path.join(stdlib, name)
        try:
            with open(path, encoding="utf-8") as handle:
                parts.append(f"# file: {name}\n{handle.read()}")
            used.append(name)
        except OSError:
            missing.append(name)
    if not parts:
        raise FileNotFoundError(f"none of {list(files)} found in {stdlib}")
    text = "\n".join(parts)
    return {"files": used, "missing": missing, "stdlib": stdlib, "text": text,
            "sha256": hashlib.sha256(text.encode()).hexdigest()}


def text_tokens(tokenizer: Any, text: str, count: int) -> list[int]:
    """The first `count` tokens of `text` (no special tokens: plain source, not a chat)."""
    ids = list(tokenizer.encode(text, add_special_tokens=False))
    if len(ids) < count:
        raise ValueError(f"the quality text has {len(ids)} tokens, fewer than the {count} asked for")
    return [int(t) for t in ids[:count]]


# -- measurements -------------------------------------------------------------------------------


def nll_sum(logits: Any, targets: Sequence[int]) -> float:
    """Sum over rows of -log softmax(logits row)[target], in float64 (adds no rounding of its own)."""
    logits = np.asarray(logits, dtype=np.float64)
    peak = logits.max(axis=1, keepdims=True)
    log_norm = peak[:, 0] + np.log(np.exp(logits - peak).sum(axis=1))
    return float((log_norm - logits[np.arange(len(targets)), np.asarray(targets, dtype=np.int64)]).sum())


def perplexity(backend: Any, tokens: Sequence[int], chunk: int = CHUNK_TOKENS) -> dict[str, Any]:
    """exp(mean negative log-likelihood) of tokens[1:] given the ones before, one `forward` per chunk.

    The cache carries the context across chunks, so every token is scored with the whole text
    before it; the last row of a chunk scores the first token of the next one. Log-softmax runs in
    float64 on the float32 logits the backend returns, so the score adds no rounding of its own.
    """
    if len(tokens) < 2:
        raise ValueError("perplexity needs at least 2 tokens")
    cache = backend.new_cache()
    nll = 0.0
    scored = 0
    began = time.perf_counter()
    for start in range(0, len(tokens) - 1, chunk):
        rows = list(tokens[start : min(start + chunk, len(tokens) - 1)])  # the last token is only a target
        logits = backend.forward(rows, cache)
        nll += nll_sum(logits, tokens[start + 1 : start + 1 + len(rows)])
        scored += len(rows)
    mean = nll / scored
    return {"perplexity": round(math.exp(mean), 4), "mean_nll": round(mean, 6), "scored_tokens": scored,
            "chunk_tokens": chunk, "seconds": round(time.perf_counter() - began, 3)}


def greedy_replies(engine: Any, prompts: Sequence[Sequence[int]], max_tokens: int) -> list[list[int]]:
    """The serial greedy reply (token ids) to each prompt."""
    from agentfold.engine.decode import GenerationConfig

    return [list(engine.generate(list(p), GenerationConfig(max_tokens=max_tokens, draft=False)).tokens)
            for p in prompts]


def _first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The index of the first differing token (the shorter length if one is a prefix), None if equal."""
    if list(a) == list(b):
        return None
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))


def available_backends(device: str = "auto") -> list[str]:
    """The backends that can run on `device` here (`backend_choice.candidates`: torch only where
    PyTorch is installed, MLX everywhere but CUDA)."""
    from agentfold.engine.backend_choice import candidates

    return candidates(device)


# -- the report ---------------------------------------------------------------------------------


def quality_report(model: str | Path | None = None, backends: Sequence[str] | None = None,
                   tokens: int = TEXT_TOKENS, chunk: int = CHUNK_TOKENS, reply_prompts: Sequence[str] = REPLY_PROMPTS,
                   reply_max_tokens: int = REPLY_MAX_TOKENS, dtype: str | None = None, device: str = "auto",
                   limit_pct: float = DEFAULT_LIMIT_PCT,
                   progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Perplexity of float32 vs int8 per backend on the fixed text, and greedy replies float vs int8.

    `default_ok` per backend: |int8 / float32 - 1| <= `limit_pct` %; the report's `default_ok`:
    every measured backend passes. A backend that cannot run here is recorded with the reason.
    """
    from agentfold.engine.factory import build_engine

    say = progress or (lambda message: None)
    began = time.perf_counter()
    path = model_path(None if model is None else str(model))
    source = stdlib_text()
    names = list(backends) if backends else available_backends(device)
    report: dict[str, Any] = {
        "model": str(path),
        "text": {key: source[key] for key in ("files", "missing", "stdlib", "sha256")}
        | {"tokens": tokens, "chunk_tokens": chunk},
        "method": ("exp(mean NLL) of tokens[1:] of the text, one backend.forward pass per chunk with the KV cache "
                   "carried across chunks, log-softmax in float64 over the float32 logits"),
        "limit_pct": limit_pct,
        "replies_note": ("greedy replies of a small model diverge under any numeric change; reported, not gated"),
        "backends": {},
    }
    all_replies: dict[str, dict[str, list[list[int]]]] = {}  # backend -> quant -> replies
    text_ids: list[int] = []  # the scored tokens (one tokenizer: every backend scores the same ids)
    for name in names:
        entry: dict[str, Any] = {}
        replies = all_replies.setdefault(name, {})
        try:
            for quant in _quants(name, path, device):
                say(f"quality: {name} {'float32' if quant == 'none' else quant}: loading")
                engine = build_engine(path, dtype=dtype, drafter="none", backend=name, quant=quant, device=device,
                                      progress=None)
                tokenizer = engine.tokenizer
                ids = text_ids = text_tokens(tokenizer, source["text"], tokens)
                entry.setdefault("token_sha", hashlib.sha256(np.asarray(ids, dtype=np.int64).tobytes()).hexdigest())
                scored = perplexity(engine.backend, ids, chunk)
                scored["kernels"] = engine.backend.describe()
                scored["quant"] = engine.backend.quant
                entry["float32" if quant == "none" else quant] = scored
                say(f"quality: {name} {'float32' if quant == 'none' else quant}: "
                    f"perplexity {scored['perplexity']:.4f} ({scored['seconds']:.1f}s)")
                if reply_prompts and reply_max_tokens > 0:
                    prompts = [encode_chat(tokenizer, [{"role": "user", "content": p}]) for p in reply_prompts]
                    replies[quant] = greedy_replies(engine, prompts, reply_max_tokens)
                del engine
                gc.collect()
        except (ValueError, RuntimeError, ImportError, OSError) as error:
            entry["error"] = f"{type(error).__name__}: {error}"
            say(f"quality: {name}: cannot run ({error})")
        if "float32" in entry and "blocks" in entry:
            entry["blocks_change_pct"] = round((entry["blocks"]["perplexity"] / entry["float32"]["perplexity"] - 1) * 100, 4)
        if "float32" in entry and "int8" in entry:
            ref, quantized = entry["float32"]["perplexity"], entry["int8"]["perplexity"]
            change = (quantized / ref - 1.0) * 100.0
            entry["relative_change_pct"] = round(change, 4)
            entry["default_ok"] = abs(change) <= limit_pct
        if all(quant in replies for quant in QUANTS):
            rows = []
            for prompt, float_reply, int8_reply in zip(reply_prompts, replies["none"], replies["int8"], strict=True):
                rows.append({"prompt": prompt, "float32_tokens": len(float_reply), "int8_tokens": len(int8_reply),
                             "identical": float_reply == int8_reply,
                             "first_difference": _first_difference(float_reply, int8_reply)})
            same = sum(r["identical"] for r in rows)
            entry["replies"] = {"max_tokens": reply_max_tokens, "identical": f"{same} / {len(rows)}",
                                "identical_count": same, "count": len(rows), "per_prompt": rows}
        report["backends"][name] = entry
    report["llama_cpp"] = _llama_cpp_row(path, report, text_ids, say) if text_ids else {"skipped": "no backend ran"}
    report["across_backends"] = _across_backends(all_replies)
    measured = [e for e in report["backends"].values() if "default_ok" in e]
    report["default_ok"] = bool(measured) and all(e["default_ok"] for e in measured)
    report["seconds"] = round(time.perf_counter() - began, 3)
    return report


def _quants(backend: str, path: Path, device: str) -> tuple[str, ...]:
    """float32 and int8 on every backend; on torch a GGUF on its own blocks too (the CPU default)."""
    on_cpu = device in ("auto", "cpu")
    return (*QUANTS, "blocks") if backend == "torch" and path.suffix.lower() == ".gguf" and on_cpu else QUANTS


def _llama_cpp_row(path: Path, report: dict[str, Any], ids: list[int], say: Callable[[str], None]) -> dict[str, Any]:
    """llama.cpp's perplexity on the same token ids, and the blocks' change against it (the bar:
    within 0.5%)."""
    from agentfold.bench import llamacpp

    row = llamacpp.perplexity(path, ids, threads=os.cpu_count() or 1)
    blocks = report["backends"].get("torch", {}).get("blocks")
    if "perplexity" in row and blocks and "perplexity" in blocks:
        row["blocks_vs_llama_cpp_pct"] = round((blocks["perplexity"] / row["perplexity"] - 1) * 100, 4)
    say(f"quality: llama.cpp: {row.get('perplexity', row.get('skipped'))}")
    return row


def _across_backends(replies: dict[str, dict[str, list[list[int]]]]) -> dict[str, Any]:
    """Per quant, whether every backend gave the same greedy replies (int8 is the same integer
    arithmetic on each backend; float32 sums in each backend's own order). Reported, not gated."""
    out: dict[str, Any] = {}
    for quant in QUANTS:
        runs = {name: by_quant[quant] for name, by_quant in replies.items() if quant in by_quant}
        if len(runs) < 2:
            continue
        first, *others = runs.values()
        same = sum(all(run[i] == first[i] for run in others) for i in range(len(first)))
        out["float32" if quant == "none" else quant] = {"backends": sorted(runs), "identical": f"{same} / {len(first)}",
                                                        "identical_count": same, "count": len(first)}
    return out


def bench_quality(model: str | None, out: str | Path, backend: str = "auto", dtype: str | None = None,
                  device: str = "auto", tokens: int = TEXT_TOKENS,
                  progress: Callable[[str], None] | None = print) -> dict[str, Any]:
    """`agentfold bench quality`: the quality report alone, with the machine header, written as JSON."""
    started = time.perf_counter()
    timestamp = utc_timestamp()
    machine = machine_info()
    backends = None if backend == "auto" else [backend]
    report = quality_report(model, backends=backends, tokens=tokens, dtype=dtype, device=device, progress=progress)
    result = {**run_header(SCHEMA, timestamp, False, machine), "quality": report}
    finish_run(result, started, out)
    return result


def summary_line(report: dict[str, Any]) -> str:
    """One line per report: perplexity float32 -> int8 per backend, replies identical, verdict."""
    parts = []
    for name, entry in report.get("backends", {}).items():
        if "relative_change_pct" in entry:
            replies = entry.get("replies", {}).get("identical", "-")
            parts.append(f"{name}: ppl {entry['float32']['perplexity']:.3f} -> {entry['int8']['perplexity']:.3f} "
                         f"({entry['relative_change_pct']:+.2f}%), replies identical {replies}")
        else:
            parts.append(f"{name}: {entry.get('error', 'not measured')}")
        if "blocks_change_pct" in entry:
            parts.append(f"{name} blocks: ppl {entry['blocks']['perplexity']:.3f} ({entry['blocks_change_pct']:+.2f}%)")
    llama = report.get("llama_cpp", {})
    if "perplexity" in llama:
        versus = llama.get("blocks_vs_llama_cpp_pct")
        parts.append(f"llama.cpp: ppl {llama['perplexity']:.3f}"
                     + (f" (blocks {versus:+.2f}% of it)" if versus is not None else ""))
    for quant, same in report.get("across_backends", {}).items():
        parts.append(f"{quant} replies {' vs '.join(same['backends'])} identical {same['identical']}")
    verdict = "int8 within" if report.get("default_ok") else "int8 NOT within"
    return "; ".join(parts) + f"; {verdict} {report.get('limit_pct')}% of float32"
