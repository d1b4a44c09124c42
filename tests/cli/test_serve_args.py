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
