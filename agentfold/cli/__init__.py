"""The `agentfold` command line: one parser over the subcommands' own modules, one error handler.

Errors the user can fix end in one readable line on stderr and a non-zero exit, never a traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from agentfold import prepare_process
from agentfold.bench import load as loadtest
from agentfold.cli import bench as bench_cli
from agentfold.cli import generate as generate_cli
from agentfold.cli import offload as offload_cli
from agentfold.cli import ops as ops_cli
from agentfold.cli import serve as server_cli
from agentfold.cli import sessions as sessions_cli
from agentfold.cli.args import progress
from agentfold.integrations import writer as integrate


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="agentfold", description="Local inference runtime for coding agents.")
    sub = parser.add_subparsers(dest="command", required=True)
    generate_cli.add_parser(sub)
    conv = sub.add_parser("convert", help="write a GGUF file as an MLX folder")
    conv.add_argument("gguf")
    conv.add_argument("out_dir")
    conv.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16", "keep"])

    bench_cli.add_parser(sub)
    offload_cli.add_parser(sub)
    integrate.add_parser(sub)
    loadtest.add_parser(sub)
    server_cli.add_parser(sub)
    ops_cli.add_parsers(sub)
    sessions_cli.add_parser(sub)
    return parser


def _cmd_convert(args: argparse.Namespace) -> int:
    from agentfold.engine.mlx.loader import convert_gguf

    progress(f"converting {args.gguf} to {args.out_dir} ({args.dtype})")
    out = convert_gguf(args.gguf, args.out_dir, args.dtype)
    progress(f"wrote {out}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    prepare_process()
    handlers = {"generate": generate_cli.run, "convert": _cmd_convert, "bench": bench_cli.run,
                "integrate": integrate.run, "loadtest": loadtest.run, "serve": server_cli.run, "sessions": sessions_cli.run,
                **dict.fromkeys(ops_cli.COMMANDS, ops_cli.run)}
    handlers["profile-experts"] = offload_cli.run_profile
    try:
        return handlers[args.command](args)
    except KeyboardInterrupt:
        return 130
    except (ValueError, FileNotFoundError, OSError) as error:
        print(f"agentfold: error: {error}", file=sys.stderr)
        return 2

