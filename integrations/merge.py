"""One config file's new content: the existing text merged with a `Target`'s ops, per format.

Picks the JSON, TOML or YAML merger, keeps the file's line endings, and turns a syntax or shape
problem into one `IntegrateError` line, so the command can refuse before it writes anything.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import tomlkit
import tomlkit.exceptions
import yaml

from agentfold.integrations.edits import ANYTHING, Op, Target, dotted_path, pending_ops
from agentfold.integrations.errors import ConfigShapeError, IntegrateError
from agentfold.integrations.jsonc import JsonSyntaxError, merge_json
from agentfold.integrations.toml_merge import merge_toml
from agentfold.integrations.yaml_merge import merge_yaml

_FORMAT_NAMES = {"json": "JSON", "toml": "TOML", "yaml": "YAML"}


def _syntax_detail(error: Exception) -> str:
    mark = getattr(error, "problem_mark", None)
    if mark is not None:  # PyYAML: the message spans lines; keep the gist
        problem = getattr(error, "problem", None) or "syntax error"
        return f"line {mark.line + 1} column {mark.column + 1}: {problem}"
    return " ".join(str(error).split())


def _shown(removal: Op) -> str:
    """A removed entry as the user wrote it: `[a.b]` for a table, `key = "value"` for a value."""
    if removal.value is ANYTHING or isinstance(removal.value, dict):
        return f"[{dotted_path(removal.path)}]"
    return f"`{dotted_path(removal.path)} = {json.dumps(removal.value)}`"


@dataclass
class Change:
    """One file's content before and after the merge, and what the user should be warned about."""

    target: Target
    old: str | None  # None: the file does not exist
    new: str
    warnings: list[str] = field(default_factory=list)

    @property
    def changed(self) -> bool:
        return self.old != self.new


def merge(target: Target, old: str | None) -> Change:
    """The new content of one file; IntegrateError (one line) if the existing file cannot be used."""
    name = _FORMAT_NAMES[target.fmt]
    warnings: list[str] = []
    removals = [op for op in target.ops if op.remove]
    if removals and target.fmt != "toml":
        raise ValueError(f"removals are only implemented for TOML, not {name} ({target.display})")
    crlf = old is not None and "\r\n" in old  # edit with \n, hand back the file's own line endings
    text = old.replace("\r\n", "\n") if crlf else old  # type: ignore[union-attr]
    try:
        if target.fmt == "json":
            new = merge_json(text, target.ops)
        elif target.fmt == "toml":
            removed = pending_ops(tomlkit.parse(text).unwrap(), removals) if text and removals else []
            new = merge_toml(text, target.ops)
            warnings += [f"{target.display}: removed {_shown(op)}: {op.reason}" for op in removed]
        else:
            new, dropped = merge_yaml(text, target.ops)
            if dropped:
                warnings.append(f"{target.display}: PyYAML cannot keep comments; they are in the backup")
    except (JsonSyntaxError, tomlkit.exceptions.ParseError, yaml.YAMLError) as error:
        raise IntegrateError(f"{target.display} is not valid {name} ({_syntax_detail(error)}); "
                             "fix it and run again (nothing was written)") from None
    except ConfigShapeError as error:
        raise IntegrateError(f"{target.display}: {error}; fix it and run again (nothing was written)") from None
    if new == text:
        new = old  # type: ignore[assignment]  # nothing to do: not even line endings change
    elif crlf:
        new = new.replace("\n", "\r\n")
    return Change(target, old, new, warnings)
