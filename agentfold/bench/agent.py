"""`agentfold bench agent`: a scripted coding-agent session through both APIs, turn by turn.

A coding agent does not send one prompt: it sends the same long system prompt and tool list, the
whole conversation so far and one new message (a user request or a tool result), again and again,
with free and forced tool choice. What decides its latency is how much of each request the server
has already computed. This bench sends such a session to a real `agentfold serve`:

1. The transcript (`build_transcript`) is fixed: a long system prompt, 17 tool schemas and 37
   requests. The assistant turns of the history are scripted (tool calls and short notes), not the
   model's replies, so every run sends the same requests. Tool results are real: lines, grep hits,
   outlines and diffs of Python standard library files picked by the seed. Each result is cut so
   that a request's new tokens are at most `NEW_SHARE` of its prompt (counted with the model's
   tokenizer and the server's own chat rendering), within a prompt budget.
2. A server on a fresh home answers every request in one session (`session_id`), alternating the
   OpenAI Chat Completions and Anthropic Messages APIs (official clients, streamed). Prompt and
   cached tokens, TTFT and prefill rate come from each response's `agentfold` / `timings` blocks.
3. The server is restarted on the same home and the last requests are sent again: their KV cache
   must come back from the snapshots on disk.
4. A server with an empty home answers the same last requests: the replies must be equal.
"""

from __future__ import annotations

import datetime as _dt
import difflib
import hashlib
import json
import random
import re
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from statistics import median_low
from typing import Any

from agentfold.bench.decode import finish_run, machine_info, run_header
from agentfold.bench.server import REQUEST_TIMEOUT_S, BenchError, ServerProcess, client_for, dump_reply, stream_chat
from agentfold.bench.suite import WARMUP, _model_entry
from agentfold.bench.workloads import pick_windows, stdlib_files

SCHEMA = "agentfold.bench.decode.agent/1"
CACHED_GOAL = 0.95  # every request after the first has at least this share of its prompt cached
NEW_SHARE = 0.04  # the transcript is cut so that a request's new tokens are at most this share of its prompt
SESSION = "bench-agent"
TASKS = 4
PROFILES = {  # reply budgets, requests re-sent after the restart, prompt budget, tool result lines at most
    "full": {"reply_tokens": 16, "call_tokens": 48, "restart_turns": 3, "prompt_cap": 7000, "lines": 40},
    # one-line results: 37 requests of ~60-120 new tokens (a scripted call and a result) reach ~5,100 tokens
    "quick": {"reply_tokens": 8, "call_tokens": 32, "restart_turns": 2, "prompt_cap": 5500, "lines": 1},
}
SYSTEM_PROMPT = """You are a coding agent working in a checkout of a Python library, together with the user.

How you work:
- You act only through the tools listed below; never claim to have read, run or changed anything you did not do \
with a tool. Read before you edit: look at a file, or at least grep it, before you change it.
- Keep every change minimal and focused on the task. Do not reformat code you do not touch, do not rename \
anything you were not asked to rename, and keep public behaviour identical unless the task says otherwise.
- After an edit, run the relevant tests, then show the diff. If a test fails, read the failure, fix the cause \
and run the tests again; never delete or weaken a test to make it pass.
- Prefer `replace_in_file` for small edits and `write_file` only for new files. Paths are relative to the \
repository root. Use `grep` and `outline` to find definitions and callers instead of reading whole files.
- Keep a short task list with `todo_write` when a request has several steps, and mark items done as you go.
- When a request is ambiguous, ask with `ask_user` instead of guessing. Do not commit unless asked to.

Style of your replies:
- Be brief: one or two sentences between tool calls, and a short summary at the end of a task saying what \
changed, where, and how it was checked.
- Quote code only when it helps the user decide something. Never paste a whole file back.
- Name files as `path/to/file.py` and functions as `name()`.

Repository conventions:
- Private helpers start with an underscore. They are not public API, but other modules of the package may call \
them, so a rename updates every caller in the repository.
- Tests mirror the module names (`tests/test_<module>.py`) and are plain pytest functions: no network, no sleeps, \
no randomness without a seed.
- Docstrings say what a function returns and when it raises; keep them in step with renames and signatures.
- Follow the existing formatting: four spaces, lines up to 120 characters, double quotes. Maintainers write the \
changelog; do not edit it.

Tool results are plain text. Long results are cut and end with a line saying how many lines were left out: ask \
for a narrower range instead of reading the same file again. A failed call returns a line starting with \
`Error:`; read it and correct the call instead of repeating it.

The repository is a plain Python package with its tests under `tests/`. The Python version is the one of the \
local interpreter; no network access is available, and nothing may be installed."""


