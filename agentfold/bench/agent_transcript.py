"""The agent bench's session: a fixed coding-agent transcript, sized with the model's own tokenizer.

A coding agent does not send one prompt: it sends the same long system prompt and tool list, the
whole conversation so far and one new message (a user request or a tool result), again and again,
with free and forced tool choice. To measure what the server reuses between such requests, the
requests must be the same on every run, so the transcript (`build_transcript`) is fixed: a long
system prompt, 17 tool schemas and 37 requests. The assistant turns of the history are scripted
(tool calls and short notes), not the model's replies. Tool results are real: lines, grep hits,
outlines and diffs of Python standard library files picked by the seed. Each result is cut so
that a request's new tokens are at most `NEW_SHARE` of its prompt (counted with the model's
tokenizer and the server's own chat rendering), within a prompt budget. `openai_messages` and
`anthropic_messages` give a request in each API's shape.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import random
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from agentfold.bench.workloads import pick_windows, stdlib_files

NEW_SHARE = 0.04  # the transcript is cut so that a request's new tokens are at most this share of its prompt
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
