"""One chat turn in transport-neutral form, and the checks that need no runtime.

Every front end (the OpenAI, Responses and Anthropic HTTP APIs; anything else that speaks chat)
parses its request into a `ChatPlan`: messages in OpenAI chat shape, tools, sampling and limits.
What a plan means for decoding (its sampling parameters, the grammar a reply must follow, the
trailing instruction for forced calls and JSON output) is decided here, once, so the transports
cannot drift apart. Turning a plan into a `TurnRequest` needs the runtime (tokenizer, context
length) and lives in `agentfold.serve.chat_turn`.

A plan the client must fix is a `PlanError`, whose message says what to fix and whose `param`
names the field; each transport answers it in its own shape (the HTTP APIs as a 400).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from agentfold.chat.harmony import harmony_grammar, lazy_harmony_grammar
from agentfold.chat.template import trailing_instruction
from agentfold.chat.tools import ToolSpec
from agentfold.engine.constraints import json_object_grammar, json_schema_grammar, tool_call_grammar
from agentfold.engine.lazy_calls import is_lazy, lazy_tool_grammar
from agentfold.engine.sampler import SamplingParams

log = logging.getLogger(__name__)


class PlanError(ValueError):
    """A chat request the client must fix: `message` says what, `param` names the field, `code` the kind."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class ContextOverflow(PlanError):
    """A prompt that does not fit the context: `prompt_tokens` of a `limit`-token context, which
    leaves a prompt at most `limit - 1` (the reply needs a token). Each API words it as its clients
    parse it (Anthropic's `prompt is too long: N tokens > M maximum`, OpenAI's code)."""

    def __init__(self, prompt_tokens: int, limit: int) -> None:
        super().__init__(f"This model's maximum context length is {limit} tokens, but the prompt is "
                         f"{prompt_tokens} tokens. Shorten the messages.", param="messages",
                         code="context_length_exceeded")
        self.prompt_tokens = prompt_tokens
        self.limit = limit

    @property
    def anthropic_message(self) -> str:
        """The message Claude Code matches (`/^prompt is too long: \\d+ tokens > \\d+ maximum$/`) to compact."""
        return f"prompt is too long: {self.prompt_tokens} tokens > {self.limit - 1} maximum"


def json_kind(value: Any) -> str:
    """A JSON value's kind as an error message names it ("an object", "null", ...)."""
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean", int: "an integer",
            float: "a number", type(None): "null"}.get(type(value), type(value).__name__)


@dataclass
class ChatPlan:
    """One chat turn in API-neutral form (messages in OpenAI chat shape)."""

    messages: list[dict[str, Any]]
    tools: list[ToolSpec] = field(default_factory=list)
    tool_choice: str | dict[str, str] = "auto"  # auto | none | required | {"name": ...}
    parallel_tool_calls: bool = True
    response_format: dict[str, Any] | None = None  # {"type": "json_object"} / {"type": "json_schema", ...}
    max_tokens: int | None = None
    max_tokens_param: str = "max_tokens"  # the request's name for it, for error messages
    stop: list[str] = field(default_factory=list)
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int = 0
    draft: bool = True
    audit: bool = False
    session_id: str | None = None
    stream: bool = False
    model: str = ""
    raw_prompt: str | list[int] | None = None  # /v1/completions: no chat template
    logprobs: int | None = None  # None: none; N: each token's logprob and its row's N most likely
    prediction: str = ""  # Predicted Outputs: text the reply is expected to repeat, drafted from (exact)


def parse_tool_choice(value: Any, tools: Sequence[ToolSpec], param: str = "tool_choice") -> str | dict[str, str]:
    """OpenAI / Responses / Anthropic tool_choice, normalized to auto|none|required|{"name"}."""
    if value is None:
        return "auto"
    if isinstance(value, str):
        if value in ("auto", "none", "required"):
            choice = value
        elif value == "any":
            choice = "required"
        else:
            raise PlanError(f"'{param}' must be 'auto', 'none', 'required' or a named function, not {value!r}.",
                            param=param)
    elif isinstance(value, dict):
        kind = value.get("type")
        name = value.get("name") or (value.get("function") or {}).get("name")
        if kind in ("auto", "none"):
            choice = kind
        elif kind in ("any", "required"):
            choice = "required"
        elif kind in ("function", "tool", "custom") and isinstance(name, str) and name:
            choice = {"name": name}
        else:
            raise PlanError(f"'{param}' is not a tool choice this server understands: {json.dumps(value)[:120]}.",
                            param=param)
    else:
        raise PlanError(f"'{param}' must be a string or an object, not {json_kind(value)}.", param=param)
    if isinstance(choice, dict) and choice["name"] not in {t.name for t in tools}:
        raise PlanError(f"'{param}' names the tool {choice['name']!r}, which is not among the request's tools.",
                        param=param)
    if choice == "required" and not tools:
        raise PlanError(f"'{param}' is 'required' but the request has no tools.", param=param)
    return choice


