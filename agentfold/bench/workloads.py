"""Agent workloads for `agentfold bench all`, built from the Python standard library on this machine.

A coding agent's turns are not a chat prompt: the context opens with files the agent has read, the
user pastes code and asks for an edit, the model calls tools and reads their results. Each session
here is such a conversation over real source files, picked deterministically from a seed, so two
runs (and two machines with the same Python) send the same requests:

- `agent-edit`: the user pastes a 60-80 line window of a stdlib module, asks what a function does,
  then asks for the window back with that function renamed (SmolLM2-135M stops copying past about
  1,000 tokens, so the window is short, as in `agentfold bench decode`).
- `agent-tool`: the model is asked for a rename and must call `read_file` (a forced call, decoded
  under the tool's grammar), reads the file as a tool message, calls `replace_in_file`, reads its
  result and continues.
- `fresh-code` and `prose`: writing with nothing to copy from, for contrast.

Every session's first prompt is padded to a target context (1K, 4K, 16K tokens) with further
stdlib files as "open files" in the system message, chosen and cut per session and context so
that no two sessions share a cached prefix. Later turns depend on the model's replies (the runner
appends them); the user and tool messages do not.
"""

from __future__ import annotations

import ast
import hashlib
import os
import random
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

KINDS = ("agent-edit", "agent-tool", "fresh-code", "prose")
WINDOW_LINES = (60, 80)  # the pasted window is this many lines, at most WINDOW_CHARS characters
WINDOW_CHARS = 2600  # about 700 SmolLM2 tokens: a 1K context still has room for the question
SKIP_FILES = {"this.py", "antigravity.py", "__hello__.py", "__phello__.py"}
SYSTEM_INTRO = ("You are a coding agent working in a Python repository. Answer briefly and precisely. "
                "These files are open in the editor:")
MAX_TOKENS = {  # (full, quick) reply budget per turn
    "explain": (48, 12), "edit": (160, 16), "read_call": (64, 48), "edit_call": (128, 96), "answer": (64, 12),
    "fresh": (128, 16), "tests": (96, 12), "story": (96, 16), "more": (64, 12),
}
QUICK_TOOL_LINES = 24  # --quick: lines of the file the read_file result returns
QUICK_TURNS = {"agent-edit": 2, "agent-tool": 2, "fresh-code": 1, "prose": 1}
FRESH_CODE_TASKS = (
    "`merge_intervals(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]` that merges overlapping closed "
    "intervals and returns them sorted by start",
    "`parse_duration(text: str) -> int` that turns strings like '1h30m' or '45s' into seconds and raises "
    "ValueError on bad input",
    "`chunked(items: list, size: int) -> list[list]` that splits a list into consecutive chunks of at most "
    "`size` items",
    "`lru_get(cache: dict, order: list, key: str, limit: int)` that implements a tiny least-recently-used lookup",
)
STORY_TOPICS = (
    "an old lighthouse keeper who finds a message in a bottle on her last day at work",
    "a night-shift baker who hears a knock on the back door at 3 a.m.",
    "a cartographer asked to map a town that changes overnight",
    "two rival beekeepers forced to share a single hive",
)
TOOLS = [
    {"type": "function", "function": {
        "name": "read_file", "description": "Read a file of the repository and return its text.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}},
    {"type": "function", "function": {
        "name": "replace_in_file", "description": "Replace every occurrence of `old` with `new` in a file.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "old": {"type": "string"},
                                                         "new": {"type": "string"}},
                       "required": ["path", "old", "new"]}}},
    {"type": "function", "function": {
        "name": "run_tests", "description": "Run the test suite of a module and return the summary line.",
        "parameters": {"type": "object", "properties": {"module": {"type": "string"}}, "required": ["module"]}}},
]

Counter = Callable[[list[dict[str, Any]], list[dict[str, Any]] | None, str | None], int]


# -- picking real code --------------------------------------------------------------------------


def stdlib_dir() -> Path:
    return Path(os.path.dirname(os.__file__))


def stdlib_files() -> list[Path]:
    """Top-level stdlib modules, sorted by name (the population every pick is drawn from)."""
    return sorted(p for p in stdlib_dir().glob("*.py") if p.name not in SKIP_FILES)


def _read(path: Path) -> str | None:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    return text if text.isascii() and "\t" not in text else None


