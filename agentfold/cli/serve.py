"""`agentfold serve`: bind, load one model while answering /health with 503 "loading", then serve it.

The port is bound before the model loads (loading takes seconds to minutes; finding out the port
is taken afterwards wastes them) and that same socket serves the model once it is ready (see
`agentfold.cli.loading`). Loading reports progress on stderr line by line. Every option can also
come from an `AGENTFOLD_<OPTION>` environment variable (`agentfold.cli.env`).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import threading
from typing import Any

from agentfold.cli.args import (
    add_ctx_size_arg,
    add_model_args,
    add_model_dir_arg,
    check_ctx_size,
    drafter_choice,
    progress,
)
from agentfold.cli.env import apply_env_defaults, check_env
from agentfold.cli.stage import add_stage_args, check_stage_args, launched_rank, run_launched, stage_options
from agentfold.serve.limits import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_QUEUE, is_loopback

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8080


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `serve` on the `agentfold` command's subparsers."""
    parser = subparsers.add_parser("serve", help="serve the model over HTTP (OpenAI, Responses, Anthropic APIs)",
                                   description="Serve one local model to coding assistants over HTTP.")
    add_model_args(parser)
    add_model_dir_arg(parser)
    add_ctx_size_arg(parser)
    parser.add_argument("--host", default=DEFAULT_HOST, help=f"address to listen on (default {DEFAULT_HOST})")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT})")
    parser.add_argument("--drafter", default="suffix", choices=["suffix", "draft-model", "none"],
                        help="how drafts are proposed (output is identical either way)")
    parser.add_argument("--draft-model", help="a small model sharing the tokenizer, used as drafter")
    parser.add_argument("--no-draft", action="store_true", help="serial reference decoding only")
    parser.add_argument("--alias", action="append", default=[],
                        help="another name the model answers to in /v1/models (repeatable)")
    parser.add_argument("--max-active", type=int, default=4,
                        help="replies decoded at once, sharing one forward pass each round (lanes; default 4); "
                             "the rest queue")
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
    add_stage_args(parser)
    apply_env_defaults(parser)
    return parser


