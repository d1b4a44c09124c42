"""`agentfold bench decode`: serial vs drafted vs mlx-lm vs llama.cpp, in one run, on three fixed workloads.

The workloads (`bench.prompts`) are built from files every Python install has, so two machines
bench the same prompts: (a) code-edit re-emits a real stdlib module with one small rename (where
suffix lookup drafting pays), (b) fresh-code writes a new function, (c) prose writes a paragraph.
Each one is decoded greedily by the engine (the backend and quant `--backend` / `--quant` pick, as
`agentfold generate` would) serially and with drafting, by stock mlx-lm on the float model, and by
llama.cpp on the same GGUF where llama-cpp-python is installed; rates are also put against a
memory-bandwidth roofline measured in the same run, over the bytes the chosen backend reads per
token, and the run measures the engine against the bus (`bench.bus`, the record's `bus` and
`roofline.read_bandwidth`): the read bandwidth at the backend's threads, a one-row pass part by
part (decoder layers, output head, sampling, the rest) with the GB/s each part's weights stream
at, and passes of 1-16 rows against llama.cpp's on the same ids. Int8 weights change the numerics,
so the run also reports their cost in quality next to float32 (`bench_quality`). Speed is
reported, never asserted: the run's `identical` flags (drafted == serial) are the part that must
hold; equality with mlx-lm's float model or with llama.cpp is reported only.

The run is a sequence of steps, one function each: load the engines (`decode_rig.load_rig`),
measure the roofline (`Roofline.measure`), open llama.cpp, warm up, decode each workload
(`_workload_row`), time the passes against the bus (`bus.bus_section`), assemble the record
(`_record`), append the quality report (`_append_quality`). The `bus` section's schema is in
`bench.bus`'s docstring.
"""

from __future__ import annotations

import gc
import os
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from agentfold.bench import llamacpp as bench_llamacpp
from agentfold.bench.bus import bus_section
from agentfold.bench.busy import busy_row
from agentfold.bench.decode_rig import Choice, Rig, Roofline, load_rig
from agentfold.bench.machine import finish_run, machine_info, run_header, utc_timestamp
from agentfold.bench.mlx_baseline import MLX_LM_NUM_DRAFT_TOKENS, mlx_dtype, mlx_lm_decode, stock_attention
from agentfold.bench.prompts import WARMUP_PROMPT, encode_chat, workloads
from agentfold.bench.rates import completion_row, ratio, rounded
from agentfold.bench.weights import backend_bytes, model_path, model_record, weights_dtype
from agentfold.kernels import blas

SCHEMA = "agentfold.bench.decode/1"
QUICK_MAX_TOKENS = 32
TARGETS = {"code_edit_speedup": 2.5, "prose_speedup": 0.95, "serial_tps": 25.0}


# -- the steps ----------------------------------------------------------------------------------


def _open_llama(rig: Rig, loads: Sequence[tuple[dict[str, Any], list[int]]], max_tokens: int,
                machine: dict[str, Any], say: Callable[[str], None]) -> tuple[Any, dict[str, Any]]:
    """llama.cpp on the same GGUF with room for the longest prompt, or None and why not."""
    longest = max(len(prompt) for _, prompt in loads)
    # + a batch (512): llama-cpp-python's prompt-lookup eval writes a whole batch of scores from
    # n_past, past n_ctx near the end (a 762-token prompt on the coder model overflowed).
    llama, llama_info = bench_llamacpp.open_llama_cpp(rig.path, longest + max_tokens + 64 + 512,
                                                      machine["cpus_usable"] or os.cpu_count() or 1)
    say(f"bench: llama.cpp: {llama_info.get('skipped') or 'llama-cpp-python ' + str(llama_info.get('version'))}")
    return llama, llama_info


