"""`agentfold bench moe`: the agent MoE models at their real size, on random weights, against llama.cpp.

The engine runs two MoE GGUF architectures on its CPU block kernels, `qwen3moe` (Qwen3-Coder-30B-A3B)
and `gpt-oss` (gpt-oss-20b, MXFP4 experts). Their real weights cannot be downloaded here, and speed
does not depend on what the weights say, only on their shapes and block types: so this bench writes
a GGUF of random blocks at the real dimensions in the block types the shipped files use, once, to
`<cache root>/bench/` (`$AGENTFOLD_CACHE`, else ~/.cache/agentfold; `bench.moe_files`), and runs both.

**The run.** Each engine runs in a child process of its own (`python -m agentfold.bench.moe_size
child ...`), so that its peak RSS (`getrusage`, with /proc's RssAnon / RssFile at the end) is its own
and the first one's memory is gone before the second loads; the file is read through once before
each (`page_cache_read_seconds`) so both start from the same page cache. Each engine is loaded
(`load_seconds`) and warmed up on a reply to 512 other random ids (`warmup_seconds`; `ready_seconds` is
both): every layer routes to every expert, so the blocks each engine repacks into its own layout
(AgentFold on first use, llama.cpp at load) are repacked before anything is timed. Both then take the
same seeded random ids: a prompt of `prefill` tokens, then `max_tokens` tokens of greedy serial decode; prefill
rate = prompt tokens / time to the first token, decode rate = tokens after the first / the time after
it (`bench.rates.steady_tps`). AgentFold (`build_engine(path, backend="torch", device="cpu",
quant="blocks")`, its row-exactness check in its load time) then decodes the prompt plus a window of
its own ids serially, and drafted from that serial reply as the request's prediction (Predicted
Outputs: random weights copy nothing a suffix drafter could find; an all-right prediction is the
verify passes' best case at the real shape); the drafted reply must equal the serial one. llama.cpp
(llama-cpp-python, one `Llama`, its default batch sizes, as many threads as the engine) decodes the
same prompt (`bench.llamacpp.decode`). The rates are the kernels' at the real shapes, not a model's.

Record (`--out`, schema `agentfold.bench.moe/1`): the run header (machine with CPU identity),
`settings`, per model `file`, `agentfold`, `llama_cpp` (or `{"skipped"|"failed": why}`) and `ratios`
(AgentFold over llama.cpp), `summary`, `all_identical`, `all_ran`. Peak RSS counts the file's pages a
child touched as well as its own memory; /proc's RssAnon and RssFile tell the two apart (llama.cpp
maps the whole file and keeps repacked copies; AgentFold repacks on first use and drops the file's
pages it repacked, `block_linear._release_file_pages`).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from agentfold.bench.machine import Ticker, memory_now, rss_line
from agentfold.bench.moe_files import (
    MoEShape,
    Say,
    default_cache_dir,
    ensure_file,
    read_through,
    shapes_for,
    tokenizer_fields,
)

SCHEMA = "agentfold.bench.moe/1"
DEFAULT_PREFILL = 4096
DEFAULT_MAX_TOKENS = 32
REPEAT_WINDOW = 128  # ids of the prompt repeated at its end for the drafted decode (at most a quarter of it)
# A warm-up reply through each engine first, its prompt long enough that every layer routes to every
# expert (512 tokens x 8 of 128 experts, or x 4 of 32, leave none out): both engines repack the blocks
# they repack (AgentFold on first use, llama.cpp at load) and touch every page before the measured rows.
WARM_TOKENS = 512
WARM_DRAFTED = 8  # and a drafted reply on a few of those tokens: the verify path's first call
def prompt_ids(shape: MoEShape, count: int, seed: int, key: int = 0) -> list[int]:
    """`count` seeded random ids of the ordinary tokens (no control token); `key` tells prompts apart."""
    rng = np.random.default_rng([seed, count, key])
    return [int(t) for t in rng.integers(0, shape.vocab - len(shape.specials()), size=count)]


def repeated_prompt(prompt: Sequence[int]) -> tuple[list[int], dict[str, int]]:
    """The prompt with a window of its own ids appended (a code edit re-emitting what it was shown),
    which the bench decodes serially, then drafted with that serial reply as its prediction."""
    window = max(4, min(REPEAT_WINDOW, len(prompt) // 4))
    start = len(prompt) // 2
    return list(prompt) + list(prompt[start : start + window]), {"window": window, "window_start": start}


# -- the children --------------------------------------------------------------------------------


def _child_say(engine: str) -> Say:
    def say(message: str) -> None:
        print(f"bench moe: {engine}: {message}", file=sys.stderr, flush=True)

    return say


def _without(row: dict[str, Any], *keys: str) -> dict[str, Any]:
    return {k: v for k, v in row.items() if k not in keys}


def _agentfold_generate(engine: Any, prompt: list[int], max_tokens: int, draft: bool, cache: Any, say: Say,
                        what: str, prediction: Sequence[int] = ()) -> Any:
    """One greedy reply, with a progress line per prefill chunk and every 8 tokens."""
    from agentfold.engine.decode import GenerationConfig

    began = time.perf_counter()
    start = cache.length

    def on_prefill(state: Any) -> None:
        seconds = time.perf_counter() - began
        done = state.length - start
        say(f"{what}: prefilled {state.length} / {len(prompt)} tokens ({done / seconds:.1f} tok/s so far)")

    generation = engine.stream(prompt, GenerationConfig(max_tokens=max_tokens, draft=draft,
                                                            prediction=tuple(prediction)), cache,
                               on_prefill=on_prefill)
    made = 0
    for delta in generation:
        if delta.tokens:
            before, made = made, made + len(delta.tokens)
            if made // 8 != before // 8:
                say(f"{what}: {made} / {max_tokens} tokens")
    assert generation.completion is not None
    return generation.completion


def run_agentfold(request: dict[str, Any]) -> dict[str, Any]:
    """The AgentFold child: load, prefill + serial decode, then serial and drafted on the repeated prompt."""
    from agentfold.bench.machine import thread_info
    from agentfold.bench.rates import completion_row, ratio, rounded
    from agentfold.engine.factory import build_engine

    say = _child_say("agentfold")
    path, prompt, max_tokens = Path(request["path"]), list(request["prompt"]), int(request["max_tokens"])
    say(f"loading {path.name} (torch on the CPU, on its GGUF blocks; then the row-exactness self-check)")
    began = time.perf_counter()
    with Ticker(30.0, lambda: f"loading: {time.perf_counter() - began:.0f} s ({rss_line()})", say):
        engine = build_engine(path, backend="torch", device="cpu", quant="blocks", progress=say)
    load_seconds = time.perf_counter() - began
    backend = engine.backend
    loaded_memory = memory_now()
    warm = list(request["warm_prompt"])
    say(f"loaded in {load_seconds:.1f} s (RSS {loaded_memory.get('VmRSS', 0) / 1e9:.2f} GB); warm-up: a reply "
        f"of 2 tokens to {len(warm)} other tokens, a drafted one to {WARM_DRAFTED}")
    began = time.perf_counter()
    _agentfold_generate(engine, warm, 2, False, backend.new_cache(), say, "warm-up")
    _agentfold_generate(engine, warm[:WARM_DRAFTED], 2, True, backend.new_cache(), say, "warm-up, drafted")
    warmup_seconds = time.perf_counter() - began

    say(f"prefill {len(prompt)} tokens, then {max_tokens} tokens of serial greedy decode")
    cache = backend.new_cache()
    serial = _agentfold_generate(engine, prompt, max_tokens, False, cache, say, "serial")
    row = completion_row(serial)
    ttft = serial.stats.ttft_seconds
    prefill = {"tokens": len(prompt), "seconds": rounded(ttft, 3), "tps": rounded(len(prompt) / ttft, 2),
               "engine_prefill_seconds": rounded(serial.stats.prefill_seconds, 3),
               "engine_prefill_tps": rounded(serial.stats.prefilled_tokens / serial.stats.prefill_seconds, 2)
               if serial.stats.prefill_seconds > 0 else None}
    say(f"prefill {prefill['tps']} tok/s ({ttft:.1f} s to the first token), serial decode {row['steady_tps']} tok/s")

    repeated, where = repeated_prompt(prompt)
    say(f"the repeated prompt ({len(repeated)} tokens: {where['window']} ids of the prompt again, its first "
        f"{len(prompt)} tokens from the cache): serial, then drafted")
    backend.truncate(cache, len(prompt))
    again = _agentfold_generate(engine, repeated, max_tokens, False, cache, say, "repeated, serial")
    backend.truncate(cache, len(prompt))
    drafted = _agentfold_generate(engine, repeated, max_tokens, True, cache, say, "repeated, drafted",
                                  prediction=again.tokens)
    again_row, drafted_row = completion_row(again), completion_row(drafted)
    identical = drafted.tokens == again.tokens
    say(f"drafted {drafted_row['reply_tps']} tok/s against serial {again_row['reply_tps']} tok/s, "
        f"{drafted.stats.tokens_per_pass:.2f} tokens a pass, {'identical' if identical else 'DIFFERENT'}")
    exactness = engine.exactness
    return {
        "engine": "agentfold",
        "backend": {"name": backend.name, "quant": backend.quant, "kernels": backend.describe()},
        "threads": thread_info(backend),
        "load_seconds": round(load_seconds, 3),
        "model_load_seconds": round(float(getattr(backend.loaded, "load_seconds", 0.0)), 3),
        "selfcheck_seconds": round(exactness.seconds, 3),
        "warmup_seconds": round(warmup_seconds, 3),
        "ready_seconds": round(load_seconds + warmup_seconds, 3),
        "exactness": {"max_width": exactness.max_width, "drafting": exactness.drafting,
                      "describe": exactness.describe()},
        "drafter": engine.drafter.name if engine.drafter else "none",
        "memory_after_load": loaded_memory,
        "prefill": prefill,
        "decode_tps": row["steady_tps"],
        "decode": _without(row, "text_head"),
        "tokens": list(serial.tokens),
        "drafted": {
            "prompt_tokens": len(repeated), "cached_tokens": len(prompt), **where,
            "prediction_tokens": len(again.tokens),
            "serial_tps": again_row["reply_tps"], "drafted_tps": drafted_row["reply_tps"],
            "speedup": ratio(drafted_row["reply_tps"], again_row["reply_tps"]),
            "tokens_per_pass": rounded(drafted.stats.tokens_per_pass, 4),
            "acceptance_rate": rounded(drafted.stats.acceptance_rate, 4),
            "drafted_tokens": drafted.stats.drafted, "accepted": drafted.stats.accepted,
            "identical": identical,
            "serial": _without(again_row, "text_head"), "drafted_run": _without(drafted_row, "text_head"),
        },
        **memory_now(),
    }


def run_llama_cpp(request: dict[str, Any]) -> dict[str, Any]:
    """The llama.cpp child: one `Llama` on the file, the same prompt prefilled and decoded serially."""
    import llama_cpp

    from agentfold.bench import llamacpp as bench_llamacpp

    say = _child_say("llama.cpp")
    path, prompt, max_tokens = Path(request["path"]), list(request["prompt"]), int(request["max_tokens"])
    threads, n_ctx = int(request["threads"]), len(prompt) + max_tokens + 64
    say(f"loading {path.name} (llama-cpp-python {getattr(llama_cpp, '__version__', '?')}, {threads} threads, "
        f"n_ctx {n_ctx})")
    began = time.perf_counter()
    with Ticker(30.0, lambda: f"loading: {time.perf_counter() - began:.0f} s ({rss_line()})", say):
        llm = llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                              verbose=False)
    load_seconds = time.perf_counter() - began
    loaded_memory = memory_now()
    warm = list(request["warm_prompt"])
    say(f"loaded in {load_seconds:.1f} s (RSS {loaded_memory.get('VmRSS', 0) / 1e9:.2f} GB); warm-up: a reply "
        f"of 2 tokens to {len(warm)} other tokens")
    stops = list(request.get("stop_ids") or [])
    n_batch = getattr(llm, "n_batch", None)
    try:
        began = time.perf_counter()
        with Ticker(20.0, lambda: f"warm-up: {llm.n_tokens} tokens evaluated ({time.perf_counter() - began:.0f} s)",
                    say):
            bench_llamacpp.decode(llm, warm, 2, stops)
        warmup_seconds = time.perf_counter() - began
        say(f"prefill {len(prompt)} tokens, then {max_tokens} tokens of serial greedy decode")
        began = time.perf_counter()
        with Ticker(20.0, lambda: f"serial: {llm.n_tokens} tokens evaluated ({time.perf_counter() - began:.0f} s)",
                    say):
            row = bench_llamacpp.decode(llm, prompt, max_tokens, stops)
    finally:
        llm.close()
    ttft = row["ttft_seconds"]
    prefill = {"tokens": len(prompt), "seconds": ttft, "tps": round(len(prompt) / ttft, 2) if ttft else None,
               "n_batch": n_batch}
    say(f"prefill {prefill['tps']} tok/s ({ttft:.1f} s to the first token), serial decode {row['steady_tps']} tok/s")
    return {
        "engine": "llama.cpp",
        "version": getattr(llama_cpp, "__version__", None),
        "threads": threads,
        "n_ctx": n_ctx,
        "load_seconds": round(load_seconds, 3),
        "warmup_seconds": round(warmup_seconds, 3),
        "ready_seconds": round(load_seconds + warmup_seconds, 3),
        "memory_after_load": loaded_memory,
        "prefill": prefill,
        "decode_tps": row["steady_tps"],
        "decode": _without(row, "tokens"),
        "tokens": row["tokens"],
        "weights": "the file's own blocks, llama.cpp's kernels (its defaults: mmap, extra buffer types)",
        **memory_now(),
    }


def child_main(argv: Sequence[str]) -> int:
    """`python -m agentfold.bench.moe_size child ENGINE REQUEST.json RESULT.json`."""
    from agentfold import prepare_process

    engine, request_file, result_file = argv
    prepare_process()
    request = json.loads(Path(request_file).read_text())
    result = run_agentfold(request) if engine == "agentfold" else run_llama_cpp(request)
    Path(result_file).write_text(json.dumps(result))
    return 0


def run_child(engine: str, request: dict[str, Any], say: Say) -> dict[str, Any]:
    """Run one engine's child; its result, or `{"failed": why}` (its last lines of output kept)."""
    with tempfile.TemporaryDirectory(prefix="agentfold-bench-moe-") as folder:
        request_file, result_file = Path(folder) / "request.json", Path(folder) / "result.json"
        request_file.write_text(json.dumps(request))
        command = [sys.executable, "-m", "agentfold.bench.moe_size", "child", engine, str(request_file),
                   str(result_file)]
        tail: collections.deque[str] = collections.deque(maxlen=12)
        with subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, errors="replace") as child:
            assert child.stdout is not None
            for line in child.stdout:
                line = line.rstrip()
                if line:
                    tail.append(line)
                    say(line)
            code = child.wait()
        if code != 0 or not result_file.is_file():
            why = (f"killed by signal {-code}{' (out of memory?)' if code == -9 else ''}" if code < 0
                   else f"exit status {code}")
            return {"failed": f"the {engine} child ended with {why}", "last_lines": list(tail)}
        return json.loads(result_file.read_text())


