"""Merging AgentFold's entries into a TOML file (Codex's `config.toml`) through tomlkit.

tomlkit keeps comments and layout; this module adds the rules it does not know: replace a table
of ours whole, keep the comments that trail it, and leave inline tables inline.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tomlkit
import tomlkit.items

from agentfold.integrations.edits import Op, dotted_path, pending_ops
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


def merge_toml(text: str | None, ops: Sequence[Op]) -> str:
    """`text` (None: no file yet) with the pending ops applied; unchanged when none is pending."""
    doc = tomlkit.parse(text) if text else tomlkit.document()
    pending = pending_ops(doc.unwrap(), ops)
    if not pending:
        return text or ""
    for op in pending:
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
    return out.rstrip("\n") + "\n"