def _warm_up(rig: Rig, llama: Any, quick: bool, say: Callable[[str], None]) -> dict[str, Any]:
    """A few tokens through every engine, so no first-call cost lands in a measured row."""
    from agentfold.engine.decode import GenerationConfig

    say("bench: warm-up")
    warm_prompt = encode_chat(rig.tokenizer, [{"role": "user", "content": WARMUP_PROMPT}])
    warm_tokens = 4 if quick else 8
    warm_began = time.perf_counter()
    rig.engine.generate(warm_prompt, GenerationConfig(max_tokens=warm_tokens, draft=False))
    rig.engine.generate(warm_prompt, GenerationConfig(max_tokens=warm_tokens, draft=True))
    with stock_attention(rig.patched_models):
        mlx_lm_decode(rig.baseline.model, rig.tokenizer, warm_prompt, warm_tokens)
    if llama is not None:
        for runner in (llama.serial, llama.lookup):
            if runner is not None:
                bench_llamacpp.decode(runner, warm_prompt, warm_tokens, rig.eos)
    return {"prompt_tokens": len(warm_prompt), "max_tokens": warm_tokens,
            "seconds": round(time.perf_counter() - warm_began, 3)}


def _speed_columns(load: dict[str, Any], prompt: Sequence[int], max_tokens: int, serial: Any, drafted: Any,
                   rows: tuple[dict[str, Any], dict[str, Any]], stock: dict[str, Any],
                   roofline: Roofline) -> dict[str, Any]:
    """A workload's rates, drafting counts and equality flags (engine serial, drafted, mlx-lm)."""
    s_tps, d_tps, m_tps = rows[0]["steady_tps"], rows[1]["steady_tps"], stock["steady_tps"]
    return {
        "description": load["description"],
        "prompt_tokens": len(prompt),
        "max_tokens": max_tokens,
        "serial_tps": rounded(s_tps),
        "drafted_tps": rounded(d_tps),
        "drafted_tps_decodestats": rounded(drafted.stats.decode_tps),
        "speedup": ratio(d_tps, s_tps),
        "tokens_per_pass": rounded(drafted.stats.tokens_per_pass, 4),
        "acceptance_rate": rounded(drafted.stats.acceptance_rate, 4),
        "drafted": drafted.stats.drafted,
        "accepted": drafted.stats.accepted,
        "accepted_per_position": list(drafted.stats.accepted_per_position),
        "identical": serial.tokens == drafted.tokens,
        "mlx_lm_tps": m_tps,
        "mlx_lm_identical_to_serial": stock["identical_to_serial"],
        "serial_vs_mlx_lm": ratio(s_tps, m_tps),
        "drafted_vs_mlx_lm": ratio(d_tps, m_tps),
        "serial_roofline_fraction": roofline.fraction(s_tps),
        "drafted_roofline_fraction": roofline.fraction(d_tps),
        "mlx_lm_roofline_fraction": roofline.fraction(m_tps, mlx_lm=True),
    }


def _llama_columns(row: dict[str, Any], llama: Any, prompt: Sequence[int], max_tokens: int, rig: Rig,
                   serial: Any, s_tps: float | None) -> str:
    """llama.cpp's row (serial and prompt lookup) into `row`; the progress line's part."""
    row["llama_cpp"] = bench_llamacpp.workload_row(llama, prompt, max_tokens, rig.eos, serial.tokens, s_tps)
    row["llama_cpp_tps"] = row["llama_cpp"]["serial_tps"]
    row["llama_cpp_prompt_lookup_tps"] = row["llama_cpp"].get("prompt_lookup_tps")
    return (f", llama.cpp {row['llama_cpp_tps'] or 0:.1f} tok/s"
            f" (prompt lookup {row['llama_cpp_prompt_lookup_tps'] or 0:.1f})")


