"""`agentfold stage`: one pipeline stage (rank >= 1) of a model split over processes or machines,
and the `serve --stages` options that start or await them (`engine.torch.stages`, `engine.mlx.stages`).

One machine: `agentfold serve --stages 2` starts rank 1 itself (a child process over loopback).
Two machines, torch: on B, `agentfold stage --rank 1 --stages 2 --master A:29500 --model M`; on A,
`agentfold serve --stages 2 --stage-master 0.0.0.0:29500 --no-spawn --model M`. The command line
always uses gloo (CPU tensors on the wire, whatever the device); NCCL is
`StageOptions(transport="nccl")` in code, and untested.

Two machines, MLX (mlx.core.distributed's ring over TCP): one hostfile in MLX's format on both,
`[["A:35141"], ["B:35141"]]` (rank 0 first); on B `agentfold stage --backend mlx --rank 1
--stages 2 --hostfile FILE --model M`, on A `agentfold serve --backend mlx --stages 2 --hostfile
FILE --no-spawn --model M`. Or `mlx.launch` starts `agentfold serve --backend mlx --stages N` on
every host: a process whose MLX_RANK is >= 1 runs as that stage instead of serving.
"""

from __future__ import annotations

import argparse
import atexit
import os
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
    parser.add_argument("--master", default=None, metavar="ADDR:PORT",
                        help="torch: where rank 0 (agentfold serve --stages N) listens, e.g. 192.168.1.10:29500")
    parser.add_argument("--hostfile", default=None, metavar="FILE",
                        help="mlx: the MLX ring hostfile, a JSON list of [\"ip:port\"] per rank (rank 0 first)")
    add_model_args(parser)
    add_model_dir_arg(parser)
    parser.add_argument("--stage-dir", default=None, metavar="DIR",
                        help="where this stage keeps its layers' KV snapshots (default <home>/stages/rank<N>)")
    parser.add_argument("--home", default=None, help="default $AGENTFOLD_HOME or ~/.local/share/agentfold")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for rank 0 (default 600)")
    return parser


def add_stage_args(parser: argparse.ArgumentParser) -> None:
    """`serve`'s options: --stages, --stage-master (torch), --hostfile (mlx), --no-spawn."""
    parser.add_argument("--stages", type=int, default=None, metavar="N",
                        help="split the model by layers over N processes (torch or mlx backend); without "
                             "--no-spawn the other N-1 start here as child processes over loopback")
    parser.add_argument("--stage-master", default=None, metavar="ADDR:PORT",
                        help=f"torch: where rank 0 listens for its stages (default 127.0.0.1:<free port>, or "
                             f"0.0.0.0:{DEFAULT_MASTER_PORT} with --no-spawn)")
    parser.add_argument("--hostfile", default=None, metavar="FILE",
                        help="mlx: the MLX ring hostfile of every rank, rank 0 (this one) first (default: one "
                             "written for 127.0.0.1; needed with --no-spawn)")
    parser.add_argument("--no-spawn", action="store_true",
                        help="start no stages here: wait for `agentfold stage --rank N ...` on other machines")


def check_stage_args(args: argparse.Namespace) -> None:
    """Refuse impossible stage settings before anything loads (one readable line)."""
    stages = getattr(args, "stages", None)
    if stages is None:
        if getattr(args, "no_spawn", False) or getattr(args, "stage_master", None) or getattr(args, "hostfile", None):
            raise ValueError("--no-spawn, --stage-master and --hostfile need --stages N")
        return
    if stages < 1:
        raise ValueError(f"--stages must be >= 1, not {stages}")
    if args.backend == "mlx":
        if args.stage_master:
            raise ValueError("--stage-master is the torch stages' address; MLX stages name every rank in --hostfile")
        if args.no_spawn and not (args.hostfile or os.environ.get("MLX_HOSTFILE")):
            raise ValueError("--backend mlx --stages N --no-spawn needs --hostfile FILE (every rank's address)")
    elif args.hostfile:
        raise ValueError("--hostfile is for MLX stages (pass --backend mlx); torch stages use --stage-master")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def stage_command(rank: int, stages: int, master: str, model: str | Path, stage_dir: str | Path,
                  extra: list[str] | tuple[str, ...] = (), hostfile: str | Path | None = None) -> list[str]:
    """The command line of one local stage process (torch: `master`; mlx: `hostfile`, master unused)."""
    where = ["--backend", "mlx", "--hostfile", str(hostfile)] if hostfile else ["--master", master]
    return [sys.executable, "-m", "agentfold.cli", "stage", "--rank", str(rank), "--stages", str(stages),
            *where, "--model", str(model), "--stage-dir", str(stage_dir), *extra]


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
    """The stage options of `serve --stages N` (None without it), its local stages started first."""
    check_stage_args(args)
    if args.stages is None or args.stages == 1:
        return None
    from agentfold.sessions.index import default_home

    root = Path(home).expanduser() if home else default_home()
    extra = ["--quant", args.quant, *(["--dtype", args.dtype] if args.dtype else [])]
    if args.backend == "mlx":
        from agentfold.engine.mlx.stage_wire import write_local_hostfile
        from agentfold.engine.mlx.stages import MLXStageOptions

        if "MLX_RANK" in os.environ or args.no_spawn:  # mlx.launch started every rank, or other machines
            return MLXStageOptions(args.stages, args.hostfile or os.environ.get("MLX_HOSTFILE"))
        hostfile = args.hostfile or write_local_hostfile(root / "stages" / f"ring-{os.getpid()}.json", args.stages)
        spawn(args.stages, "", model, root, extra, hostfile)
        return MLXStageOptions(args.stages, str(hostfile))
    from agentfold.engine.torch.stages import StageOptions

    if args.no_spawn:
        return StageOptions(args.stages, args.stage_master or f"0.0.0.0:{DEFAULT_MASTER_PORT}")
    master = args.stage_master or f"127.0.0.1:{free_port()}"
    spawn(args.stages, master, model, root, ["--backend", "torch", "--device", args.device, *extra])
    return StageOptions(args.stages, master)


