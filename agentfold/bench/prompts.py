"""The decode bench's three fixed workloads, built from files every Python install has.

Two machines bench the same prompts only if the prompts come from what both have: (a) code-edit
re-emits a real stdlib module with one small rename (where suffix lookup drafting pays), (b)
fresh-code writes a new function, (c) prose writes a paragraph. The offload and quality benches
reuse them (and `encode_chat`, the chat rendering every in-process bench uses).
"""

from __future__ import annotations

import ast
import hashlib
import os
from typing import Any

# (file, function to rename, new name): the first one present in this Python's stdlib is used.
CODE_EDIT_WINDOW = 70  # lines the full code-edit workload re-emits
CODE_EDIT_SOURCES = (
    ("colorsys.py", "_v", "_hue_to_channel"),
    ("sched.py", "enterabs", "enter_absolute"),
    ("bisect.py", "insort_right", "insert_sorted_right"),
    ("textwrap.py", "dedent", "remove_common_indent"),
)
CODE_EDIT_MAX_LINES = 180  # a longer file is cut to its first CODE_EDIT_CUT_LINES lines
CODE_EDIT_CUT_LINES = 150

FRESH_CODE_PROMPT = (
    "Write a Python function `merge_intervals(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]` "
    "that merges overlapping closed intervals and returns them sorted by start. Include a docstring, "
    "type hints, and handle an empty list. Reply with the code only."
)
PROSE_PROMPT = (
    "Write a short story of three paragraphs about an old lighthouse keeper who finds a message in a "
    "bottle on the morning of her last day at work. Use vivid, concrete details."
)
WARMUP_PROMPT = "Say hello in one short sentence."


def _excerpt(source: str, old: str) -> tuple[str, list[int]]:
    """The functions that define or call `old`, with the lines between them (1-based span)."""
    spans = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        calls = any(isinstance(n, ast.Call) and getattr(n.func, "id", getattr(n.func, "attr", None)) == old
                    for n in ast.walk(node))
        if node.name == old or calls:
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            spans.append((first, node.end_lineno or node.lineno))
    first, last = min(s for s, _ in spans), max(e for _, e in spans)
    lines = source.splitlines()[first - 1 : last]
    return "\n".join(lines) + "\n", [first, last]


def code_edit_source(excerpt: bool = False) -> dict[str, Any]:
    """The stdlib file the code-edit workload re-emits, and the rename it asks for.

    The whole file (cut to its first lines if long); `excerpt` keeps only the functions that
    define or call the renamed one (the quick bench's short prompt).
    """
    stdlib = os.path.dirname(os.__file__)
    for name, old, new in CODE_EDIT_SOURCES:
        path = os.path.join(stdlib, name)
        if not os.path.isfile(path):
            continue
        with open(path, encoding="utf-8") as handle:
            lines = handle.read().splitlines()
        if len(lines) > CODE_EDIT_MAX_LINES:
            lines = lines[:CODE_EDIT_CUT_LINES]
        source = "\n".join(lines) + "\n"
        if f"def {old}(" not in source:
            continue
        span = [1, len(lines)]
        if excerpt:
            source, span = _excerpt(source, old)
        elif len(lines) > CODE_EDIT_WINDOW:
            # SmolLM2-135M stops copying past ~1,000 tokens (it answers a few ``` fences), so the
            # full workload is a 70-line window around the renamed function and its callers
            _, (first, last) = _excerpt(source, old)
            start = max(0, min(len(lines) - CODE_EDIT_WINDOW, (first + last) // 2 - CODE_EDIT_WINDOW // 2))
            source = "\n".join(lines[start : start + CODE_EDIT_WINDOW]) + "\n"
            span = [start + 1, start + CODE_EDIT_WINDOW]
        return {
            "file": path,
            "lines": source.count("\n"),
            "line_span": span,
            "excerpt": excerpt,
            "sha256": hashlib.sha256(source.encode()).hexdigest(),
            "rename": [old, new],
            "source": source,
        }
    raise FileNotFoundError(f"none of {[s[0] for s in CODE_EDIT_SOURCES]} found in {stdlib}")


def workloads(quick: bool = False) -> list[dict[str, Any]]:
    """The three fixed workloads as chat messages (deterministic for a given Python install)."""
    edit = code_edit_source(excerpt=quick)
    old, new = edit["rename"]
    request = (
        f"Here is {'part of ' if edit['excerpt'] else ''}the Python module `{os.path.basename(edit['file'])}`:\n\n```python\n{edit['source']}```\n\n"
        f"Rename the function `{old}` to `{new}`, updating every call to it. Change nothing else. "
        f"Reply with the complete updated {'code' if edit['excerpt'] else 'file'} in one ```python code block."
    )
    return [
        {
            "name": "code-edit",
            "description": (f"re-emit {os.path.basename(edit['file'])} lines {edit['line_span'][0]}-{edit['line_span'][1]}"
                            f" renaming {old} -> {new}"),
            "source": {k: v for k, v in edit.items() if k != "source"},
            "messages": [{"role": "user", "content": request}],
        },
        {
            "name": "fresh-code",
            "description": "write a new Python function (no source in context)",
            "messages": [{"role": "user", "content": FRESH_CODE_PROMPT}],
        },
        {
            "name": "prose",
            "description": "write a short story",
            "messages": [{"role": "user", "content": PROSE_PROMPT}],
        },
    ]


def encode_chat(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """The prompt ids of `messages` under the tokenizer's own chat template, ready for a reply."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tokenizer.encode(text, add_special_tokens=False))