def check_schema(schema: Any, where: str) -> dict[str, Any]:
    """A tool's parameter schema: an object (missing means no parameters), else a PlanError."""
    if schema is None:
        return {"type": "object", "properties": {}}
    if not isinstance(schema, dict):
        raise PlanError(f"{where} must be a JSON schema object, not {json_kind(schema)}.")
    return schema


def sampling(plan: ChatPlan) -> SamplingParams:
    """The plan's sampling parameters; values the sampler refuses are a PlanError."""
    try:
        return SamplingParams(temperature=plan.temperature, top_k=plan.top_k, top_p=plan.top_p,
                              min_p=plan.min_p, seed=plan.seed)
    except ValueError as error:
        raise PlanError(str(error)) from error


def grammar_for(plan: ChatPlan, special_tags: frozenset[str] | None = frozenset(),
                harmony: frozenset[str] | None = None) -> str | None:
    """The grammar a reply must follow: forced tool calls, JSON output, a call once one starts;
    None when free.

    `harmony`: the model writes harmony (gpt-oss; `chat.harmony`), and these of its tags are one
    special token each: a forced call or JSON output is held to its harmony form
    (`harmony_grammar`), and with `tool_choice` auto a call once its header names a declared tool
    (`lazy_harmony_grammar`).

    The engine masks rows with it (serial and verify alike), so even a small model returns a
    well-formed call, and drafting stays exact. With `tool_choice` auto the grammar is lazy
    (`engine.lazy_calls`): free text until the reply starts a call, the tools' schemas from there
    to the call's end. `special_tags`: the call tags that are one special token in the tokenizer
    (`engine.lazy_calls.special_tags`); None where the tokenizer cannot take a lazy grammar.
    """
    if harmony is not None:
        if plan.tools and plan.tool_choice == "auto" and not plan.response_format:
            return lazy_harmony_grammar(plan.tools, harmony)
        return harmony_grammar(plan.tools, plan.tool_choice, plan.response_format, harmony)
    if plan.tools and (plan.tool_choice == "required" or isinstance(plan.tool_choice, dict)):
        tools = [{"name": t.name, "parameters": t.parameters} for t in plan.tools]
        name = plan.tool_choice["name"] if isinstance(plan.tool_choice, dict) else None
        return tool_call_grammar(tools, name=name, parallel=plan.parallel_tool_calls and name is None,
                                 special=special_tags or ())
    fmt = plan.response_format
    if fmt and fmt.get("type") == "json_object":
        return json_object_grammar()
    if fmt and fmt.get("type") == "json_schema":
        return json_schema_grammar((fmt.get("json_schema") or fmt).get("schema") or {"type": "object"})
    if plan.tools and plan.tool_choice == "auto" and special_tags is not None:
        return lazy_tool_grammar([{"name": t.name, "parameters": t.parameters} for t in plan.tools], special_tags)
    return None


@lru_cache(maxsize=64)
def _grammar_problem(grammar: str) -> str:
    """llguidance's complaint about a grammar ('' when it compiles); a client resends the same
    tools every turn, so each grammar is compiled here once."""
    import llguidance

    return llguidance.LLMatcher.validate_grammar(grammar)


def checked_grammar(plan: ChatPlan, special_tags: frozenset[str] | None = frozenset(),
                    harmony: frozenset[str] | None = None) -> str | None:
    """`grammar_for(plan)`, compiled once here so a bad schema is refused now, not a failed turn later.

    A lazy grammar that does not compile (a tool schema llguidance cannot use) is dropped instead:
    the reply is free, and calls are still read from its text (`chat.tool_calls`).
    """
    grammar = grammar_for(plan, special_tags, harmony)
    if grammar is None:
        return None
    problem = _grammar_problem(grammar)
    if problem and is_lazy(grammar):
        log.warning("tool calls decoded without their grammar: %s", problem.strip().splitlines()[0][:300])
        return None
    if problem:
        where = "tools" if plan.tools and plan.tool_choice not in ("auto", "none") else "response_format"
        reason = problem.strip().splitlines()[0].split(": ", 1)[-1]
        raise PlanError(f"The JSON schema in '{where}' cannot be used: {reason}. Send a valid JSON schema object.",
                        param=where)
    return grammar


def plan_instructions(plan: ChatPlan, harmony: bool = False) -> str:
    """The strong instruction for forced calls and JSON output, a user turn after the conversation
    (`harmony`: worded for a model that writes calls in harmony form)."""
    return trailing_instruction(plan.tool_choice, plan.response_format, harmony)
