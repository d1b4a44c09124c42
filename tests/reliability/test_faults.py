"""Faults: a client hanging up mid-stream, the server killed with SIGKILL, a read-only or full disk.

- Disconnect (in-process stack, one decoding slot): the turn is cancelled within one verify pass
  of the hang-up, on every streaming API, and the next request gets the slot and completes.
- kill -9 (`agentfold serve` processes on one --home): once while a snapshot file is being written,
  once mid-generation. After each restart the SQLite index passes its integrity check, every row
  names a complete file of the recorded size and sha256, no temporary file is left (start-up
  removes the dead writer's), and every session resumes with a reply equal to a fresh server's.
- Read-only home (a real permission denial: as root the server runs without CAP_DAC_OVERRIDE) and
  a full disk (a real 1 MiB tmpfs in a private mount namespace): a warning on stderr, replies still
  correct, and (read-only) not a byte of the home changed.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from agentfold.bench.harness import ServerProcess
from agentfold.sessions.snapshots import SnapshotStore
from tests.helpers.api_helpers import api_server, wait_idle  # noqa: F401  (fixture)
from tests.helpers.reliability_helpers import check_store, service_server, store_state

SERVE = ["--no-draft"]  # no self-check at start-up: the restarts stay quick (replies are the same bytes)
STORY = ("The lighthouse keeper counted the ships that passed each night, wrote their names in a ledger, "
         "and wondered where each one was going. ")


def ask(url: str, messages: list[dict], session: str | None = None, max_tokens: int = 6, **extra) -> dict:
    body = {"model": "m", "messages": messages, "max_tokens": max_tokens, "temperature": 0, **extra}
    if session:
        body["session_id"] = session
    response = httpx.post(url + "/v1/chat/completions", json=body, timeout=600)
    assert response.status_code == 200, response.text
    return response.json()


def fresh(api, messages: list[dict], max_tokens: int = 6) -> str:
    """The reply of a fresh server with no sessions (serial decoding)."""
    return ask(api.url, messages, max_tokens=max_tokens, draft=False)["choices"][0]["message"]["content"]


def text(reply: dict) -> str:
    return reply["choices"][0]["message"]["content"]


# ---------------------------------------------------------------------------------------------
# A client that hangs up
# ---------------------------------------------------------------------------------------------

STREAMS = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "Tell me a very long story."}],
                             "max_tokens": 400},
    "/v1/messages": {"messages": [{"role": "user", "content": "Tell me a very long story."}], "max_tokens": 400},
    "/v1/responses": {"input": "Tell me a very long story.", "max_output_tokens": 400},
}


def test_disconnect_frees_the_engine_within_one_pass(smollm2_engine, tmp_path):
    with service_server(smollm2_engine, tmp_path / "home", max_active=1) as (url, service):
        runtime = service.runtime
        for path, fields in STREAMS.items():
            cancelled = runtime.counters["cancelled"]
            turn = None
            with httpx.stream("POST", url + path, json={"model": "m", "stream": True, **fields},
                              timeout=120) as response:
                assert response.status_code == 200
                for line in response.iter_lines():
                    running = runtime.running()  # one read: the list can empty between two calls
                    turn = turn or (running[0] if running else None)
                    if line.startswith("data: ") and ("delta" in line or "output_text.delta" in line) \
                            and turn is not None and turn.passes >= 2:
                        break  # tokens are flowing: hang up
            assert turn is not None, (path, "the reply ended before the engine was seen running it")
            assert wait_idle(runtime, timeout=60), path
            assert turn.status == "cancelled" and turn.completion is None, path
            assert turn.passes_at_cancel is not None and turn.passes - turn.passes_at_cancel <= 1, (
                path, turn.passes, turn.passes_at_cancel)
            assert turn.passes < 400 and runtime.counters["cancelled"] == cancelled + 1
            reply = ask(url, [{"role": "user", "content": "Hi"}], max_tokens=2)  # the one slot is free again
            assert reply["usage"]["completion_tokens"] == 2


# ---------------------------------------------------------------------------------------------
# kill -9 and restart on the same home
# ---------------------------------------------------------------------------------------------

def kill_when(server: ServerProcess, seen: threading.Event, condition, timeout: float = 300) -> None:
    """SIGKILL the server from a watcher thread the moment `condition()` holds (polled every ~1 ms)."""

    def watch() -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and server.proc.poll() is None:
            if condition():
                server.kill()
                seen.set()
                return
            time.sleep(0.001)

    threading.Thread(target=watch, daemon=True).start()


def temp_files(home: Path) -> list[str]:
    folder = home / "snapshots"
    return [p.name for p in folder.iterdir() if ".tmp." in p.name] if folder.exists() else []


@pytest.mark.slow
def test_kill_during_snapshot_write_and_generation(api_server, tmp_path):  # noqa: F811
    home = tmp_path / "home"
    a1 = [{"role": "user", "content": "Name a fruit."}]
    b1 = [{"role": "user", "content": "Summarize this log:\n" + STORY * 8}]  # ~330 tokens: a 15 MB snapshot, ~50 ms to write
    c1 = [{"role": "user", "content": "Write a long poem about the sea."}]

    # 1. a stored turn, then SIGKILL while the next turn's snapshot file is being written
    first = ServerProcess(home, SERVE, log_path=tmp_path / "serve-1.log").start()
    try:
        reply_a1 = text(ask(first.url, a1, session="sess-a"))
        writing = threading.Event()
        kill_when(first, writing, lambda: bool(temp_files(home)))
        with pytest.raises(httpx.HTTPError):
            httpx.post(first.url + "/v1/chat/completions", timeout=600,
                       json={"model": "m", "messages": b1, "max_tokens": 4, "session_id": "sess-b"})
        assert writing.wait(5), "the snapshot write was never seen"
    finally:
        first.kill()
    assert temp_files(home), "a kill mid-write leaves the temporary file (never a half file under the real name)"

    # 2. restart: the debris is gone, the index is consistent, sessions resume exactly; then kill mid-generation
    second = ServerProcess(home, SERVE, log_path=tmp_path / "serve-2.log").start()
    try:
        check_store(home)
        assert "recovered from an earlier crash" in second.log()
        a2 = [*a1, {"role": "assistant", "content": reply_a1}, {"role": "user", "content": "And a vegetable?"}]
        resumed = ask(second.url, a2, session="sess-a")
        assert resumed["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # restored from sess-a's snapshot
        assert text(resumed) == fresh(api_server, a2)
        assert text(ask(second.url, b1, session="sess-b", max_tokens=4)) == fresh(api_server, b1, 4)
        generating = threading.Event()
        with httpx.stream("POST", second.url + "/v1/chat/completions", timeout=600, json={
                "model": "m", "messages": c1, "max_tokens": 300, "stream": True, "session_id": "sess-c"}) as stream:
            chunks = 0
            try:
                for line in stream.iter_lines():
                    chunks += '"content":"' in line
                    if chunks == 3:
                        second.kill()
                        generating.set()
            except httpx.HTTPError:
                pass
        assert generating.is_set()
    finally:
        second.kill()

    # 3. restart again: consistent, and every session still resumes to a fresh server's reply
    third = ServerProcess(home, SERVE, log_path=tmp_path / "serve-3.log").start()
    try:
        check_store(home)
        assert text(ask(third.url, c1, session="sess-c")) == fresh(api_server, c1)
        a3 = [*a2, {"role": "assistant", "content": text(resumed)}, {"role": "user", "content": "And a nut?"}]
        again = ask(third.url, a3, session="sess-a")
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        assert text(again) == fresh(api_server, a3)
    finally:
        third.stop()
    check_store(home)


# ---------------------------------------------------------------------------------------------
# Read-only and full disks
# ---------------------------------------------------------------------------------------------

def without_root_override() -> list[str]:
    """A command prefix under which file permissions bind (root ignores them unless it drops these)."""
    if os.geteuid() != 0:
        return []
    if shutil.which("setpriv") is None:
        pytest.skip("running as root without setpriv: cannot make a directory read-only for the server")
    caps = "-dac_override,-dac_read_search,-fowner"
    return ["setpriv", f"--bounding-set={caps}", f"--inh-caps={caps}", "--"]


@pytest.mark.slow  # a real server process
def test_read_only_home_serves_without_persistence(api_server, tmp_path):  # noqa: F811
    home = tmp_path / "home"
    SnapshotStore(home)  # an existing index (and snapshots folder), as an earlier run leaves them
    before = store_state(home)
    for path in [home, *home.rglob("*")]:
        path.chmod(0o555 if path.is_dir() else 0o444)
    messages = [{"role": "user", "content": "Name a color."}]
    try:
        with ServerProcess(home, SERVE, prefix=without_root_override(), log_path=tmp_path / "serve.log") as server:
            for _ in range(2):
                assert text(ask(server.url, messages, session="ro-1")) == fresh(api_server, messages)
            log = server.log()
        assert "cannot be written" in log and "WITHOUT persistence" in log, log[-2000:]
    finally:
        for path in [home, *home.rglob("*")]:
            path.chmod(0o755 if path.is_dir() else 0o644)
    assert store_state(home) == before


@pytest.mark.slow  # a real server process
def test_sigterm_writes_pending_snapshots_and_exits_143(tmp_path):
    """`docker stop` / systemd send SIGTERM: uvicorn re-raises it after its graceful shutdown, which
    with the default handler killed the process before the sessions flushed. It must unwind instead:
    the turn's snapshot is on disk, the telemetry closed, and the exit status is 128 + SIGTERM."""
    home = tmp_path / "home"
    server = ServerProcess(home, SERVE, stop_signal=signal.SIGTERM, log_path=tmp_path / "serve.log").start()
    try:
        ask(server.url, [{"role": "user", "content": "Name a fruit."}], session="term-1")
        status = server.stop()
    finally:
        server.kill()
    log = server.log()
    assert status == 128 + signal.SIGTERM, (status, log[-2000:])
    assert "stopping: writing pending session snapshots" in log, log[-2000:]
    state = store_state(home)
    assert state["files"] and any("term-1" in repr(row) for rows in state.values() for row in rows), state


