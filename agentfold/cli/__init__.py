"""The `agentfold` command line: generate, convert, bench.

Errors the user can fix end in one readable line on stderr and a non-zero exit, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from agentfold import prepare_process
from agentfold.cli.args import add_backend_args


def _progress(message: str) -> None:
    print(f"[agentfold] {message}", file=sys.stderr, flush=True)


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="GGUF file or MLX/Hugging Face folder (default: embedded SmolLM2-135M)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16", "keep"],
                        help="weights dtype after loading (float32 is fastest on CPU)")


def _add_backend_args(parser: argparse.ArgumentParser) -> None:
    add_backend_args(parser)
    parser.set_defaults(dtype=None)  # float32; bfloat16 for torch on CUDA


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="agentfold", description="Local inference runtime for coding agents.")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate a reply to a prompt, streamed")
    _add_model_args(gen)
    gen.add_argument("prompt", help="the user message (use - to read stdin)")
    gen.add_argument("--draft-model", help="a small model sharing the tokenizer, used as drafter")
    gen.add_argument("--drafter", default="suffix", choices=["suffix", "draft-model", "none"])
    gen.add_argument("--no-draft", action="store_true", help="serial reference decoding")
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--min-p", type=float, default=0.0)
    gen.add_argument("--max-tokens", type=int, default=256)
    gen.add_argument("--system", help="system message")
    gen.add_argument("--raw", action="store_true", help="do not apply the chat template")
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--json", action="store_true", help="print the telemetry line as JSON")
    _add_backend_args(gen)

    conv = sub.add_parser("convert", help="write a GGUF file as an MLX folder")
    conv.add_argument("gguf")
    conv.add_argument("out_dir")
    conv.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16", "keep"])

    bench = sub.add_parser("bench", help="benchmarks (JSON out)")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    decode = bench_sub.add_parser("decode", help="serial vs drafted vs mlx_lm on code edit, fresh code, prose")
    _add_model_args(decode)
    _add_backend_args(decode)
    decode.add_argument("--draft-model")
    decode.add_argument("--max-tokens", type=int, default=128)
    decode.add_argument("--quick", action="store_true")
    decode.add_argument("--no-quality", action="store_true", help="skip the float32-vs-int8 quality report")
    decode.add_argument("--out", required=True, help="JSON file to write")
    quality = bench_sub.add_parser("quality", help="perplexity of float32 vs int8 weights on a fixed text, per backend")
    _add_model_args(quality)
    quality.add_argument("--backend", default="auto", choices=["auto", "mlx", "torch"],
                         help="auto (default): every backend that runs here; or just mlx or torch")
    quality.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                         help="torch backend device (auto: cuda if visible)")
    quality.add_argument("--tokens", type=int, default=1024, help="tokens of the fixed stdlib text to score")
    quality.add_argument("--out", required=True, help="JSON file to write")
    sessions = bench_sub.add_parser("sessions", help="resumed-after-restart vs cold time to first token, snapshot I/O")
    _add_model_args(sessions)
    sessions.add_argument("--contexts", default="2048,8192", help="context sizes in tokens, comma-separated")
    sessions.add_argument("--quick", action="store_true")
    sessions.add_argument("--out", required=True, help="JSON file to write")
    agent = bench_sub.add_parser("agent", help="a 30+ turn coding-agent session through both APIs: cached share, "
                                 "TTFT and prefill per turn, after a restart, against a fresh server")
    _add_model_args(agent)
    agent.add_argument("--quick", action="store_true", help="tiny tool results, shorter replies, 2 restart turns")
    agent.add_argument("--seed", type=int, default=0, help="picks the stdlib files of the transcript")
    agent.add_argument("--out", required=True, help="JSON file to write")
    suite = bench_sub.add_parser("all", help="agent workloads through the HTTP server against baselines, with a report")
    _add_model_args(suite)
    suite.add_argument("--quick", action="store_true", help="1K context only, short replies (a few minutes)")
    suite.add_argument("--contexts", help="context sizes in tokens, comma-separated (default 1024,4096,16384)")
    suite.add_argument("--long-model", help="model for contexts beyond --model's window (default: Gemma 3 270M)")
    suite.add_argument("--seed", type=int, default=0, help="picks the stdlib files and prompts")
    suite.add_argument("--out", required=True, help="JSON file to write")
    suite.add_argument("--report-dir", help="also write the Markdown report and PNG plots here")
    report = bench_sub.add_parser("report", help="Markdown summary and PNG plots from a `bench all` JSON")
    report.add_argument("results", help="the JSON `bench all` wrote")
    report.add_argument("--out-dir", help="where to write report.md and the plots (default: next to the JSON)")
    from agentfold.cli import offload as offload_cli
    offload_cli.add_bench_parser(bench_sub)
    offload_cli.add_parser(sub)

    from agentfold.bench import load as loadtest
    from agentfold.cli import ops as ops_cli
    from agentfold.cli import serve as server_cli
    from agentfold.cli import sessions as sessions_cli
    from agentfold.integrations import writer as integrate
    integrate.add_parser(sub)
    loadtest.add_parser(sub)
    server_cli.add_parser(sub)
    ops_cli.add_parsers(sub)
    sessions_cli.add_parser(sub)
    return parser


def _cmd_generate(args: argparse.Namespace) -> int:
    from agentfold.chat.template import render_chat
    from agentfold.engine.decode import GenerationConfig
    from agentfold.engine.factory import build_engine
    from agentfold.engine.sampler import SamplingParams
    from agentfold.serve.models import resolve, verdict_file

    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                            min_p=args.min_p, seed=args.seed)
    config = GenerationConfig(params=params, max_tokens=args.max_tokens, stop=tuple(args.stop),
                              draft=not args.no_draft)
    drafter = "none" if args.no_draft else ("draft-model" if args.draft_model else args.drafter)
    engine = build_engine(resolve(args.model), dtype=args.dtype, drafter=drafter, draft_model=args.draft_model,
                          progress=_progress, backend=args.backend, device=args.device, quant=args.quant,
                          verdicts=verdict_file())
    tokenizer = engine.tokenizer
    if args.raw or not tokenizer.chat_template:
        ids = tokenizer.encode(prompt)
    else:
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
            {"role": "user", "content": prompt}
        ]
        ids = tokenizer.encode(render_chat(tokenizer, messages), add_special_tokens=False)  # the server's renderer
    generation = engine.stream(ids, config)
    for delta in generation:
        sys.stdout.write(delta.text)
        sys.stdout.flush()
    completion = generation.completion
    stats = completion.stats
    sys.stdout.write("\n")
    line = {
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.completion_tokens,
        "finish_reason": completion.finish_reason,
        "prefill_tps": round(stats.prefilled_tokens / stats.prefill_seconds, 1) if stats.prefill_seconds else None,
        "ttft_ms": round(stats.ttft_seconds * 1000, 1),
        "decode_tps": round(stats.decode_tps, 2),
        "passes": stats.verify_passes,
        "drafted": stats.drafted,
        "accepted": stats.accepted,
        "tokens_per_pass": round(stats.tokens_per_pass, 2),
        "draft_method": stats.draft_method,
        "exactness": engine.exactness.describe(),
        "token_sha": completion.token_sha[:16],
    }
    if args.json:
        print(json.dumps(line), file=sys.stderr)
    else:
        print(
            f"[agentfold] {line['completion_tokens']} tokens, {line['decode_tps']} tok/s, "
            f"{line['passes']} passes, {line['drafted']} drafted, {line['accepted']} accepted, "
            f"{line['tokens_per_pass']} tokens/pass, ttft {line['ttft_ms']} ms ({line['draft_method']}; "
            f"{line['exactness']})",
            file=sys.stderr,
        )
    return 0


def _cmd_convert(args: argparse.Namespace) -> int:
    from agentfold.engine.mlx.loader import convert_gguf

    _progress(f"converting {args.gguf} to {args.out_dir} ({args.dtype})")
    out = convert_gguf(args.gguf, args.out_dir, args.dtype)
    _progress(f"wrote {out}")
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    from agentfold.bench.decode import bench_decode

    if args.bench in ("all", "report"):
        return _cmd_bench_suite(args)
    if args.bench == "offload":
        from agentfold.cli.offload import run_bench

        return run_bench(args)
    if args.bench == "sessions":
        from agentfold.bench.sessions import BenchError, bench_sessions

        contexts = tuple(int(c) for c in args.contexts.split(",") if c.strip())
        try:
            result = bench_sessions(args.model, args.out, contexts=contexts, quick=args.quick,
                                    progress=_progress, dtype=args.dtype)
        except BenchError as error:
            raise ValueError(str(error)) from error
        _progress(f"wrote {args.out}: {json.dumps(result.get('summary', {}))}")
        return 0
    if args.bench == "agent":
        from agentfold.bench.agent import bench_agent
        from agentfold.bench.server import BenchError as ServerBenchError

        try:
            result = bench_agent(args.model, args.out, quick=args.quick, seed=args.seed, dtype=args.dtype,
                                 progress=_progress)
        except ServerBenchError as error:
            raise ValueError(str(error)) from error
        _progress(f"wrote {args.out}: {json.dumps(result['summary'])}")
        return 0 if result["summary"]["ok"] else 1
    if args.bench == "quality":
        from agentfold.bench.quality import bench_quality, summary_line

        result = bench_quality(args.model, args.out, backend=args.backend, dtype=args.dtype, device=args.device,
                               tokens=args.tokens, progress=_progress)
        _progress(f"wrote {args.out}: {summary_line(result['quality'])}")
        return 0
    from agentfold.serve.models import verdict_file

    result = bench_decode(args.model, args.out, draft_model=args.draft_model, max_tokens=args.max_tokens,
                          dtype=args.dtype, quick=args.quick, progress=_progress, backend=args.backend,
                          quant=args.quant, device=args.device, verdicts=verdict_file(),
                          quality=not args.no_quality)
    _progress(f"wrote {args.out}")
    for name, row in result.get("workloads", {}).items():
        _progress(f"{name}: " + ", ".join(f"{k}={v}" for k, v in row.items() if isinstance(v, (int, float, bool))))
    return 0


def _cmd_bench_suite(args: argparse.Namespace) -> int:
    if args.bench == "report":
        from agentfold.bench.report import report_from_file

        for path in report_from_file(args.results, args.out_dir):
            _progress(f"wrote {path}")
        return 0
    from agentfold.bench.server import BenchError
    from agentfold.bench.suite import bench_all

    contexts = tuple(int(c) for c in args.contexts.split(",") if c.strip()) if args.contexts else None
    try:
        result = bench_all(args.model, args.out, quick=args.quick, report_dir=args.report_dir, contexts=contexts,
                           long_model=args.long_model, seed=args.seed, dtype=args.dtype, progress=_progress)
    except BenchError as error:
        raise ValueError(str(error)) from error
    _progress(f"wrote {args.out}: {json.dumps(result['summary'])}")
    return 0 if result["summary"]["all_equal"] else 1


def main(argv: Sequence[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    prepare_process()
    from agentfold.bench import load as loadtest
    from agentfold.cli import ops as ops_cli
    from agentfold.cli import serve as server_cli
    from agentfold.cli import sessions as sessions_cli
    from agentfold.integrations import writer as integrate
    handlers = {"generate": _cmd_generate, "convert": _cmd_convert, "bench": _cmd_bench,
                "integrate": integrate.run, "loadtest": loadtest.run, "serve": server_cli.run, "sessions": sessions_cli.run,
                **dict.fromkeys(ops_cli.COMMANDS, ops_cli.run)}
    if args.command == "profile-experts":
        from agentfold.cli.offload import run_profile

        handlers["profile-experts"] = run_profile
    try:
        return handlers[args.command](args)
    except KeyboardInterrupt:
        return 130
    except (ValueError, FileNotFoundError, OSError) as error:
        print(f"agentfold: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
