"""`agentfold bench offload`: MoE decode with a device budget for experts, and the dense torch path.

Part 1 builds a Qwen3-MoE with the real dimensions of Qwen3-30B-A3B (hidden 2048, 48 layers, 128
experts, top-8, expert width 768, 32 / 4 heads of 128, vocabulary 151936) and random weights
(no checkpoint is on disk and nothing is downloaded: the dense weights are drawn on the device,
the experts drawn and quantized to int8 a few at a time). A routing profile is recorded over a
calibration prefill, then with the expert budget at 25%, 50% and 100% of the experts it decodes
serially and drafted, reporting tokens per second, expert hit rate, experts per layer by tier,
swaps and the device / CPU / copy time split. Every budget must give the same tokens: the tier
never changes an expert's bits.

Part 2 decodes SmolLM2-135M-Instruct with the torch backend (serial and drafted, on the code-edit
workload) against `transformers` `generate` on the same device, in the same run.

`--quick`, and any CPU run, use a small MoE (few layers, small dimensions) and short replies.
Speed is reported, never asserted.
"""

from __future__ import annotations

import json
import platform
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from agentfold.bench.harness import TokenClock
from agentfold.bench.machine import finish_run, machine_info, run_header, utc_timestamp
from agentfold.bench.prompts import encode_chat, workloads
from agentfold.bench.rates import completion_row, rounded, steady_tps
from agentfold.bench.weights import model_record

SCHEMA = "agentfold.bench.offload/1"
BUDGETS = (0.25, 0.5, 1.0)
COPY_RUN = {"fraction": 0.25, "copy_share": 1.0, "stream_slots": 32}  # misses copied over PCIe, not run on CPU

QWEN3_30B_A3B: dict[str, Any] = {
    "model_type": "qwen3_moe", "hidden_size": 2048, "num_hidden_layers": 48, "num_experts": 128,
    "num_experts_per_tok": 8, "moe_intermediate_size": 768, "intermediate_size": 6144,
    "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 151936,
    "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "norm_topk_prob": True, "tie_word_embeddings": False,
    "decoder_sparse_step": 1, "mlp_only_layers": [],
}
SMALL_MOE: dict[str, Any] = {
    **QWEN3_30B_A3B, "hidden_size": 128, "num_hidden_layers": 4, "num_experts": 32, "num_experts_per_tok": 4,
    "moe_intermediate_size": 64, "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 32, "vocab_size": 4096,
}
FULL = {"moe": QWEN3_30B_A3B, "moe_tokens": 64, "moe_width": 8, "calibration_tokens": 256,
        "dense_tokens": 128, "dense_width": 16}
SMALL = {"moe": SMALL_MOE, "moe_tokens": 16, "moe_width": 4, "calibration_tokens": 32,
         "dense_tokens": 12, "dense_width": 4}
WEIGHT_STD = 0.02


def _versions() -> dict[str, Any]:
    import torch

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {"torch": torch.__version__, "triton": triton_version, "cuda": torch.version.cuda}


