"""`agentfold mcp`, `agentfold stats` and `agentfold audit`: operating a runtime from the shell.

- `mcp`: the MCP server (agentfold.mcp.server) over stdio, for clients that launch their tools.
  stdout is the wire, so everything else (loading progress, logs) goes to stderr.
- `stats`: recent turns and the latency summary, straight from `<home>/telemetry.sqlite`. It
  never loads a model or MLX, so it answers in a blink next to a running server (WAL lets it
  read while the server writes), and a missing file is reported, not created.
- `audit`: replays stored turns serially (Service.audit_turn) and prints each verdict; the exit
  status is 1 if any reply differs from its serial replay. Turn ids are checked before the model
  loads, so a typo costs nothing.

`add_parsers(subparsers)` registers the three commands on the `agentfold` parser and
`run(args)` runs the one chosen; `python -m agentfold.cli.ops` works on its own too.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from agentfold.cli.args import MODEL_HELP, progress

COMMANDS = ("mcp", "stats", "audit")  # what run() handles: cli.main can route these names to it
DTYPES = ["float32", "bfloat16", "float16", "keep"]


class OpsError(Exception):
    """A user-fixable problem (unknown turn, nothing to audit): one line on stderr, exit status 2."""


def _home(args: argparse.Namespace) -> Path:
    from agentfold.sessions.index import default_home  # SQLite only: no MLX, no engine

    return Path(args.home).expanduser() if getattr(args, "home", None) else default_home()


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help=MODEL_HELP)
    parser.add_argument("--dtype", default="float32", choices=DTYPES,
                        help="weights dtype after loading (use the one the server used)")
    parser.add_argument("--home", default=None,
                        help="sessions, snapshots and telemetry (default $AGENTFOLD_HOME or ~/.local/share/agentfold)")


def add_parsers(subparsers: Any) -> None:
    """Register `mcp`, `stats` and `audit` on the `agentfold` command's subparsers."""
    mcp = subparsers.add_parser("mcp", help="serve the MCP tools over stdio (for clients that launch them)",
                                description="Serve generation, exactness checks, audits, telemetry and "
                                            "sessions as MCP tools over stdio. Logs go to stderr.")
    _add_model_args(mcp)
    mcp.add_argument("--drafter", default="suffix", choices=["suffix", "draft-model", "none"],
                     help="how drafts are proposed (replies are identical either way)")
    mcp.add_argument("--draft-model", help="a small model sharing the tokenizer, used as drafter")
    mcp.add_argument("--no-sessions", action="store_true", help="do not keep KV snapshots (prefill every turn)")
    mcp.add_argument("--audit-rate", type=float, default=0.0,
                     help="share of drafted turns replayed serially after the reply (0..1)")
    mcp.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])

    stats = subparsers.add_parser("stats", help="recent turns and latency summary from the telemetry store",
                                  description="Recent turns and the latency summary from <home>/telemetry.sqlite "
                                              "(no model is loaded).")
    stats.add_argument("--home", default=None,
                       help="runtime home (default $AGENTFOLD_HOME or ~/.local/share/agentfold)")
    stats.add_argument("--session", help="only this session's turns")
    stats.add_argument("--last", type=int, default=20, help="how many recent turns (default 20)")
    stats.add_argument("--json", action="store_true", help="print JSON instead of a table")

    audit = subparsers.add_parser("audit", help="replay stored turns serially and compare their tokens",
                                  description="Replay stored turns serially (no drafts, empty cache) and compare "
                                              "token ids with what was sent. Exit status 1 if any differs.")
    audit.add_argument("turn_ids", nargs="*", metavar="TURN_ID", help="turns to audit")
    audit.add_argument("--session", help="audit every stored turn of this session")
    _add_model_args(audit)
    audit.add_argument("--json", action="store_true", help="print the verdicts as JSON")


def run(args: argparse.Namespace) -> int:
    """Run the chosen command; returns the exit status (user errors: one line on stderr, 2)."""
    handlers = {"mcp": run_mcp, "stats": run_stats, "audit": run_audit}
    try:
        return handlers[args.command](args)
    except OpsError as error:
        print(f"agentfold {args.command}: error: {error}", file=sys.stderr)
        return 2


# ---------------------------------------------------------------------------------------------
# Loading (one place, so tests can hand in an engine they already have)
# ---------------------------------------------------------------------------------------------

