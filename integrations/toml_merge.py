"""Merging AgentFold's entries into a TOML file (Codex's `config.toml`) through tomlkit.

tomlkit keeps comments and layout; this module adds the rules it does not know: replace a table
of ours whole, keep the comments that trail it, and leave inline tables inline.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tomlkit
import tomlkit.exceptions
import tomlkit.items

from agentfold.integrations.edits import ANYTHING, Op, dotted_path, pending_ops
from agentfold.integrations.errors import ConfigShapeError


def _toml_table(value: dict, trailing: Sequence[Any] = ()) -> tomlkit.items.Table:
    table = tomlkit.table()
    for key, item in value.items():
        table.add(key, item)
    for item in trailing:
        table.add(item)
    if not trailing:
        table.add(tomlkit.nl())
    return table


def _remove(doc: Any, path: Sequence[Any]) -> None:
    """Delete `path`, then every table above it that this left empty (`[profiles]` once its last profile goes)."""
    chain = [doc]
    for step in path[:-1]:
        chain.append(chain[-1][step])
    del chain[-1][path[-1]]
    for depth in range(len(chain) - 1, 0, -1):
        if len(chain[depth]) == 0:
            del chain[depth - 1][path[depth - 1]]
        else:
            break


def _header(line: str) -> str | None:
    """The dotted name of a `[table]` header line (spaces inside dropped), else None."""
    stripped = line.split("#", 1)[0].strip()
    if stripped.startswith("[") and stripped.endswith("]") and not stripped.startswith("[["):
        return "".join(stripped[1:-1].split())
    return None


def _remove_table_lines(text: str, path: Sequence[str]) -> str:
    """`text` without the `[a.b]` table at `path` (and its sub-tables), line by line.

    tomlkit counts the comments and blank lines after a table's last key as part of it, though they
    introduce the next table; cutting lines keeps them where the user put them.
    """
    name = ".".join(path)
    lines = text.splitlines(keepends=True)
    out: list[str] = []
    index = 0
    while index < len(lines):
        header = _header(lines[index])
        if header != name and not (header or "").startswith(name + "."):
            out.append(lines[index])
            index += 1
            continue
        end = index + 1
        while end < len(lines) and _header(lines[end]) is None:
            end += 1
        keep = end
        while keep > index + 1 and (not lines[keep - 1].strip() or lines[keep - 1].lstrip().startswith("#")):
            keep -= 1
        kept = lines[keep:end]
        while kept and not kept[0].strip() and (not out or not out[-1].strip()):
            kept.pop(0)  # the blank line that separated the removed table is already there
        out.extend(kept)
        index = end
    return "".join(out)


def _lookup_path(doc: Any, path: Sequence[Any]) -> bool:
    node = doc
    for step in path:
        if not isinstance(node, dict) or step not in node:
            return False
        node = node[step]
    return True


def _without_tables(text: str, doc: Any, removals: Sequence[Op]) -> Any:
    """`doc` with the removed tables cut out line by line when that means the same; else `doc` as it was."""
    tables = [op for op in removals if isinstance(op.value, dict) or op.value is ANYTHING]
    if not tables:
        return doc
    cut = text
    for op in tables:
        cut = _remove_table_lines(cut, [str(step) for step in op.path])
    expected = tomlkit.parse(text)
    for op in tables:
        if _lookup_path(expected, op.path):
            _remove(expected, op.path)
    try:
        candidate = tomlkit.parse(cut)
    except tomlkit.exceptions.ParseError:
        return doc
    return candidate if candidate.unwrap() == expected.unwrap() else doc


def merge_toml(text: str | None, ops: Sequence[Op]) -> str:
    """`text` (None: no file yet) with the pending ops applied; unchanged when none is pending."""
    doc = tomlkit.parse(text) if text else tomlkit.document()
    pending = pending_ops(doc.unwrap(), ops)
    if not pending:
        return text or ""
    doc = _without_tables(text or "", doc, [op for op in pending if op.remove])
    for op in pending:
        if op.remove:
            if _lookup_path(doc, op.path):
                _remove(doc, op.path)
            continue
        parent: Any = doc
        for depth, step in enumerate(op.path[:-1]):
            if step not in parent:
                parent[step] = tomlkit.table(is_super_table=True)
            parent = parent[step]
            if not isinstance(parent, dict):
                raise ConfigShapeError(dotted_path(op.path[: depth + 1]), parent, "a table")
        key = op.path[-1]
        old = parent.get(key)
        if isinstance(op.value, dict) and isinstance(parent, tomlkit.items.InlineTable):
            new = tomlkit.inline_table()
            new.update(op.value)
            parent[key] = new
        elif isinstance(op.value, dict):
            trailing: list[Any] = []  # comments and blank lines after the old entry belong to what follows
            if isinstance(old, tomlkit.items.Table):
                for k, item in reversed(old.value.body):
                    if k is not None:
                        break
                    trailing.insert(0, item)
            parent[key] = _toml_table(op.value, trailing)
        else:
            parent[key] = op.value
    out = tomlkit.dumps(doc)
    if not (text or "").startswith("\n"):
        out = out.lstrip("\n")  # a removal at the top leaves no blank first line behind
    return out.rstrip("\n") + "\n"