def spawn(stages: int, master: str, model: str | Path, root: Path, extra: list[str],
          hostfile: str | Path | None = None) -> None:
    """Start ranks 1..stages-1 here as child processes, stopped at exit."""
    processes = [subprocess.Popen(stage_command(rank, stages, master, model, root / "stages" / f"rank{rank}", extra,
                                                hostfile), start_new_session=True)
                 for rank in range(1, stages)]
    atexit.register(stop_processes, processes)  # runs after the backend's own close (atexit is LIFO)
    progress(f"started {len(processes)} local stage(s) for rank 0 " + (f"on the ring in {hostfile}" if hostfile
                                                                       else f"at {master}"))


def launched_rank(args: argparse.Namespace) -> int:
    """The rank `mlx.launch` gave `serve --backend mlx --stages N` (MLX_RANK), 0 without it."""
    rank = os.environ.get("MLX_RANK", "0")
    if args.backend != "mlx" or not args.stages or args.stages < 2:
        return 0
    if not rank.isdigit() or int(rank) >= args.stages:
        raise ValueError(f"MLX_RANK={rank!r} is not a rank of --stages {args.stages}")
    return int(rank)


def run(args: argparse.Namespace) -> int:
    """Load this stage's layers, join rank 0, run its commands until it shuts the pipeline down."""
    from agentfold.serve.models import resolve
    from agentfold.sessions.index import default_home

    mlx = args.backend == "mlx" or (args.backend == "auto" and args.hostfile is not None)
    if not 1 <= args.rank < max(args.stages, 1):
        raise ValueError(f"--rank must be in 1..{args.stages - 1} for --stages {args.stages} "
                         "(rank 0 is `agentfold serve --stages N`)")
    hostfile = args.hostfile or (os.environ.get("MLX_HOSTFILE") if mlx else None)
    if mlx and not hostfile:
        raise ValueError("agentfold stage --backend mlx needs --hostfile FILE (the MLX ring of every rank)")
    if not mlx and not args.master:
        raise ValueError("agentfold stage needs --master ADDR:PORT (torch), or --backend mlx --hostfile FILE")
    stage_dir = args.stage_dir or (Path(args.home).expanduser() if args.home else default_home()) / "stages" / \
        f"rank{args.rank}"
    path = resolve(args.model, args.model_dir)
    if mlx:
        from agentfold.engine.mlx.loader import load_model
        from agentfold.engine.mlx.stage_wire import read_hostfile
        from agentfold.engine.mlx.stage_worker import run_stage as run_mlx_stage

        read_hostfile(hostfile, args.stages)  # a bad hostfile before the model loads
        loaded = load_model(path, args.dtype or "float32", progress)
        why = run_mlx_stage(loaded, args.rank, args.stages, hostfile, stage_dir, quant=args.quant,
                            timeout=args.timeout, say=progress)
    else:
        from agentfold.engine.torch.loader import load_torch_model
        from agentfold.engine.torch.stage_worker import run_stage

        loaded = load_torch_model(path, args.dtype or "auto", args.device, progress)
        why = run_stage(loaded, args.rank, args.stages, args.master, stage_dir, quant=args.quant,
                        timeout=args.timeout, say=progress)
    progress(f"stage {args.rank}: {why}")
    return 0


def run_launched(args: argparse.Namespace) -> int:
    """`serve --backend mlx --stages N` started by `mlx.launch` as rank MLX_RANK >= 1: be that stage."""
    args.rank, args.master, args.stage_dir, args.timeout = launched_rank(args), None, None, 600.0
    progress(f"MLX_RANK={args.rank}: running as stage {args.rank} of {args.stages}, not serving")
    return run(args)