def load_engine(model: str | None, dtype: str = "float32", drafter: str = "suffix",
                draft_model: str | None = None) -> Any:
    """Build the engine for `--model` (progress on stderr; nothing on stdout, which may be the MCP wire)."""
    from agentfold.engine.factory import build_engine
    from agentfold.serve.models import resolve

    path = resolve(model)
    progress(f"loading {path}")
    with contextlib.redirect_stdout(sys.stderr):
        return build_engine(path, dtype=dtype, drafter=drafter, draft_model=draft_model, progress=progress)


def _service(engine: Any, home: Path, sessions: bool = True, audit_rate: float = 0.0) -> Any:
    from agentfold.serve.scheduler import Runtime
    from agentfold.serve.service import Service

    runtime = Runtime(engine, engine.backend.loaded.name)
    try:
        return Service(runtime, home=home, sessions=sessions, audit_rate=audit_rate)
    except BaseException:
        runtime.close()
        raise


# ---------------------------------------------------------------------------------------------
# mcp
# ---------------------------------------------------------------------------------------------

def run_mcp(args: argparse.Namespace) -> int:
    """Load the model and serve the MCP tools over stdio until the client closes the pipe."""
    if not 0.0 <= args.audit_rate <= 1.0:
        raise OpsError(f"--audit-rate must be in [0, 1], not {args.audit_rate}")
    # stderr only, configured before the SDK's own logging setup (which then leaves it alone)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="[agentfold] %(levelname)s %(name)s: %(message)s")
    from agentfold.mcp.server import build_mcp

    drafter = "draft-model" if args.draft_model else args.drafter
    engine = load_engine(args.model, args.dtype, drafter, args.draft_model)
    service = _service(engine, _home(args), sessions=not args.no_sessions, audit_rate=args.audit_rate)
    progress(f"serving {service.runtime.model_id} over MCP stdio ({engine.exactness.describe()}); "
         f"sessions and telemetry in {service.home}")
    try:
        build_mcp(service).run("stdio")
    finally:
        service.close()
    return 0


# ---------------------------------------------------------------------------------------------
# stats
# ---------------------------------------------------------------------------------------------

TABLE = [  # (header, width, right-aligned, row -> text)
    ("started", 19, False, lambda r: time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r["started_at"]))),
    ("turn", 21, False, lambda r: r["turn_id"][:21]),
    ("session", 12, False, lambda r: (r["session_id"] or "-")[:12]),
    ("api", 9, False, lambda r: r["api"]),
    ("prompt", 6, True, lambda r: str(r["prompt_tokens"])),
    ("cached", 6, True, lambda r: str(r["cached_tokens"])),
    ("reply", 5, True, lambda r: str(r["completion_tokens"])),
    ("ttft_ms", 8, True, lambda r: f"{r['ttft_ms']:.1f}"),
    ("tok/s", 7, True, lambda r: f"{r['decode_tps']:.1f}"),
    ("tok/pass", 8, True, lambda r: f"{r['tokens_per_pass']:.2f}"),
    ("accept", 6, True, lambda r: f"{r['acceptance_rate']:.2f}" if r["drafted"] else "-"),
    ("finish", 10, False, lambda r: r["finish_reason"] if r["status"] == "ok" else r["status"]),
    ("audit", 7, False, lambda r: r["audit"] + (f"@{r['mismatch_position']}" if r["audit"] == "failed" else "")),
]


def _cells(values: list[str]) -> str:
    return "  ".join(v.rjust(w) if right else v.ljust(w) for v, (_, w, right, _) in zip(values, TABLE, strict=True)).rstrip()


def _fmt(value: Any, digits: int = 1) -> str:
    if value is None:
        return "-"
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def format_stats(rows: list[dict[str, Any]], summary: dict[str, Any], session: str | None = None) -> str:
    """The `stats` table: one line per turn (oldest first), then the latency summary."""
    lines = []
    if rows:
        lines.append(_cells([header for header, *_ in TABLE]))
        lines += [_cells([cell(row) for *_, cell in TABLE]) for row in reversed(rows)]
    else:
        lines.append("no turns" + (f" in session {session}" if session else ""))
    scope = f"last {summary['last_n']} turns" if summary.get("last_n") else "all turns"
    lines += [
        "",
        f"summary over {scope} of all sessions: {summary['turns']} turns, {summary['errors']} errors",
        f"  ttft ms   p50 {_fmt(summary['ttft_p50'])}  p90 {_fmt(summary['ttft_p90'])}  p99 {_fmt(summary['ttft_p99'])}",
        f"  itl ms    p50 {_fmt(summary['itl_p50'], 2)}  p90 {_fmt(summary['itl_p90'], 2)}  "
        f"p99 {_fmt(summary['itl_p99'], 2)}",
        f"  decode    {_fmt(summary['decode_tps'])} tok/s, {_fmt(summary['tokens_per_pass'], 2)} tokens/pass, "
        f"acceptance {_fmt(summary['acceptance_rate'], 2)}, cache hit share {_fmt(summary['cache_hit_share'], 2)}",
        f"  audits    {summary['audits_passed']} passed, {summary['audits_failed']} failed",
    ]
    return "\n".join(lines)


