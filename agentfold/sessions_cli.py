"""`agentfold sessions`: list, inspect, fork, pin and delete stored sessions without a model.

These commands only touch the session home's SQLite index (`index.db`) and its snapshot files,
so they must start in a blink and never load weights. `agentfold.sessions` cannot be imported
for that: its store imports MLX and mlx-lm (seconds of start-up), and `SessionManager` needs an
engine for its snapshot key. `SessionIndex` below therefore works on the same tables with the
standard library alone, and mirrors `SessionManager.fork` / `pin` / `delete` / `list_sessions`
statement for statement (tests/test_sessions_cli.py checks it against them on the same home).
It is safe next to a running server: the index is in WAL mode, writes are short transactions,
and a server that finds a snapshot file gone drops it and prefills instead.

A missing home or index is an empty one: nothing here creates files just by looking.
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import sys
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any


class SessionsError(Exception):
    """A user-fixable problem (unknown id, no such turn); reported as one line, exit status 1."""


def default_home() -> Path:
    """The sessions home the runtime uses (the same rule as `agentfold.sessions.store.default_home`)."""
    return Path(os.environ.get("AGENTFOLD_HOME") or "~/.local/share/agentfold").expanduser()


class SessionIndex:
    """The index half of `SessionManager`, on SQLite only (no MLX, no engine)."""

    def __init__(self, home: str | Path | None = None) -> None:
        self.home = Path(home).expanduser() if home is not None else default_home()
        self.db_path = self.home / "index.db"
        self.dir = self.home / "snapshots"
        self._conn: sqlite3.Connection | None = None

    @property
    def exists(self) -> bool:
        return self.db_path.is_file()

    def _db(self) -> sqlite3.Connection:
        if self._conn is None:
            # mode=rw: never create an index where there is none
            conn = sqlite3.connect(self.db_path.resolve().as_uri() + "?mode=rw", uri=True, timeout=30)
            conn.row_factory = sqlite3.Row
            conn.execute("PRAGMA busy_timeout = 30000")
            self._conn = conn
        return self._conn

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def rows(self, sql: str, params: Sequence[Any] = ()) -> list[dict[str, Any]]:
        if not self.exists:
            return []
        return [dict(row) for row in self._db().execute(sql, list(params))]

    # --- reading ---

    def list_sessions(self) -> list[dict[str, Any]]:
        """Sessions, most recently used first, with turn count and snapshot bytes (as the manager's)."""
        return self.rows(
            "select s.*, count(t.id) as turns, coalesce(sum(n.bytes), 0) as bytes from sessions s "
            "left join turns t on t.session_id = s.id left join snapshots n on n.id = t.snapshot_id "
            "group by s.id order by s.last_used desc")

    def list_snapshots(self) -> list[dict[str, Any]]:
        """Snapshots, most recently used first, with how many sessions and turns name each."""
        return self.rows(
            "select n.*, count(distinct t.session_id) as sessions, count(t.id) as turns from snapshots n "
            "left join turns t on t.snapshot_id = n.id group by n.id order by n.last_used desc")

    def resolve(self, session_id: str) -> str:
        """The full id of a session given its id or a unique prefix of it."""
        if not session_id:
            raise SessionsError("a session id is required")
        exact = self.rows("select id from sessions where id = ?", [session_id])
        if exact:
            return exact[0]["id"]
        escaped = session_id.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
        found = self.rows("select id from sessions where id like ? escape '\\'", [escaped + "%"])
        if not found:
            raise SessionsError(f"no session {session_id!r} in {self.home}")
        if len(found) > 1:
            raise SessionsError(f"{session_id!r} matches {len(found)} sessions in {self.home}; give more of the id")
        return found[0]["id"]

    def session(self, session_id: str) -> dict[str, Any]:
        found = [s for s in self.list_sessions() if s["id"] == session_id]
        if not found:
            raise SessionsError(f"no session {session_id!r} in {self.home}")
        return found[0]

    def turns(self, session_id: str) -> list[dict[str, Any]]:
        return self.rows("select * from turns where session_id = ? order by [index]", [session_id])

    def turns_with_snapshots(self, session_id: str) -> list[dict[str, Any]]:
        """Turns with their snapshot's token count, bytes and pin (None where it is gone)."""
        return self.rows(
            "select t.*, n.token_count as snapshot_tokens, n.bytes as snapshot_bytes, n.pinned as snapshot_pinned "
            "from turns t left join snapshots n on n.id = t.snapshot_id where t.session_id = ? order by t.[index]",
            [session_id])

    # --- writing (SessionManager's semantics) ---

    def fork(self, session_id: str, turn: int) -> str:
        """A new session holding turns 0..`turn` of `session_id`; both share those snapshots."""
        kept = [t for t in self.turns(session_id) if t["index"] <= turn]
        if not kept or kept[-1]["index"] != turn:
            raise SessionsError(f"session {session_id} has no turn {turn}")
        title = self.rows("select title from sessions where id = ?", [session_id])[0]["title"]
        forked = uuid.uuid4().hex
        now = time.time()
        db = self._db()
        with db:
            db.execute("insert into sessions (id, created, last_used, pinned, parent, title) values (?, ?, ?, 0, ?, ?)",
                       [forked, now, now, session_id, title])
            for row in kept:
                row = {**row, "id": uuid.uuid4().hex, "session_id": forked}
                columns = ", ".join(f'"{c}"' for c in row)
                db.execute(f"insert into turns ({columns}) values ({', '.join('?' * len(row))})", list(row.values()))
        return forked

    def pin(self, session_id: str, pinned: bool = True) -> None:
        """A pinned session's snapshots are never evicted."""
        db = self._db()
        with db:
            db.execute("update sessions set pinned = ? where id = ?", [int(pinned), session_id])

    def delete(self, session_id: str) -> list[dict[str, Any]]:
        """Delete a session and its turns, and the snapshots no other turn uses (not pinned ones).

        Returns the removed snapshots' rows.
        """
        named = {t["snapshot_id"] for t in self.turns(session_id)} - {None}
        db = self._db()
        with db:
            db.execute("delete from turns where session_id = ?", [session_id])
            db.execute("delete from sessions where id = ?", [session_id])
        removed = []
        for snapshot_id in sorted(named):
            found = self.rows("select * from snapshots where id = ?", [snapshot_id])
            shared = self.rows("select 1 from turns where snapshot_id = ? limit 1", [snapshot_id])
            if found and not shared and not found[0]["pinned"]:
                self._remove(found[0])
                removed.append(found[0])
        return removed

    def _remove(self, row: dict[str, Any]) -> None:
        """Row first, then file (as `SnapshotStore.remove`): a row never names a missing file for long."""
        db = self._db()
        with db:
            db.execute("delete from snapshots where id = ?", [row["id"]])
            db.execute("update turns set snapshot_id = null where snapshot_id = ?", [row["id"]])
        (self.dir / row["file"]).unlink(missing_ok=True)


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
    index = SessionIndex(args.home)
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
    """`python -m agentfold.sessions_cli list ...`: the same commands without the rest of the CLI."""
    parser = argparse.ArgumentParser(prog="agentfold")
    add_parser(parser.add_subparsers(dest="command", required=True))
    return run(parser.parse_args(["sessions", *(sys.argv[1:] if argv is None else argv)]))


if __name__ == "__main__":
    sys.exit(main())
