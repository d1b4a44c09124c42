"""Grammar-constrained decoding (llguidance) that keeps drafting exact.

A constraint chooses each row's token among those its grammar allows after everything committed
so far (`GrammarConstraint`: every row masked; `engine.lazy_calls`: only where a tool call has
started). The decode loop advances it only with tokens it commits, in order, and row j + 1 is
read only when draft j was accepted, so row j's choice is made from exactly the state serial
decoding has at that position: the same choice on serial and verify rows, the same bytes.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Sequence
from functools import lru_cache
from typing import Any, Protocol

import numpy as np

from agentfold.engine.sampler import SamplingParams, choose


class Constraint(Protocol):
    """What the decode loop needs of a constraint: a row's token, and the committed token."""

    def choose(self, row: np.ndarray, position: int, params: SamplingParams) -> int: ...

    def advance(self, token: int) -> None: ...


class GrammarConstraint:
    """An llguidance matcher over one reply; `mask` returns a copy with disallowed tokens at -inf."""

    def __init__(self, tokenizer: Any, grammar: str) -> None:
        import llguidance

        self.matcher = llguidance.LLMatcher(ll_tokenizer(tokenizer), grammar)
        if self.matcher.is_error():
            raise ValueError(f"invalid grammar: {self.matcher.get_error()}")

    @staticmethod
    def bits(matcher: Any, vocab_size: int) -> np.ndarray:
        """The tokens `matcher` allows next, as a boolean array of `vocab_size`."""
        bits = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8)
        allowed = np.unpackbits(bits, bitorder="little").view(bool)  # 0 / 1 bytes: a view, no copy
        if allowed.shape[0] < vocab_size:
            allowed = np.concatenate([allowed, np.zeros(vocab_size - allowed.shape[0], dtype=bool)])
        return allowed[:vocab_size]

    def allowed(self, vocab_size: int) -> np.ndarray:
        return self.bits(self.matcher, vocab_size)

    def mask(self, logits: np.ndarray) -> np.ndarray:
        return np.where(self.allowed(logits.shape[0]), logits, np.float32(-np.inf)).astype(logits.dtype, copy=False)

    def choose(self, row: np.ndarray, position: int, params: SamplingParams) -> int:
        """The sampler's choice among the tokens the grammar allows."""
        return choose(self.mask(row), position, params)

    def advance(self, token: int) -> None:
        self.matcher.consume_token(int(token))

    @property
    def done(self) -> bool:
        return self.matcher.is_stopped()


@lru_cache(maxsize=4)
def _cached_ll_tokenizer(tokenizer_id: int, tokenizer: Any) -> Any:
    import llguidance.hf

    return llguidance.hf.from_tokenizer(tokenizer)


def ll_tokenizer(tokenizer: Any) -> Any:
    """Building llguidance's tokenizer costs about a second: once per tokenizer."""
    return _cached_ll_tokenizer(id(tokenizer), tokenizer)


# one line, standard separators: short calls that any JSON parser and any client display reads
_COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def declared_only(schema: Any) -> Any:
    """`schema` where every object that lists `properties` and says nothing of `additionalProperties`
    admits only those properties (OpenAI's strict function calling; nested schemas too).

    JSON Schema's default admits any extra key, and a small model under the mask then fills the
    arguments with the schema's own words (`"type": "object", "properties": ...`) until max_tokens.
    A schema that sets `additionalProperties` keeps its choice.
    """
    if isinstance(schema, list):
        return [declared_only(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: (value if key in ("const", "enum", "default", "examples") else declared_only(value))
           for key, value in schema.items()}
    if isinstance(schema.get("properties"), dict):
        out["properties"] = {name: declared_only(sub) for name, sub in schema["properties"].items()}
        out.setdefault("additionalProperties", False)
    return out


def tool_call_schema(tool: dict[str, Any]) -> dict[str, Any]:
    """JSON schema of one `{"name": ..., "arguments": {...}}` call to an OpenAI-style function tool."""
    function = tool.get("function", tool)
    parameters = function.get("parameters") or function.get("input_schema") or {"type": "object"}
    return {
        "type": "object",
        "properties": {"name": {"const": function["name"]}, "arguments": declared_only(parameters)},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def tag_rule(tag: str, special: Collection[str]) -> str:
    """Grammar for a call tag: the special token or its text where `tag` is one special token in the
    served tokenizer (`special`, as `lazy_calls.special_tags` finds them), else the text alone."""
    return f'({tag} | "{tag}")' if tag in special else f'"{tag}"'


def tool_call_grammar(tools: Sequence[dict[str, Any]], name: str | None = None, parallel: bool = True,
                      special: Collection[str] = ()) -> str:
    """Lark grammar for one or more `<tool_call>{json}</tool_call>` blocks (Hermes / Qwen format).

    `name` forces one function; otherwise any of `tools` may be called. `special`: the tags that
    are one special token in the served tokenizer (`lazy_calls.special_tags`; Qwen2.5: both).
    llguidance reads such a token as a special token, never as the tag's text, yet its mask for
    the text "<tool_call>" let Qwen's token through, and the matcher then stopped on it: a forced
    call on the coder model was the bare tag. The grammar names the token where there is one.
    """
    chosen = [t for t in tools if (t.get("function", t)).get("name") == name] if name else list(tools)
    if not chosen:
        raise ValueError(f"tool_choice names {name!r}, which is not among the tools")
    schemas = [tool_call_schema(t) for t in chosen]
    schema = dict(schemas[0]) if len(schemas) == 1 else {"anyOf": schemas}
    schema["x-guidance"] = _COMPACT
    repeat = "+" if parallel else ""
    open_tag, close_tag = (tag_rule(tag, special) for tag in ("<tool_call>", "</tool_call>"))
    return (
        f"start: call{repeat}\n"
        f'call: {open_tag} "\\n" body "\\n" {close_tag} "\\n"?\n'
        f"body: %json {json.dumps(schema)}\n"
    )


def json_object_grammar() -> str:
    """Any JSON object (`response_format: json_object`)."""
    return json_schema_grammar({"type": "object"})


def json_schema_grammar(schema: dict[str, Any]) -> str:
    """One JSON value matching `schema` (`response_format: json_schema`)."""
    return f"start: body\nbody: %json {json.dumps({**schema, 'x-guidance': _COMPACT})}\n"
