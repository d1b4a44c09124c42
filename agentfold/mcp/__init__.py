"""The MCP server (streamable HTTP and stdio): generate, sessions, audits as tools."""