@pytest.mark.slow  # a real server process
def test_full_disk_warns_and_keeps_serving(api_server, tmp_path):  # noqa: F811
    probe = subprocess.run(["unshare", "--mount", "sh", "-c", f"mount -t tmpfs -o size=64k tmpfs {tmp_path}"],
                           capture_output=True) if shutil.which("unshare") else None
    if probe is None or probe.returncode != 0:
        pytest.skip("needs `unshare --mount` and tmpfs mounts (CAP_SYS_ADMIN) for a real full disk")
    home = tmp_path / "tiny"
    home.mkdir()
    prefix = ["unshare", "--mount", "sh", "-c", 'mount -t tmpfs -o size=1m tmpfs "$0" && exec "$@"', str(home)]
    # ~200 prompt tokens: a snapshot of 4+ MB in float16 (SmolLM2: 30 layers x 2 x 3 heads x 64), so
    # whatever the KV dtype it cannot fit the 1 MB the store's SQLite index and telemetry share
    rules = " ".join(f"Rule {n}: answer with one common word, no punctuation, no explanation." for n in range(1, 16))
    messages = [{"role": "system", "content": rules}, {"role": "user", "content": "Name an animal."}]
    with ServerProcess(home, SERVE, prefix=prefix, log_path=tmp_path / "serve.log") as server:
        for session in ("full-1", "full-1", "full-2"):
            assert text(ask(server.url, messages, session=session)) == fresh(api_server, messages)
        log = server.log()
    assert "snapshot not saved" in log and "MB free" in log, log[-2000:]


