"""`agentfold serve` argument handling (the parts that run before any model loads)."""

from __future__ import annotations

import argparse
import socket

import pytest

from agentfold.cli.serve import add_parser, run
from agentfold.serve.models import short_names


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="agentfold")
    add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["serve", *argv])


def test_defaults_are_loopback_8080():
    args = parse()
    assert (args.host, args.port, args.drafter, args.no_draft, args.max_active) == ("127.0.0.1", 8080, "suffix",
                                                                                     False, 4)
    assert parse("--no-draft", "--port", "9000").no_draft


def test_short_aliases():
    assert short_names("SmolLM2-135M-Instruct.Q4_1") == ["smollm2-135m-instruct", "smollm2-135m-instruct.q4_1"]
    assert short_names("qwen2.5-coder") == []


def test_busy_port_fails_before_loading():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(OSError, match=f"127.0.0.1:{port}"):
            run(parse("--port", str(port), "--model", "/nonexistent/model.gguf"))
    with pytest.raises(ValueError, match="--port"):
        run(parse("--port", "0"))


def test_stage_args_for_mlx(tmp_path, monkeypatch):
    """`--stages N` on MLX: a hostfile (not --stage-master); `mlx.launch`'s MLX_RANK makes a stage."""
    from agentfold.cli.stage import check_stage_args, launched_rank, stage_options

    monkeypatch.delenv("MLX_RANK", raising=False)
    monkeypatch.delenv("MLX_HOSTFILE", raising=False)
    hostfile = tmp_path / "hosts.json"
    options = stage_options(parse("--backend", "mlx", "--stages", "2", "--no-spawn", "--hostfile", str(hostfile)),
                            tmp_path / "model", tmp_path)
    assert (options.backend, options.stages, options.hostfile) == ("mlx", 2, str(hostfile))
    for argv, message in ((("--backend", "mlx", "--stages", "2", "--no-spawn"), "needs --hostfile"),
                          (("--backend", "mlx", "--stages", "2", "--stage-master", "h:1"), "--hostfile"),
                          (("--backend", "torch", "--stages", "2", "--hostfile", "f"), "--backend mlx"),
                          (("--hostfile", "f",), "need --stages N")):
        with pytest.raises(ValueError, match=message):
            check_stage_args(parse(*argv))
    args = parse("--backend", "mlx", "--stages", "2")
    assert launched_rank(args) == 0
    monkeypatch.setenv("MLX_RANK", "1")
    assert launched_rank(args) == 1 and launched_rank(parse("--stages", "2")) == 0
    monkeypatch.setenv("MLX_RANK", "5")
    with pytest.raises(ValueError, match="not a rank of --stages 2"):
        launched_rank(args)
