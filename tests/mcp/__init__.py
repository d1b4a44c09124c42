"""Tests of the MCP server through the official mcp client."""
