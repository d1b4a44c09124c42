"""`bench decode` against the memory bus: the read bandwidth, a one-row pass part by part, and pass widths.

A serial token on a CPU is bound by how fast the weights stream in, so a decode rate means most
next to what the bus gives and to where a pass spends its time. This module measures three things
on the engine `bench decode` already loaded, at the thread count that engine decodes with:

- `read_bandwidth`: a streaming read (a sum) of a >= 1 GiB array, repeated, best and median. The
  copy figure in the roofline counts read + write bytes; a pass only reads its weights, so this is
  the ceiling its parts are put against. The read is `torch.sum` over float32 run on torch's
  intra-op threads set to the backend's count (the kernels' pool runs that many too): a vectorized
  reduction that is memory-bound (float32, float64 and int64 sums all read at the same rate here),
  with no C kernel of our own to maintain. numpy's sum is one thread and compute-bound (on one
  thread of the Xeon its pairwise sum read ~7 GB/s, torch's ~12.6), so it is only the fallback
  without torch.
  The same read over as many bytes as a token reads is recorded too: a model whose weights fit in
  the last-level cache (SmolLM2's ~96 MB in the Xeon's 480 MiB L3) is read at that cache's rate.
- `one_row_pass`: a serial decode step (`backend.forward([token], cache)` and the greedy pick)
  repeated at a short context with the cache rolled back after each, the real modules timed inside
  the real pass: every decoder layer, the final norm, the output head (`Transformer.logits` less
  the norm), the embedding, the greedy pick, and the rest (the pass total less all of them: Python
  between the calls, tensors made, logits to numpy). Layers and head carry the bytes they read (their
  linear weights) and the GB/s that makes, against the read bandwidth. Torch on the CPU only: MLX has
  no torch modules to time, and on CUDA a host timer measures launches.
- `pass_widths`: passes of 1, 2, 4, 8 and 16 rows (a verify pass's widths) from the same cache
  state, the engine's `backend.forward` against llama.cpp's `Llama.eval` on the same GGUF and ids
  (`llamacpp.PassRunner`, all rows' logits as a verify pass needs them), in alternating blocks so
  that the machine's drift weighs on both.

Schema (`bus` at the top of the decode JSON; the read bandwidth is `roofline.read_bandwidth`):

    bus.context_tokens, bus.threads, bus.read_gbs     the context every pass runs at, threads, and
                                                      the read bandwidth (best) shares are against
    bus.read_gbs_weights_size                         the same read over as many bytes as a token
                                                      reads (roofline.read_bandwidth_weights_size)
    bus.one_row_pass: {passes, warm_passes, position, pass_ms, pass_ms_without_timers,
        parts: {decoder_layers, final_norm, output_head, embedding, sampling, rest:
                {ms, share_of_pass, bytes, gbs, read_share}},   (bytes / gbs / read_share None where
                                                                 the part reads no weights)
        parts_ms_sum, weight_bytes, gbs, read_share, read_share_weights_size, kv_cache_bytes,
        layers, kernel_layers, bytes_basis, note}  or {skipped: why}
    bus.pass_widths: {context_tokens, repeats, warm_repeats, ids, llama_cpp: {version, threads,
        logits_all, n_ctx} or {skipped: why},   (llama_cpp_ms and the ratio None when skipped)
        rows: {"1".."16": {rows, agentfold_ms, agentfold_ms_per_row, llama_cpp_ms,
                           agentfold_vs_llama_cpp}}, note}

`agentfold_vs_llama_cpp` is llama.cpp's pass time over the engine's (above 1: the engine is faster),
as the decode and prefill rows' ratios are rates over rates.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from agentfold.bench.rates import ratio

READ_MEBIBYTES = 1024  # >= 1 GiB: past the last-level cache (480 MiB on the Xeon), as the coder's weights are
READ_REPEATS = 10
QUICK_READ_REPEATS = 5
CONTEXT_TOKENS = 128  # a short context: the pass reads its weights, little cache
PART_PASSES = 50
PART_WARM_PASSES = 5
WIDTHS = (1, 2, 4, 8, 16)
WIDTH_REPEATS = 20
QUICK_WIDTH_REPEATS = 10
WIDTH_WARM_REPEATS = 3
PARTS = ("decoder_layers", "final_norm", "output_head", "embedding", "sampling", "rest")
WEIGHT_PARTS = ("decoder_layers", "output_head")  # the parts that stream weights


def _timed_calls(call: Callable[[], Any], repeats: int, warm: int) -> list[float]:
    """Seconds of each of `repeats` calls of `call`, after `warm` untimed ones."""
    for _ in range(warm):
        call()
    seconds = []
    for _ in range(repeats):
        began = time.perf_counter()
        call()
        seconds.append(time.perf_counter() - began)
    return seconds


def _median_ms(seconds: Sequence[float]) -> float:
    return round(statistics.median(seconds) * 1e3, 4)


def _gbs(nbytes: int, seconds: float) -> float | None:
    return round(nbytes / seconds / 1e9, 3) if seconds > 0 else None


# -- the read bandwidth -------------------------------------------------------------------------


def last_level_cache_bytes() -> int | None:
    """The largest CPU cache's size (Linux sysfs), None where it is not told: a model whose weights
    fit in it can be read faster than the bus gives."""
    sizes = []
    for entry in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = entry.read_text().strip().upper()
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        try:
            sizes.append(int(text.rstrip("KMG")) * scale)
        except ValueError:
            continue
    return max(sizes) if sizes else None


def read_bandwidth(threads: int, mebibytes: int = READ_MEBIBYTES, repeats: int = READ_REPEATS) -> dict[str, Any]:
    """The bytes a streaming read moves per second with `threads` threads: a sum over a
    `mebibytes` float32 array (written once first, so every page is in), timed `repeats` times."""
    if repeats < 1:
        raise ValueError("repeats must be >= 1")
    try:
        import torch
    except ImportError:
        torch = None
    if torch is not None:
        previous = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            array = torch.ones(mebibytes * (1 << 20) // 4, dtype=torch.float32)
            nbytes = array.numel() * array.element_size()
            seconds = _timed_calls(array.sum, repeats, warm=2)  # (warm: setup out, a cache-sized array in the cache)
            del array
        finally:
            torch.set_num_threads(previous)
        method, used = f"torch.sum over float32 on torch's intra-op threads ({threads})", threads
    else:
        import numpy as np

        values = np.ones(mebibytes * (1 << 20) // 4, dtype=np.float32)
        nbytes = int(values.nbytes)
        seconds = _timed_calls(values.sum, repeats, warm=1)
        del values
        method, used = "numpy sum over float32, one thread (torch is not installed; compute-bound, a floor)", 1
    best, median = min(seconds), statistics.median(seconds)
    return {
        "method": method + ", bytes read counted",
        "threads": used,
        "array_bytes": nbytes,
        "repeats": repeats,
        "seconds": [round(s, 6) for s in seconds],
        "best_seconds": round(best, 6),
        "median_seconds": round(median, 6),
        "best_gbs": _gbs(nbytes, best),
        "median_gbs": _gbs(nbytes, median),
        "last_level_cache_bytes": last_level_cache_bytes(),
    }


# -- a one-row pass, part by part ---------------------------------------------------------------


class PartClock:
    """Seconds spent inside wrapped callables since the last `reset`, by part, and their calls."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}

    def reset(self) -> None:
        self.seconds = {}
        self.calls = {}

    def wrap(self, part: str, function: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            began = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self.seconds[part] = self.seconds.get(part, 0.0) + time.perf_counter() - began
                self.calls[part] = self.calls.get(part, 0) + 1

        return timed


_ABSENT = object()


@contextlib.contextmanager
def timed_modules(model: Any, clock: PartClock) -> Iterator[None]:
    """Every decoder layer's `forward`, the final norm's, the embedding's and `model.logits` timed
    into `clock` (instance attributes over the class's methods), put back as they were on the way
    out, also when the pass inside fails."""
    targets = [(layer, "forward", "decoder_layers") for layer in model.model.layers]
    targets += [(model.model.norm, "forward", "final_norm"), (model, "logits", "logits"),
                (model.model.embed_tokens, "forward", "embedding")]
    installed: list[tuple[Any, str, Any]] = []
    try:
        for owner, name, part in targets:
            before = vars(owner).get(name, _ABSENT)
            setattr(owner, name, clock.wrap(part, getattr(owner, name)))
            installed.append((owner, name, before))
        yield
    finally:
        for owner, name, before in reversed(installed):
            if before is _ABSENT:
                delattr(owner, name)
            else:
                setattr(owner, name, before)


def _held_bytes(weight: Any) -> int:
    """Bytes a linear's weight holds as the kernels read it: a BlockLinear's blocks, an Int8Weight's
    values and scales, a float tensor's elements."""
    if hasattr(weight, "element_size"):
        return int(weight.numel() * weight.element_size())
    return int(weight.nbytes())


def linear_weight_bytes(modules: Any) -> int:
    """The bytes of every linear weight among `modules` (fused q / k / v and gate / up once)."""
    from agentfold.engine.torch.models.llama import Fused, Linear

    held: dict[int, Any] = {}
    for module in modules:
        if isinstance(module, Linear):
            weight = module.quantized if module.quantized is not None else module.weight
        elif isinstance(module, Fused):
            weight = module.weight
        else:
            continue
        held[id(weight)] = weight
    return sum(_held_bytes(weight) for weight in held.values())


def head_weight_bytes(model: Any) -> int:
    """The output head's bytes: its quantized weight, else lm_head's, else the tied embedding table."""
    if model.head_quantized is not None:
        return _held_bytes(model.head_quantized)
    if model.lm_head is not None:
        return _held_bytes(model.lm_head.weight)
    return _held_bytes(model.model.embed_tokens.weight)


def parts_skipped(backend: Any) -> str | None:
    """Why `one_row_pass` cannot time this backend's parts, or None when it can."""
    if getattr(backend, "name", None) != "torch":
        return (f"the {getattr(backend, 'name', type(backend).__name__)} backend has no torch modules to time "
                "part by part (the pass is one framework graph)")
    if backend.device.type != "cpu":
        return f"the parts are timed on the CPU only (on {backend.device.type} a host timer measures launches)"
    model = backend.model
    inner = getattr(model, "model", None)
    if not all(hasattr(inner, name) for name in ("layers", "norm", "embed_tokens")) or not hasattr(model, "logits"):
        return f"{type(model).__name__} has no model.layers / norm / embed_tokens and logits to time"
    return None


def _part(ms: float, pass_ms: float, nbytes: int | None, read_gbs: float | None) -> dict[str, Any]:
    gbs = _gbs(nbytes, ms / 1e3) if nbytes is not None else None
    return {"ms": round(ms, 4), "share_of_pass": round(ms / pass_ms, 4) if pass_ms else None, "bytes": nbytes,
            "gbs": gbs, "read_share": round(gbs / read_gbs, 4) if gbs and read_gbs else None}


def _kv_cache_bytes(model: Any, cache: Any, length: int) -> int:
    """Keys and values a one-row pass at `length` tokens of context reads (every layer's, in full)."""
    args, keys = model.args, cache.layers[0].keys
    return int(len(cache.layers) * 2 * length * args.num_key_value_heads * args.head_dim * keys.element_size())


def _timed_passes(backend: Any, model: Any, cache: Any, start: Any, token: int, greedy: Any, warm: int,
                  passes: int) -> tuple[list[float], dict[str, list[float]]] | str:
    """Each timed pass's total and its parts' seconds (after `warm` untimed ones), the modules wrapped
    by `timed_modules`; a reason instead where the pass did not run through those modules."""
    from agentfold.engine.sampler import choose

    clock = PartClock()
    timed_choose = clock.wrap("sampling", choose)
    totals: list[float] = []
    by_part: dict[str, list[float]] = {part: [] for part in PARTS}
    with timed_modules(model, clock):
        for index in range(warm + passes):
            clock.reset()
            began = time.perf_counter()
            logits = backend.forward([token], cache)
            timed_choose(logits[-1], cache.length, greedy)
            total = time.perf_counter() - began
            backend.rollback(cache, start, 0)
            if clock.calls.get("decoder_layers", 0) != len(model.model.layers) or not clock.calls.get("logits"):
                return (f"the pass ran {clock.calls.get('decoder_layers', 0)} of {len(model.model.layers)} decoder "
                        f"layer modules and {clock.calls.get('logits', 0)} logits calls: its parts are not these modules")
            if index < warm:
                continue
            seconds = dict(clock.seconds)
            parts = {"decoder_layers": seconds["decoder_layers"], "final_norm": seconds.get("final_norm", 0.0),
                     "output_head": seconds["logits"] - seconds.get("final_norm", 0.0),
                     "embedding": seconds.get("embedding", 0.0), "sampling": seconds["sampling"]}
            parts["rest"] = total - sum(parts.values())
            totals.append(total)
            for part, value in parts.items():
                by_part[part].append(value)
    return totals, by_part


def one_row_pass(backend: Any, context: Sequence[int], token: int, read_gbs: float | None,
                 read_gbs_weights_size: float | None = None, passes: int = PART_PASSES,
                 warm: int = PART_WARM_PASSES) -> dict[str, Any]:
    """A serial decode step's time and its parts' (see the module docstring), median over `passes`;
    shares against `read_gbs` (and the whole pass's against `read_gbs_weights_size` too).

    The cache holds `context`; every pass appends `token` and is rolled back, so all run at the same
    position. First `passes` plain passes (no timers), then `passes` with every part timed inside the
    real `backend.forward`: `rest` is each pass's total less its parts, so it is never negative.
    """
    from agentfold.engine.sampler import SamplingParams, choose

    skipped = parts_skipped(backend)
    if skipped is not None:
        return {"skipped": skipped}
    model, greedy = backend.model, SamplingParams()
    cache = backend.new_cache()
    backend.prefill(list(context), cache)
    start = backend.checkpoint(cache)

    def step() -> None:
        logits = backend.forward([token], cache)
        choose(logits[-1], cache.length, greedy)
        backend.rollback(cache, start, 0)

    for _ in range(warm):
        step()
    plain: list[float] = []
    for _ in range(passes):
        began = time.perf_counter()
        step()
        plain.append(time.perf_counter() - began)

    timed = _timed_passes(backend, model, cache, start, token, greedy, warm, passes)
    if isinstance(timed, str):
        return {"skipped": timed}
    totals, by_part = timed
    pass_ms = _median_ms(totals)
    layer_bytes = linear_weight_bytes(module for layer in model.model.layers for module in layer.modules())
    head_bytes = head_weight_bytes(model)
    weights = {"decoder_layers": layer_bytes, "output_head": head_bytes}
    parts_out = {part: _part(_median_ms(values), pass_ms, weights.get(part), read_gbs)
                 for part, values in by_part.items()}
    pass_gbs = _gbs(layer_bytes + head_bytes, pass_ms / 1e3)
    return {
        "passes": passes,
        "warm_passes": warm,
        "position": len(context),
        "pass_ms": pass_ms,
        "pass_ms_without_timers": _median_ms(plain),
        "parts": parts_out,
        "parts_ms_sum": round(sum(part["ms"] for part in parts_out.values()), 4),
        "weight_bytes": layer_bytes + head_bytes,
        "gbs": pass_gbs,
        "read_share": round(pass_gbs / read_gbs, 4) if pass_gbs and read_gbs else None,
        "read_share_weights_size": (round(pass_gbs / read_gbs_weights_size, 4)
                                    if pass_gbs and read_gbs_weights_size else None),
        "kv_cache_bytes": _kv_cache_bytes(model, cache, len(context)),
        "layers": len(model.model.layers),
        "kernel_layers": sum(1 for layer in model.model.layers if getattr(layer, "kernel", None) is not None),
        "bytes_basis": ("linear weights as the kernels hold them (BlockLinear.nbytes: the GGUF's blocks; "
                        "Int8Weight: values + scales; float: the tensor), fused q / k / v and gate / up once; "
                        "norms, the embedding row and the KV cache (kv_cache_bytes) not counted"),
        "note": ("medians over passes of one token at `position`, the cache rolled back after each; parts timed "
                 "inside backend.forward by wrapping each decoder layer's forward, the final norm's, the "
                 "embedding's and Transformer.logits (output_head = logits less the final norm); sampling is "
                 "engine.sampler.choose, greedy; rest = each pass's total less its parts (Python between calls, "
                 "logits to numpy); gbs = bytes / ms, read_share = gbs / the read bandwidth (best)"),
    }


# -- passes of several rows, against llama.cpp --------------------------------------------------


def pass_widths(backend: Any, gguf: Path, context: Sequence[int], rows: Sequence[int], threads: int,
                widths: Sequence[int] = WIDTHS, repeats: int = WIDTH_REPEATS,
                warm: int = WIDTH_WARM_REPEATS) -> dict[str, Any]:
    """The engine's pass time at each width against llama.cpp's on the same file and ids.

    Every pass starts from the same state: the engine's cache holds `context` and is rolled back
    after each pass, llama.cpp's goes back to it before each (`llamacpp.PassRunner`). Per width the
    two run in blocks of passes back to back (weights warm in the caches, as in a decode), the
    engine's block first, then llama.cpp's, then llama.cpp's again and the engine's (ABBA): a
    machine whose speed drifts during a width weighs on both alike. Each block starts with `warm`
    passes; the medians are over `repeats` passes per engine (rounded up to even).
    """
    from agentfold.bench import llamacpp as bench_llamacpp

    if len(rows) < max(widths):
        raise ValueError(f"{len(rows)} row ids for passes of up to {max(widths)} rows")
    cache = backend.new_cache()
    backend.prefill(list(context), cache)
    start = backend.checkpoint(cache)

    def engine_seconds(ids: Sequence[int]) -> float:
        began = time.perf_counter()
        backend.forward(ids, cache)
        elapsed = time.perf_counter() - began
        backend.rollback(cache, start, 0)
        return elapsed

    runner, llama_info = bench_llamacpp.open_pass_runner(gguf, context, max(widths), threads)
    runs: list[tuple[str, Callable[[Sequence[int]], float]]] = [("agentfold", engine_seconds)]
    if runner is not None:
        runs.append(("llama_cpp", runner.seconds))
    block = -(-repeats // 2)
    table: dict[str, dict[str, Any]] = {}
    try:
        for width in widths:
            ids = list(rows[:width])
            seconds: dict[str, list[float]] = {name: [] for name, _ in runs}
            for order in (runs, runs[::-1]):
                for name, run in order:
                    for _ in range(warm):
                        run(ids)
                    seconds[name].extend(run(ids) for _ in range(block))
            our_ms = _median_ms(seconds["agentfold"])
            their_ms = _median_ms(seconds["llama_cpp"]) if "llama_cpp" in seconds else None
            table[str(width)] = {"rows": width, "agentfold_ms": our_ms, "agentfold_ms_per_row": round(our_ms / width, 4),
                                 "llama_cpp_ms": their_ms, "agentfold_vs_llama_cpp": ratio(their_ms, our_ms)}
    finally:
        if runner is not None:
            runner.close()
    return {
        "context_tokens": len(context),
        "repeats": 2 * block,
        "warm_repeats": warm,
        "ids": "stdlib source text (bench.prefill.prompt_ids): the context, then the pass's rows, the same ids in both",
        "llama_cpp": llama_info,
        "rows": table,
        "note": ("medians of one pass of `rows` new tokens from the same cache state (rolled back after each), in "
                 "blocks engine, llama.cpp, llama.cpp, engine: AgentFold's backend.forward (logits of every row, "
                 "as numpy) and llama.cpp's Llama.eval with logits_all (every row's logits copied out, as a verify "
                 "pass needs them); agentfold_vs_llama_cpp = llama_cpp_ms / agentfold_ms"),
    }


# -- the section --------------------------------------------------------------------------------


def bus_section(rig: Any, read: dict[str, Any], read_weights_size: dict[str, Any], threads: int, quick: bool,
                say: Callable[[str], None]) -> dict[str, Any]:
    """`bench decode`'s `bus` record: the one-row pass's parts and the widths, each with its progress
    line. `read` / `read_weights_size`: the roofline's read bandwidths (>= 1 GiB, and over as many
    bytes as a token reads)."""
    from agentfold.bench.prefill import prompt_ids

    backend = rig.target
    ids = prompt_ids(rig.tokenizer, CONTEXT_TOKENS + max(WIDTHS), 0, "decode-bus")
    context, rows = ids[:CONTEXT_TOKENS], ids[CONTEXT_TOKENS:]
    read_gbs, small_gbs = read.get("best_gbs"), read_weights_size.get("best_gbs")
    one_row = one_row_pass(backend, context, rows[0], read_gbs, small_gbs)
    say(f"bench: one-row pass: {one_row_line(one_row)}")
    widths = pass_widths(backend, rig.path, context, rows, threads,
                         repeats=QUICK_WIDTH_REPEATS if quick else WIDTH_REPEATS)
    say(f"bench: pass widths: {widths_line(widths)}")
    return {"context_tokens": CONTEXT_TOKENS, "threads": threads, "read_gbs": read_gbs,
            "read_gbs_weights_size": small_gbs, "one_row_pass": one_row, "pass_widths": widths}


def read_line(read: dict[str, Any]) -> str:
    return (f"{read['best_gbs']} GB/s best, {read['median_gbs']} median ({read['array_bytes'] / 1e9:.2f} GB read "
            f"{read['repeats']} times, {read['threads']} threads)")


def one_row_line(one_row: dict[str, Any]) -> str:
    """`pass 6.7 ms: decoder_layers 4.1 ms (52 MB, 12.6 GB/s, 110% of read), ...`, or why skipped."""
    if "skipped" in one_row:
        return f"skipped ({one_row['skipped']})"
    pieces = []
    for name, part in one_row["parts"].items():
        piece = f"{name} {part['ms']:.3f} ms"
        if part["bytes"] is not None:
            piece += (f" ({part['bytes'] / 1e6:.1f} MB, {part['gbs']} GB/s"
                      + (f", {part['read_share']:.0%} of read)" if part["read_share"] else ")"))
        pieces.append(piece)
    return (f"{one_row['pass_ms']:.3f} ms at {one_row['position']} tokens "
            f"({one_row['pass_ms_without_timers']:.3f} without timers): " + ", ".join(pieces))


def widths_line(widths: dict[str, Any]) -> str:
    """`1 row 6.7 ms (llama.cpp 9.0, 1.34x), 2 rows ...`, llama.cpp's figures only where it ran."""
    pieces = []
    for row in widths["rows"].values():
        piece = f"{row['rows']} rows {row['agentfold_ms']:.2f} ms"
        if row["llama_cpp_ms"] is not None:
            piece += f" (llama.cpp {row['llama_cpp_ms']:.2f}, {row['agentfold_vs_llama_cpp']}x)"
        pieces.append(piece)
    skipped = widths["llama_cpp"].get("skipped")
    return ", ".join(pieces) + (f"; llama.cpp skipped ({skipped})" if skipped else "")

