"""`agentfold stage`: one pipeline stage (rank >= 1) of a model split over processes or machines,
and the `serve --stages` options that start or await them (`engine.torch.stages`).

One machine: `agentfold serve --stages 2` starts rank 1 itself (a child process over loopback).
Two machines: on B, `agentfold stage --rank 1 --stages 2 --master A:29500 --model M`; on A,
`agentfold serve --stages 2 --stage-master 0.0.0.0:29500 --no-spawn --model M`. Torch only: MLX's
own `mlx.core.distributed` is not wired here. The command line always uses gloo (CPU tensors on
the wire, whatever the device); NCCL is `StageOptions(transport="nccl")` in code, and untested.
"""

from __future__ import annotations

import argparse
import atexit
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from agentfold.cli.args import add_model_args, add_model_dir_arg, progress

DEFAULT_MASTER_PORT = 29500


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `stage` on the `agentfold` command's subparsers."""
    parser = subparsers.add_parser("stage", help="run one pipeline stage (rank >= 1) of a model split by layers",
                                   description="Hold layers of a model for `agentfold serve --stages N` (rank 0) "
                                               "and run its passes over them, bit for bit.")
    parser.add_argument("--rank", type=int, required=True, help="this stage's rank, 1..stages-1")
    parser.add_argument("--stages", type=int, required=True, help="ranks in the pipeline, rank 0 included")
    parser.add_argument("--master", required=True, metavar="ADDR:PORT",
                        help="where rank 0 (agentfold serve --stages N) listens, e.g. 192.168.1.10:29500")
    add_model_args(parser)
    add_model_dir_arg(parser)
    parser.add_argument("--stage-dir", default=None, metavar="DIR",
                        help="where this stage keeps its layers' KV snapshots (default <home>/stages/rank<N>)")
    parser.add_argument("--home", default=None, help="default $AGENTFOLD_HOME or ~/.local/share/agentfold")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for rank 0 (default 600)")
    return parser


def add_stage_args(parser: argparse.ArgumentParser) -> None:
    """`serve`'s options: --stages, --stage-master, --no-spawn."""
    parser.add_argument("--stages", type=int, default=None, metavar="N",
                        help="split the model by layers over N processes (torch backend); without --no-spawn "
                             "the other N-1 start here as child processes over loopback")
    parser.add_argument("--stage-master", default=None, metavar="ADDR:PORT",
                        help=f"where rank 0 listens for its stages (default 127.0.0.1:<free port>, or "
                             f"0.0.0.0:{DEFAULT_MASTER_PORT} with --no-spawn)")
    parser.add_argument("--no-spawn", action="store_true",
                        help="start no stages here: wait for `agentfold stage --rank N ...` on other machines")


def check_stage_args(args: argparse.Namespace) -> None:
    """Refuse impossible stage settings before anything loads (one readable line)."""
    stages = getattr(args, "stages", None)
    if stages is None:
        if getattr(args, "no_spawn", False) or getattr(args, "stage_master", None):
            raise ValueError("--no-spawn and --stage-master need --stages N")
        return
    if stages < 1:
        raise ValueError(f"--stages must be >= 1, not {stages}")
    if args.backend == "mlx":
        raise ValueError("--stages runs on the torch backend only (MLX's mlx.core.distributed is not wired here); "
                         "pass --backend torch")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def stage_command(rank: int, stages: int, master: str, model: str | Path, stage_dir: str | Path,
                  extra: list[str] | tuple[str, ...] = ()) -> list[str]:
    """The command line of one local stage process."""
    return [sys.executable, "-m", "agentfold.cli", "stage", "--rank", str(rank), "--stages", str(stages),
            "--master", master, "--model", str(model), "--stage-dir", str(stage_dir), *extra]


def stop_processes(processes: list[subprocess.Popen], grace: float = 10.0) -> None:
    """Wait for stages to exit (after rank 0's shutdown), then terminate, then kill them."""
    deadline = time.monotonic() + grace
    for process in processes:
        try:
            process.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.terminate()
            try:
                process.wait(5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def stage_options(args: argparse.Namespace, model: str | Path, home: str | Path | None = None) -> Any:
    """The `StageOptions` of `serve --stages N` (None without it), its local stages started first."""
    check_stage_args(args)
    if args.stages is None or args.stages == 1:
        return None
    from agentfold.engine.torch.stages import StageOptions
    from agentfold.sessions.index import default_home

    if args.no_spawn:
        return StageOptions(args.stages, args.stage_master or f"0.0.0.0:{DEFAULT_MASTER_PORT}")
    master = args.stage_master or f"127.0.0.1:{free_port()}"
    root = Path(home).expanduser() if home else default_home()
    extra = ["--backend", "torch", "--quant", args.quant, "--device", args.device,
             *(["--dtype", args.dtype] if args.dtype else [])]
    processes = [subprocess.Popen(stage_command(rank, args.stages, master, model, root / "stages" / f"rank{rank}",
                                                extra), start_new_session=True)
                 for rank in range(1, args.stages)]
    atexit.register(stop_processes, processes)  # runs after the backend's own close (atexit is LIFO)
    progress(f"started {len(processes)} local stage(s) for rank 0 at {master}")
    return StageOptions(args.stages, master)


def run(args: argparse.Namespace) -> int:
    """Load this stage's layers, connect to rank 0, run its commands until it shuts the pipeline down."""
    from agentfold.engine.torch.loader import load_torch_model
    from agentfold.engine.torch.stage_worker import run_stage
    from agentfold.serve.models import resolve
    from agentfold.sessions.index import default_home

    if args.backend == "mlx":
        raise ValueError("agentfold stage runs the torch backend only (MLX's mlx.core.distributed is not wired here)")
    if not 1 <= args.rank < max(args.stages, 1):
        raise ValueError(f"--rank must be in 1..{args.stages - 1} for --stages {args.stages} "
                         "(rank 0 is `agentfold serve --stages N`)")
    stage_dir = args.stage_dir or (Path(args.home).expanduser() if args.home else default_home()) / "stages" / \
        f"rank{args.rank}"
    path = resolve(args.model, args.model_dir)
    loaded = load_torch_model(path, args.dtype or "auto", args.device, progress)
    why = run_stage(loaded, args.rank, args.stages, args.master, stage_dir, quant=args.quant, timeout=args.timeout,
                    say=progress)
    progress(f"stage {args.rank}: {why}")
    return 0
