"""The MCP server on the real SmolLM2: in-process through the SDK's `Client`, and over real HTTP.

Every structured result is checked against the source of truth: the telemetry rows in SQLite
(`service.telemetry`), the session index (`service.sessions`) and a direct engine call on the same
prompt and sampling (`engine.generate`), which the MCP reply must equal token for token.
"""

from __future__ import annotations

import json

# isort: split
import httpx
import httpx2
import numpy as np
import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError

from agentfold.chat.template import render_chat
from agentfold.engine.decode import GenerationConfig
from agentfold.engine.drafters import NoiseDrafter
from agentfold.engine.sampler import SamplingParams
from agentfold.http.app import create_app
from agentfold.mcp.results import HIDDEN_TURN_FIELDS
from agentfold.mcp.server import mount_mcp
from agentfold.serve.service import Service
from tests.helpers.api_helpers import ServerThread
from tests.helpers.drafting import PinnedDepth
from tests.helpers.mcp_calls import call, error_text

pytestmark = pytest.mark.anyio

CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three colors."}]
TOOLS = {"generate", "check_exactness", "audit_turn", "get_turn", "list_turns", "latency_summary",
         "list_sessions", "get_session", "fork_session", "pin_session", "delete_session", "list_snapshots"}
READ_ONLY = {"check_exactness", "get_turn", "list_turns", "latency_summary", "list_sessions", "get_session",
             "list_snapshots"}





@pytest.fixture(scope="module")
def http_url(service):
    routes, lifespan = mount_mcp(service)
    server = ServerThread(create_app(service.runtime, extra_routes=routes, lifespan=lifespan)).start()
    yield server.url
    server.stop()


def direct(engine, ids: list[int], max_tokens: int, temperature: float = 0.0, seed: int = 0, draft: bool = True):
    """The engine itself on the same prompt and sampling (the runtime is idle between tool calls)."""
    config = GenerationConfig(params=SamplingParams(temperature=temperature, seed=seed), max_tokens=max_tokens,
                              draft=draft)
    return engine.generate(ids, config)


def chat_ids(service: Service, messages: list[dict]) -> list[int]:
    return service.runtime.encode(render_chat(service.runtime.tokenizer, messages))


def stored(service: Service, turn_id: str) -> dict:
    service.telemetry.flush()
    row = service.telemetry.get_turn(turn_id)
    assert row is not None
    return row


def public(row: dict) -> dict:
    return {k: v for k, v in row.items() if k not in HIDDEN_TURN_FIELDS}




@pytest.fixture(scope="module")
def first_turn(service, mcp):
    """One chat turn generated over MCP (in-process), with the progress notifications it sent."""
    import anyio

    progress: list[tuple[float, float | None]] = []

    async def on_progress(done: float, total: float | None, message: str | None) -> None:
        progress.append((done, total))

    async def go() -> dict:
        async with Client(mcp) as client:
            return await call(client, "generate", {"messages": CHAT, "max_tokens": 12, "seed": 1},
                              progress_callback=on_progress)

    return anyio.run(go), progress


async def test_tools_are_listed_with_annotations(mcp):
    async with Client(mcp) as client:
        tools = {t.name: t for t in (await client.list_tools()).tools}
        templates = {t.uri_template for t in (await client.list_resource_templates()).resource_templates}
    assert set(tools) == TOOLS
    assert all(tools[name].output_schema for name in TOOLS)
    assert {n for n, t in tools.items() if t.annotations and t.annotations.read_only_hint} == READ_ONLY
    assert tools["delete_session"].annotations.destructive_hint is True
    assert {"agentfold://sessions/{session_id}", "agentfold://turns/{turn_id}"} <= templates