def _draft_model_columns(row: dict[str, Any], rig: Rig, prompt: Sequence[int], max_tokens: int, serial: Any,
                         s_tps: float | None) -> str:
    """The draft-model engine and mlx-lm's speculative decoding into `row`; the progress line's part."""
    from agentfold.engine.decode import GenerationConfig

    with_model = rig.draft_engine.generate(prompt, GenerationConfig(max_tokens=max_tokens, draft=True))
    with stock_attention(rig.patched_models):
        spec = mlx_lm_decode(rig.baseline.model, rig.tokenizer, prompt, max_tokens,
                             draft_model=rig.baseline_draft.model)
    spec["identical_to_serial"] = spec["token_sha"] == serial.token_sha
    model_row = completion_row(with_model)
    dm_tps = model_row["steady_tps"]
    row.update({
        "draft_model_tps": rounded(dm_tps),
        "draft_model_speedup": ratio(dm_tps, s_tps),
        "draft_model_tokens_per_pass": rounded(with_model.stats.tokens_per_pass, 4),
        "draft_model_acceptance_rate": rounded(with_model.stats.acceptance_rate, 4),
        "draft_model_identical": serial.tokens == with_model.tokens,
        "mlx_lm_speculative_tps": spec["steady_tps"],
        "draft_model_vs_mlx_lm_speculative": ratio(dm_tps, spec["steady_tps"]),
        "draft_model_run": model_row,
        "mlx_lm_speculative": spec,
    })
    return (f"; draft-model {dm_tps or 0:.1f} tok/s"
            f" ({'identical' if row['draft_model_identical'] else 'DIFFERENT'}),"
            f" mlx-lm speculative {spec['steady_tps'] or 0:.1f} tok/s")


def _workload_row(rig: Rig, load: dict[str, Any], prompt: list[int], max_tokens: int, llama: Any,
                  roofline: Roofline, say: Callable[[str], None]) -> dict[str, Any]:
    """One workload through every engine: serial, drafted, mlx-lm, and llama.cpp / the draft model if present."""
    from agentfold.engine.decode import GenerationConfig

    name = load["name"]
    say(f"bench: {name}: {len(prompt)} prompt tokens, {max_tokens} max tokens")
    serial = rig.engine.generate(prompt, GenerationConfig(max_tokens=max_tokens, draft=False))
    drafted = rig.engine.generate(prompt, GenerationConfig(max_tokens=max_tokens, draft=True))
    with stock_attention(rig.patched_models):
        stock = mlx_lm_decode(rig.baseline.model, rig.tokenizer, prompt, max_tokens)
    # mlx-lm runs the float model: with int8 weights its reply may differ (reported, not asserted)
    stock["identical_to_serial"] = stock["token_sha"] == serial.token_sha
    serial_row, drafted_row = completion_row(serial), completion_row(drafted)
    row = _speed_columns(load, prompt, max_tokens, serial, drafted, (serial_row, drafted_row), stock, roofline)
    s_tps, d_tps = serial_row["steady_tps"], drafted_row["steady_tps"]
    if name == "code-edit":
        row["exactness_cost"] = _exactness_cost(rig.engine, prompt, max_tokens, serial, d_tps, rig.patched_models)
    if "source" in load:
        row["source"] = load["source"]
    row["serial"] = serial_row
    row["drafted_run"] = drafted_row
    row["mlx_lm"] = stock
    line = (f"bench: {name}: serial {s_tps or 0:.1f} tok/s, drafted {d_tps or 0:.1f} tok/s "
            f"(x{row['speedup'] or 0:.2f}, {drafted.stats.tokens_per_pass:.2f} tok/pass, "
            f"{drafted.stats.acceptance_rate:.0%} accepted), mlx-lm {stock['steady_tps'] or 0:.1f} tok/s, "
            f"{'identical' if row['identical'] else 'DIFFERENT'}")
    if llama is not None:
        line += _llama_columns(row, llama, prompt, max_tokens, rig, serial, s_tps)
    if rig.draft_engine is not None:
        line += _draft_model_columns(row, rig, prompt, max_tokens, serial, s_tps)
    say(line)
    return row