def test_startup_recovery_removes_crash_debris(tmp_path):
    """What each kind of crash leaves, planted by hand, and what a new store does with it."""
    home = tmp_path / "home"
    store = SnapshotStore(home)
    folder = home / "snapshots"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    old = time.time() - 3600

    def plant(name: str, size: int = 64, age: float | None = None) -> Path:
        path = folder / name
        path.write_bytes(b"\0" * size)
        if age is not None:
            os.utime(path, (age, age))
        return path

    def row(snapshot_id: str, size: int) -> dict:
        return {"id": snapshot_id, "key": "k", "tokens_hash": snapshot_id, "token_count": 1, "boundaries": "[]",
                "parent": None, "bytes": size, "file": f"{snapshot_id}.safetensors", "checksum": "0" * 64,
                "created": old, "last_used": old, "hits": 0, "pinned": 0}

    dead_temp = plant(f".aaa.{dead.pid}.1234abcd.tmp.safetensors")  # its writer died mid-write
    live_temp = plant(f".bbb.{os.getpid()}.1234abcd.tmp.safetensors")  # a live writer's: kept
    orphan = plant("ccc.safetensors", age=old)  # renamed, row never committed
    young = plant("ddd.safetensors")  # maybe a live writer about to commit: kept for now
    plant("eee.safetensors", size=10)  # indexed as 64 bytes: truncated
    with store.write() as db:
        db["snapshots"].insert_all([row("eee", 64), row("fff", 64), row("ggg", 64)])  # fff: file gone
        db["sessions"].insert({"id": "s", "created": old, "last_used": old, "pinned": 0, "parent": None,
                               "title": ""})
        db["turns"].insert_all([{"id": f"t{i}", "session_id": "s", "index": i, "prompt_tokens": 1,
                                 "reply_tokens": 1, "snapshot_id": sid, "created": old}
                                for i, sid in enumerate(["fff", "ggg", "zzz"])])
    plant("ggg.safetensors")  # intact: kept

    recovered = SnapshotStore(home).recovered
    assert recovered.temp_files == [dead_temp.name] and not dead_temp.exists() and live_temp.exists()
    assert recovered.orphan_files == [orphan.name] and not orphan.exists() and young.exists()
    assert sorted(recovered.dropped_rows) == ["eee", "fff"] and recovered.dangling_turns == 1  # zzz never existed
    remaining = {r["id"] for r in store.rows("select id from snapshots")}
    assert remaining == {"ggg"}
    assert [t["snapshot_id"] for t in store.rows("select snapshot_id from turns order by [index]")] == [None, "ggg",
                                                                                                        None]
    assert not SnapshotStore(home).recovered  # a second start finds nothing to do