def _tool(name: str, description: str, required: Sequence[str] = (), /, **properties: tuple[str, str]) -> dict:
    props = {key: {"type": kind, "description": text} for key, (kind, text) in properties.items()}
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": props, "required": list(required)}}}


STR, INT, BOOL = "string", "integer", "boolean"
PATH = (STR, "path relative to the repository root")
TOOLS = [
    _tool("read_file", "Read a text file of the repository, optionally a range of lines.", ["path"], path=PATH,
          start_line=(INT, "first line, 1-based"), end_line=(INT, "last line, inclusive")),
    _tool("write_file", "Create or overwrite a file with the given content.", ["path", "content"], path=PATH,
          content=(STR, "the complete new content")),
    _tool("replace_in_file", "Replace exact text in a file; fails if `old` does not occur.", ["path", "old", "new"],
          path=PATH, old=(STR, "exact text to find"), new=(STR, "replacement text"),
          count=(INT, "occurrences to replace (default: all)")),
    _tool("list_dir", "List the entries of a directory with their sizes in bytes.", ["path"], path=PATH,
          depth=(INT, "levels to descend (default 1)")),
    _tool("find_files", "Find files whose path matches a glob pattern.", ["pattern"],
          pattern=(STR, "glob such as **/*.py"), path=(STR, "directory to search (default: the root)")),
    _tool("grep", "Search file contents with a regular expression; returns path:line: text.", ["pattern"],
          pattern=(STR, "Python regular expression"), path=(STR, "file or directory"),
          ignore_case=(BOOL, "case-insensitive match"), max_results=(INT, "stop after this many matches")),
    _tool("outline", "List the classes and functions defined in a Python file, with line numbers.", ["path"],
          path=PATH),
    _tool("run_tests", "Run pytest on a path and return its summary.", [], path=(STR, "test file or directory"),
          keyword=(STR, "only tests matching this -k expression"), verbose=(BOOL, "list every test")),
    _tool("run_command", "Run a shell command in the repository and return its output.", ["command"],
          command=(STR, "the command line"), timeout_s=(INT, "seconds before it is killed")),
    _tool("python_eval", "Run a short Python snippet in a fresh interpreter and return its stdout.", ["code"],
          code=(STR, "Python source")),
    _tool("git_status", "Show the working tree status in short format."),
    _tool("git_diff", "Show the unified diff of uncommitted changes.", [], path=(STR, "limit to this path"),
          staged=(BOOL, "diff the index instead of the working tree")),
    _tool("git_log", "Show recent commits, newest first.", [], path=(STR, "limit to this path"),
          limit=(INT, "number of commits")),
    _tool("git_commit", "Stage the given paths and commit.", ["message"], message=(STR, "commit message"),
          paths=(STR, "space-separated paths to stage first")),
    _tool("show_docs", "Return the signature and docstring of a Python object by dotted name.", ["name"],
          name=(STR, "dotted name such as json.dumps")),
    _tool("todo_write", "Replace the task list shown to the user.", ["items"],
          items=(STR, "one task per line, prefixed with [ ] or [x]")),
    _tool("ask_user", "Ask the user a question and wait for the answer.", ["question"], question=(STR, "the question")),
]
ANTHROPIC_TOOLS = [{"name": t["function"]["name"], "description": t["function"]["description"],
                    "input_schema": t["function"]["parameters"]} for t in TOOLS]


# -- the script ---------------------------------------------------------------------------------


def _call(name: str, text: str = "", **arguments: Any) -> dict[str, Any]:
    """A scripted assistant turn: a short note and/or one tool call (its id is set when the script is built)."""
    return {"role": "assistant", "text": text, "calls": [{"name": name, "input": arguments}] if name else []}