async def test_generate_equals_engine_and_its_telemetry_row(service, mcp, first_turn):
    result, progress = first_turn
    reference = direct(service.engine, chat_ids(service, CHAT), 12)
    assert result["token_sha"] == reference.token_sha and result["text"] == reference.text
    assert result["finish_reason"] == reference.finish_reason
    assert result["completion_tokens"] == len(reference.tokens)

    row = stored(service, result["turn_id"])
    assert row["api"] == "mcp" and row["session_id"] == result["session_id"] is not None and row["client"]
    for key in ("token_sha", "prompt_tokens", "cached_tokens", "completion_tokens", "drafted", "accepted",
                "verify_passes", "draft_method", "finish_reason"):
        assert row[key] == result[key], key
    for key in ("decode_tps", "ttft_ms", "prefill_ms", "total_ms"):
        assert result[key] == pytest.approx(row[key], abs=1e-3), key
    assert row["inputs"]["reply"] and row["inputs"]["prompt"] == chat_ids(service, CHAT)

    # progress: committed tokens of max_tokens, rising to the reply's length
    assert progress and all(total == 12 for _, total in progress)
    counts = [done for done, _ in progress]
    assert counts == sorted(counts) and counts[-1] == result["completion_tokens"]

    async with Client(mcp) as client:
        assert await call(client, "get_turn", {"turn_id": result["turn_id"]}) == public(row)
        listed = await call(client, "list_turns", {"session_id": result["session_id"]})
        resource = await client.read_resource(f"agentfold://turns/{result['turn_id']}")
    assert listed["count"] == 1 and listed["turns"] == [public(row)]
    assert json.loads(resource.contents[0].text) == public(row)
    assert "inputs" not in listed["turns"][0] and "emit_ms" not in listed["turns"][0]


async def test_session_resumes_over_mcp_and_equals_fresh(service, mcp, first_turn):
    result, _ = first_turn
    session = result["session_id"]
    messages = [*CHAT, {"role": "assistant", "content": result["text"]}, {"role": "user", "content": "One more."}]
    async with Client(mcp) as client:
        second = await call(client, "generate", {"messages": messages, "max_tokens": 8, "session_id": session})
        detail = await call(client, "get_session", {"session_id": session})
        resource = await client.read_resource(f"agentfold://sessions/{session}")
    assert second["session_id"] == session
    assert 0 < second["cached_tokens"] < second["prompt_tokens"]
    assert second["token_sha"] == direct(service.engine, chat_ids(service, messages), 8).token_sha

    turns = service.sessions.turns(session)
    assert [t["index"] for t in detail["turns"]] == [t["index"] for t in turns] == [0, 1]
    assert [t["snapshot_id"] for t in detail["turns"]] == [t["snapshot_id"] for t in turns]
    assert detail["session"]["id"] == session and detail["session"]["turns"] == 2
    service.telemetry.flush()
    rows = service.telemetry.list_turns(session_id=session)
    assert [t["turn_id"] for t in detail["telemetry"]] == [r["turn_id"] for r in rows]
    assert [t["turn_id"] for t in detail["telemetry"]] == [second["turn_id"], result["turn_id"]]
    assert json.loads(resource.contents[0].text) == detail


async def test_fork_pin_delete_and_snapshots(service, mcp, first_turn):
    result, _ = first_turn
    session = result["session_id"]
    manager = service.sessions
    async with Client(mcp) as client:
        listed = await call(client, "list_sessions")
        assert [s["id"] for s in listed["sessions"]] == [s["id"] for s in manager.list_sessions()]

        fork = await call(client, "fork_session", {"session_id": session, "turn": 0})
        assert fork["parent"] == session and fork["turns"] == 1
        assert [t["index"] for t in manager.turns(fork["session_id"])] == [0]
        parent = next(s for s in manager.list_sessions() if s["id"] == fork["session_id"])["parent"]
        assert parent == session

        assert await call(client, "pin_session", {"session_id": fork["session_id"]}) == {
            "session_id": fork["session_id"], "pinned": True}
        assert next(s for s in manager.list_sessions() if s["id"] == fork["session_id"])["pinned"] == 1
        await call(client, "pin_session", {"session_id": fork["session_id"], "pinned": False})
        assert next(s for s in manager.list_sessions() if s["id"] == fork["session_id"])["pinned"] == 0

        snapshots = await call(client, "list_snapshots")
        stored_snapshots = manager.list_snapshots()
        assert [s["id"] for s in snapshots["snapshots"]] == [s["id"] for s in stored_snapshots]
        assert snapshots["total_bytes"] == sum(s["bytes"] for s in stored_snapshots) > 0

        deleted = await call(client, "delete_session", {"session_id": fork["session_id"]})
        assert deleted["deleted"] and deleted["removed_snapshots"] == []  # the parent still uses them
        assert fork["session_id"] not in {s["id"] for s in manager.list_sessions()}
        assert manager.turns(session)  # the parent is untouched
        assert "no session" in await error_text(client, "delete_session", {"session_id": fork["session_id"]})


