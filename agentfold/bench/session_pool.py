"""The pool of agent sessions `bench lanes` serves at every concurrency level.

A fixed pool, so that every level does the same work: `MIX` repeated (six code edits that ask a
pasted stdlib window back with a function renamed, a sampled story, a fresh function), every
prompt distinct, built from files every Python install has (`workloads.pick_windows`), in the
order clients take them. Each session is a task and then its follow-up (`FOLLOW_UPS`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from agentfold.bench.harness import BenchError
from agentfold.bench.workloads import FRESH_CODE_TASKS, STORY_TOPICS, pick_windows

# The pool every level serves: four sessions per client at 8 clients. With 16 (two per client) the
# pool's drain, its last sessions served by fewer than 8 clients, took ~30% of the 8-client level's
# time (a 2-core Zen 4, 2026-12-03: the first client found the pool empty at 10.3 s of 14.4 s), so
# the level's rate said as much about the pool's size as about 8 clients at once.
SESSIONS = 32
QUICK_SESSIONS = 4
QUICK_LINES = 24  # --quick: code-edit windows cut to this many lines around the renamed function
# Any prefix of the pool has the story (a sampled session) second.
MIX = ("code-edit", "prose", "code-edit", "fresh-code", "code-edit", "code-edit", "code-edit", "code-edit")
MAX_SESSIONS = len(MIX) * min(len(FRESH_CODE_TASKS), len(STORY_TOPICS))  # every prompt distinct
SAMPLED_TEMPERATURE = 0.7
SYSTEM = "You are a coding agent working in a Python repository. Answer briefly and precisely."
FOLLOW_UPS = {"code-edit": "Good. Now write a short pytest test for the function you renamed.",
              "fresh-code": "Now add input validation to it and show the whole function again.",
              "prose": "Continue the story with one more paragraph."}


def session_prompts(seed: int = 0, quick: bool = False, count: int = SESSIONS) -> list[dict[str, Any]]:
    """The pool's `count` first chats, in the order clients take them (deterministic per seed and
    Python install): `MIX` repeated, code edits of windows from distinct stdlib files
    (`workloads.pick_windows`; `quick`: only the lines from the renamed function's first to its
    last mention, as short prompts), distinct fresh functions and story topics; the stories are
    the sampled sessions."""
    if not 1 <= count <= MAX_SESSIONS:
        raise BenchError(f"sessions must be between 1 and {MAX_SESSIONS}, not {count}")
    kinds = [MIX[i % len(MIX)] for i in range(count)]
    windows = iter([_excerpt(w) if quick else w for w in pick_windows(seed, kinds.count("code-edit"))])
    made = {"fresh-code": 0, "prose": 0}
    sessions = []
    for index, kind in enumerate(kinds):
        if kind == "code-edit":
            session = _edit(next(windows))
        else:
            session = (_fresh if kind == "fresh-code" else _story)(seed + made[kind])
            made[kind] += 1
        sampled = kind == "prose"
        session.update(index=index, temperature=SAMPLED_TEMPERATURE if sampled else 0.0, sampled=sampled)
        sessions.append(session)
    return sessions


def _edit(window: dict[str, Any]) -> dict[str, Any]:
    old, new = window["rename"]
    first, last = window["line_span"]
    user = (f"Here is `{window['file']}` lines {first}-{last}:\n\n```python\n{window['text']}```\n\n"
            f"Rename the function `{old}` to `{new}` in that code, updating every call to it. Change nothing "
            "else. Reply with the complete updated code in one ```python code block.")
    return {"name": f"edit-{Path(window['file']).stem}", "kind": "code-edit",
            "description": f"re-emit {window['file']} lines {first}-{last} renaming {old} -> {new}",
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]}


def _fresh(pick: int) -> dict[str, Any]:
    task = FRESH_CODE_TASKS[pick % len(FRESH_CODE_TASKS)]
    name = task.split("`")[1].split("(")[0]
    return {"name": f"fresh-{name}", "kind": "fresh-code", "description": f"write {name}()",
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content":
                         f"Write a Python function {task}. Include a docstring and type hints. Reply with the code "
                         "only."}]}


def _story(pick: int) -> dict[str, Any]:
    topic = STORY_TOPICS[pick % len(STORY_TOPICS)]
    return {"name": f"story-{pick % len(STORY_TOPICS)}", "kind": "prose", "description": f"a short story about {topic}",
            "messages": [{"role": "user", "content": f"Write a short story of three paragraphs about {topic}. Use "
                          "vivid, concrete details."}]}


def _excerpt(window: dict[str, Any]) -> dict[str, Any]:
    """The window cut to the lines from the renamed function's first to its last mention (at most
    `QUICK_LINES`, a line of context either side): a short prompt that still asks for a copy."""
    old = window["rename"][0]
    lines = window["text"].splitlines()
    hits = [i for i, line in enumerate(lines) if f"{old}(" in line]
    low = max(0, min(hits) - 1)
    high = min(len(lines), max(hits) + 2, low + QUICK_LINES)
    first = window["line_span"][0] + low
    return {**window, "text": "\n".join(lines[low:high]) + "\n", "line_span": [first, first + high - low - 1],
            "lines": high - low}
