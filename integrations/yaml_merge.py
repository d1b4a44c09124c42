"""Merging AgentFold's entries into a YAML file (Continue, aider) through PyYAML.

PyYAML drops comments, so flat files such as `.aider.conf.yml` are edited line by line when that
provably means the same document; otherwise the file is re-dumped and the caller warns the user.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Sequence
from typing import Any

import yaml

from agentfold.integrations.edits import Named, Op, dotted_path, pending_ops, plain_set
from agentfold.integrations.errors import ConfigShapeError


class _YamlDumper(yaml.SafeDumper):
    def increase_indent(self, flow: bool = False, indentless: bool = False) -> None:  # indent lists under their key
        return super().increase_indent(flow, False)


def _yaml_dump(data: Any) -> str:
    return yaml.dump(data, Dumper=_YamlDumper, sort_keys=False, default_flow_style=False, allow_unicode=True, width=4096)


def _yaml_flat_edit(text: str, changes: dict[str, Any], expected: Any) -> str | None:
    """Top-level scalar keys set line by line, so the file's comments stay; None when that is not safe."""
    lines = text.splitlines(keepends=True)
    for key, value in changes.items():
        line = _yaml_dump({key: value})
        if line.count("\n") != 1:
            return None
        pattern = re.compile(rf"^{re.escape(key)}\s*:")
        hits = [i for i, existing in enumerate(lines) if pattern.match(existing)]
        if len(hits) > 1:
            return None
        if hits:
            lines[hits[0]] = line
        else:
            if lines and not lines[-1].endswith("\n"):
                lines[-1] += "\n"
            lines.append(line)
    out = "".join(lines)
    try:
        return out if yaml.safe_load(out) == expected else None
    except yaml.YAMLError:
        return None


def merge_yaml(text: str | None, ops: Sequence[Op]) -> tuple[str, bool]:
    """The merged YAML, and whether comments had to be dropped (PyYAML cannot keep them)."""
    data = yaml.safe_load(text) if text else None
    root_is_list = bool(ops) and isinstance(ops[0].path[0], Named)
    if data is not None and not isinstance(data, list if root_is_list else dict):
        raise ConfigShapeError("(top level)", data, "a list" if root_is_list else "a mapping")
    pending = pending_ops(data, ops)
    if not pending:
        return text or "", False
    merged = copy.deepcopy(data)
    for op in pending:
        merged = plain_set(merged, op.path, op.value, dotted_path(op.path))
    if text and isinstance(data, dict) and all(len(op.path) == 1 and isinstance(op.path[0], str) for op in pending):
        flat = _yaml_flat_edit(text, {op.path[0]: op.value for op in pending}, merged)  # type: ignore[misc]
        if flat is not None:
            return flat, False
    had_comments = bool(text) and any(line.lstrip().startswith("#") for line in text.splitlines())  # type: ignore[union-attr]
    return _yaml_dump(merged), had_comments
