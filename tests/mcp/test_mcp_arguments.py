"""MCP tool arguments are honoured or refused, never silently dropped (issue #17, item 7).

Through the official `mcp` client against the real server on SmolLM2: `list_snapshots` filters by
`session_id`, `delete_session` keeps a pinned session unless `force`, an argument no tool takes is
named in a tool error, and schema errors are one readable line, not pydantic's report.
"""

from __future__ import annotations

import pytest
from mcp import Client

from tests.helpers.mcp_calls import call, error_text

pytestmark = pytest.mark.anyio





@pytest.fixture(scope="module")
def two_sessions(mcp):
    """Two sessions, each with one generated turn (so each names its own snapshots)."""
    import anyio

    async def go() -> list[str]:
        async with Client(mcp) as client:
            ids = []
            for text in ("Name a color.", "Write the word blue twice."):
                result = await client.call_tool("generate", {"messages": [{"role": "user", "content": text}],
                                                             "max_tokens": 2})
                assert not result.is_error, result.content
                ids.append(result.structured_content["session_id"])
            return ids

    return anyio.run(go)




async def test_list_snapshots_of_one_session(service, mcp, two_sessions):
    first, second = two_sessions
    manager = service.sessions
    named = {t["snapshot_id"] for t in manager.turns(first)} - {None}
    others = {t["snapshot_id"] for t in manager.turns(second)} - {None}
    assert named and others - named  # both sessions left snapshots, and they differ
    async with Client(mcp) as client:
        everything = await call(client, "list_snapshots", {})
        only = await call(client, "list_snapshots", {"session_id": first})
        missing = await error_text(client, "list_snapshots", {"session_id": "no-such-session"})
    assert {s["id"] for s in everything["snapshots"]} >= named | others
    assert {s["id"] for s in only["snapshots"]} == named and only["count"] == len(named)
    assert only["total_bytes"] == sum(s["bytes"] for s in only["snapshots"])
    assert "no session" in missing


async def test_delete_keeps_a_pinned_session_unless_forced(service, mcp, two_sessions):
    manager = service.sessions
    async with Client(mcp) as client:
        fork = (await call(client, "fork_session", {"session_id": two_sessions[0], "turn": 0}))["session_id"]
        await call(client, "pin_session", {"session_id": fork})
        refused = await error_text(client, "delete_session", {"session_id": fork})
        assert "pinned" in refused and "force" in refused
        assert fork in {s["id"] for s in manager.list_sessions()}  # still there
        deleted = await call(client, "delete_session", {"session_id": fork, "force": True})
    assert deleted["deleted"] and fork not in {s["id"] for s in manager.list_sessions()}


async def test_unknown_argument_is_named(mcp):
    async with Client(mcp) as client:
        text = await error_text(client, "list_snapshots", {"sesion_id": "abc"})
        many = await error_text(client, "generate", {"prompt": "hi", "max_token": 3, "temp": 1})
    assert "'sesion_id'" in text and "session_id" in text.split("takes:")[1]
    assert "'max_token'" in many and "'temp'" in many and "max_tokens" in many


async def test_validation_errors_are_one_readable_line(mcp):
    async with Client(mcp) as client:
        budget = await error_text(client, "generate", {"prompt": "hi", "max_tokens": -3})
        role = await error_text(client, "generate", {"messages": [{"role": "robot", "content": "x"}]})
        missing = await error_text(client, "get_turn", {})
        kind = await error_text(client, "list_turns", {"limit": "many"})
    for text in (budget, role, missing, kind):
        assert "\n" not in text and "pydantic" not in text and "validation error" not in text, text
    assert budget.startswith("generate: invalid arguments: 'max_tokens'") and "-3" in budget
    assert "greater than or equal to 1" in budget
    assert "'messages[0].role'" in role and "'robot'" in role and "'user'" in role
    assert missing == "get_turn: invalid arguments: 'turn_id' is required."
    assert "'limit'" in kind and "'many'" in kind