def _say(text: str) -> dict[str, Any]:
    return _call("", text)


def _task_steps(k: int, window: dict[str, Any]) -> list[dict[str, Any]]:
    """Eight requests of one rename task on a real stdlib file: find, read, grep, outline, edit, test, diff."""
    path, (old, new), (first, last) = window["file"], window["rename"], window["line_span"]
    source = Path(window["path"]).read_text(encoding="utf-8")
    lines = source.splitlines()
    hits = [f"{path}:{n}: {line.strip()}" for n, line in enumerate(lines, 1) if f"{old}(" in line]
    defs = [f"{path}:{n}: {line.strip()}" for n, line in enumerate(lines, 1)
            if re.match(r"\s*(async def|def|class) ", line)]
    renamed = window["text"].replace(f"{old}(", f"{new}(")
    diff = list(difflib.unified_diff(window["text"].splitlines(), renamed.splitlines(), f"a/{path}", f"b/{path}",
                                     n=1, lineterm=""))
    test = f"tests/test_{Path(path).stem.lstrip('_')}.py"
    tests = 12 + 7 * k
    numbered = [f"{n:>5}  {line}" for n, line in enumerate(window["text"].splitlines(), first)]
    return [
        {"user": f"Task {k + 1}: rename `{old}` to `{new}` in `{path}` and update every call to it. Behaviour must "
                 "not change.", "choice": "required" if k % 2 else "auto",
         "then": _call("grep", "I'll find the definition first.", pattern=rf"def {old}\(", path=path)},
        {"result": [h for h in hits if "def " in h] or hits[:1],
         "then": _call("read_file", path=path, start_line=first, end_line=last)},
        {"result": numbered, "choice": {"name": "grep"} if k % 2 else "auto",
         "then": _call("grep", pattern=rf"{old}\(", path=".")},
        {"result": hits, "then": _call("outline", path=path)},
        {"result": defs, "choice": "auto" if k % 2 else {"name": "replace_in_file"},
         "then": _call("replace_in_file", path=path, old=f"{old}(", new=f"{new}(")},
        {"result": [f"Replaced {source.count(f'{old}(')} occurrences in {path}."],
         "choice": {"name": "run_tests"} if k < 2 else "auto", "then": _call("run_tests", path=test)},
        {"result": [f"{test} {'.' * tests} [100%]", f"{tests} passed in 0.{31 + 9 * k}s"],
         "user": "Show me the diff before we move on.", "then": _call("git_diff", path=path)},
        {"result": diff, "then": _say(f"Renamed `{old}()` to `{new}()` in `{path}` "
                                      f"({len(hits)} places); {tests} tests pass.")},
    ]