# -- the bench -----------------------------------------------------------------------------------


def _ratios(ours: dict[str, Any], theirs: dict[str, Any]) -> dict[str, Any]:
    from agentfold.bench.rates import ratio

    if "prefill" not in ours or "prefill" not in theirs:
        return {}
    return {
        "prefill": ratio(ours["prefill"]["tps"], theirs["prefill"]["tps"]),
        "decode": ratio(ours["decode_tps"], theirs["decode_tps"]),
        "drafted_vs_llama_cpp_serial": ratio(ours["drafted"]["drafted_tps"], theirs["decode_tps"]),
        "load_seconds": ratio(ours["load_seconds"], theirs["load_seconds"]),
        "ready_seconds": ratio(ours["ready_seconds"], theirs["ready_seconds"]),
        "peak_rss": ratio(ours["peak_rss_bytes"], theirs["peak_rss_bytes"]),
        "note": "AgentFold over llama.cpp: above 1, AgentFold's rate is higher (its seconds or bytes more)",
    }


def _available_memory() -> int | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def bench_model(shape: MoEShape, prefill: int, max_tokens: int, cache_dir: Path, seed: int, llama: bool,
                keep_file: bool, say: Say) -> dict[str, Any]:
    """One shape: its file, AgentFold's child, llama.cpp's child, and the ratios."""
    import importlib.util

    from agentfold.bench.llamacpp import NOT_INSTALLED

    say(f"bench moe: {shape.name} ({shape.arch}, {shape.layers} layers, {shape.experts} experts of which "
        f"{shape.used} used, {shape.label})")
    file = ensure_file(shape, cache_dir, seed, say)
    path = Path(file["path"])
    prompt = prompt_ids(shape, prefill, seed)
    available = _available_memory()
    if available is not None and available < file["bytes"]:
        say(f"bench moe: warning: {available / 1e9:.1f} GB of memory available for a {file['gb']:.1f} GB file: "
            "the engines will read parts of it from disk again")
    request: dict[str, Any] = {"path": str(path), "prompt": prompt, "max_tokens": max_tokens,
                               "warm_prompt": prompt_ids(shape, min(WARM_TOKENS, prefill), seed, key=1)}
    record: dict[str, Any] = {"shape": dataclasses.asdict(shape), "file": file, "prompt_tokens": prefill,
                              "max_tokens": max_tokens}
    say(f"bench moe: {shape.name}: reading the file through before AgentFold loads it")
    read_seconds = read_through(path, say)
    ours = run_child("agentfold", request, say)
    ours["page_cache_read_seconds"] = round(read_seconds, 2)
    tokens = ours.pop("tokens", None)
    record["agentfold"] = ours
    if not llama:
        record["llama_cpp"] = {"skipped": "--no-llama-cpp"}
    elif importlib.util.find_spec("llama_cpp") is None:
        record["llama_cpp"] = {"skipped": NOT_INSTALLED}
    else:
        threads = (ours.get("threads") or {}).get("backend") or len(os.sched_getaffinity(0))
        say(f"bench moe: {shape.name}: reading the file through before llama.cpp loads it")
        read_seconds = read_through(path, say)
        eos = tokenizer_fields(shape)["tokenizer.ggml.eos_token_id"]
        theirs = run_child("llama.cpp", {**request, "threads": int(threads), "stop_ids": [eos]}, say)
        theirs["page_cache_read_seconds"] = round(read_seconds, 2)
        their_tokens = theirs.pop("tokens", None)
        if tokens is not None and their_tokens is not None:
            theirs["identical_to_agentfold_serial"] = their_tokens == tokens
        record["llama_cpp"] = theirs
    record["ratios"] = _ratios(ours, record["llama_cpp"])
    if not keep_file:
        path.unlink(missing_ok=True)
        record["file"]["deleted_after_run"] = True
        say(f"bench moe: deleted {path} (--no-keep-files)")
    return record