def run_stats(args: argparse.Namespace) -> int:
    """Print recent turns and the latency summary; reads SQLite only (no MLX)."""
    if args.last < 1:
        raise OpsError(f"--last must be >= 1, not {args.last}")
    path = _home(args) / "telemetry.sqlite"
    if not path.is_file():
        if args.json:
            print(json.dumps({"telemetry": str(path), "turns": [], "summary": None}))
        else:
            print(f"no telemetry at {path} (nothing served with this home yet)")
        return 0
    from agentfold.serve.telemetry import TelemetryStore

    store = TelemetryStore(path)
    try:
        rows = store.list_turns(session_id=args.session, limit=args.last)
        summary = store.latency_summary(last_n=args.last)
    finally:
        store.close()
    rows = [{k: v for k, v in r.items() if k not in ("inputs", "emit_ms")} for r in rows]
    if args.json:
        print(json.dumps({"telemetry": str(path), "turns": rows, "summary": summary}))
    else:
        print(format_stats(rows, summary, args.session))
    return 0


# ---------------------------------------------------------------------------------------------
# audit
# ---------------------------------------------------------------------------------------------

def _turns_to_audit(path: Path, turn_ids: Sequence[str], session: str | None) -> list[dict[str, Any]]:
    """The stored rows to replay, oldest first; every id must exist and hold replay inputs."""
    if not path.is_file():
        raise OpsError(f"no telemetry at {path}")
    from agentfold.serve.telemetry import TelemetryStore

    store = TelemetryStore(path)
    try:
        rows = []
        for turn_id in turn_ids:
            row = store.get_turn(turn_id)
            if row is None:
                raise OpsError(f"no turn {turn_id!r} in {path}")
            rows.append(row)
        if session is not None:
            found = store.list_turns(session_id=session, limit=1_000_000)
            if not found:
                raise OpsError(f"no turns of session {session!r} in {path}")
            rows += sorted(found, key=lambda r: r["started_at"])
    finally:
        store.close()
    missing = [r["turn_id"] for r in rows if not (r.get("inputs") or {}).get("prompt")]
    if missing:
        raise OpsError(f"no stored inputs to replay for {', '.join(missing)}")
    return list({r["turn_id"]: r for r in rows}.values())


def run_audit(args: argparse.Namespace) -> int:
    """Replay the chosen turns serially, print a verdict per turn; 1 if any failed."""
    if not args.turn_ids and not args.session:
        raise OpsError("name turns to audit (TURN_ID ...) or a session (--session ID)")
    home = _home(args)
    rows = _turns_to_audit(home / "telemetry.sqlite", args.turn_ids, args.session)
    engine = load_engine(args.model, args.dtype, drafter="none")  # the replay is serial: no drafter needed
    service = _service(engine, home, sessions=False)
    try:
        loaded = service.runtime.model_id
        for model in sorted({r["model"] for r in rows} - {loaded}):
            progress(f"warning: some turns were served by {model!r}, but {loaded!r} is loaded; "
                 "a different model or dtype gives different tokens")
        verdicts = asyncio.run(_audit_all(service, [r["turn_id"] for r in rows]))
    finally:
        service.close()
    failed = [v for v in verdicts if v["verdict"] != "passed"]
    if args.json:
        print(json.dumps(verdicts))
    else:
        for v in verdicts:
            where = "" if v["mismatch_position"] is None else f" (first difference at token {v['mismatch_position']})"
            print(f"{v['turn_id']}  {v['verdict']}{where}")
        print(f"{len(verdicts) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed else 0


async def _audit_all(service: Any, turn_ids: Sequence[str]) -> list[dict[str, Any]]:
    """One replay at a time: audits compete with nothing and report in order."""
    return [await service.audit_turn(turn_id) for turn_id in turn_ids]


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m agentfold.cli.ops COMMAND ...` (the same commands as `agentfold COMMAND`)."""
    parser = argparse.ArgumentParser(prog="agentfold")
    add_parsers(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    try:
        return run(args)
    except KeyboardInterrupt:
        return 130
    except (ValueError, OSError) as error:
        print(f"agentfold {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
