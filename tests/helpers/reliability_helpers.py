"""Shared by the reliability tests: a full serving stack on loopback, store fingerprints, error shapes."""

from __future__ import annotations

import hashlib
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from agentfold.http.app import build_app
from agentfold.serve.scheduler import Runtime
from agentfold.serve.service import Service
from tests.helpers.api_helpers import MODEL_ID, ServerThread

STORE_TABLES = ("sessions", "turns", "snapshots")


@contextmanager
def service_server(engine, home: Path, **app_options: Any) -> Iterator[tuple[str, Service]]:
    """`agentfold serve`'s stack (Service + build_app: APIs, MCP, metrics) on a loopback port, in-process."""
    runtime_options = {k: app_options.pop(k) for k in ("max_active", "max_queue") if k in app_options}
    service = Service(Runtime(engine, MODEL_ID, aliases=("smollm2",), **runtime_options), home=home)
    server = ServerThread(build_app(service, **app_options)).start()
    try:
        yield server.url, service
    finally:
        server.stop()
        service.close()


def store_state(home: Path) -> dict[str, Any]:
    """Every row of the session index and the sha256 of every file under snapshots/ (read-only)."""
    state: dict[str, Any] = {}
    db = home / "index.db"
    if db.exists():
        conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
        try:
            for table in STORE_TABLES:
                state[table] = sorted(conn.execute(f"select * from {table}").fetchall(), key=repr)
        finally:
            conn.close()
    folder = home / "snapshots"
    state["files"] = {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
                      for p in sorted(folder.iterdir())} if folder.exists() else {}
    return state


def check_store(home: Path) -> dict[str, Any]:
    """Assert the index is consistent with the files; returns the state.

    SQLite's own integrity check passes; every snapshot row names a present file of the recorded
    size and sha256; no temporary file is left; every turn names an existing snapshot (or none)
    and an existing session.
    """
    conn = sqlite3.connect(f"file:{home / 'index.db'}?mode=ro", uri=True)
    try:
        assert conn.execute("pragma integrity_check").fetchone()[0] == "ok"
        snapshots = conn.execute("select id, file, bytes, checksum from snapshots").fetchall()
        turns = conn.execute("select snapshot_id, session_id from turns").fetchall()
        sessions = {row[0] for row in conn.execute("select id from sessions")}
    finally:
        conn.close()
    folder = home / "snapshots"
    assert not [p.name for p in folder.iterdir() if ".tmp." in p.name], "temporary snapshot files left behind"
    for snapshot_id, name, size, checksum in snapshots:
        data = (folder / name).read_bytes()
        assert len(data) == size and hashlib.sha256(data).hexdigest() == checksum, snapshot_id
    ids = {row[0] for row in snapshots}
    for snapshot_id, session_id in turns:
        assert snapshot_id is None or snapshot_id in ids
        assert session_id in sessions
    return store_state(home)


def is_anthropic(path: str) -> bool:
    return "/messages" in path


def assert_api_error(response: httpx.Response, status: int, *words: str) -> str:
    """A 4xx in the API's own shape whose message holds `words`; returns the message."""
    assert response.status_code == status, (response.status_code, response.text[:500])
    body = response.json()
    if is_anthropic(response.request.url.path):
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
        message = body["error"]["message"]
    else:
        error = body["error"]
        assert set(error) == {"message", "type", "code", "param"}, error
        message = error["message"]
    assert isinstance(message, str) and message and "Traceback" not in message
    for word in words:
        assert word.lower() in message.lower(), (word, message)
    return message
