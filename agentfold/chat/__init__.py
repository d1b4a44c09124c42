"""Model-facing chat: the chat template, tool calls, prefill cuts; no HTTP."""