def bind(host: str, port: int) -> socket.socket:
    """The listening socket the server keeps for its whole life (bound once: no race for the port)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as error:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {error.strerror or error} "
                      "(is another server running? pick another --port)") from error
    return sock


def check_limits(args: argparse.Namespace) -> None:
    """Refuse unsafe or impossible settings before the model loads (one readable line, exit 2)."""
    check_env(args)
    check_stage_args(args)
    if not is_loopback(args.host) and not args.api_key:
        raise ValueError(f"refusing to listen on {args.host} without an API key: anyone on the network could "
                         "use the model and read its sessions; pass --api-key (or set AGENTFOLD_API_KEY), "
                         "or keep the default --host 127.0.0.1")
    checks = [(0 < args.port < 65536, f"--port must be in 1..65535, not {args.port}"),
              (args.max_active >= 1, f"--max-active must be >= 1, not {args.max_active}"),
              (args.max_queue >= 0, f"--max-queue must be >= 0, not {args.max_queue}"),
              (args.max_body_bytes >= 1024, f"--max-body-bytes must be >= 1024, not {args.max_body_bytes}"),
              (0.0 <= args.audit_rate <= 1.0, f"--audit-rate must be in [0, 1], not {args.audit_rate}"),
              (args.default_max_tokens is None or args.default_max_tokens >= 1,
               f"--default-max-tokens must be >= 1, not {args.default_max_tokens}")]
    for ok, message in checks:
        if not ok:
            raise ValueError(message)
    check_ctx_size(args.ctx_size, None, "")  # its lower bound now; the trained context once the model is known


class _LoadInterrupted(Exception):
    """Raised from the progress callback when the server stops while the model loads."""


class ModelLoader(threading.Thread):
    """Loads the model, builds runtime, service and app, and switches the server over to them."""

    def __init__(self, args: argparse.Namespace, path: Any, names: list[str], switching: Any, loading: Any) -> None:
        super().__init__(name="agentfold-load", daemon=True)
        self.args, self.path, self.names = args, path, names
        self.switching, self.loading = switching, loading
        self.stopping = threading.Event()
        self.service: Any = None
        self.error: BaseException | None = None
        self.on_failure = lambda: None  # set by `run`: stop the server

    def say(self, message: str) -> None:
        if self.stopping.is_set():
            raise _LoadInterrupted
        self.loading.stage = message
        progress(message)

    def run(self) -> None:
        try:
            self._load()
        except _LoadInterrupted:
            pass
        except BaseException as error:  # reported by `run` in the main thread (one line, exit 2)
            self.error = error
            self.on_failure()

    def _load(self) -> None:
        self.say(f"loading {self.path}")
        from agentfold.engine.factory import build_engine
        from agentfold.http.app import build_app
        from agentfold.serve.models import short_names, verdict_file
        from agentfold.serve.scheduler import Runtime
        from agentfold.serve.service import Service

        args = self.args
        drafter = drafter_choice(args)
        engine = build_engine(self.path, dtype=args.dtype, drafter=drafter, draft_model=args.draft_model,
                              progress=self.say, backend=args.backend, device=args.device, quant=args.quant,
                              verdicts=verdict_file(), stages=stage_options(args, self.path, args.home))
        self.say("starting the runtime")
        name = engine.backend.loaded.name
        aliases = [n for n in dict.fromkeys([*args.alias, *self.names, *short_names(name)]) if n != name]
        runtime = Runtime(engine, name, aliases=aliases, max_active=args.max_active, max_queue=args.max_queue,
                          context_length=args.ctx_size)
        self.service = Service(runtime, home=args.home, sessions=not args.no_sessions, audit_rate=args.audit_rate)
        app = build_app(self.service, api_key=args.api_key, default_max_tokens=args.default_max_tokens,
                        host=args.host, max_body_bytes=args.max_body_bytes, cors_origins=args.cors_origin)
        keyed, args.api_key = bool(args.api_key), None  # only its hash is kept (serve.auth)
        if not self.switching.switch(app, self.stopping):
            return
        progress(f"sessions and telemetry in {self.service.home}")
        progress(f"serving {name} (context {runtime.context_length}, {engine.exactness.describe()}) "
                 f"on http://{args.host}:{args.port}  names: {', '.join(runtime.model_names)}")
        if keyed:
            progress("API key required on every route but /health")

    def stop(self) -> None:
        """At shutdown, before uvicorn waits for its clients: interrupt the load, or close the runtime so
        the turns decoding end now (the worker checks between prefill layer steps and verify passes)."""
        if self.service is None:
            if self.is_alive() and self.error is None:
                progress("stopping: interrupting the model load")
            self.stopping.set()
            return
        runtime = self.service.runtime
        running, queued = runtime.running(), runtime.waiting
        if running or queued:
            progress(f"stopping: ending {len(running)} running and {queued} queued turns (their clients get 503 "
                     "\"shutting down\"), then writing pending session snapshots")
        # Not turn.cancel(): a cancelled turn ends as TurnCancelled (a 500 to its client), a closed one as 503.
        runtime.close(timeout=0)


def _model_names(args: argparse.Namespace) -> tuple[Any, str, list[str]]:
    """The path to load, its name and its catalogue short names; refuses a --ctx-size past the trained context."""
    from agentfold.serve.models import describe, entry_for, resolve

    path = resolve(args.model, args.model_dir)
    entry = entry_for(path, args.model_dir) or describe(path)
    check_ctx_size(args.ctx_size, entry.context_length, entry.name)
    return path, entry.name, entry.aliases


def run(args: argparse.Namespace) -> int:
    """Bind, serve 503 "loading" while the model loads, then serve it; returns the exit status."""
    import uvicorn

    from agentfold.cli.loading import LoadingApp, SwitchingApp

    if launched_rank(args) >= 1:  # `mlx.launch` started this process as a pipeline stage
        return run_launched(args)
    check_limits(args)
    sock = bind(args.host, args.port)
    try:
        path, name, names = _model_names(args)
    except BaseException:
        sock.close()
        raise
    logging.basicConfig(level=args.log_level.upper(), format="[agentfold] %(levelname)s %(name)s: %(message)s")
    loading = LoadingApp(name)  # its name, not its path: a 503 needs no key, so it must not reveal folders
    switching = SwitchingApp(loading)
    loader = ModelLoader(args, path, names, switching, loading)
    server = _server(uvicorn.Config(switching, log_level=args.log_level, access_log=False,
                                    timeout_graceful_shutdown=5), on_stop=loader.stop)
    loader.on_failure = lambda: setattr(server, "should_exit", True)
    progress(f"listening on http://{args.host}:{args.port} (/health answers 503 until the model is ready)")
    # uvicorn shuts down gracefully on SIGTERM / SIGINT, then re-raises it under the handler found
    # here: the default SIGTERM one would kill the process before the sessions flush and telemetry
    # closes below, and SIGINT may be inherited as ignored (a server started with `&`), which made
    # Ctrl-C's exit status 0 there. Both unwind to 128 + signal.
    signal.signal(signal.SIGTERM, _exit_on_signal)
    signal.signal(signal.SIGINT, _exit_on_signal)
    loader.start()
    try:
        server.run(sockets=[sock])
    finally:
        loader.stopping.set()
        loader.join(30)
        if loader.service is not None:
            progress("stopping: writing pending session snapshots, closing telemetry")
            loader.service.close()
        sock.close()
    if loader.error is not None:
        raise loader.error
    return 0


def _server(config: Any, on_stop: Any) -> Any:
    """uvicorn's Server, calling `on_stop` when shutdown begins (before uvicorn waits for clients)."""
    import uvicorn

    class Server(uvicorn.Server):
        async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
            on_stop()
            await super().shutdown(sockets=sockets)

    return Server(config)


def _exit_on_signal(signum: int, frame: object) -> None:
    """SIGTERM after uvicorn's graceful shutdown: unwind (so `finally` runs), exit 128 + signal."""
    raise SystemExit(128 + signum)
