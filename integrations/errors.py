"""The two ways `agentfold integrate` refuses, kept apart from the code that raises them.

Every module of the package raises these; the command (`writer.run`) turns them into one line on
stderr and exit status 1, so the user never sees a traceback for something they can fix.
"""

from __future__ import annotations

from typing import Any


class IntegrateError(Exception):
    """A problem the user can fix; reported as one line on stderr, never a traceback."""


class ConfigShapeError(Exception):
    """An existing file parses, but holds something else where AgentFold's entry goes."""

    def __init__(self, dotted: str, value: Any, wanted: str) -> None:
        super().__init__(f"`{dotted}` is {_kind(value)}, not {wanted}")


def _kind(value: Any) -> str:
    if hasattr(value, "unwrap"):  # a tomlkit item
        value = value.unwrap()
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    if value is None:
        return "null"
    return f"a {type(value).__name__}"
