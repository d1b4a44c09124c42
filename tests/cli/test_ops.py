"""`agentfold stats`, `audit` and `mcp` (agentfold.cli.ops) on a home with real telemetry rows.

The rows come from real turns of the SmolLM2 engine through a Service. `audit` runs in-process
with `load_engine` handing it the already-loaded engine; `stats` runs in a subprocess too, to
show it never imports MLX; `mcp` is launched over stdio by the SDK's own client.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

# isort: split
import anyio
import pytest
from mcp import Client, StdioServerParameters

from agentfold.cli import ops as ops_cli
from agentfold.engine.decode import GenerationConfig
from agentfold.serve.scheduler import Runtime, TurnRequest
from agentfold.serve.service import Service
from agentfold.serve.telemetry import TurnRecord

SESSION = "cli-session"


@pytest.fixture(scope="module")
def home(smollm2_engine, tmp_path_factory) -> dict:
    """A home with two real turns of one session, and a tampered copy of the first (a wrong reply)."""
    path = tmp_path_factory.mktemp("ops-home")
    service = Service(Runtime(smollm2_engine, smollm2_engine.backend.loaded.name), home=path)
    try:
        ids = [service.runtime.encode(text) for text in ("def add(a, b):\n    return", "The sky is")]

        async def turns() -> list[str]:
            out = []
            for prompt in ids:
                _, turn = await service.run_turn(TurnRequest(prompt=prompt, config=GenerationConfig(max_tokens=6),
                                                             api="cli", session_id=SESSION))
                out.append(turn.id)
            return out

        good = asyncio.run(turns())
        service.telemetry.flush()
        row = service.telemetry.get_turn(good[0])
        reply = list(row["inputs"]["reply"])
        reply[1] = (reply[1] + 1) % len(smollm2_engine.tokenizer)
        bad = TurnRecord.from_dict({**row, "turn_id": "turn-tampered", "session_id": "other",
                                    "inputs": {**row["inputs"], "reply": reply}})
        service.telemetry.record(replace(bad, started_at=row["started_at"] + 1e-3))
        service.telemetry.flush()
    finally:
        service.close()
    return {"path": path, "good": good, "bad": "turn-tampered"}


def stored_rows(path: Path) -> list[dict]:
    from agentfold.serve.telemetry import TelemetryStore

    with TelemetryStore(path / "telemetry.sqlite") as store:
        return store.list_turns()


def test_stats_table(home, capsys):
    assert ops_cli.main(["stats", "--home", str(home["path"])]) == 0
    out = capsys.readouterr().out
    for turn_id in [*home["good"], home["bad"]]:
        assert turn_id[:21] in out
    assert "summary over last 20 turns of all sessions: 3 turns, 0 errors" in out and "ttft ms" in out


def test_stats_json_matches_the_store(home, capsys):
    from agentfold.serve.telemetry import TelemetryStore

    assert ops_cli.main(["stats", "--home", str(home["path"]), "--session", SESSION, "--last", "5", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    with TelemetryStore(home["path"] / "telemetry.sqlite") as store:
        rows = store.list_turns(session_id=SESSION, limit=5)
        summary = store.latency_summary(last_n=5)
    assert [r["turn_id"] for r in shown["turns"]] == [r["turn_id"] for r in rows] == home["good"][::-1]
    assert shown["turns"] == [{k: v for k, v in r.items() if k not in ("inputs", "emit_ms")} for r in rows]
    assert shown["summary"] == summary


def test_stats_reads_sqlite_only(home, tmp_path):
    """No MLX (so no model) is imported, and an empty home stays empty."""
    code = ("import json, sys; from agentfold.cli.ops import main; "
            "rc = main(['stats', '--json', '--home', sys.argv[1]]); rc2 = main(['stats', '--home', sys.argv[2]]); "
            "print(json.dumps([rc, rc2, [m for m in sys.modules if m.split('.')[0] in ('mlx', 'mlx_lm')]]))")
    done = subprocess.run([sys.executable, "-c", code, str(home["path"]), str(tmp_path / "empty")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    *shown, last = done.stdout.strip().splitlines()
    assert json.loads(last) == [0, 0, []]
    assert len(json.loads(shown[0])["turns"]) == 3 and "no telemetry at" in shown[1]
    assert not (tmp_path / "empty").exists()


def test_audit_exit_codes(home, smollm2_engine, monkeypatch, capsys):
    loads = []

    def load_engine(*args, **kwargs):
        loads.append(args)
        return smollm2_engine

    monkeypatch.setattr(ops_cli, "load_engine", load_engine)
    path = str(home["path"])

    assert ops_cli.main(["audit", home["good"][0], "--home", path]) == 0
    assert f"{home['good'][0]}  passed" in capsys.readouterr().out

    assert ops_cli.main(["audit", "--session", SESSION, "--home", path, "--json"]) == 0
    verdicts = json.loads(capsys.readouterr().out)
    assert [v["turn_id"] for v in verdicts] == home["good"] and {v["verdict"] for v in verdicts} == {"passed"}

    assert ops_cli.main(["audit", home["bad"], home["good"][1], "--home", path]) == 1
    out = capsys.readouterr().out
    assert f"{home['bad']}  failed (first difference at token 1)" in out and "1 passed, 1 failed" in out

    rows = {r["turn_id"]: r for r in stored_rows(home["path"])}
    assert rows[home["bad"]]["audit"] == "failed" and rows[home["bad"]]["mismatch_position"] == 1
    assert rows[home["good"][0]]["audit"] == "passed"

    loaded = len(loads)
    assert ops_cli.main(["audit", "turn-nope", "--home", path]) == 2  # checked before any model loads
    assert ops_cli.main(["audit", "--home", path]) == 2
    assert "no turn 'turn-nope'" in capsys.readouterr().err and len(loads) == loaded


def test_mcp_over_stdio(home, tmp_path):
    """`agentfold mcp` as a client launches it: tools listed, a tool answered, nothing else on stdout."""
    params = StdioServerParameters(
        command=sys.executable, args=["-m", "agentfold.cli.ops", "mcp", "--drafter", "none",
                                      "--home", str(home["path"])], env=dict(os.environ))

    async def go() -> tuple[set[str], dict, dict]:
        async with Client(params, read_timeout_seconds=120) as client:
            tools = {t.name for t in (await client.list_tools()).tools}
            summary = await client.call_tool("latency_summary", {})
            reply = await client.call_tool("generate", {"prompt": "Hello there, how are", "max_tokens": 3})
            return tools, summary.structured_content, reply.structured_content

    tools, summary, reply = anyio.run(go)
    assert {"generate", "audit_turn", "list_sessions"} <= tools
    assert summary["turns"] >= 3
    assert reply["completion_tokens"] >= 1 and reply["draft_method"] == "none"
    rows = {r["turn_id"]: r for r in stored_rows(home["path"])}
    assert rows[reply["turn_id"]]["api"] == "mcp"
