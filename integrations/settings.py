"""The values that fill the templates' `{{PLACEHOLDER}}`s, and the server URL they start from.

Kept apart from the command so the templates, the per-client builders and the tests share one
definition of "what AgentFold is configured as" (URL, model, context window, MCP transport).
"""

from __future__ import annotations

import urllib.parse
from dataclasses import dataclass

from agentfold.integrations.errors import IntegrateError

DEFAULT_BASE_URL = "http://127.0.0.1:8080"
DEFAULT_CONTEXT_LENGTH = 32768  # Claude Code's system prompt alone is 14-23K tokens


@dataclass(frozen=True)
class Settings:
    """What goes into the placeholders."""

    base_url: str  # server root, no trailing slash, no /v1 (Claude Code wants it that way)
    model: str
    context_length: int = DEFAULT_CONTEXT_LENGTH
    transport: str = "http"
    model_path: str | None = None  # checkpoint `agentfold mcp --model` loads (stdio transport)
    command: str = "agentfold"  # the executable stdio clients start

    @property
    def openai_base_url(self) -> str:
        return self.base_url + "/v1"

    @property
    def mcp_url(self) -> str:
        return self.base_url + "/mcp"

    @property
    def max_output_tokens(self) -> int:
        return max(256, min(8192, self.context_length // 4))

    def placeholders(self) -> dict[str, str | int]:
        values: dict[str, str | int] = {
            "BASE_URL": self.base_url,
            "OPENAI_BASE_URL": self.openai_base_url,
            "MCP_URL": self.mcp_url,
            "MODEL": self.model,
            "CONTEXT_LENGTH": self.context_length,
            "MAX_OUTPUT_TOKENS": self.max_output_tokens,
            # Claude Code compacts at min(its idea of the model's window, this): it takes an unknown
            # model name for a 1M-token model and would otherwise overflow the served context
            "AUTO_COMPACT_WINDOW": str(self.context_length),
            "AGENTFOLD": self.command,
        }
        if self.model_path is not None:
            values["MODEL_PATH"] = self.model_path
        return values


def normalize_base_url(url: str) -> str:
    """`http://host:port` from what a user may type (`.../v1`, `.../mcp`, a trailing slash)."""
    url = url.strip()
    parsed = urllib.parse.urlsplit(url)
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise IntegrateError(f"--base-url {url!r} is not an http(s) URL (example: {DEFAULT_BASE_URL})")
    path = parsed.path.rstrip("/")
    for suffix in ("/v1", "/mcp"):
        if path.endswith(suffix):
            path = path[: -len(suffix)]
    return urllib.parse.urlunsplit((parsed.scheme, parsed.netloc, path, "", ""))