def _summary(models: dict[str, dict[str, Any]]) -> dict[str, Any]:
    rows: dict[str, Any] = {}
    for name, model in models.items():
        ours, theirs = model["agentfold"], model["llama_cpp"]
        rows[name] = {
            "agentfold_prefill_tps": (ours.get("prefill") or {}).get("tps"),
            "llama_cpp_prefill_tps": (theirs.get("prefill") or {}).get("tps"),
            "agentfold_decode_tps": ours.get("decode_tps"),
            "agentfold_drafted_tps": (ours.get("drafted") or {}).get("drafted_tps"),
            "llama_cpp_decode_tps": theirs.get("decode_tps"),
            "prefill_ratio": model["ratios"].get("prefill"),
            "decode_ratio": model["ratios"].get("decode"),
            "agentfold_peak_rss_gb": ours.get("peak_rss_gb"),
            "llama_cpp_peak_rss_gb": theirs.get("peak_rss_gb"),
            "drafted_identical": (ours.get("drafted") or {}).get("identical"),
            "failed": [engine for engine, part in (("agentfold", ours), ("llama.cpp", theirs)) if "failed" in part],
        }
    return {"models": rows,
            "all_identical": all(row["drafted_identical"] is True for row in rows.values()),
            "all_ran": not any(row["failed"] for row in rows.values())}


