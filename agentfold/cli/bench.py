"""`agentfold bench ...`: the benchmarks' subcommands; each writes one JSON file (and a report for `all`).

A bench's own failure (`BenchError`: a server that would not start, a reply that differs) ends as
one readable line through the CLI's error handler.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from agentfold.cli.args import add_model_args, add_model_file_args, progress


def add_parser(sub: Any) -> None:
    bench = sub.add_parser("bench", help="benchmarks (JSON out)")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    decode = bench_sub.add_parser("decode", help="serial vs drafted vs llama.cpp and mlx_lm on code edit, fresh code, "
                                   "prose; --busy, --prefill")
    add_model_args(decode)
    decode.add_argument("--draft-model")
    decode.add_argument("--max-tokens", type=int, default=128)
    decode.add_argument("--quick", action="store_true")
    decode.add_argument("--no-quality", action="store_true", help="skip the float32-vs-int8 quality report")
    decode.add_argument("--busy", action="store_true",
                        help="also decode the fresh-code workload serially beside one busy process (kept share of idle)")
    decode.add_argument("--prefill", default="", metavar="TOKENS[,TOKENS...]",
                        help="also prefill prompts of these many tokens (stdlib source, e.g. 4096,12288), and "
                             "llama.cpp the same ids")
    decode.add_argument("--out", required=True, help="JSON file to write")
    quality = bench_sub.add_parser("quality", help="perplexity of float32, int8 and the GGUF's own blocks (and "
                                    "llama.cpp) on a fixed text, per backend")
    add_model_file_args(quality)
    quality.add_argument("--backend", default="auto", choices=["auto", "mlx", "torch"],
                         help="auto (default): every backend that runs here; or just mlx or torch")
    quality.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                         help="torch backend device (auto: cuda if visible)")
    quality.add_argument("--tokens", type=int, default=1024, help="tokens of the fixed stdlib text to score")
    quality.add_argument("--out", required=True, help="JSON file to write")
    sessions = bench_sub.add_parser("sessions", help="resumed-after-restart vs cold time to first token, snapshot I/O")
    add_model_file_args(sessions)
    sessions.add_argument("--contexts", default="2048,8192", help="context sizes in tokens, comma-separated")
    sessions.add_argument("--quick", action="store_true")
    sessions.add_argument("--out", required=True, help="JSON file to write")
    tools = bench_sub.add_parser("tools", help="tool calls through the server on cases of four kinds (one function, "
                                 "one of several, several calls, no tool fits), scored beside the model's raw text")
    add_model_args(tools)
    tools.add_argument("--quick", action="store_true", help="two cases of each kind")
    tools.add_argument("--out", required=True, help="JSON file to write")
    agent = bench_sub.add_parser("agent", help="a 30+ turn coding-agent session through both APIs: cached share, "
                                 "TTFT and prefill per turn, after a restart, against a fresh server")
    add_model_file_args(agent)
    agent.add_argument("--quick", action="store_true", help="tiny tool results, shorter replies, 2 restart turns")
    agent.add_argument("--seed", type=int, default=0, help="picks the stdlib files of the transcript")
    agent.add_argument("--prefill-contexts", help="prompt sizes in tokens for the prefill rates, comma-separated "
                       "(default 1024,4096,16384; --quick: 256)")
    agent.add_argument("--out", required=True, help="JSON file to write")
    lanes = bench_sub.add_parser("lanes", help="a pool of agent sessions served 1, 2, 4, 8 at a time on one runtime: "
                                 "aggregate tok/s, per-client TTFT and ITL, every reply equal to its solo run")
    add_model_args(lanes)
    lanes.add_argument("--clients", help="concurrent client levels, comma-separated, at most the sessions (default "
                       "1,2,4,8; --quick: 1,2; 1 always runs: it is the solo reference)")
    lanes.add_argument("--max-tokens", type=int, default=128, help="reply tokens per client (--quick: at most 32)")
    lanes.add_argument("--sessions", type=int, help="agent sessions in the pool every level serves (default 32; "
                       "--quick: 4; at most 32)")
    lanes.add_argument("--turns", type=int, default=2, help="turns per session: the task, then follow-ups (default 2)")
    lanes.add_argument("--rounds", type=int, help="runs of every level, levels up then down (default 2: "
                       "1,2,4,8,8,4,2,1, so that a drift of the machine's speed weighs on every level alike; --quick: 1)")
    lanes.add_argument("--quick", action="store_true", help="levels 1 and 2, four sessions, short code edits, 32-token "
                       "replies")
    lanes.add_argument("--seed", type=int, default=0, help="picks the stdlib files; the sampled client's seed")
    lanes.add_argument("--out", required=True, help="JSON file to write")
    suite = bench_sub.add_parser("all", help="agent workloads through the HTTP server against baselines, with a report")
    add_model_file_args(suite)
    suite.add_argument("--quick", action="store_true", help="1K context only, short replies (a few minutes)")
    suite.add_argument("--contexts", help="context sizes in tokens, comma-separated (default 1024,4096,16384)")
    suite.add_argument("--long-model", help="model for contexts beyond --model's window (default: Gemma 3 270M)")
    suite.add_argument("--seed", type=int, default=0, help="picks the stdlib files and prompts")
    suite.add_argument("--out", required=True, help="JSON file to write")
    suite.add_argument("--report-dir", help="also write the Markdown report and PNG plots here")
    report = bench_sub.add_parser("report", help="Markdown summary and PNG plots from a `bench all` JSON")
    report.add_argument("results", help="the JSON `bench all` wrote")
    report.add_argument("--out-dir", help="where to write report.md and the plots (default: next to the JSON)")
    _add_moe_parser(bench_sub)
    from agentfold.cli import offload as offload_cli

    offload_cli.add_bench_parser(bench_sub)


def _add_moe_parser(bench_sub: Any) -> None:
    """`bench moe`: the agent MoE models at their real size (`bench.moe_size`)."""
    moe = bench_sub.add_parser("moe", help="Qwen3-Coder-30B-A3B and gpt-oss-20b at their real size (random "
                               "weights, written once) against llama.cpp: load, prefill, decode, drafted, peak RSS")
    moe.add_argument("--arch", default="all", help="qwen3-coder-30b-a3b, gpt-oss-20b or all (default: both; "
                     "tiny-qwen3moe and tiny-gpt-oss: a few-MB smoke run)")
    moe.add_argument("--prefill", default=str(4096), help="prompt tokens prefilled before the decode (default 4096)")
    moe.add_argument("--max-tokens", default=str(32), help="tokens decoded after the prompt (default 32)")
    moe.add_argument("--out", help="JSON file to write (default: moe-ARCH.json here)")
    moe.add_argument("--cache-dir", help="where the random GGUF files are written and reused (default: "
                     "$AGENTFOLD_CACHE/bench, else ~/.cache/agentfold/bench)")
    moe.add_argument("--keep-files", action=argparse.BooleanOptionalAction, default=True,
                     help="keep each file for the next run (default); --no-keep-files deletes it after its run")
    moe.add_argument("--layers", help="only the first N layers of each model: a shorter run at the real widths "
                     "(its figures are not the model's)")
    moe.add_argument("--seed", default="0", help="seed of the weights and the prompt ids (default 0)")
    moe.add_argument("--no-llama-cpp", action="store_true", help="run AgentFold only")


def run(args: argparse.Namespace) -> int:
    from agentfold.bench.decode import bench_decode

    if args.bench in ("all", "report"):
        return _run_suite(args)
    if args.bench == "offload":
        from agentfold.cli.offload import run_bench

        return run_bench(args)
    if args.bench == "moe":
        return _run_moe(args)
    if args.bench == "sessions":
        from agentfold.bench.sessions import BenchError, bench_sessions

        contexts = tuple(int(c) for c in args.contexts.split(",") if c.strip())
        try:
            result = bench_sessions(args.model, args.out, contexts=contexts, quick=args.quick,
                                    progress=progress, dtype=args.dtype)
        except BenchError as error:
            raise ValueError(str(error)) from error
        progress(f"wrote {args.out}: {json.dumps(result.get('summary', {}))}")
        return 0
    if args.bench == "lanes":
        return _run_lanes(args)
    if args.bench == "tools":
        from agentfold.bench.harness import BenchError
        from agentfold.bench.tools import bench_tools
        from agentfold.serve.models import verdict_file

        try:
            result = bench_tools(args.model, args.out, quick=args.quick, backend=args.backend, quant=args.quant,
                                 device=args.device, dtype=args.dtype, verdicts=verdict_file(), progress=progress)
        except BenchError as error:
            raise ValueError(str(error)) from error
        progress(f"wrote {args.out}: {json.dumps(result['summary'])}")
        return 0 if result["summary"]["ok"] else 1
    if args.bench == "agent":
        from agentfold.bench.agent import bench_agent
        from agentfold.bench.server import BenchError as ServerBenchError

        try:
            contexts = (tuple(int(c) for c in args.prefill_contexts.split(",") if c.strip())
                        if args.prefill_contexts else None)
            result = bench_agent(args.model, args.out, quick=args.quick, seed=args.seed, dtype=args.dtype,
                                 progress=progress, prefill_contexts=contexts)
        except ServerBenchError as error:
            raise ValueError(str(error)) from error
        progress(f"wrote {args.out}: {json.dumps(result['summary'])}")
        return 0 if result["summary"]["ok"] else 1
    if args.bench == "quality":
        from agentfold.bench.quality import bench_quality, summary_line

        result = bench_quality(args.model, args.out, backend=args.backend, dtype=args.dtype, device=args.device,
                               tokens=args.tokens, progress=progress)
        progress(f"wrote {args.out}: {summary_line(result['quality'])}")
        return 0
    from agentfold.serve.models import verdict_file

    result = bench_decode(args.model, args.out, draft_model=args.draft_model, max_tokens=args.max_tokens,
                          dtype=args.dtype, quick=args.quick, progress=progress, backend=args.backend,
                          quant=args.quant, device=args.device, verdicts=verdict_file(),
                          quality=not args.no_quality, busy=args.busy, prefill=_token_counts(args.prefill))
    progress(f"wrote {args.out}")
    for name, row in result.get("workloads", {}).items():
        progress(f"{name}: " + ", ".join(f"{k}={v}" for k, v in row.items() if isinstance(v, (int, float, bool))))
    return 0


def _whole_number(name: str, text: str | None) -> int | None:
    """`--name TEXT` as an int (None if not given); a readable error for anything else."""
    if text is None:
        return None
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{name} takes a whole number, not {text!r}") from None


def _run_moe(args: argparse.Namespace) -> int:
    from agentfold.bench.moe_size import bench_moe

    result = bench_moe(args.arch, args.out, prefill=_whole_number("--prefill", args.prefill),
                       max_tokens=_whole_number("--max-tokens", args.max_tokens), cache_dir=args.cache_dir,
                       keep_files=args.keep_files, seed=_whole_number("--seed", args.seed),
                       llama=not args.no_llama_cpp, layers=_whole_number("--layers", args.layers), progress=progress)
    for name, row in result["summary"]["models"].items():
        progress(f"{name}: " + ", ".join(f"{k}={v}" for k, v in row.items()))
    return 0 if result["summary"]["all_identical"] and result["summary"]["all_ran"] else 1


def _token_counts(text: str) -> list[int]:
    """`--prefill 4096,12288` as [4096, 12288]; a readable error for anything else."""
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"--prefill takes comma-separated numbers of tokens, not {text!r}") from None


def _run_lanes(args: argparse.Namespace) -> int:
    from agentfold.bench.harness import BenchError
    from agentfold.bench.lanes import bench_lanes

    try:
        levels = [int(c) for c in args.clients.split(",") if c.strip()] if args.clients else None
    except ValueError:
        raise ValueError(f"--clients takes comma-separated integers, not {args.clients!r}") from None
    try:
        result = bench_lanes(args.model, args.out, quick=args.quick, levels=levels, max_tokens=args.max_tokens,
                             seed=args.seed, dtype=args.dtype, backend=args.backend, quant=args.quant,
                             device=args.device, progress=progress, sessions=args.sessions, turns=args.turns,
                             rounds=args.rounds)
    except BenchError as error:
        raise ValueError(str(error)) from error
    progress(f"wrote {args.out}: {json.dumps(result['summary'])}")
    return 0 if result["summary"]["all_equal"] else 1


def _run_suite(args: argparse.Namespace) -> int:
    if args.bench == "report":
        from agentfold.bench.report import report_from_file

        for path in report_from_file(args.results, args.out_dir):
            progress(f"wrote {path}")
        return 0
    from agentfold.bench.server import BenchError
    from agentfold.bench.suite import bench_all

    contexts = tuple(int(c) for c in args.contexts.split(",") if c.strip()) if args.contexts else None
    try:
        result = bench_all(args.model, args.out, quick=args.quick, report_dir=args.report_dir, contexts=contexts,
                           long_model=args.long_model, seed=args.seed, dtype=args.dtype, progress=progress)
    except BenchError as error:
        raise ValueError(str(error)) from error
    progress(f"wrote {args.out}: {json.dumps(result['summary'])}")
    summary = result["summary"]
    return 0 if summary["all_equal"] and summary.get("lanes_all_equal") is not False else 1
