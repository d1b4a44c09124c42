"""`agentfold profile-experts` and `agentfold bench offload`: the MoE expert offload commands.

- `profile-experts --model PATH --text FILE --out profile.json` prefills a MoE model (torch
  backend) over a calibration text and writes how often each layer routed to each expert: the
  routing profile that seeds the device-resident experts (`install_offload(..., profile=...)`).
- `bench offload --out FILE.json [--quick] [--device auto|cpu|cuda]`: see `agentfold.bench.offload`.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from agentfold.cli.args import progress

PROFILE_CHUNK = 512  # prefill chunk (tokens) of the calibration text


def add_parser(sub: Any) -> None:
    """Register `profile-experts` on the `agentfold` subcommands."""
    prof = sub.add_parser("profile-experts", help="record a MoE model's expert routing over a text (JSON out)")
    prof.add_argument("--model", required=True, help="MoE model: Hugging Face folder or GGUF file")
    prof.add_argument("--text", required=True, help="calibration text file")
    prof.add_argument("--out", required=True, help="profile JSON to write")
    prof.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    prof.add_argument("--max-tokens", type=int, default=0, help="profile at most this many tokens (0: all)")


def add_bench_parser(bench_sub: Any) -> None:
    """Register `bench offload` on the `agentfold bench` subcommands."""
    off = bench_sub.add_parser("offload", help="MoE decode at 25/50/100%% of experts on the device; dense torch "
                                               "backend vs transformers")
    off.add_argument("--out", required=True, help="JSON file to write")
    off.add_argument("--quick", action="store_true", help="small MoE, short replies (about a minute on CPU)")
    off.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])


def profile_experts(model: str | Path, text_file: str | Path, out: str | Path, device: str = "auto",
                    max_tokens: int = 0, progress: Any = None) -> dict[str, Any]:
    """Prefill `text_file` through the MoE model at `model`, recording routing; write the profile."""
    from agentfold.engine.moe.placement import save_profile
    from agentfold.engine.moe.profile import record_routing
    from agentfold.engine.torch.backend import TorchBackend
    from agentfold.engine.torch.loader import load_torch_model

    say = progress or (lambda message: None)
    text_path = Path(text_file)
    if not text_path.is_file():
        raise FileNotFoundError(f"{text_file}: no such calibration text file")
    text = text_path.read_text(encoding="utf-8", errors="replace")
    loaded = load_torch_model(model, "auto", device, progress=say)
    ids = list(loaded.tokenizer.encode(text, add_special_tokens=False))
    if max_tokens > 0:
        ids = ids[:max_tokens]
    if not ids:
        raise ValueError(f"{text_file}: the text has no tokens")
    backend = TorchBackend(loaded)
    began = time.perf_counter()
    with record_routing(loaded.model) as counts:
        backend.prefill(ids, backend.new_cache(), range(PROFILE_CHUNK, len(ids), PROFILE_CHUNK))
    seconds = time.perf_counter() - began
    config = loaded.config
    data = save_profile(out, counts, model=str(loaded.path), model_type=config.get("model_type"),
                        num_experts=int(config["num_experts"]), top_k=int(config["num_experts_per_tok"]),
                        tokens=len(ids), text=str(text_path), seconds=round(seconds, 3))
    say(f"profiled {len(ids)} tokens over {len(counts)} MoE layers in {seconds:.1f}s: wrote {out}")
    return data


def run_profile(args: argparse.Namespace) -> int:
    profile_experts(args.model, args.text, args.out, device=args.device, max_tokens=args.max_tokens, progress=progress)
    return 0


def run_bench(args: argparse.Namespace) -> int:
    from agentfold.bench.offload import bench_offload

    result = bench_offload(args.out, quick=args.quick, device=args.device, progress=progress)
    progress(f"wrote {args.out}: {json.dumps(result['summary'])}")
    return 0 if result["summary"]["moe_identical_across_budgets"] and result["summary"]["moe_drafted_identical"] else 1