def bench_moe(arch: str = "all", out: str | Path | None = None, prefill: int = DEFAULT_PREFILL,
              max_tokens: int = DEFAULT_MAX_TOKENS, cache_dir: str | Path | None = None, keep_files: bool = True,
              seed: int = 0, llama: bool = True, layers: int | None = None, progress: Say | None = print) -> dict:
    """Write (or reuse) each shape's random GGUF and run AgentFold and llama.cpp on it; write the JSON.

    `arch`: a `SHAPES` name or `all` (the real two); `layers`: only the first this many layers of each
    (a shorter run at the real widths, whose figures are not the model's)."""
    from agentfold.bench.machine import finish_run, machine_info, run_header, utc_timestamp

    say = progress or (lambda message: None)
    shapes = shapes_for(arch, layers)
    if prefill < 16:
        raise ValueError(f"--prefill must be at least 16 tokens, not {prefill}")
    if max_tokens < 2:
        raise ValueError(f"--max-tokens must be at least 2 to measure a decode rate, not {max_tokens}")
    for shape in shapes:
        if prefill + REPEAT_WINDOW + max_tokens + 64 > shape.context:
            raise ValueError(f"--prefill {prefill} does not fit {shape.name}'s context of {shape.context} tokens")
    folder = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
    out = Path(out) if out else Path(f"moe-{arch}.json")
    started, timestamp, machine = time.perf_counter(), utc_timestamp(), machine_info()
    models = {shape.name: bench_model(shape, prefill, max_tokens, folder, seed, llama, keep_files, say)
              for shape in shapes}
    result: dict[str, Any] = {
        **run_header(SCHEMA, timestamp, False, machine),
        "settings": {"arch": arch, "prefill_tokens": prefill, "max_tokens": max_tokens, "seed": seed,
                     "layers": layers, "cache_dir": str(folder), "keep_files": keep_files, "llama_cpp": llama,
                     "sampling": "greedy"},
        "method": {
            "weights": "random blocks at the model's real shapes and block types (see the module docstring); "
                       "rates are the kernels', drafting acceptance is not a trained model's",
            "processes": "each engine in its own child process, one after the other, the file read through "
                         "before each; peak RSS is the child's (getrusage ru_maxrss; RssFile counts the "
                         "memory-mapped file's pages the child touched)",
            "prefill": "prompt tokens / seconds to the first token of the serial reply (llama.cpp: Llama.generate "
                       "through bench.llamacpp.decode; AgentFold: Engine.generate, whose own prefill clock is "
                       "engine_prefill_tps)",
            "decode": "steady_tps: (tokens - 1) / (time of the last token - time of the first), greedy, "
                      "at the prompt's context",
            "drafted": "AgentFold only: the prompt plus a window of its own ids, from the cached prompt, serial, "
                       "then drafted from the serial reply sent as its prediction (Predicted Outputs: every "
                       "draft right, the verify passes' best case on this shape; random weights copy nothing "
                       "a suffix drafter could find); rates are reply_tps (tokens / the reply's time after its prefill, the "
                       "first pass included, as it commits most of a predicted reply); identical must hold",
        },
        "models": models,
    }
    machine["threads"] = next((m["agentfold"]["threads"] for m in models.values() if "threads" in m["agentfold"]),
                              machine["threads"])
    result["summary"] = _summary(models)
    finish_run(result, started, out)
    say(f"bench moe: wrote {out} in {result['duration_seconds']:.0f} s")
    return result


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["child"] and len(argv) == 4:
        return child_main(argv[1:])
    print("python -m agentfold.bench.moe_size: internal, `agentfold bench moe`'s child processes", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