def _device_info(device: Any, machine: dict[str, Any]) -> dict[str, Any]:
    import torch

    if device.type != "cuda":
        return {"type": "cpu", "name": machine.get("processor") or platform.machine(),
                "threads": torch.get_num_threads()}
    props = torch.cuda.get_device_properties(device)
    return {"type": "cuda", "name": props.name, "memory_gb": round(props.total_memory / 2**30, 1),
            "multiprocessors": props.multi_processor_count}


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def moe_prompt(vocab_size: int, length: int = 96, seed: int = 7) -> list[int]:
    """A fixed prompt of ordinary ids: a random run of length / 2 said twice (something to look up)."""
    rng = np.random.default_rng(seed)
    half = [int(t) for t in rng.integers(min(1000, vocab_size // 4), vocab_size, size=length // 2)]
    return half + half


def _decode(engine: Any, prompt: Sequence[int], max_tokens: int, draft: bool) -> Any:
    from agentfold.engine.decode import GenerationConfig

    return engine.generate(prompt, GenerationConfig(max_tokens=max_tokens, draft=draft))


def _budget_run(loaded: Any, layers: dict, fraction: float, profile: dict, plan: dict, prompt: list[int],
                say: Callable[[str], None], **options: Any) -> tuple[dict[str, Any], list[int]]:
    from agentfold.engine.decode import Engine
    from agentfold.engine.drafters import SuffixLookupDrafter
    from agentfold.engine.moe.offload import install_offload
    from agentfold.engine.selfcheck import check_row_exactness
    from agentfold.engine.torch.backend import TorchBackend

    total = sum(q.num_experts for q in layers.values()) * next(iter(layers.values())).expert_bytes
    budget = int(round(fraction * total))
    began = time.perf_counter()
    offload = install_offload(loaded.model, budget, profile=profile, layers=layers, **options)
    install_seconds = time.perf_counter() - began
    backend = TorchBackend(loaded)
    report = check_row_exactness(backend, max_width=plan["moe_width"])
    engine = Engine(backend, loaded.tokenizer, set(), drafter=SuffixLookupDrafter(min_match=3), exactness=report)
    _decode(engine, prompt, 4, draft=False)  # warm-up (kernels compiled, pool touched)
    serial = _decode(engine, prompt, plan["moe_tokens"], draft=False)
    drafted = _decode(engine, prompt, plan["moe_tokens"], draft=True)
    s_row, d_row = completion_row(serial), completion_row(drafted)
    row = {
        "fraction": fraction,
        "copy_share": offload.copy_share,
        "budget_bytes": budget,
        "device_slots": offload.placement.slots,
        "install_seconds": round(install_seconds, 3),
        "exactness": report.describe(),
        "max_width": report.max_width,
        "serial_tps": s_row["steady_tps"],
        "drafted_tps": d_row["steady_tps"],
        "tokens_per_pass": rounded(drafted.stats.tokens_per_pass, 4),
        "acceptance_rate": rounded(drafted.stats.acceptance_rate, 4),
        "identical": serial.tokens == drafted.tokens,
        "hit_rate": serial.stats.offload["hit_rate"],
        "experts_per_layer": serial.stats.offload["experts_per_layer"],
        "per_pass_ms": serial.stats.offload["per_pass_ms"],
        "swaps": serial.stats.offload["swaps"] + drafted.stats.offload["swaps"],
        "serial": {**s_row, "offload": serial.stats.offload},
        "drafted_run": {**d_row, "offload": drafted.stats.offload},
    }
    copies = f" + copies of misses ({offload.stream_slots} scratch slots)" if offload.copy_share else ""
    say(f"bench: experts at {fraction:.0%}{copies} ({offload.placement.slots} slots): serial {row['serial_tps'] or 0:.2f} tok/s,"
        f" drafted {row['drafted_tps'] or 0:.2f} tok/s, hit rate {row['hit_rate']}, swaps {row['swaps']},"
        f" {'identical' if row['identical'] else 'DIFFERENT'}")
    return row, serial.tokens


def bench_moe(plan: dict[str, Any], device: Any, dtype: Any, say: Callable[[str], None],
              partial: Callable[[list[dict[str, Any]]], None] = lambda rows: None) -> dict[str, Any]:
    """The random Qwen3-MoE at each expert budget (see the module docstring); `partial` sees each row."""
    import torch

    from agentfold.engine.moe.offload import install_offload, remove_offload
    from agentfold.engine.moe.profile import record_routing
    from agentfold.engine.moe.random_moe import random_moe
    from agentfold.engine.torch.backend import TorchBackend

    config = plan["moe"]
    say(f"bench: building a random {config['num_hidden_layers']}-layer, {config['num_experts']}-expert "
        f"Qwen3-MoE on {device}")
    loaded, layers = random_moe(config, device, dtype, seed=0, std=WEIGHT_STD, progress=say)
    _sync(device)
    expert_bytes = sum(q.num_experts for q in layers.values()) * next(iter(layers.values())).expert_bytes
    dense_bytes = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
    say(f"bench: built in {loaded.load_seconds:.1f}s: {expert_bytes / 1e9:.2f} GB int8 experts, "
        f"{dense_bytes / 1e9:.2f} GB dense weights")

    say(f"bench: routing profile over a {plan['calibration_tokens']}-token calibration prefill")
    began = time.perf_counter()
    install_offload(loaded.model, expert_bytes, layers=layers)
    calibration = [int(t) for t in np.random.default_rng(11).integers(1000 % config["vocab_size"],
                                                                        config["vocab_size"],
                                                                        size=plan["calibration_tokens"])]
    backend = TorchBackend(loaded)
    with record_routing(loaded.model) as counts:
        backend.prefill(calibration, backend.new_cache())
    profile = {layer: values.tolist() for layer, values in counts.items()}
    shares = [np.sort(np.asarray(v) / max(1, sum(v)))[::-1] for v in profile.values()]
    top_quarter = float(np.mean([s[: max(1, len(s) // 4)].sum() for s in shares]))
    profile_row = {"tokens": plan["calibration_tokens"], "seconds": round(time.perf_counter() - began, 3),
                   "top_quarter_share": round(top_quarter, 4)}

    prompt = moe_prompt(config["vocab_size"])
    rows, replies = [], []
    for run in [{"fraction": f} for f in BUDGETS] + [COPY_RUN]:
        run = dict(run)
        row, tokens = _budget_run(loaded, layers, run.pop("fraction"), profile, plan, prompt, say, **run)
        rows.append(row)
        partial(rows)
        replies.append(tokens)
    remove_offload(loaded.model)
    del loaded, layers
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {
        "config": config,
        "weights": f"random normal (std {WEIGHT_STD}); experts int8 per output row, fp32 scales",
        "dtype": str(dtype).removeprefix("torch."),
        "expert_bytes": expert_bytes,
        "dense_bytes": dense_bytes,
        "prompt_tokens": len(prompt),
        "max_tokens": plan["moe_tokens"],
        "profile": profile_row,
        "budgets": rows,
        "identical_across_budgets": all(r == replies[0] for r in replies),
        "note": ("random router weights route almost uniformly, so hit rates are close to the budget share; "
                 "a real checkpoint's routing is more concentrated"),
    }


def transformers_decode(path: Path, prompt: Sequence[int], max_tokens: int, device: Any, dtype: Any,
                        eos: set[int]) -> dict[str, Any]:
    """Greedy `generate` of the same folder, prompt and length; rate (n - 1) / (t_last - t_first)."""
    import torch
    from transformers import AutoModelForCausalLM

    began = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).to(device).eval()
    load = time.perf_counter() - began
    ids = torch.tensor([list(prompt)], device=device)
    kwargs = {"max_new_tokens": max_tokens, "do_sample": False, "eos_token_id": sorted(eos) or None,
              "pad_token_id": sorted(eos)[0] if eos else 0}
    with torch.inference_mode():
        model.generate(ids, **{**kwargs, "max_new_tokens": 2})  # warm-up
        clock = TokenClock(lambda: _sync(device))
        started = time.perf_counter()
        model.generate(ids, streamer=clock, **kwargs)
    tokens = clock.tokens
    del model
    return {"load_seconds": round(load, 3), "completion_tokens": len(tokens),
            "steady_tps": rounded(steady_tps(clock.times, 1)),
            "ttft_seconds": rounded(clock.times[0] - started, 4) if clock.times else None,
            "tokens": tokens}


def _smollm2_folder(say: Callable[[str], None]) -> Path:
    """The converted float32 SmolLM2 folder in the model cache (converted once if missing)."""
    from agentfold.engine.mlx.loader import convert_gguf
    from agentfold.serve.models import cache_dir, default_model_path

    gguf = default_model_path()
    stat = gguf.stat()
    out = cache_dir() / f"{gguf.stem}-float32-{stat.st_size}-{int(stat.st_mtime)}"
    if not (out / "config.json").exists():
        say(f"bench: converting {gguf.name} to {out}")
        convert_gguf(gguf, out, "float32")
    return out


def bench_dense(plan: dict[str, Any], device: Any, say: Callable[[str], None]) -> dict[str, Any]:
    """SmolLM2 with the torch backend, serial and drafted, against transformers on the same device."""
    import torch

    from agentfold.engine.decode import Engine
    from agentfold.engine.drafters import SuffixLookupDrafter
    from agentfold.engine.selfcheck import check_row_exactness
    from agentfold.engine.torch.backend import TorchBackend
    from agentfold.engine.torch.loader import load_torch_model

    path = _smollm2_folder(say)
    loaded = load_torch_model(path, "auto", device.type, progress=say)
    loaded.model.to(device)  # buffers (RoPE tables) follow the weights
    backend = TorchBackend(loaded)
    report = check_row_exactness(backend, max_width=plan["dense_width"])
    say(f"bench: SmolLM2 torch backend: {report.describe()}")
    engine = Engine(backend, loaded.tokenizer, loaded.eos_token_ids, drafter=SuffixLookupDrafter(min_match=3),
                    exactness=report)
    load = next(w for w in workloads(quick=plan is not FULL) if w["name"] == plan.get("dense_workload", "code-edit"))
    prompt = encode_chat(loaded.tokenizer, load["messages"])
    _decode(engine, prompt[:32], 4, draft=False)
    serial = _decode(engine, prompt, plan["dense_tokens"], draft=False)
    drafted = _decode(engine, prompt, plan["dense_tokens"], draft=True)
    s_row, d_row = completion_row(serial), completion_row(drafted)
    dtype = next(loaded.model.parameters()).dtype
    size = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
    params = sum(p.numel() for p in loaded.model.parameters())
    record = model_record(loaded, str(dtype).removeprefix("torch."), size, params)
    eos = loaded.eos_token_ids
    del engine, backend, loaded
    if device.type == "cuda":
        torch.cuda.empty_cache()
    say("bench: transformers generate on the same device")
    stock = transformers_decode(path, prompt, plan["dense_tokens"], device, dtype, eos)
    stock_tokens = stock.pop("tokens")
    stock["identical_to_serial"] = stock_tokens == serial.tokens
    row = {
        "model": record,
        "workload": load["description"],
        "prompt_tokens": len(prompt),
        "max_tokens": plan["dense_tokens"],
        "exactness": report.describe(),
        "serial_tps": s_row["steady_tps"],
        "drafted_tps": d_row["steady_tps"],
        "speedup": rounded(d_row["steady_tps"] / s_row["steady_tps"], 4)
        if d_row["steady_tps"] and s_row["steady_tps"] else None,
        "tokens_per_pass": rounded(drafted.stats.tokens_per_pass, 4),
        "identical": serial.tokens == drafted.tokens,
        "transformers_tps": stock["steady_tps"],
        "serial_vs_transformers": rounded(s_row["steady_tps"] / stock["steady_tps"], 4)
        if s_row["steady_tps"] and stock["steady_tps"] else None,
        "serial": s_row,
        "drafted_run": d_row,
        "transformers": stock,
    }
    say(f"bench: SmolLM2 torch: serial {row['serial_tps'] or 0:.1f} tok/s, drafted {row['drafted_tps'] or 0:.1f} "
        f"tok/s ({'identical' if row['identical'] else 'DIFFERENT'}), transformers {row['transformers_tps'] or 0:.1f}"
        f" tok/s")
    return row


def _label(row: dict[str, Any]) -> str:
    return f"{row['fraction']:.0%}" + (" + copies" if row["copy_share"] else "")


def bench_offload(out: str | Path, quick: bool = False, device: str = "auto",
                  progress: Callable[[str], None] | None = print, plan: dict[str, Any] | None = None) -> dict[str, Any]:
    """Run both parts and write the JSON record to `out` (`plan`: sizes other than FULL / SMALL)."""
    import torch

    from agentfold.engine.torch.loader import resolve_device

    say = progress or (lambda message: None)
    started = time.perf_counter()
    timestamp = utc_timestamp()
    machine = machine_info()
    target = resolve_device(device)
    plan = plan or (SMALL if quick or target.type == "cpu" else FULL)
    dtype = torch.bfloat16 if target.type == "cuda" else torch.float32
    result: dict[str, Any] = {**run_header(SCHEMA, timestamp, quick or plan is not FULL, machine),
                              "torch": _versions(), "device": _device_info(target, machine),
                              "configuration": "qwen3-30b-a3b" if plan is FULL else "small", "plan": plan}
    result["versions"].update(result["torch"])
    result["complete"] = False

    def partial(rows: list[dict[str, Any]]) -> None:  # what a run cut short still leaves behind
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps({**result, "moe": {"budgets": rows}}, indent=2) + "\n")

    result["moe"] = bench_moe(plan, target, dtype, say, partial)
    partial(result["moe"]["budgets"])
    result["dense"] = bench_dense(plan, target, say)
    result["complete"] = True
    budgets = result["moe"]["budgets"]
    result["summary"] = {
        "moe_identical_across_budgets": result["moe"]["identical_across_budgets"],
        "moe_drafted_identical": all(r["identical"] for r in budgets),
        "moe_serial_tps": {_label(r): r["serial_tps"] for r in budgets},
        "moe_drafted_tps": {_label(r): r["drafted_tps"] for r in budgets},
        "moe_hit_rate": {_label(r): r["hit_rate"] for r in budgets},
        "dense_identical": result["dense"]["identical"],
        "dense_serial_vs_transformers": result["dense"]["serial_vs_transformers"],
    }
    finish_run(result, started, out)
    say(f"bench: done in {result['duration_seconds']:.0f}s, wrote {out}")
    return result
