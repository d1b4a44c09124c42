"""The `agentfold` command line: one parser over the subcommands' own modules, one error handler.

Errors the user can fix end in one readable line on stderr and a non-zero exit, never a traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from types import ModuleType

from agentfold import __version__, prepare_process
from agentfold.cli.args import progress


def _commands() -> dict[str, ModuleType]:
    """The modules that add their subcommands and run them. Imported here, not at the top, so that
    `python -m agentfold.cli.sessions` (whose package this is) does not import itself twice."""
    from agentfold.bench import load as loadtest
    from agentfold.cli import bench, generate, models, offload, ops, serve, sessions, stage
    from agentfold.integrations import writer as integrate

    return {"generate": generate, "bench": bench, "offload": offload, "integrate": integrate, "loadtest": loadtest,
            "serve": serve, "ops": ops, "sessions": sessions, "models": models, "stage": stage}


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="agentfold", description="Local inference runtime for coding agents.")
    parser.add_argument("--version", action="version", version=f"agentfold {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    commands = _commands()
    commands["generate"].add_parser(sub)
    conv = sub.add_parser("convert", help="write a GGUF file as an MLX folder")
    conv.add_argument("gguf")
    conv.add_argument("out_dir")
    conv.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16", "keep"])

    for name in ("models", "bench", "offload", "integrate", "loadtest", "serve", "sessions", "stage"):
        commands[name].add_parser(sub)
    commands["ops"].add_parsers(sub)
    sub.add_parser("version", help="print the version")
    return parser


def _cmd_convert(args: argparse.Namespace) -> int:
    from agentfold.engine.mlx.loader import convert_gguf

    progress(f"converting {args.gguf} to {args.out_dir} ({args.dtype})")
    out = convert_gguf(args.gguf, args.out_dir, args.dtype)
    progress(f"wrote {out}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    if args.command == "version":
        print(f"agentfold {__version__}")
        return 0
    prepare_process()
    commands = _commands()
    handlers = {name: module.run for name, module in commands.items() if name not in ("ops", "offload")}
    handlers.update({"convert": _cmd_convert, "profile-experts": commands["offload"].run_profile,
                     **dict.fromkeys(commands["ops"].COMMANDS, commands["ops"].run)})
    try:
        return handlers[args.command](args)
    except KeyboardInterrupt:
        return 130
    except (ValueError, FileNotFoundError, OSError) as error:
        print(f"agentfold: error: {error}", file=sys.stderr)
        return 2

