"""Calling AgentFold's MCP tools with the official client: a result that must succeed, or must fail."""

from __future__ import annotations

from typing import Any

from mcp.client import Client


async def call(client: Client, name: str, args: dict | None = None, **kwargs: Any) -> dict:
    """The tool's structured result; fails the test if the tool reported an error."""
    result = await client.call_tool(name, args or {}, **kwargs)
    assert not result.is_error, result.content
    return result.structured_content


async def error_text(client: Client, name: str, args: dict) -> str:
    """The tool's error message; fails the test if the call succeeded."""
    result = await client.call_tool(name, args)
    assert result.is_error, result.structured_content
    return result.content[0].text
