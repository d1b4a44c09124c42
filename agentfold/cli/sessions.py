"""`agentfold sessions`: list, inspect, fork, pin and delete stored sessions without a model.

These commands only touch the session home's SQLite index (`index.db`) and its snapshot files,
through `agentfold.sessions.index.SessionIndex`: the same class the server's `SessionManager`
uses, which imports no MLX, mlx-lm or engine code, so they start in a blink and never load
weights. It is safe next to a running server: the index is in WAL mode, writes are short
transactions, and a server that finds a snapshot file gone drops it and prefills instead.

A missing home or index is an empty one: nothing here creates files just by looking. The index
module is imported when a command runs, not when `agentfold` builds its parser.
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from agentfold.sessions.index import SessionIndex


# --- formatting ---------------------------------------------------------------------------------


def _size(n: int | None) -> str:
    if n is None:
        return "-"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _when(stamp: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(stamp)) if stamp else "-"


def _iso(stamp: float | None) -> str | None:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(stamp)) if stamp else None


def _title(text: str | None, width: int = 40) -> str:
    flat = " ".join((text or "").split())
    return flat if len(flat) <= width else flat[: width - 1] + "…"


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]], right: Sequence[int] = ()) -> str:
    cells = [list(map(str, header))] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = []
    for row in cells:
        parts = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))]
        lines.append("  ".join(parts).rstrip())
    return "\n".join(lines)


def _session_json(row: dict[str, Any]) -> dict[str, Any]:
    return {"id": row["id"], "title": row["title"], "turns": row["turns"], "bytes": row["bytes"],
            "created": row["created"], "last_used": row["last_used"], "last_used_iso": _iso(row["last_used"]),
            "pinned": bool(row["pinned"]), "parent": row["parent"]}


def _snapshot_json(row: dict[str, Any]) -> dict[str, Any]:
    return {"id": row["id"], "tokens": row["token_count"], "bytes": row["bytes"], "hits": row["hits"],
            "pinned": bool(row["pinned"]), "created": row["created"], "last_used": row["last_used"],
            "last_used_iso": _iso(row["last_used"]), "parent": row["parent"], "key": row["key"], "file": row["file"],
            "sessions": row["sessions"], "turns": row["turns"]}


# --- commands -----------------------------------------------------------------------------------


def _emit(args: argparse.Namespace, data: Any, text: str) -> None:
    print(json.dumps(data, indent=2) if args.json else text)


def _cmd_list(index: SessionIndex, args: argparse.Namespace) -> int:
    rows = index.list_sessions()
    text = _table(["ID", "TITLE", "TURNS", "BYTES", "LAST USED", "PINNED"],
                  [[r["id"], _title(r["title"]), r["turns"], _size(r["bytes"]), _when(r["last_used"]),
                    "yes" if r["pinned"] else ""] for r in rows], right=(2, 3))
    _emit(args, [_session_json(r) for r in rows], text if rows else f"no sessions in {index.home}")
    return 0


def _cmd_show(index: SessionIndex, args: argparse.Namespace) -> int:
    session = index.session(index.resolve(args.id))
    turns = index.turns_with_snapshots(session["id"])
    head = [("session", session["id"]), ("title", _title(session["title"], 100)),
            ("created", _when(session["created"])), ("last used", _when(session["last_used"])),
            ("pinned", "yes" if session["pinned"] else "no"), ("parent", session["parent"] or "-"),
            ("turns", session["turns"]), ("bytes", _size(session["bytes"]))]
    text = "\n".join(f"{k:<10} {v}" for k, v in head)
    if turns:
        text += "\n\n" + _table(
            ["TURN", "PROMPT", "REPLY", "SNAPSHOT", "TOKENS", "BYTES", "CREATED"],
            [[t["index"], t["prompt_tokens"], t["reply_tokens"], t["snapshot_id"] or "-",
              t["snapshot_tokens"] if t["snapshot_tokens"] is not None else "-", _size(t["snapshot_bytes"]),
              _when(t["created"])] for t in turns], right=(0, 1, 2, 4, 5))
    data = {**_session_json(session),
            "turn_list": [{"index": t["index"], "prompt_tokens": t["prompt_tokens"], "reply_tokens": t["reply_tokens"],
                           "snapshot_id": t["snapshot_id"], "snapshot_tokens": t["snapshot_tokens"],
                           "snapshot_bytes": t["snapshot_bytes"], "created": t["created"]} for t in turns]}
    _emit(args, data, text)
    return 0


def _cmd_fork(index: SessionIndex, args: argparse.Namespace) -> int:
    source = index.resolve(args.id)
    forked = index.fork(source, args.turn)
    _emit(args, {"id": forked, "parent": source, "turns": args.turn + 1}, forked)
    return 0


def _cmd_pin(index: SessionIndex, args: argparse.Namespace) -> int:
    session_id = index.resolve(args.id)
    pinned = args.sessions_command == "pin"
    index.pin(session_id, pinned)
    _emit(args, {"id": session_id, "pinned": pinned}, f"{'pinned' if pinned else 'unpinned'} {session_id}")
    return 0


def _cmd_delete(index: SessionIndex, args: argparse.Namespace) -> int:
    session_id = index.resolve(args.id)
    removed = index.delete(session_id)
    freed = sum(r["bytes"] for r in removed)
    _emit(args, {"id": session_id, "removed_snapshots": [r["id"] for r in removed], "freed_bytes": freed},
          f"deleted {session_id} ({len(removed)} snapshot{'s' if len(removed) != 1 else ''} removed, {_size(freed)})")
    return 0


def _cmd_snapshots(index: SessionIndex, args: argparse.Namespace) -> int:
    rows = index.list_snapshots()
    text = _table(["ID", "TOKENS", "BYTES", "HITS", "SESSIONS", "PINNED", "LAST USED"],
                  [[r["id"], r["token_count"], _size(r["bytes"]), r["hits"], r["sessions"], "yes" if r["pinned"] else "",
                    _when(r["last_used"])] for r in rows], right=(1, 2, 3, 4))
    if rows:
        text += f"\n{len(rows)} snapshots, {_size(sum(r['bytes'] for r in rows))}"
    _emit(args, [_snapshot_json(r) for r in rows], text if rows else f"no snapshots in {index.home}")
    return 0


COMMANDS = {"list": _cmd_list, "show": _cmd_show, "fork": _cmd_fork, "pin": _cmd_pin, "unpin": _cmd_pin,
            "delete": _cmd_delete, "snapshots": _cmd_snapshots}


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add `sessions` and its subcommands to the `agentfold` command's subparsers."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--home", help="sessions home (default: $AGENTFOLD_HOME or ~/.local/share/agentfold)")
    common.add_argument("--json", action="store_true", help="print JSON")
    parser = subparsers.add_parser("sessions", help="list, show, fork, pin and delete stored sessions (no model)")
    sub = parser.add_subparsers(dest="sessions_command", required=True)
    sub.add_parser("list", parents=[common], help="sessions, most recently used first")
    sub.add_parser("show", parents=[common], help="one session and its turns").add_argument("id")
    fork = sub.add_parser("fork", parents=[common], help="a new session holding turns 0..K of ID")
    fork.add_argument("id")
    fork.add_argument("--turn", type=int, required=True, help="last turn (0-based) the fork keeps")
    sub.add_parser("pin", parents=[common], help="never evict this session's snapshots").add_argument("id")
    sub.add_parser("unpin", parents=[common], help="let this session's snapshots be evicted").add_argument("id")
    sub.add_parser("delete", parents=[common],
                   help="delete a session and the snapshots no other session uses").add_argument("id")
    sub.add_parser("snapshots", parents=[common], help="stored snapshots, most recently used first")
    return parser


def run(args: argparse.Namespace) -> int:
    """Run one `agentfold sessions` subcommand; user errors are one line on stderr and exit 1."""
    from agentfold.sessions.index import SessionIndex, SessionsError

    index = SessionIndex(args.home, create=False)
    try:
        return COMMANDS[args.sessions_command](index, args)
    except SessionsError as error:
        print(f"agentfold sessions: error: {error}", file=sys.stderr)
        return 1
    except sqlite3.Error as error:
        print(f"agentfold sessions: error: {index.db_path}: {error}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # `agentfold sessions list | head`: the reader left, nothing to report
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    finally:
        index.close()


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m agentfold.cli.sessions list ...`: the same commands without the rest of the CLI."""
    parser = argparse.ArgumentParser(prog="agentfold")
    add_parser(parser.add_subparsers(dest="command", required=True))
    return run(parser.parse_args(["sessions", *(sys.argv[1:] if argv is None else argv)]))


if __name__ == "__main__":
    sys.exit(main())