async def test_bad_input_is_a_tool_error(mcp):
    async with Client(mcp) as client:
        both = await error_text(client, "generate", {"messages": CHAT, "prompt": "hi"})
        neither = await error_text(client, "generate", {})
        assert "exactly one of 'messages'" in both and "exactly one of 'messages'" in neither
        assert "max_tokens" in await error_text(client, "generate", {"prompt": "hi", "max_tokens": -3})
        assert "temperature" in await error_text(client, "generate", {"prompt": "hi", "temperature": -0.5})
        assert "context" in await error_text(client, "generate", {"prompt": "hi", "max_tokens": 10**7})
        assert "empty" in await error_text(client, "generate", {"messages": []})
        assert "role" in await error_text(client, "generate", {"messages": [{"role": "robot", "content": "x"}]})
        assert "exactly one" in await error_text(client, "check_exactness", {})
        assert "temperature" in await error_text(client, "check_exactness", {"prompt": "x", "temperature": -1})
        assert "no turn" in await error_text(client, "get_turn", {"turn_id": "turn-nope"})
        assert "no turn" in await error_text(client, "audit_turn", {"turn_id": "turn-nope"})
        assert "limit" in await error_text(client, "list_turns", {"limit": 0})
        for tool, args in (("get_session", {}), ("pin_session", {}), ("delete_session", {}),
                           ("fork_session", {"turn": 0})):
            assert "no session" in await error_text(client, tool, {"session_id": "nope", **args})
        with pytest.raises(MCPError, match="no turn"):
            await client.read_resource("agentfold://turns/turn-nope")
        with pytest.raises(MCPError, match="no session"):
            await client.read_resource("agentfold://sessions/nope")


async def test_fork_beyond_the_last_turn_is_an_error(mcp, first_turn):
    result, _ = first_turn
    async with Client(mcp) as client:
        text = await error_text(client, "fork_session", {"session_id": result["session_id"], "turn": 9})
    assert "no turn 9" in text


async def test_check_exactness_equal_on_the_real_model(service, mcp):
    args = {"prompt": "def fib(n):\n    return", "max_tokens": 10, "temperature": 0.8, "seed": 5}
    async with Client(mcp) as client:
        result = await call(client, "check_exactness", args)
    assert result["equal"] is True and result["mismatch_position"] is None
    reference = direct(service.engine, service.runtime.encode(args["prompt"]), 10, 0.8, 5, draft=False)
    assert result["drafted"]["token_sha"] == result["serial"]["token_sha"] == reference.token_sha
    assert result["serial"]["drafted"] == 0 and result["serial"]["tokens"] == len(reference.tokens)
    for side in ("drafted", "serial"):
        assert result[side]["total_ms"] > 0 and result[side]["verify_passes"] >= 1


async def test_check_exactness_catches_a_broken_drafter(service, mcp, monkeypatch):
    engine = service.engine
    monkeypatch.setattr(engine, "drafter", NoiseDrafter(len(engine.tokenizer), seed=1))
    monkeypatch.setattr(engine, "controller", PinnedDepth(max_depth=4))

    def commit_unchecked(logits, drafts, base, params, constraint, stats):  # wrong on purpose
        return [*drafts, int(np.argmax(logits[len(drafts)]))]

    monkeypatch.setattr(engine, "_verify", commit_unchecked)  # the broken decode loop audits must catch
    async with Client(mcp) as client:
        result = await call(client, "check_exactness", {"prompt": "The capital of France is", "max_tokens": 8})
    assert result["equal"] is False and result["mismatch_position"] is not None
    assert result["drafted"]["drafted"] > 0
    assert result["drafted"]["token_sha"] != result["serial"]["token_sha"]