def _exactness_cost(engine: Any, prompt: Sequence[int], max_tokens: int, serial: Any, d_tps: float | None,
                    patched_models: Sequence[Any]) -> dict[str, Any]:
    """The cost of exact attention: the same drafted run on MLX's batched (not row-exact) attention.

    Only the MLX backend has such a path; torch's CPU kernels and int8 linears have no inexact
    twin to swap in, so there it is recorded as skipped.
    """
    from agentfold.engine.decode import GenerationConfig

    target = engine.backend
    if target.name != "mlx":
        return {"skipped": f"the {target.name} backend has no inexact kernels to compare with (row-exact by construction)"}
    linear = "int8 linears (exact integer sums)" if target.quant == "int8" else blas.current().name
    with stock_attention(patched_models):
        inexact = engine.generate(prompt, GenerationConfig(max_tokens=max_tokens, draft=True))
    i_tps = completion_row(inexact)["steady_tps"]
    return {
        "exact_path": f"row-exact attention (one-row kernel per verify row) + {linear}",
        "inexact_path": f"MLX batched attention (not row-exact) + {linear}",
        "exact_drafted_tps": rounded(d_tps),
        "inexact_drafted_tps": rounded(i_tps),
        "exact_vs_inexact": ratio(d_tps, i_tps),
        "inexact_identical_to_serial": inexact.tokens == serial.tokens,
    }


# -- the record ---------------------------------------------------------------------------------


def _backend_section(rig: Rig, choice: Choice) -> dict[str, Any]:
    from agentfold.engine import backend_choice

    target = rig.target
    described = target.describe()
    chosen_key = backend_choice.verdict_key(rig.path, choice.device, choice.quant)
    return {
        "name": target.name,
        "quant": target.quant,
        "requested": {"backend": choice.backend, "quant": choice.quant, "device": choice.device},
        "kernels": described,
        "auto_verdict": backend_choice.recall(choice.verdicts, chosen_key) if choice.backend == "auto" else None,
    }


def _model_sections(rig: Rig, dtype: str | None) -> dict[str, Any]:
    """The record's `model` and `draft_model`."""
    engine, target, weights = rig.engine, rig.target, rig.weights
    return {
        "model": {
            **model_record(target.loaded, weights_dtype(target, dtype), weights["resident_bytes"],
                           weights["parameters"]),
            "quant": target.quant,
            "drafter": engine.drafter.name if engine.drafter else "none",
            "max_drafts": engine.max_drafts,
        },
        "draft_model": None if rig.draft_backend is None else {
            "path": str(rig.draft_path),
            "name": rig.draft_backend.loaded.name,
            "bytes": backend_bytes(rig.draft_backend)["resident_bytes"],
            "mlx_lm_num_draft_tokens": MLX_LM_NUM_DRAFT_TOKENS,
        },
    }


def _exactness_section(exactness: Any) -> dict[str, Any] | None:
    """The engine's self-check: widths checked, their differences and pass times."""
    if exactness is None:
        return None
    return {
        "max_width": exactness.max_width,
        "lane_width": exactness.lane_width,  # rows of several replies' shared pass (lanes), 0: off
        "drafting": exactness.drafting,
        "checked_widths": sorted(exactness.checked),
        "checked": {str(w): ok for w, ok in sorted(exactness.checked.items())},
        "max_abs_diff": {str(w): d for w, d in sorted(exactness.max_abs_diff.items())},
        "pass_seconds": {str(w): round(s, 6) for w, s in sorted(exactness.pass_seconds.items())},
        "seconds": round(exactness.seconds, 3),
        "describe": exactness.describe(),
    }


def _baseline_notes(dtype: str | None) -> dict[str, str]:
    return {
        "mlx_lm": ("mlx_lm.generate.stream_generate, greedy, stock attention, same prompt, on the model's "
                   f"{mlx_dtype(dtype)} weights (no int8): its tokens differ from an int8 engine's wherever the "
                   "numerics decide; compared, not required"),
        "llama_cpp": ("llama-cpp-python on the same GGUF (its own quantized weights and kernels), greedy, serial "
                      "and prompt-lookup; compared, not required"),
        "decode_rate": ("steady_tps: (tokens - b) / (time of last token - time of first pass), b = tokens the first"
                        " pass committed (1 when serial: (n - 1) / (t_last - t_first)); decode_tps: DecodeStats'"),
    }


