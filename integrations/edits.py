"""What AgentFold writes into a config file, independent of the file's format.

A template fragment becomes a tuple of `Op`s (one path, one value each) aimed at a `Target` file;
the JSON, TOML and YAML mergers share the helpers here to find which ops are still to do and to
apply them to plain data, so "only our own entries change" means the same thing in every format.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentfold.integrations.errors import ConfigShapeError


@dataclass(frozen=True)
class Named:
    """A path step into a list: the item whose `name` is this (Continue's models, aider's settings)."""

    name: str


class _Anything:
    """The type of `ANYTHING`: a removal that applies whatever the value is."""


ANYTHING = _Anything()


@dataclass(frozen=True)
class Op:
    """Set `path` to `value` in a config file, or (`remove`) delete it where it holds `value` (or ANYTHING).

    Removals undo what an older AgentFold wrote in a shape the client no longer accepts (Codex's
    `[profiles.agentfold]`); `reason` is what the user is told when one happens.
    """

    path: tuple[str | Named, ...]
    value: Any
    only_if_missing: bool = False  # header keys (`name`, `version`, `$schema`): never overwrite the user's
    remove: bool = False
    reason: str = ""


@dataclass(frozen=True)
class Target:
    """One config file, its format, and the ops AgentFold writes into it."""

    label: str  # short name for golden files and messages: mcp, settings, config, ...
    path: Path
    fmt: str  # json | toml | yaml
    ops: tuple[Op, ...]
    display: str = ""  # the path as shown to the user (relative to the project, or ~/...)


def ops_from(fragment: Any, owned: Sequence[tuple[str, ...]] = (), defaults: Sequence[str] = ()) -> tuple[Op, ...]:
    """The writes a template fragment stands for.

    Dicts merge key by key down to the leaves, except at an `owned` path (`*` matches any key), whose
    value is AgentFold's own entry and is replaced whole. A list of dicts with a `name` merges item by
    item on that name. Top-level keys in `defaults` are written only where the file lacks them.
    """
    ops: list[Op] = []

    def is_owned(path: tuple[str, ...]) -> bool:
        return any(len(o) == len(path) and all(a in ("*", b) for a, b in zip(o, path, strict=True)) for o in owned)

    def walk(value: Any, path: tuple[Any, ...]) -> None:
        if path and isinstance(path[-1], str) and is_owned(path):  # type: ignore[arg-type]
            ops.append(Op(path, value))
        elif isinstance(value, dict) and value:
            for key, child in value.items():
                walk(child, (*path, key))
        elif isinstance(value, list) and value and all(isinstance(v, dict) and "name" in v for v in value):
            for item in value:
                ops.append(Op((*path, Named(item["name"])), item))
        else:
            ops.append(Op(path, value, only_if_missing=len(path) == 1 and path[0] in defaults))

    walk(fragment, ())
    return tuple(ops)


class _Missing:
    """The type of `MISSING`: no value at a path (distinct from a null in the file)."""


MISSING = _Missing()


def _lookup(data: Any, path: Sequence[str | Named]) -> Any:
    for step in path:
        if isinstance(step, Named):
            if not isinstance(data, list):
                return MISSING
            data = next((item for item in data if isinstance(item, dict) and item.get("name") == step.name), MISSING)
        elif isinstance(data, dict) and step in data:
            data = data[step]
        else:
            return MISSING
        if data is MISSING:
            return MISSING
    return data


def plain_set(data: Any, path: tuple[str | Named, ...], value: Any, dotted: str) -> Any:
    """Set `path` in plain data (dicts and lists); returns the (possibly new) root."""
    if not path:
        return copy.deepcopy(value)
    step, rest = path[0], path[1:]
    if isinstance(step, Named):
        if data is None:
            data = []
        if not isinstance(data, list):
            raise ConfigShapeError(dotted, data, "a list")
        for index, item in enumerate(data):
            if isinstance(item, dict) and item.get("name") == step.name:
                data[index] = plain_set(item, rest, value, dotted)
                return data
        data.append(plain_set(None, rest, value, dotted))
        return data
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigShapeError(dotted, data, "a mapping")
    data[step] = plain_set(data.get(step), rest, value, dotted)
    return data


def dotted_path(path: Sequence[str | Named]) -> str:
    """`path` as shown in messages: `a.b.[name=x]`, or `(top level)`."""
    return ".".join(f"[name={p.name}]" if isinstance(p, Named) else p for p in path) or "(top level)"


def pending_ops(data: Any, ops: Sequence[Op]) -> list[Op]:
    """The ops that would change `data` (plain data parsed from the file); empty when it is up to date."""
    out = []
    for op in ops:
        existing = _lookup(data, op.path)
        if op.remove:
            if existing is not MISSING and (op.value is ANYTHING or existing == op.value):
                out.append(op)
        elif existing is MISSING or (not op.only_if_missing and existing != op.value):
            out.append(op)
    return out