async def test_restored_engine_drafts_exactly_again(service, smollm2_engine):
    """The broken-drafter test above must leave the shared engine as it found it."""
    assert "_verify" not in vars(smollm2_engine)
    assert not isinstance(smollm2_engine.drafter, NoiseDrafter)


async def test_audit_of_a_real_turn_passes(service, mcp, first_turn):
    result, _ = first_turn
    async with Client(mcp) as client:
        verdict = await call(client, "audit_turn", {"turn_id": result["turn_id"]})
        summary = await call(client, "latency_summary", {})
        recent = await call(client, "latency_summary", {"last_n": 2})
    assert verdict == {"turn_id": result["turn_id"], "verdict": "passed", "mismatch_position": None,
                       "token_sha": result["token_sha"], "audit_token_sha": result["token_sha"]}
    row = stored(service, result["turn_id"])
    assert row["audit"] == "passed" and row["audit_token_sha"] == result["token_sha"]
    assert summary == service.telemetry.latency_summary()
    assert recent == service.telemetry.latency_summary(last_n=2)
    assert summary["audits_passed"] >= 1 and summary["turns"] == len(service.telemetry.list_turns())


async def test_over_http(service, http_url):
    progress: list[float] = []

    async def on_progress(done: float, total: float | None, message: str | None) -> None:
        progress.append(done)

    async with Client(http_url + "/mcp") as client:
        assert {t.name for t in (await client.list_tools()).tools} == TOOLS
        result = await call(client, "generate", {"prompt": "Once upon a time", "max_tokens": 8, "seed": 2,
                                                 "temperature": 0.5}, progress_callback=on_progress)
        row = stored(service, result["turn_id"])
        assert await call(client, "get_turn", {"turn_id": result["turn_id"]}) == public(row)
        resource = await client.read_resource(f"agentfold://turns/{result['turn_id']}")
        assert "no turn" in await error_text(client, "get_turn", {"turn_id": "turn-nope"})
    reference = direct(service.engine, service.runtime.encode("Once upon a time"), 8, 0.5, 2)
    assert result["token_sha"] == reference.token_sha == row["token_sha"] and row["api"] == "mcp"
    assert json.loads(resource.contents[0].text) == public(row)
    assert progress and progress[-1] == result["completion_tokens"]

    # clients of the handshake era (initialize, protocol 2025-06-18) get the same tools and progress
    progress.clear()
    async with Client(http_url + "/mcp", mode="legacy") as client:
        legacy = await call(client, "generate", {"prompt": "Once upon a time", "max_tokens": 4, "seed": 2,
                                                 "temperature": 0.5}, progress_callback=on_progress)
    assert legacy["token_sha"] == direct(service.engine, service.runtime.encode("Once upon a time"), 4, 0.5, 2).token_sha
    assert progress and progress[-1] == legacy["completion_tokens"]

    # DNS-rebinding protection stays on for loopback; other paths keep the app's own 404
    async with httpx.AsyncClient() as http:
        rebound = await http.post(http_url + "/mcp", headers={"Host": "evil.example"}, json={})
        missing = await http.get(http_url + "/nope")
    assert rebound.status_code == 421
    assert missing.status_code == 404 and "error" in missing.json()


async def test_http_api_key(service):
    """With an API key, /mcp wants it too (like the HTTP APIs), sent as x-api-key or Bearer."""
    routes, lifespan = mount_mcp(service, api_key="sekret")
    server = ServerThread(create_app(service.runtime, api_key="sekret", extra_routes=routes,
                                     lifespan=lifespan)).start()
    try:
        async with httpx.AsyncClient() as http:
            refused = await http.post(server.url + "/mcp", json={})
        assert refused.status_code == 401
        async with httpx2.AsyncClient(headers={"Authorization": "Bearer sekret"}) as keyed:
            async with Client(streamable_http_client(server.url + "/mcp", http_client=keyed)) as client:
                summary = await call(client, "latency_summary", {})
        assert summary["turns"] == len(service.telemetry.list_turns())
    finally:
        server.stop()