def _geomean(rows: dict[str, dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in rows.values() if r.get(key)]
    return round(statistics.geometric_mean(values), 4) if values else None


def _summary(rows: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """All-identical flag, geomeans, and the issue's speed targets (reported here, never asserted)."""
    serial_rates = [r["serial_tps"] for r in rows.values() if r.get("serial_tps")]
    code, prose = rows.get("code-edit", {}).get("speedup"), rows.get("prose", {}).get("speedup")
    serial_min = min(serial_rates) if serial_rates else None
    return {
        "all_identical": all(r["identical"] for r in rows.values())
        and all(r.get("draft_model_identical", True) for r in rows.values()),
        "speedup_geomean": _geomean(rows, "speedup"),
        "serial_vs_mlx_lm_geomean": _geomean(rows, "serial_vs_mlx_lm"),
        "code_edit_speedup": code,
        "prose_speedup": prose,
        "serial_tps_min": serial_min,
        "serial_tps_geomean": _geomean(rows, "serial_tps"),
        "targets": {
            "code_edit_speedup": {"min": TARGETS["code_edit_speedup"], "value": code,
                                  "met": bool(code and code >= TARGETS["code_edit_speedup"])},
            "prose_speedup": {"min": TARGETS["prose_speedup"], "value": prose,
                              "met": bool(prose and prose >= TARGETS["prose_speedup"])},
            "serial_tps": {"min": TARGETS["serial_tps"], "value": serial_min, "every_workload": True,
                           "met": bool(serial_min and serial_min >= TARGETS["serial_tps"])},
        },
    }


def _prefill_row(rig: Rig, tokens: int, machine: dict[str, Any], say: Callable[[str], None]) -> dict[str, Any]:
    """A `tokens`-long prompt of stdlib source prefilled by the engine (its own prefill clock, as a
    first turn's TTFT is made) and by llama.cpp on the same file and ids, one after the other."""
    from agentfold.bench.prefill import WARM_TOKENS, engine_rate, prompt_ids

    ids = prompt_ids(rig.tokenizer, tokens, 0, f"decode-prefill:{tokens}")
    engine_rate(rig.engine, prompt_ids(rig.tokenizer, WARM_TOKENS, 0, "decode-prefill:warm"))
    say(f"bench: prefill: {tokens} prompt tokens")
    ours = engine_rate(rig.engine, ids)
    threads = int(machine["threads"]["backend"])
    theirs = bench_llamacpp.prefill_rate(rig.path, ids, threads)
    row = {"prompt_tokens": tokens, "source": "stdlib source text (bench.prefill.prompt_ids), no chat template",
           "agentfold": ours, "llama_cpp": theirs, "agentfold_vs_llama_cpp": ratio(ours["tps"], theirs.get("tps"))}
    say(f"bench: prefill: {tokens} tokens {ours['tps']} tok/s, llama.cpp {theirs.get('tps')} tok/s"
        + (f" ({row['agentfold_vs_llama_cpp']}x)" if row["agentfold_vs_llama_cpp"] else f" ({theirs.get('skipped')})"))
    return row


def _record(rig: Rig, choice: Choice, timestamp: str, max_tokens: int, quick: bool, machine: dict[str, Any],
            say: Callable[[str], None], busy: bool = False, prefill: Sequence[int] = ()) -> dict[str, Any]:
    """Every step from the roofline to the last workload, and the record they make (quality not yet in)."""
    threads = int(machine["threads"]["backend"] or machine["cpus_usable"] or os.cpu_count() or 1)
    roofline = Roofline.measure(rig, quick, say, threads)
    loads = [(w, encode_chat(rig.tokenizer, w["messages"])) for w in workloads(quick)]
    llama, llama_info = _open_llama(rig, loads, max_tokens, machine, say)
    warmup = _warm_up(rig, llama, quick, say)
    rows = {load["name"]: _workload_row(rig, load, prompt, max_tokens, llama, roofline, say)
            for load, prompt in loads}
    busy_machine = None
    if busy:  # the fresh-code workload again, beside one busy process
        name, prompt = next((load["name"], prompt) for load, prompt in loads if load["name"] == "fresh-code")
        busy_machine = {"workload": name, **busy_row(rig.engine, llama, prompt, max_tokens, rig.eos, rows[name], say)}
    if llama is not None:
        llama.close()
    bus = bus_section(rig, roofline.read, roofline.read_weights_size, threads, quick, say)
    prefill_rows = [_prefill_row(rig, tokens, machine, say) for tokens in prefill]
    result: dict[str, Any] = {
        **run_header(SCHEMA, timestamp, quick, machine),
        "max_tokens": max_tokens,
        "sampling": "greedy",
        "backend": _backend_section(rig, choice),
        **_model_sections(rig, choice.dtype),
        "exactness": _exactness_section(rig.engine.exactness),
        "roofline": roofline.section(),
        "baseline": _baseline_notes(choice.dtype),
        "llama_cpp": llama_info,
        "warmup": warmup,
        "workloads": rows,
        "bus": bus,
    }
    if busy_machine is not None:
        result["busy_machine"] = busy_machine
    if prefill_rows:
        result["prefill"] = {"rows": prefill_rows}
    result["summary"] = _summary(rows)
    return result


def _append_quality(result: dict[str, Any], path: Path, quick: bool, choice: Choice,
                    say: Callable[[str], None]) -> None:
    """The float32-vs-int8 report (`bench_quality`; a short one when `quick`) into the record."""
    from agentfold.bench.quality import quality_report, summary_line

    say("bench: quality report (float32 vs int8 perplexity)")
    gc.collect()
    if quick:
        report = quality_report(path, backends=[result["backend"]["name"]], tokens=128, chunk=128,
                                reply_prompts=(), dtype=choice.dtype, device=choice.device, progress=say)
    else:
        report = quality_report(path, dtype=choice.dtype, device=choice.device, progress=say)
    result["quality"] = report
    result["summary"]["quality_default_ok"] = report["default_ok"]
    say(f"bench: quality: {summary_line(report)}")


# -- the benchmark ------------------------------------------------------------------------------


def bench_decode(model: str | None, out: str | Path, draft_model: str | None = None, max_tokens: int = 128,
                 dtype: str | None = "float32", quick: bool = False, progress: Callable[[str], None] = print,
                 backend: str = "auto", quant: str = "auto", device: str = "auto", verdicts: Path | None = None,
                 quality: bool = True, busy: bool = False, prefill: int | Sequence[int] = ()) -> dict:
    """Measure serial, drafted, mlx-lm and llama.cpp greedy decode on code-edit, fresh-code and prose; write JSON.

    `backend` / `quant` / `device` go to `build_engine`; `backend="auto"` remembers its verdict in
    `verdicts` (default: `models.verdict_file()`, the file `agentfold generate` reads too, so the
    bench measures the backend users get). `quality`: append the float32-vs-int8 report
    (`bench_quality`; a short one when `quick`). `busy`: the fresh-code workload's serial decode again
    beside one busy process (`bench.busy`), against its idle rate and llama.cpp's. `prefill`: prompts
    of these many tokens, each prefilled by the engine and by llama.cpp on the same ids (`prefill.rows`).
    """
    say = progress or (lambda message: None)
    started = time.perf_counter()
    timestamp = utc_timestamp()
    if quick:
        max_tokens = min(max_tokens, QUICK_MAX_TOKENS)
    if max_tokens < 2:
        raise ValueError("max_tokens must be >= 2 to measure a decode rate")
    prefill = [prefill] if isinstance(prefill, int) else list(prefill)
    prefill = [tokens for tokens in prefill if tokens != 0]
    if any(tokens < 0 for tokens in prefill):
        raise ValueError("prefill must be numbers of tokens >= 0")
    machine = machine_info()

    path = model_path(model)
    if backend == "auto" and verdicts is None:
        from agentfold.serve.models import verdict_file

        verdicts = verdict_file()
    choice = Choice(backend, quant, device, dtype, verdicts)
    rig = load_rig(path, draft_model, choice, machine, say)
    result = _record(rig, choice, timestamp, max_tokens, quick, machine, say, busy, prefill)
    del rig  # the engines' memory goes back before the quality report loads its own
    if quality:
        _append_quality(result, path, quick, choice, say)
    finish_run(result, started, out)
    say(f"bench: done in {result['duration_seconds']:.0f}s")
    return result
