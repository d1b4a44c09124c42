"""The command-line arguments every model-loading command shares, defined once."""

from __future__ import annotations

import argparse
import sys


def progress(message: str) -> None:
    """The one progress printer of every command: `[agentfold] message` on stderr, flushed."""
    print(f"[agentfold] {message}", file=sys.stderr, flush=True)


def add_model_args(parser: argparse.ArgumentParser) -> None:
    """--model, --dtype, --backend, --quant, --device."""
    parser.add_argument("--model", help="GGUF file or MLX/Hugging Face folder (default: embedded SmolLM2-135M)")
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16", "keep"],
                        help="weights dtype after loading (default float32, fastest on CPU; torch on CUDA: bfloat16)")
    add_backend_args(parser)


def add_model_file_args(parser: argparse.ArgumentParser) -> None:
    """--model and --dtype (float32 by default) for commands that always run the MLX backend."""
    parser.add_argument("--model", help="GGUF file or MLX/Hugging Face folder (default: embedded SmolLM2-135M)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16", "keep"],
                        help="weights dtype after loading (float32 is fastest on CPU)")


def add_backend_args(parser: argparse.ArgumentParser) -> None:
    """--backend, --quant, --device (for commands that take --model and --dtype their own way)."""
    parser.add_argument("--backend", default="auto", choices=["auto", "mlx", "torch"],
                        help="auto (default): the backend that verifies widest and fastest here, measured once "
                             "per machine and model; mlx; or torch (PyTorch, CPU or CUDA)")
    parser.add_argument("--quant", default="auto", choices=["auto", "int8", "none"],
                        help="auto/int8: int8 weights with exact integer sums (row-exact by construction); "
                             "none: float weights (row-exact only as wide as the BLAS happens to be)")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                        help="torch backend device (auto: cuda if visible)")
