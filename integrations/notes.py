"""What to tell the user after `agentfold integrate CLIENT`: the next step, and what was not done.

Separate from the file builders because these are messages, not config: restarts, approvals,
trust prompts and the limits of each client that no config file can fix.
"""

from __future__ import annotations

from agentfold.integrations.clients import NO_MCP, Env


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
                       "~/.codex/config.toml: run `agentfold integrate codex --scope user` to send its model traffic here")
        else:
            out.append('start Codex with `codex --profile agentfold` (or put `profile = "agentfold"` at the top of '
                       "~/.codex/config.toml to make it the default)")
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
