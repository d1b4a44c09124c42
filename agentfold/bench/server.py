"""The client side of the suite and agent benches: the official `openai` client, streamed, timed on arrival.

The suite measures what an agent feels: requests go through the official `openai` client to a real
`agentfold serve` (`bench.harness.ServerProcess`), streamed. Times are taken on the client when
chunks arrive; the server's own figures come back on the last chunk (`timings`, `agentfold`), in
`/metrics` and in the telemetry SQLite of its home, which is read after the server has stopped.
"""

from __future__ import annotations

import json
import time
from typing import Any

from agentfold.bench.harness import BenchError, ServerProcess
from agentfold.bench.prompts import WARMUP_PROMPT

REQUEST_TIMEOUT_S = 3600  # a 16K-token prefill on two cores takes minutes
WARMUP = [{"role": "user", "content": WARMUP_PROMPT}]  # the first request every bench client sends


def client_for(server: ServerProcess) -> Any:
    """An `openai.OpenAI` client for `server`, with the bench's long timeout and no retries."""
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=REQUEST_TIMEOUT_S, max_retries=0)


def stream_chat(client: Any, messages: list[dict[str, Any]], max_tokens: int, *, draft: bool, session_id: str,
                tools: list[dict[str, Any]] | None = None, tool_choice: Any = None, seed: int = 0) -> dict[str, Any]:
    """One streamed chat completion; client-side arrival times plus the server's last-chunk telemetry.

    `ttft_s` is the time from the call to the first chunk that carries text or a tool call (the first
    chunk, with the role only, comes before the prefill). Chunk gaps are what a client sees between
    content arrivals; the server streams each verify pass's text as it settles, and a tool call as
    one piece when its JSON is complete, so tool calls show no gaps on this side.
    """
    kwargs: dict[str, Any] = {}
    if tools:
        kwargs["tools"] = tools
        if tool_choice is not None:
            kwargs["tool_choice"] = tool_choice
    began = time.perf_counter()
    stream = client.chat.completions.create(
        model="default", messages=messages, max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True}, seed=seed,
        extra_body={"draft": draft, "session_id": session_id}, **kwargs)
    arrivals: list[float] = []
    content: list[str] = []
    calls: dict[int, dict[str, Any]] = {}
    finish, timings, block, usage = None, None, None, None
    for chunk in stream:
        now = time.perf_counter() - began
        extra = chunk.model_extra or {}
        timings = extra.get("timings") or timings
        block = extra.get("agentfold") or block
        if chunk.usage is not None:
            usage = chunk.usage.model_dump()
        for choice in chunk.choices:
            delta = choice.delta
            got = False
            if delta.content:
                content.append(delta.content)
                got = True
            for call in delta.tool_calls or []:
                entry = calls.setdefault(call.index, {"id": None, "name": "", "arguments": ""})
                entry["id"] = call.id or entry["id"]
                if call.function is not None:
                    entry["name"] += call.function.name or ""
                    entry["arguments"] += call.function.arguments or ""
                got = True
            if got:
                arrivals.append(now)
            if choice.finish_reason:
                finish = choice.finish_reason
    total = time.perf_counter() - began
    gaps = [(b - a) * 1e3 for a, b in zip(arrivals, arrivals[1:], strict=False)]
    return {
        "content": "".join(content),
        "tool_calls": [calls[i] for i in sorted(calls)],
        "finish_reason": finish,
        "ttft_s": round(arrivals[0], 4) if arrivals else None,
        "total_s": round(total, 4),
        "chunks": len(arrivals),
        "chunk_gaps_ms": [round(g, 3) for g in gaps],
        "timings": timings,
        "agentfold": block,
        "usage": usage,
    }


def assistant_message(reply: dict[str, Any]) -> dict[str, Any]:
    """The reply as the assistant message an agent appends to its history."""
    message: dict[str, Any] = {"role": "assistant", "content": reply["content"] or None}
    if reply["tool_calls"]:
        message["tool_calls"] = [{"id": c["id"] or f"call_{i}", "type": "function",
                                  "function": {"name": c["name"], "arguments": c["arguments"]}}
                                 for i, c in enumerate(reply["tool_calls"])]
    return message


def dump_reply(reply: dict[str, Any]) -> str:
    """A stable text of a reply (content and tool calls) for comparing two replies."""
    return json.dumps({"content": reply["content"], "calls": [(c["name"], c["arguments"]) for c in reply["tool_calls"]]})


# BenchError is re-exported: `agentfold.cli.bench` catches the suite's and the agent bench's errors from here
__all__ = ["REQUEST_TIMEOUT_S", "WARMUP", "BenchError", "assistant_message", "client_for", "dump_reply",
           "stream_chat"]
