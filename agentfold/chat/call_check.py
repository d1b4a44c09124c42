"""Whether a call the model wrote is one the client can run: a declared tool, arguments that fit it.

A reply's text becomes a tool call only when it names a tool the request declared and its
arguments are a JSON object that validates against that tool's JSON schema (`jsonschema`, the
draft the schema names, 2020-12 by default). Anything else stays text: a client never receives a
call it cannot run. Without a declared list (`tools=None`, the parser's standalone use) any name
is taken, and only the tagged `<tool_call>` form counts as a call.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import Any

import jsonschema

from agentfold.chat.tools import ToolCall, ToolSpec

log = logging.getLogger(__name__)


def arguments_object(arguments: Any) -> dict[str, Any] | None:
    """A call's arguments as an object: an object as is, a JSON string of one parsed, absent as {}."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            return None
    if arguments is None:
        return {}
    return arguments if isinstance(arguments, dict) else None


class DeclaredTools:
    """The tools one request declared (None: any name), checking calls against them."""

    def __init__(self, tools: Sequence[ToolSpec] | None = None) -> None:
        self.by_name = {tool.name: tool for tool in tools} if tools is not None else None
        self._validators: dict[str, Any] = {}
        # each name as it opens in JSON, its quote dropped (`Read"`): what a partial name must begin
        self._json_names = [json.dumps(name, ensure_ascii=False)[1:] for name in self.by_name or ()]

    @property
    def any_name(self) -> bool:
        return self.by_name is None

    def declares(self, name: str) -> bool:
        return self.by_name is None or name in self.by_name

    def may_name(self, partial: str, json_escaped: bool = True) -> bool:
        """Whether some declared name begins with `partial` (raw JSON string text when `json_escaped`)."""
        if self.by_name is None:
            return False
        if json_escaped:
            return any(name.startswith(partial) for name in self._json_names)
        return any(name.startswith(partial) for name in self.by_name)

    def call(self, name: Any, arguments: Any) -> ToolCall | None:
        """The call, when `name` is declared and `arguments` fit its schema; else None."""
        if not isinstance(name, str) or not name or not self.declares(name):
            return None
        args = arguments_object(arguments)
        if args is None or not self._fits(name, args):
            return None
        return ToolCall(name, json.dumps(args, ensure_ascii=False))

    def _fits(self, name: str, args: dict[str, Any]) -> bool:
        if self.by_name is None:
            return True
        validator = self._validators.get(name)
        if validator is None:
            schema = self.by_name[name].parameters or {"type": "object"}
            try:
                cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
                cls.check_schema(schema)
                validator = self._validators[name] = cls(schema)
            except jsonschema.SchemaError as error:  # the client's schema cannot be checked: take the call
                log.warning("tool %r: its schema cannot be checked (%s)", name, error.message[:200])
                validator = self._validators[name] = False
        if validator is False:
            return True
        try:
            return validator.is_valid(args)
        except Exception as error:  # e.g. an unresolvable $ref: as above
            log.warning("tool %r: its schema cannot be checked (%s)", name, error)
            return True