def _rename_window(path: Path) -> dict[str, Any] | None:
    """A window of WINDOW_LINES around a function that is called in it, or None if the file has none."""
    text = _read(path)
    if text is None:
        return None
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return None
    lines = text.splitlines()
    defs = sorted((node.lineno, node.name) for node in ast.walk(tree)
                  if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                  and len(node.name) >= 4 and not node.name.startswith("__"))
    calls: dict[str, list[int]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            name = getattr(node.func, "id", getattr(node.func, "attr", None))
            if name:
                calls.setdefault(name, []).append(node.lineno)
    for size in range(WINDOW_LINES[1], WINDOW_LINES[0] - 1, -10):
        for line, name in defs:
            if sum(1 for _, n in defs if n == name) != 1:
                continue  # one definition, so the rename is unambiguous
            users = [c for c in calls.get(name, []) if abs(c - line) < size - 2 and c != line]
            if not users:
                continue
            first, last = min([line, *users]), max([line, *users])
            if last - first + 1 > size:
                continue
            start = max(0, min(len(lines) - size, (first + last) // 2 - size // 2))
            window = "\n".join(lines[start:start + size]) + "\n"
            new = "new_" + name.lstrip("_")
            if len(window) > WINDOW_CHARS or new in text or window.count(f"{name}(") < 2:
                continue
            return {"file": path.name, "path": str(path), "line_span": [start + 1, start + size],
                    "lines": size, "rename": [name, new], "text": window,
                    "sha256": hashlib.sha256(window.encode()).hexdigest()}
    return None


def pick_windows(seed: int, count: int) -> list[dict[str, Any]]:
    """`count` rename windows from distinct stdlib files, in the order a seeded shuffle visits them."""
    files = stdlib_files()
    random.Random(f"windows:{seed}").shuffle(files)
    picked = []
    for path in files:
        window = _rename_window(path)
        if window is not None:
            picked.append(window)
            if len(picked) == count:
                return picked
    raise FileNotFoundError(f"only {len(picked)} stdlib files in {stdlib_dir()} have a function to rename")


def filler_files(seed: int, key: str, exclude: Sequence[str]) -> list[Path]:
    """The stdlib files that pad one session's context, in a seeded order of their own per `key`."""
    files = [p for p in stdlib_files() if p.name not in exclude and _read(p) is not None]
    random.Random(f"filler:{seed}:{key}").shuffle(files)
    return files


# -- sessions -----------------------------------------------------------------------------------


def session_plans(seed: int = 0, quick: bool = False) -> list[dict[str, Any]]:
    """The four sessions without context padding: which files, renames and prompts (no tokenizer needed)."""
    edit, tool = pick_windows(seed, 2)
    rng = random.Random(f"prompts:{seed}")
    task, topic = rng.choice(FRESH_CODE_TASKS), rng.choice(STORY_TOPICS)

    def budget(name: str) -> int:
        return MAX_TOKENS[name][1 if quick else 0]

    old, new = edit["rename"]
    t_old, t_new = tool["rename"]
    forced = {"type": "function", "function": {"name": "read_file"}}
    plans = [
        {"name": "agent-edit", "kind": "code",
         "description": f"paste {edit['file']} lines {edit['line_span'][0]}-{edit['line_span'][1]}, "
                        f"ask about {old}, then re-emit it renaming {old} -> {new}",
         "source": {k: v for k, v in edit.items() if k != "text"},
         "turns": [
             {"user": f"Here is `{edit['file']}` lines {edit['line_span'][0]}-{edit['line_span'][1]}:\n\n"
                      f"```python\n{edit['text']}```\n\nWhat does `{old}` do? Answer in two sentences.",
              "category": "prose", "max_tokens": budget("explain")},
             {"user": f"Rename the function `{old}` to `{new}` in that code, updating every call to it. Change "
                      "nothing else. Reply with the complete updated code in one ```python code block.",
              "category": "code", "max_tokens": budget("edit")},
         ]},
        {"name": "agent-tool", "kind": "tool",
         "description": f"forced read_file of {tool['file']}, the file as a tool result, forced replace_in_file "
                        f"{t_old} -> {t_new}, its result, then a reply",
         "source": {k: v for k, v in tool.items() if k != "text"},
         "tools": TOOLS,
         "turns": [
             {"user": f"In `{tool['file']}`, rename the function `{t_old}` to `{t_new}`. Read the file first.",
              "tool_choice": forced, "category": "tool_call", "max_tokens": budget("read_call")},
             {"tool_result": f"{tool['file']} lines {tool['line_span'][0]}-{tool['line_span'][1]}:\n{tool['text']}",
              "tool_choice": {"type": "function", "function": {"name": "replace_in_file"}},
              "category": "tool_call", "max_tokens": budget("edit_call")},
             {"tool_result": f"Replaced {tool['text'].count(t_old + '(')} occurrences of `{t_old}` with "
                             f"`{t_new}` in {tool['file']}.",
              "tool_choice": "auto", "category": "prose", "max_tokens": budget("answer")},
         ]},
        {"name": "fresh-code", "kind": "code", "description": "write a new Python function, then tests for it",
         "turns": [
             {"user": f"Write a Python function {task}. Include a docstring and type hints. Reply with the code only.",
              "category": "code", "max_tokens": budget("fresh")},
             {"user": "Now write three pytest tests for that function.", "category": "code",
              "max_tokens": budget("tests")},
         ]},
        {"name": "prose", "kind": "prose", "description": "a short story, then one more paragraph",
         "turns": [
             {"user": f"Write a short story of three paragraphs about {topic}. Use vivid, concrete details.",
              "category": "prose", "max_tokens": budget("story")},
             {"user": "Continue the story with one more paragraph.", "category": "prose",
              "max_tokens": budget("more")},
         ]},
    ]
    if quick:  # the turns that exercise something the others do not; the file comes back, read freely
        for plan in plans:
            plan["turns"] = plan["turns"][:QUICK_TURNS[plan["name"]]]
        head = "\n".join(tool["text"].splitlines()[:QUICK_TOOL_LINES])  # the forced call's instruction leaves
        plans[1]["turns"][1].update(  # nothing cached for this turn: keep its prefill short
            tool_result=f"{tool['file']} lines {tool['line_span'][0]}-{tool['line_span'][0] + QUICK_TOOL_LINES - 1}:"
                        f"\n{head}\n", tool_choice="auto", category="prose", max_tokens=budget("answer"))
        plans[1]["description"] = f"forced read_file of {tool['file']}, the file as a tool result, then a reply"
    return plans


def first_messages(plan: dict[str, Any], system: str) -> list[dict[str, Any]]:
    """The messages of a session's first request: the system message and turn 1's user message."""
    return [{"role": "system", "content": system}, {"role": "user", "content": plan["turns"][0]["user"]}]


def _open_files(paths: Sequence[Path]) -> str:
    return "".join(f"\n\n### {path.name}\n```python\n{_read(path)}```" for path in paths)


def pad_to_context(plan: dict[str, Any], context: int, seed: int, encode: Callable[[str], list[int]],
                   decode: Callable[[list[int]], str], count: Counter) -> dict[str, Any]:
    """`plan` with a system message of open files sized so the first prompt is about `context` tokens.

    `encode` / `decode` are the model's tokenizer (no special tokens); `count(messages, tools, trailing)` is
    the prompt length the server will see. The result records the target and the prompt it reached.
    """
    from agentfold.chat.template import trailing_instruction

    exclude = [plan["source"]["file"]] if plan.get("source") else []
    files = filler_files(seed, f"{plan['name']}:{context}", exclude)
    tools = plan.get("tools")
    choice = plan["turns"][0].get("tool_choice")
    if isinstance(choice, dict):  # the OpenAI shape; the server's instruction names the function
        choice = {"name": choice["function"]["name"]}
    trailing = trailing_instruction(choice) or None  # a forced first call's instruction is in the prompt too
    base = count(first_messages(plan, SYSTEM_INTRO), tools, trailing)
    need = context - base
    text, used = "", []
    for path in files:  # a little more text than needed, then cut at a token boundary
        if need <= 0 or len(text) > 5 * need:
            break
        text += _open_files([path])
        used.append(path.name)
    ids = encode(text)
    take = max(0, need)
    system = SYSTEM_INTRO
    for _ in range(3):  # re-tokenizing a cut can shift the count by a few tokens: correct twice
        system = SYSTEM_INTRO + (decode(ids[:take]) if take else "")
        reached = count(first_messages(plan, system), tools, trailing)
        if reached == context or take == 0:
            break
        take = max(0, min(len(ids), take + context - reached))
    sized = dict(plan)
    sized.update({"context": context, "system": system, "context_files": used,
                  "first_prompt_tokens": reached,
                  "system_sha256": hashlib.sha256(system.encode()).hexdigest()})
    return sized


def build_sessions(seed: int, context: int, tokenizer: Any, quick: bool = False,
                   kinds: Sequence[str] = KINDS) -> list[dict[str, Any]]:
    """The sessions of `kinds` for one context size, padded with `tokenizer` (deterministic per seed)."""
    from agentfold.chat.template import render_chat

    def count(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, trailing: str | None) -> int:
        text = render_chat(tokenizer, messages, tools, trailing=trailing)
        return len(tokenizer.encode(text, add_special_tokens=False))

    def encode(text: str) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=False))

    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids)

    return [pad_to_context(plan, context, seed, encode, decode, count)
            for plan in session_plans(seed, quick) if plan["name"] in kinds]


def describe(session: dict[str, Any]) -> dict[str, Any]:
    """A session for the JSON: everything but the message texts (their hashes stand in for them)."""
    turns = []
    for turn in session["turns"]:
        text = turn.get("user") or turn.get("tool_result") or ""
        row = {k: v for k, v in turn.items() if k not in ("user", "tool_result")}
        row.update({"message": "user" if "user" in turn else "tool", "chars": len(text),
                    "sha256": hashlib.sha256(text.encode()).hexdigest()})
        turns.append(row)
    keep = ("name", "kind", "description", "source", "context", "context_files", "first_prompt_tokens",
            "system_sha256")
    out = {k: session[k] for k in keep if k in session}
    out["tools"] = [t["function"]["name"] for t in session.get("tools") or []]
    out["turns"] = turns
    return out
