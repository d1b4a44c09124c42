"""`agentfold serve`: load one model, then serve it over HTTP until interrupted.

The port is checked before the model loads (loading takes seconds to minutes; finding out the
port is taken afterwards wastes them), and loading reports progress on stderr line by line.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import signal
import socket
from typing import Any

from agentfold.cli.args import add_model_args, progress
from agentfold.serve.limits import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_QUEUE, is_loopback

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8080


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `serve` on the `agentfold` command's subparsers."""
    parser = subparsers.add_parser("serve", help="serve the model over HTTP (OpenAI, Responses, Anthropic APIs)",
                                   description="Serve one local model to coding assistants over HTTP.")
    add_model_args(parser)
    parser.add_argument("--host", default=DEFAULT_HOST, help=f"address to listen on (default {DEFAULT_HOST})")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT})")
    parser.add_argument("--drafter", default="suffix", choices=["suffix", "draft-model", "none"],
                        help="how drafts are proposed (output is identical either way)")
    parser.add_argument("--draft-model", help="a small model sharing the tokenizer, used as drafter")
    parser.add_argument("--no-draft", action="store_true", help="serial reference decoding only")
    parser.add_argument("--alias", action="append", default=[],
                        help="another name the model answers to in /v1/models (repeatable)")
    parser.add_argument("--max-active", type=int, default=4,
                        help="replies decoded at once, interleaved pass by pass (default 4); the rest queue")
    parser.add_argument("--default-max-tokens", type=int, default=None,
                        help="reply budget when a request names none (default: the rest of the context)")
    parser.add_argument("--api-key", default=os.environ.get("AGENTFOLD_API_KEY"),
                        help="require this key (x-api-key or Bearer) on every route but /health; "
                             "default $AGENTFOLD_API_KEY (keeps it off the command line), else none")
    parser.add_argument("--max-queue", type=int, default=DEFAULT_MAX_QUEUE,
                        help=f"requests waiting beyond --max-active before new ones get 429 + Retry-After "
                             f"(default {DEFAULT_MAX_QUEUE})")
    parser.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                        help=f"largest request body accepted; larger ones get 413 (default {DEFAULT_MAX_BODY_BYTES})")
    parser.add_argument("--cors-origin", action="append", default=[],
                        help="allow browser requests from this origin (repeatable; default: none, CORS off)")
    parser.add_argument("--home", default=None,
                        help="sessions, snapshots and telemetry (default $AGENTFOLD_HOME or ~/.local/share/agentfold)")
    parser.add_argument("--no-sessions", action="store_true", help="do not keep KV snapshots (prefill every turn)")
    parser.add_argument("--audit-rate", type=float, default=0.0,
                        help="share of drafted turns replayed serially after the reply to check exactness (0..1)")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return parser


def default_aliases(name: str) -> list[str]:
    """Short names for a checkpoint: `SmolLM2-135M-Instruct.Q4_1` -> `smollm2-135m-instruct`."""
    stem = re.sub(r"[.-](q\d.*|f16|f32|bf16|gguf)$", "", name, flags=re.IGNORECASE)
    aliases = [stem.lower(), name.lower()]
    return [a for i, a in enumerate(aliases) if a and a != name and a not in aliases[:i]]


def _check_port(host: str, port: int) -> None:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as error:
            raise OSError(f"cannot listen on {host}:{port}: {error.strerror or error} "
                          "(is another server running? pick another --port)") from error


def check_limits(args: argparse.Namespace) -> None:
    """Refuse unsafe or impossible settings before the model loads (one readable line, exit 2)."""
    if not is_loopback(args.host) and not args.api_key:
        raise ValueError(f"refusing to listen on {args.host} without an API key: anyone on the network could "
                         "use the model and read its sessions; pass --api-key (or set AGENTFOLD_API_KEY), "
                         "or keep the default --host 127.0.0.1")
    if args.max_queue < 0:
        raise ValueError(f"--max-queue must be >= 0, not {args.max_queue}")
    if args.max_body_bytes < 1024:
        raise ValueError(f"--max-body-bytes must be >= 1024, not {args.max_body_bytes}")


def run(args: argparse.Namespace) -> int:
    """Load, build the runtime and serve; returns the exit status."""
    import uvicorn

    from agentfold.engine.factory import build_engine
    from agentfold.http.app import build_app
    from agentfold.serve.models import resolve, verdict_file
    from agentfold.serve.scheduler import Runtime
    from agentfold.serve.service import Service

    if not 0 < args.port < 65536:
        raise ValueError(f"--port must be in 1..65535, not {args.port}")
    if args.max_active < 1:
        raise ValueError(f"--max-active must be >= 1, not {args.max_active}")
    check_limits(args)
    if not 0.0 <= args.audit_rate <= 1.0:
        raise ValueError(f"--audit-rate must be in [0, 1], not {args.audit_rate}")
    if args.default_max_tokens is not None and args.default_max_tokens < 1:
        raise ValueError(f"--default-max-tokens must be >= 1, not {args.default_max_tokens}")
    _check_port(args.host, args.port)
    logging.basicConfig(level=args.log_level.upper(), format="[agentfold] %(levelname)s %(name)s: %(message)s")

    path = resolve(args.model)
    drafter = "none" if args.no_draft else ("draft-model" if args.draft_model else args.drafter)
    progress(f"loading {path}")
    engine = build_engine(path, dtype=args.dtype, drafter=drafter, draft_model=args.draft_model,
                          progress=progress, backend=args.backend, device=args.device, quant=args.quant,
                          verdicts=verdict_file())
    name = engine.backend.loaded.name
    runtime = Runtime(engine, name, aliases=[*args.alias, *default_aliases(name)], max_active=args.max_active,
                      max_queue=args.max_queue)
    service = Service(runtime, home=args.home, sessions=not args.no_sessions, audit_rate=args.audit_rate)
    app = build_app(service, api_key=args.api_key, default_max_tokens=args.default_max_tokens, host=args.host,
                    max_body_bytes=args.max_body_bytes, cors_origins=args.cors_origin)
    keyed, args.api_key = bool(args.api_key), None  # only its hash is kept (serve.auth)
    progress(f"sessions and telemetry in {service.home}")
    progress(f"serving {name} (context {runtime.context_length}, {engine.exactness.describe()}) "
              f"on http://{args.host}:{args.port}  names: {', '.join(runtime.model_names)}")
    if keyed:
        progress("API key required on every route but /health")
    # uvicorn shuts down gracefully on SIGTERM, then re-raises it under the handler found here: the
    # default one would kill the process before the sessions flush and telemetry closes below.
    signal.signal(signal.SIGTERM, _exit_on_signal)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False,
                    timeout_graceful_shutdown=5)
    finally:
        progress("stopping: writing pending session snapshots, closing telemetry")
        service.close()
    return 0


def _exit_on_signal(signum: int, frame: object) -> None:
    """SIGTERM after uvicorn's graceful shutdown: unwind (so `finally` runs), exit 128 + signal."""
    raise SystemExit(128 + signum)
