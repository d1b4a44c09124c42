"""`agentfold bench agent`: a scripted coding-agent session through both APIs, turn by turn.

What decides a coding agent's latency is how much of each request the server has already
computed, so this bench sends such a session (`bench.agent_transcript`: 37 requests, each the
whole history plus one new message) to a real `agentfold serve`:

1. A server on a fresh home answers every request in one session (`session_id`), alternating the
   OpenAI Chat Completions and Anthropic Messages APIs (official clients, streamed). Prompt and
   cached tokens, TTFT and prefill rate come from each response's `agentfold` / `timings` blocks.
2. The server is restarted on the same home and the last requests are sent again: their KV cache
   must come back from the snapshots on disk.
3. A server with an empty home answers the same last requests: the replies must be equal.
4. Stall (`bench.stall`): a decoding client must not stall while another client prefills a long
   prompt (the scheduler steps prefill a decoder layer at a time): its max chunk gap beside an
   ~8K-token prefill against its own solo p99.
5. Prefill rates (`bench.prefill`): the engine's prefill tok/s next to mlx-lm's on the same ids.
"""

from __future__ import annotations

import hashlib
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from statistics import median_low
from typing import Any

from agentfold.bench.agent_transcript import (
    ANTHROPIC_TOOLS,
    NEW_SHARE,
    SYSTEM_PROMPT,
    TOOLS,
    anthropic_messages,
    build_transcript,
    entries_for,
    openai_messages,
)
from agentfold.bench.harness import BenchError, ServerProcess
from agentfold.bench.machine import finish_run, machine_info, run_header, utc_timestamp
from agentfold.bench.server import REQUEST_TIMEOUT_S, WARMUP, client_for, dump_reply, stream_chat
from agentfold.bench.weights import model_entry

SCHEMA = "agentfold.bench.agent/1"
CACHED_GOAL = 0.95  # every request after the first has at least this share of its prompt cached
SESSION = "bench-agent"


# -- sending ------------------------------------------------------------------------------------


def stream_messages(client: Any, system: str, messages: list[dict[str, Any]], max_tokens: int, *, session_id: str,
                    tool_choice: dict[str, Any], seed: int) -> dict[str, Any]:
    """One streamed Anthropic Messages request, read into the shape `stream_chat` returns."""
    began = time.perf_counter()
    stream = client.messages.create(  # temperature in the body: this SDK version no longer takes it as a parameter
        model="default", system=system, messages=messages, max_tokens=max_tokens, stream=True, tools=ANTHROPIC_TOOLS,
        tool_choice=tool_choice, extra_body={"temperature": 0, "session_id": session_id, "seed": seed, "draft": True})
    first, text, calls = None, [], {}
    finish, timings, block, usage = None, None, None, None
    for event in stream:
        extra = event.model_extra or {}
        timings, block = extra.get("timings") or timings, extra.get("agentfold") or block
        if event.type == "content_block_start" and event.content_block.type == "tool_use":
            calls[event.index] = {"id": event.content_block.id, "name": event.content_block.name, "arguments": ""}
        elif event.type == "content_block_delta":
            first = first if first is not None else time.perf_counter() - began
            if event.delta.type == "text_delta":
                text.append(event.delta.text)
            elif event.delta.type == "input_json_delta":
                calls[event.index]["arguments"] += event.delta.partial_json
        elif event.type == "message_delta":
            finish, usage = event.delta.stop_reason, event.usage.model_dump()
    return {"content": "".join(text), "tool_calls": [calls[i] for i in sorted(calls)], "finish_reason": finish,
            "ttft_s": round(first, 4) if first is not None else None,
            "total_s": round(time.perf_counter() - began, 4), "timings": timings, "agentfold": block, "usage": usage}


def _openai_choice(choice: Any) -> Any:
    return {"type": "function", "function": {"name": choice["name"]}} if isinstance(choice, dict) else choice


def _anthropic_choice(choice: Any) -> dict[str, Any]:
    if isinstance(choice, dict):
        return {"type": "tool", "name": choice["name"]}
    return {"type": "any" if choice == "required" else choice}


