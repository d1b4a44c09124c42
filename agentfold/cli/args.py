"""The command-line arguments every model-loading command shares, defined once."""

from __future__ import annotations

import argparse
import sys


def progress(message: str) -> None:
    """The one progress printer of every command: `[agentfold] message` on stderr, flushed."""
    print(f"[agentfold] {message}", file=sys.stderr, flush=True)


MODEL_HELP = ("a name `agentfold models` lists (smollm2, gemma3, ...), a GGUF file or an MLX/Hugging Face "
              "folder (default: the embedded SmolLM2-135M)")


def add_model_args(parser: argparse.ArgumentParser) -> None:
    """--model, --dtype, --backend, --quant, --device."""
    parser.add_argument("--model", help=MODEL_HELP)
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16", "keep"],
                        help="weights dtype after loading (default float32, fastest on CPU; torch on CUDA: bfloat16)")
    add_backend_args(parser)


def add_model_file_args(parser: argparse.ArgumentParser) -> None:
    """--model and --dtype (float32 by default) for commands that always run the MLX backend."""
    parser.add_argument("--model", help=MODEL_HELP)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16", "keep"],
                        help="weights dtype after loading (float32 is fastest on CPU)")


def add_backend_args(parser: argparse.ArgumentParser) -> None:
    """--backend, --quant, --device (for commands that take --model and --dtype their own way)."""
    parser.add_argument("--backend", default="auto", choices=["auto", "mlx", "torch"],
                        help="auto (default): the backend that verifies widest and fastest here, measured once "
                             "per machine and model; mlx; or torch (PyTorch, CPU or CUDA)")
    parser.add_argument("--quant", default="auto", choices=["auto", "blocks", "int8", "none"],
                        help="auto: a GGUF's own blocks where every type has a kernel (torch on CPU), else int8; "
                             "blocks: the file's Q4_K/Q6_K/Q8_0/... blocks as they are; int8: int8 weights; both "
                             "with exact integer sums (row-exact by construction); none: float weights (row-exact "
                             "only as wide as the BLAS happens to be)")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                        help="torch backend device (auto: cuda if visible)")


def drafter_choice(args: argparse.Namespace) -> str:
    """The drafter `--no-draft`, `--draft-model` and `--drafter` name together (generate and serve)."""
    return "none" if args.no_draft else ("draft-model" if args.draft_model else args.drafter)


def add_model_dir_arg(parser: argparse.ArgumentParser) -> None:
    """--model-dir: more places whose GGUF files and model folders `--model NAME` finds."""
    parser.add_argument("--model-dir", action="append", default=[], metavar="PATH",
                        help="a folder of GGUF files / model folders (or one of them) whose models --model can "
                             "name by their short names (repeatable)")


def add_ctx_size_arg(parser: argparse.ArgumentParser) -> None:
    """--ctx-size: the context served, at most the model's trained one."""
    parser.add_argument("--ctx-size", type=int, default=None, metavar="N",
                        help="context window to serve, in tokens (prompt + reply); default and maximum: the "
                             "model's trained context (AgentFold refuses more: positions past it were never "
                             "trained and replies degrade without any error)")


def check_ctx_size(ctx_size: int | None, trained: int | None, name: str) -> None:
    """Refuse a --ctx-size below 16 tokens or above the model's trained context (one readable line)."""
    if ctx_size is None:
        return
    if ctx_size < 16:
        raise ValueError(f"--ctx-size must be >= 16, not {ctx_size}")
    if trained is not None and ctx_size > trained:
        raise ValueError(f"--ctx-size {ctx_size} is larger than {name}'s trained context of {trained} tokens; "
                         f"positions past it were never trained (pass --ctx-size {trained} or less)")
