"""What to tell the user after `agentfold integrate CLIENT`: the next step, and what was not done.

Separate from the file builders because these are messages, not config: restarts, approvals,
trust prompts and the limits of each client that no config file can fix.
"""

from __future__ import annotations

import tomlkit
import tomlkit.exceptions

from agentfold.integrations.clients import NO_MCP, Env

# The context each client needs: its system prompt and tool schemas alone fill the first request.
RECOMMENDED_CONTEXT = {
    "claude-code": (32768, "its first prompt (system prompt and tools) is 10-23K tokens"),
    "codex": (32768, "its first prompt (instructions and tools) is about 10K tokens"),
    "opencode": (32768, "its first prompt (system prompt and tools) is about 10K tokens"),
    "cline": (32768, "its system prompt is over 10K tokens"),
    "roo": (32768, "its system prompt is over 10K tokens"),
    "zed": (16384, "its agent prompt and tools take several thousand tokens"),
    "continue": (16384, "its agent prompt and tools take several thousand tokens"),
    "aider": (16384, "its prompts and repo map take several thousand tokens"),
}  # cursor and vscode: MCP only, their chat model is not ours
LONG_CONTEXT_HINT = "`agentfold serve --model gemma3` (Gemma 3 270M, 32K context)"


def context_warning(client: str, context_length: int | None, model: str) -> str | None:
    """A warning when the served model's context is below what `client` needs (None: fine, or unknown)."""
    need = RECOMMENDED_CONTEXT.get(client)
    if need is None or context_length is None or context_length >= need[0]:
        return None
    return (f"{model!r} has a {context_length}-token context, too small for {client}: {need[1]}, so requests "
            f"will fail with context_length_exceeded; {need[0] // 1024}K or more is recommended. "
            f"Serve a model with a longer context, e.g. {LONG_CONTEXT_HINT}")


def _codex_foreign_selector(env: Env) -> list[str]:
    """A top-level `profile = "other"` that is not ours: Codex 0.134+ refuses to start with it."""
    try:
        data = tomlkit.parse((env.home / ".codex" / "config.toml").read_text(encoding="utf-8")).unwrap()
    except (OSError, UnicodeDecodeError, tomlkit.exceptions.ParseError):
        return []
    name = data.get("profile")
    if not isinstance(name, str):
        return []
    return [f'~/.codex/config.toml still selects `profile = "{name}"`, which Codex 0.134 and later refuse: move '
            f"[profiles.{name}] into ~/.codex/{name}.config.toml (top-level keys) and use `codex --profile {name}`"]


def notes(client: str, env: Env) -> list[str]:
    """What to do next, and what the command could not do for this client."""
    s, scope = env.settings, env.scope
    out: list[str] = []
    stdio = s.transport == "stdio" and client not in NO_MCP
    if client == "claude-code":
        out.append("restart Claude Code; it asks once to approve the `agentfold` MCP server from .mcp.json"
                   if scope == "project" else "restart Claude Code")
        out.append("CLAUDE_CODE_ATTRIBUTION_HEADER=0 keeps the prompt prefix stable, so AgentFold's prefix cache hits")
        if "/" in s.model:
            out.append(f"the model name {s.model!r} contains '/', which Claude Code handles badly; serve a short alias")
    elif client == "codex":
        if scope == "project":
            out.append("Codex loads .codex/config.toml only in trusted projects, and reads model providers only from "
                       "~/.codex: run `agentfold integrate codex --scope user` to send its model traffic here")
        else:
            out.append("start Codex with `codex --profile agentfold` (Codex 0.134 or later; to make it the default, put "
                       f'model_provider = "agentfold" and model = "{s.model}" at the top of ~/.codex/config.toml)')
            out.extend(_codex_foreign_selector(env))
    elif client == "cursor":
        out.append("only MCP is wired: Cursor sends model requests from its own servers, which cannot reach "
                   f"{s.base_url} (see integrations/README.md)")
    elif client == "vscode":
        out.append("the AgentFold tools appear in Copilot Chat's agent mode (`MCP: List Servers` starts and stops it)")
    elif client == "continue":
        out.append("reload Continue and pick the model `AgentFold`")
        legacy = env.home / ".continue" / "config.json"
        if scope == "user" and legacy.exists():
            out.append(f"{env.display(legacy)} exists: Continue ignores it once config.yaml exists; move what you need")
    elif client == "zed":
        if scope == "project":
            out.append("Zed reads language models only from the user settings: run `agentfold integrate zed --scope user` "
                       "to add the model too")
        else:
            out.append("Zed takes the API key from AGENTFOLD_API_KEY (any value works): export AGENTFOLD_API_KEY=agentfold; "
                       "then pick the model in the Agent Panel")
    elif client == "opencode":
        out.append(f"pick the model with /models in opencode, or run `opencode -m agentfold/{s.model}`")
    elif client == "aider":
        out.append("run `aider` " + ("in this folder" if scope == "project" else "anywhere"))
        if s.transport == "stdio":
            out.append("aider has no MCP support; --transport does not apply")
    if stdio:
        out.append("stdio: the client starts its own `agentfold mcp` process, which loads the model itself")
    return out