class AgentRunner:
    """Sends the transcript's requests to one server, in the bench's session."""

    def __init__(self, server: ServerProcess, transcript: dict[str, Any], seed: int) -> None:
        import anthropic

        self.transcript, self.seed = transcript, seed
        self.openai = client_for(server)
        self.claude = anthropic.Anthropic(base_url=server.url, api_key="unused", timeout=REQUEST_TIMEOUT_S,
                                          max_retries=0)

    def warm_up(self) -> None:
        stream_chat(self.openai, WARMUP, 2, draft=True, session_id="warmup", seed=self.seed)

    def send(self, index: int, phase: str) -> dict[str, Any]:
        turn = self.transcript["turns"][index]
        entries = entries_for(self.transcript, index)
        if turn["api"] == "openai":
            reply = stream_chat(self.openai, openai_messages(self.transcript["system"], entries), turn["max_tokens"],
                                draft=True, session_id=SESSION, tools=TOOLS, tool_choice=_openai_choice(turn["choice"]),
                                seed=self.seed)
            api_cached = ((reply["usage"] or {}).get("prompt_tokens_details") or {}).get("cached_tokens")
        else:
            reply = stream_messages(self.claude, self.transcript["system"], anthropic_messages(entries),
                                    turn["max_tokens"], session_id=SESSION,
                                    tool_choice=_anthropic_choice(turn["choice"]), seed=self.seed)
            api_cached = (reply["usage"] or {}).get("cache_read_input_tokens")
        block = reply["agentfold"]
        if not block:
            raise BenchError(f"{phase} turn {index + 1} ({turn['api']}): the response carried no agentfold block")
        prompt, cached = block["prompt_tokens"], block["cached_tokens"]
        prefill_ms = block.get("prefill_ms") or 0.0
        return {
            "phase": phase, "turn": index + 1, "api": turn["api"], "tool_choice": turn["tool_choice"],
            "forced_tool": turn["choice"]["name"] if isinstance(turn["choice"], dict) else None,
            "message": "+".join(e["role"] for e in turn["new"]), "prompt_tokens": prompt, "cached_tokens": cached,
            "cached_fraction": round(cached / prompt, 4) if prompt else None, "api_cached_tokens": api_cached,
            "expected_prompt_tokens": turn["expected_prompt_tokens"],
            "expected_cached_tokens": turn["expected_cached_tokens"],
            "ttft_s": round(block["ttft_ms"] / 1e3, 4), "client_first_content_s": reply["ttft_s"],
            "prefill_ms": prefill_ms, "prefilled_tokens": prompt - cached,
            "prefill_tps": round((prompt - cached) / prefill_ms * 1e3, 1) if prefill_ms > 0 else None,
            "completion_tokens": block["completion_tokens"], "max_tokens": turn["max_tokens"],
            "decode_tps": block.get("decode_tps"), "total_s": reply["total_s"], "finish_reason": reply["finish_reason"],
            "tool_calls": [c["name"] for c in reply["tool_calls"]], "text_head": reply["content"][:80],
            "token_sha": block.get("token_sha"), "reply_sha": hashlib.sha256(dump_reply(reply).encode()).hexdigest(),
            "turn_id": block.get("turn_id"),
        }


def _line(row: dict[str, Any], turns: int) -> str:
    tps = f"{row['prefill_tps']:.0f}" if row["prefill_tps"] else "-"
    return (f"agent {row['phase']} turn {row['turn']}/{turns} ({row['api']}, {row['tool_choice']}): "
            f"{row['prompt_tokens']} prompt, {row['cached_tokens']} cached ({row['cached_fraction']:.1%}), "
            f"ttft {row['ttft_s']:.2f}s, prefill {tps} tok/s, {row['completion_tokens']} tokens"
            + (f" -> {', '.join(row['tool_calls'])}" if row["tool_calls"] else ""))