def plan_steps(seed: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The requests of the session before sizing: (steps, the stdlib windows they work on)."""
    windows = pick_windows(seed, TASKS)
    files = [p for p in stdlib_files() if p.name not in {w["file"] for w in windows}]
    random.Random(f"agent:{seed}").shuffle(files)
    listing = sorted([*files[:26], *(Path(w["path"]) for w in windows)])
    todo = "\n".join(f"[ ] {w['rename'][0]}" for w in windows)
    steps = [
        {"user": "I need four functions renamed in this library (callers included). Get an overview of the "
                 "package first, then plan.", "then": _call("list_dir", path=".")},
        {"result": [f"{p.name:<28}{p.stat().st_size:>9}" for p in listing], "then": _call("todo_write", items=todo)},
        {"result": ["Task list updated (4 items)."], "then": _say("Plan is set; I'll take the renames one by one.")},
    ]
    for k, window in enumerate(windows):
        steps += _task_steps(k, window)
    steps += [
        {"user": "All four renames are done. Commit them with a short message.", "choice": {"name": "git_commit"},
         "then": _call("git_commit", message="Rename four helpers", paths=" ".join(w["file"] for w in windows))},
        {"result": ["[main 4f2a9c1] Rename four helpers", " 4 files changed, 18 insertions(+), 18 deletions(-)"],
         "then": _say("Committed as 4f2a9c1.")},
    ]
    return steps, windows


def openai_messages(system: str, entries: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = [{"role": "system", "content": system}]
    for e in entries:
        if e["role"] == "assistant":
            message: dict[str, Any] = {"role": "assistant", "content": e["text"] or None}
            if e["calls"]:
                message["tool_calls"] = [{"id": c["id"], "type": "function", "function": {
                    "name": c["name"], "arguments": json.dumps(c["input"], ensure_ascii=False)}} for c in e["calls"]]
            out.append(message)
        elif e["role"] == "tool":
            out.append({"role": "tool", "tool_call_id": e["id"], "content": e["text"]})
        else:
            out.append({"role": "user", "content": e["text"]})
    return out


def anthropic_messages(entries: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Anthropic's shape: tool results and the user's text that follows them form one user message."""
    out: list[dict[str, Any]] = []
    for e in entries:
        if e["role"] == "assistant":
            blocks = [{"type": "text", "text": e["text"]}] if e["text"] else []
            out.append({"role": "assistant", "content": blocks + [
                {"type": "tool_use", "id": c["id"], "name": c["name"], "input": c["input"]} for c in e["calls"]]})
            continue
        block = ({"type": "tool_result", "tool_use_id": e["id"], "content": e["text"]} if e["role"] == "tool"
                 else {"type": "text", "text": e["text"]})
        if out and out[-1]["role"] == "user":
            out[-1]["content"].append(block)
        else:
            out.append({"role": "user", "content": [block]})
    return out


def _choice_kind(choice: Any) -> str:
    return "named" if isinstance(choice, dict) else choice


def _new_entries(step: dict[str, Any], call_id: str | None, keep: int) -> list[dict[str, Any]]:
    new = []
    if "result" in step:
        lines = step["result"]
        text = "\n".join(lines[:keep]) + (f"\n[{len(lines) - keep} more lines]" if keep < len(lines) else "")
        new.append({"role": "tool", "id": call_id or "", "text": text})
    if "user" in step:
        new.append({"role": "user", "text": step["user"]})
    return new


def build_transcript(seed: int, tokenizer: Any, quick: bool = False) -> dict[str, Any]:
    """The session's requests, each tool result cut so its request's new tokens stay within `NEW_SHARE`."""
    from agentfold.chat.template import render_chat, trailing_instruction

    profile = PROFILES["quick" if quick else "full"]
    steps, windows = plan_steps(seed)

    def count(entries: list[dict[str, Any]], generation: bool = True, trailing: str | None = None) -> int:
        text = render_chat(tokenizer, openai_messages(SYSTEM_PROMPT, entries), TOOLS,
                           add_generation_prompt=generation, trailing=trailing)
        return len(tokenizer.encode(text, add_special_tokens=False))

    history: list[dict[str, Any]] = []
    turns: list[dict[str, Any]] = []
    sent: list[dict[str, Any]] | None = None  # the previous request's entries
    for index, step in enumerate(steps):
        choice = step.get("choice", "auto")
        trailing = trailing_instruction(choice) or None
        call_id = history[-1]["calls"][0]["id"] if history and history[-1]["calls"] else None
        cached = count(sent, generation=False) if sent else 0
        limit = min(int(cached / (1 - NEW_SHARE)),
                    cached + max(0, profile["prompt_cap"] - cached) // (len(steps) - index)) if sent else None
        total = len(step.get("result", []))
        keep = min(total, profile["lines"])
        while keep > 1 and limit is not None and count(history + _new_entries(step, call_id, keep),
                                                       trailing=trailing) > limit:
            keep = max(1, min(keep - 1, keep * 3 // 4))
        new = _new_entries(step, call_id, keep)
        prompt = count(history + new, trailing=trailing)
        then = {**step["then"], "calls": [{**c, "id": f"toolu_{index:03d}"} for c in step["then"]["calls"]]}
        turns.append({"turn": index + 1, "api": "openai" if index % 2 == 0 else "anthropic", "choice": choice,
                      "tool_choice": _choice_kind(choice), "new": new, "then": then,
                      "max_tokens": profile["reply_tokens" if choice == "auto" else "call_tokens"],
                      "expected_prompt_tokens": prompt, "expected_cached_tokens": cached,
                      "result_lines": [keep, total] if total else None})
        sent = history + new
        history = sent + [then]
    text = json.dumps([t["new"] for t in turns] + [t["then"] for t in turns], sort_keys=True)
    return {"system": SYSTEM_PROMPT, "turns": turns, "profile": profile,
            "files": [{k: w[k] for k in ("file", "line_span", "rename")} for w in windows],
            "sha256": hashlib.sha256((SYSTEM_PROMPT + text).encode()).hexdigest()}


def entries_for(transcript: dict[str, Any], index: int) -> list[dict[str, Any]]:
    """The history request `index` sends: every earlier request's messages and scripted reply, then its own."""
    turns = transcript["turns"]
    return [e for t in turns[:index] for e in [*t["new"], t["then"]]] + turns[index]["new"]


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
    server = ServerProcess(model, home=home, dtype=dtype, progress=lambda m: say(f"agent {phase} server: {m}"))
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
    return rows, {"phase": phase, "startup_seconds": server.startup_seconds, "exactness": server.health.get(
        "exactness"), "context_length": server.health.get("context_length"), "vm_hwm_bytes": memory.get("VmHWM")}


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


def bench_agent(model: str | None = None, out: str | Path | None = "bench-results/agent.json", quick: bool = False,
                seed: int = 0, dtype: str = "float32", progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run the three phases and return the result (written as JSON to `out` unless it is None)."""
    from agentfold.engine.mlx.loader import load_model
    from agentfold.serve.models import resolve

    say = progress or (lambda message: None)
    started = time.perf_counter()
    timestamp = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    result: dict[str, Any] = {**run_header(SCHEMA, timestamp, quick, machine_info()), "seed": seed}
    path = resolve(model)
    say(f"bench agent: loading {path} in this process (tokenizer, context length)")
    loaded = load_model(path, dtype, say)
    model_entry = _model_entry(loaded, dtype, "main")
    transcript = build_transcript(seed, loaded.tokenizer, quick)
    del loaded
    turns = transcript["turns"]
    last = turns[-1]["expected_prompt_tokens"] + turns[-1]["max_tokens"]
    if last > model_entry["context_length"]:
        raise BenchError(f"the transcript's last request needs {last} tokens, more than {model_entry['name']}'s "
                         f"context of {model_entry['context_length']}")
    say(f"bench agent: {len(turns)} requests, prompts from {turns[0]['expected_prompt_tokens']} to "
        f"{turns[-1]['expected_prompt_tokens']} tokens")
    tail = range(len(turns) - transcript["profile"]["restart_turns"], len(turns))
    with tempfile.TemporaryDirectory(prefix="agentfold-bench-agent-") as tmp:
        home = Path(tmp) / "home"
        rows, first = run_phase(path, home, dtype, "run", range(len(turns)), transcript, seed, say)
        restart, second = run_phase(path, home, dtype, "restart", tail, transcript, seed, say)
        fresh, third = run_phase(path, Path(tmp) / "fresh", dtype, "fresh", tail, transcript, seed, say)
    result.update({
        "model": model_entry,
        "transcript": {"sha256": transcript["sha256"], "files": transcript["files"], "profile": transcript["profile"],
                       "tools": [t["function"]["name"] for t in TOOLS], "system_prompt_chars": len(SYSTEM_PROMPT),
                       "new_share_target": NEW_SHARE, "session_id": SESSION},
        "method": METHOD,
        "servers": [first, second, third],
        "turns": rows, "restart": restart, "fresh": fresh,
        "summary": summarize(rows, restart, fresh),
    })
    if out is not None:
        finish_run(result, started, out)
    else:
        result["duration_seconds"] = round(time.perf_counter() - started, 3)
    s = result["summary"]
    say(f"bench agent: min cached after turn 1 {s['min_cached_fraction_after_first']:.1%}, "
        f"{len(s['turns_below_goal'])} below {CACHED_GOAL:.0%}, restart {s['restart_cached_fractions']}, "
        f"replies equal fresh: {s['replies_equal_fresh']}")
    return result


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
}
