"""HTTP server: OpenAI Chat / Completions / Responses, Anthropic Messages, MCP mount, metrics."""