def run_phase(model: Path, home: Path, dtype: str, phase: str, indices: Sequence[int], transcript: dict[str, Any],
              seed: int, say: Callable[[str], None]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Start a server on `home`, send the requests `indices` in order, stop it: (rows, the server's record)."""
    server = ServerProcess.for_bench(model, home=home, dtype=dtype,
                                     progress=lambda m: say(f"agent {phase} server: {m}"))
    try:
        server.start()
        runner = AgentRunner(server, transcript, seed)
        runner.warm_up()
        rows = []
        for index in indices:
            rows.append(runner.send(index, phase))
            say(_line(rows[-1], len(transcript["turns"])))
        memory = server.memory()
    finally:
        server.stop()
    stored = server.telemetry([r["turn_id"] for r in rows if r["turn_id"]])  # flushed once the server stopped
    for row in rows:
        got = stored.get(row["turn_id"]) or {}
        row.update({k: got.get(k) for k in ("cache_miss_reason", "cache_restore_ms", "snapshot_id")})
    health = server.health_at_start
    return rows, {"phase": phase, "startup_seconds": server.startup_seconds, "exactness": health.get("exactness"),
                  "context_length": health.get("context_length"), "vm_hwm_bytes": memory.get("VmHWM")}


# -- the bench ----------------------------------------------------------------------------------


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a["token_sha"] == b["token_sha"] and a["reply_sha"] == b["reply_sha"]


def summarize(rows: list[dict[str, Any]], restart: list[dict[str, Any]], fresh: list[dict[str, Any]]) -> dict:
    """Counts, the cached shares against the goal, and whether the restarted and fresh replies equal the first."""
    by_turn = {r["turn"]: r for r in rows}
    later = [r for r in rows if r["turn"] > 1]
    below = [{**{k: r[k] for k in ("turn", "api", "tool_choice", "message", "prompt_tokens", "cached_tokens",
                                   "expected_cached_tokens", "cached_fraction", "cache_miss_reason")},
              "previous_snapshot_used": r["cached_tokens"] >= r["expected_cached_tokens"]}
             for r in later if r["cached_fraction"] < CACHED_GOAL]
    restart_ok = [r["cached_fraction"] >= CACHED_GOAL for r in restart]
    summary = {
        "turns": len(rows), "apis": dict(Counter(r["api"] for r in rows)),
        "tool_choices": dict(Counter(r["tool_choice"] for r in rows)),
        "first_prompt_tokens": rows[0]["prompt_tokens"], "last_prompt_tokens": rows[-1]["prompt_tokens"],
        "min_cached_fraction_after_first": min(r["cached_fraction"] for r in later),
        "mean_cached_fraction_after_first": round(sum(r["cached_fraction"] for r in later) / len(later), 4),
        "turns_below_goal": below,
        "first_turn_ttft_s": rows[0]["ttft_s"],
        "median_ttft_s_after_first": median_low(r["ttft_s"] for r in later),
        "restart_turns": [r["turn"] for r in restart],
        "restart_cached_fractions": [r["cached_fraction"] for r in restart],
        "restart_replies_equal": all(_same(r, by_turn[r["turn"]]) for r in restart),
        "fresh_cached_fractions": [r["cached_fraction"] for r in fresh],
        "replies_equal_fresh": all(_same(r, by_turn[r["turn"]]) for r in fresh),
        "goal": f"every request after the first has >= {CACHED_GOAL:.0%} of its prompt cached, also after a restart",
    }
    summary["goal_met"] = not below and all(restart_ok)
    summary["ok"] = summary["goal_met"] and summary["restart_replies_equal"] and summary["replies_equal_fresh"]
    return summary


def _extra_sections(path: Path, tokenizer: Any, entry: dict[str, Any], quick: bool, dtype: str, seed: int,
                    prefill_contexts: Sequence[int] | None, say: Callable[[str], None]) -> dict[str, Any]:
    """The `stall` and `prefill` sections (4 and 5 of METHOD); each sets its own server or engines up."""
    from agentfold.bench.prefill import PREFILL_CONTEXTS, QUICK_CONTEXTS, bench_prefill
    from agentfold.bench.stall import bench_stall

    say("bench agent: stall check (a decoding client beside another client's long prefill)")
    stall = bench_stall(path, tokenizer, entry["context_length"], quick=quick, dtype=dtype, seed=seed, progress=say)
    contexts = tuple(prefill_contexts or (QUICK_CONTEXTS if quick else PREFILL_CONTEXTS))
    say(f"bench agent: prefill rates at {', '.join(map(str, contexts))} tokens, agentfold vs mlx_lm")
    prefill = bench_prefill(path, entry["context_length"], contexts, dtype=dtype, seed=seed, progress=say)
    return {"stall": stall, "prefill": prefill}


def bench_agent(model: str | None = None, out: str | Path | None = "bench-results/agent.json", quick: bool = False,
                seed: int = 0, dtype: str = "float32", progress: Callable[[str], None] | None = None,
                prefill_contexts: Sequence[int] | None = None) -> dict[str, Any]:
    """Run the three phases, the stall check and the prefill rates; return the result (written as JSON
    to `out` unless it is None). `prefill_contexts`: default 1K, 4K, 16K (quick: 256)."""
    from agentfold.engine.mlx.loader import load_model
    from agentfold.serve.models import resolve

    say = progress or (lambda message: None)
    started = time.perf_counter()
    result: dict[str, Any] = {**run_header(SCHEMA, utc_timestamp(), quick, machine_info()), "seed": seed}
    path = resolve(model)
    say(f"bench agent: loading {path} in this process (tokenizer, context length)")
    loaded = load_model(path, dtype, say)
    entry = model_entry(loaded, dtype, "main")
    transcript = build_transcript(seed, loaded.tokenizer, quick)
    tokenizer = loaded.tokenizer  # the stall check counts its long prompt with it
    del loaded
    turns = transcript["turns"]
    last = turns[-1]["expected_prompt_tokens"] + turns[-1]["max_tokens"]
    if last > entry["context_length"]:
        raise BenchError(f"the transcript's last request needs {last} tokens, more than {entry['name']}'s "
                         f"context of {entry['context_length']}")
    say(f"bench agent: {len(turns)} requests, prompts from {turns[0]['expected_prompt_tokens']} to "
        f"{turns[-1]['expected_prompt_tokens']} tokens")
    tail = range(len(turns) - transcript["profile"]["restart_turns"], len(turns))
    with tempfile.TemporaryDirectory(prefix="agentfold-bench-agent-") as tmp:
        home = Path(tmp) / "home"
        rows, first = run_phase(path, home, dtype, "run", range(len(turns)), transcript, seed, say)
        restart, second = run_phase(path, home, dtype, "restart", tail, transcript, seed, say)
        fresh, third = run_phase(path, Path(tmp) / "fresh", dtype, "fresh", tail, transcript, seed, say)
    extra = _extra_sections(path, tokenizer, entry, quick, dtype, seed, prefill_contexts, say)
    result.update({
        "model": entry,
        "transcript": {"sha256": transcript["sha256"], "files": transcript["files"], "profile": transcript["profile"],
                       "tools": [t["function"]["name"] for t in TOOLS], "system_prompt_chars": len(SYSTEM_PROMPT),
                       "new_share_target": NEW_SHARE, "session_id": SESSION},
        "method": METHOD,
        "servers": [first, second, third],
        "turns": rows, "restart": restart, "fresh": fresh,
        **extra,
        "summary": {**summarize(rows, restart, fresh), **extra_summary(extra)},
    })
    if out is not None:
        finish_run(result, started, out)
    else:
        result["duration_seconds"] = round(time.perf_counter() - started, 3)
    s = result["summary"]
    say(f"bench agent: min cached after turn 1 {s['min_cached_fraction_after_first']:.1%}, "
        f"{len(s['turns_below_goal'])} below {CACHED_GOAL:.0%}, restart {s['restart_cached_fractions']}, "
        f"replies equal fresh: {s['replies_equal_fresh']}; stall_ok {s['stall_ok']} (max gap / solo p99 "
        f"{s['stall_ratio']}, goal {s['stall_goal_ratio']}); prefill agentfold/mlx_lm {s['prefill_ratios']}")
    return result


def extra_summary(extra: dict[str, Any]) -> dict[str, Any]:
    """The stall and prefill figures for the summary line. `ok` stays the session-cache verdict; the stall
    check has its own (`stall_ok`) so a noisy shared machine shows up there, not as a cache failure."""
    stall = extra["stall"]
    return {"stall_ok": stall["ok"], "stall_ratio": stall["max_gap_over_solo_p99"],
            "stall_goal_ratio": stall["goal_ratio"], "stall_max_gap_ms": stall["b_beside_prefill"]["max_gap_ms"],
            "stall_solo_p99_ms": stall["b_solo"]["itl_p99_ms"], "stall_prefill_tokens": stall["a"]["prompt_tokens"],
            "prefill_tps": {str(r["context"]): {"agentfold": r["agentfold"]["tps"], "mlx_lm": r["mlx_lm"]["tps"]}
                            for r in extra["prefill"]["rows"]},
            "prefill_ratios": {str(r["context"]): r["ratio"] for r in extra["prefill"]["rows"]}}


METHOD = {
    "transcript": "fixed: system prompt, 17 tools, scripted assistant turns (not the model's replies), tool results "
                  "from stdlib files picked by the seed, cut so a request's new tokens are <= 4% of its prompt",
    "requests": "each request sends the whole history plus its new message with session_id; even turns through "
                "the openai client (chat completions), odd turns through the anthropic client (messages), streamed, "
                "greedy, drafting on",
    "figures": "prompt_tokens, cached_tokens, ttft_ms, prefill_ms from the response's agentfold block; prefill_tps = "
               "(prompt - cached) / prefill_ms; api_cached_tokens is the API's own field",
    "restart": "a new server process on the same --home re-sends the last requests (cache from disk)",
    "fresh": "a server with an empty --home answers the same last requests; replies compared by token sha and text",
    "stall": "a server with --max-active 2: client B streams a drafted code edit alone (its solo chunk gaps, p99), "
             "then again while client A prefills a ~8K-token prompt (quick: ~2K); B's max gap beside A's prefill "
             "over its solo p99 must stay <= 3 and its reply must equal the solo one (details in stall.method)",
    "prefill": "in-process prefill tok/s of the engine (backend auto, max_tokens=1, no drafting) and of mlx_lm's "
               "stream_generate (its prompt_tps) on the same ids at 1K, 4K, 16K tokens (quick: 1K); 16K on Gemma 3 "
               "270M (MLX backend) beyond the bench model's window (details in prefill.method)",
}
