"""Tool calls in free text: a lazy grammar that holds a call to the tools' schemas once the
model has named a declared tool, and never makes a call of anything else.

With `tool_choice: auto` a reply may be prose, code, or a call. The grammar here leaves the text
free until the reply names a declared tool in one of the ways the served models write a call:

- the Hermes / Qwen tag `<tool_call>` (a single special token where the tokenizer has one, as
  Qwen2.5's does, else the text; `special_tags` tells which) followed by `{"name": "Read"`;
- a JSON object that begins by naming a declared tool, `{"name": "Read"` (any whitespace, also
  inside a fenced json block), as small models and Llama 3.x write calls;
- Qwen3-Coder's XML call, `<function=Read>` (inside its `<tool_call>` tags): each declared parameter
  then follows as `<parameter=KEY>value</parameter>`, in the schema's order, required ones present,
  values as the model's template writes them (`_xml_rules`), then `</function>`.

From the declared name's closing quote to the end of the call every token must follow the call's
grammar: that tool's arguments under its JSON schema (`declared_only`), under `"arguments"` or
`"parameters"`, then `}` (and `</tool_call>` for the tag); then the text is free again.

A name the tools do not declare starts nothing: the object, tagged or not, stays free text, and
the server returns it as text (`chat.tool_calls` reads only declared names). Asked for a
triangle's area with only `determine_body_mass_index` declared, the coder model writes
`{"name": "calculate_area_of_triangle", ...}`; holding that object to the declared names (as this
grammar once did from a reply-opening `{"name": "` on) made it a call of the BMI tool with
arguments nobody asked for. After the `<tool_call>` special token, which cannot be part of a
lazy trigger's text, the grammar allows either a declared call or any text that does not open
with a declared name (`NOT_DECLARED`, a regex complement): the tag alone decides nothing.

llguidance's lazy lexemes (`trig[lazy]: TEXT /.../`) end the free text at the first trigger.

`LazyCallConstraint` keeps drafting exact and costs almost nothing while the text is free. For
each row it takes the sampler's choice on the raw logits; only when the grammar refuses that
token does it compute the full-vocabulary mask and choose again among the allowed tokens. Both
steps read only the row and the state after the committed tokens, so serial and verify rows
choose alike. In free text nothing is refused (a special token the grammar cannot place, such
as `<|python_tag|>`, passes unseen by it; an end-of-turn token ends the reply as always), so a
reply that never names a declared tool is token for token the reply without the grammar. Under
greedy decoding a refused-then-masked choice is exactly the masked argmax; with sampling, a raw
choice the grammar allows stands (top-k / top-p are applied to the raw row), else the sampler
chooses again on the masked row.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Sequence
from functools import lru_cache
from typing import Any

import numpy as np

from agentfold.engine.constraints import GrammarConstraint, declared_only, ll_tokenizer, tag_rule
from agentfold.engine.sampler import SamplingParams, choose

LAZY_MARK = "// agentfold: lazy tool calls\n"  # first line of a lazy grammar (`is_lazy`)
TAGS = ("<tool_call>", "</tool_call>")
WS = r"[ \t\r\n]{0,24}"  # bounded: a small model must not loop on whitespace inside a call
_JSON_OPTIONS = {"whitespace_pattern": WS, "item_separator": ",", "key_separator": ":"}
_REGEX_SPECIAL = set("\\.+*?()|[]{}^$#&-~/")


# The lines every lazy grammar opens with (`LazyCallConstraint` relies on them): the mark, then free
# text around any number of calls (`call`, which each grammar defines).
LAZY_PRELUDE = (LAZY_MARK.rstrip("\n"), "%llguidance {}", "start: call* free", "free: TEXT", r"TEXT: /(.|\n)*/")


def is_lazy(grammar: str | None) -> bool:
    return bool(grammar) and grammar.startswith(LAZY_MARK)


def regex_literal(literal: str) -> str:
    """`literal` as an llguidance regex that matches it alone (its special characters escaped)."""
    return "".join("\\" + c if c in _REGEX_SPECIAL else c for c in literal)


def _name_head(name: str) -> str:
    """Regex of `{"name": "<name>"` with free whitespace: the start of a JSON call to `name`."""
    return rf"\{{{WS}\"name\"{WS}:{WS}{regex_literal(json.dumps(name, ensure_ascii=False))}"


def lazy_tool_grammar(tools: Sequence[dict[str, Any]], special: Collection[str] = ()) -> str:
    """The lazy grammar for `tools` (`{"name", "parameters"}` each). `special`: the tags of `TAGS`
    that are single special tokens in the served tokenizer (`special_tags`)."""
    if not tools:
        raise ValueError("a lazy tool grammar needs at least one tool")
    lines = [*LAZY_PRELUDE, f"WS: /{WS}/", r'xml_text[lazy]: /(.|\n)*/ "</parameter>"',
             f"ARGKEY: /{WS},{WS}\"(arguments|parameters)\"{WS}:{WS}/", f"CLOSE: /{WS}\\}}/"]
    close = tag_rule("</tool_call>", special)
    calls, bodies, heads = [], [], []
    for i, tool in enumerate(tools):
        schema = {**declared_only(tool.get("parameters") or {"type": "object"}), "x-guidance": _JSON_OPTIONS}
        head, function = _name_head(tool["name"]), regex_literal(f"<function={tool['name']}>")
        lines += [f"args_{i}: %json {json.dumps(schema)}",
                  f"rest_{i}: ARGKEY args_{i} CLOSE",
                  f"HEAD_{i}: /{head}/",
                  f"json_trig_{i}[lazy]: TEXT /{head}/",
                  f"json_{i}: json_trig_{i} rest_{i}",
                  f"tag_trig_{i}[lazy]: TEXT /<tool_call>{WS}{head}/",
                  f"tagged_{i}: tag_trig_{i} rest_{i} WS {close}",
                  f"body_{i}: HEAD_{i} rest_{i}",
                  *_xml_rules(i, schema),
                  f"xml_trig_{i}[lazy]: TEXT /{function}/",
                  f"xml_{i}: xml_trig_{i} xml_rest_{i} (WS {close})?"]
        calls += [f"json_{i}", f"tagged_{i}", f"xml_{i}"]
        bodies.append(f"body_{i}")
        heads.append(head)
    lines.append(f"body: {' | '.join(bodies)}")
    if "<tool_call>" in special:  # after the tag token: a declared call, or text that names none
        lines += [rf"NOT_DECLARED: /(.|\n)*/ & ~(/{WS}({'|'.join(heads)})(.|\n)*/)",
                  f"tagged_token: TEXT <tool_call> ((WS body WS {close}) | NOT_DECLARED)"]
        calls.append("tagged_token")
    lines.append(f"call: {' | '.join(calls)}")
    return "\n".join(lines) + "\n"


def _xml_rules(i: int, schema: dict[str, Any]) -> list[str]:
    """Rules of tool i's XML call after its `<function=NAME>` (Qwen3-Coder's form, as its template
    writes one): each declared parameter in the schema's order, `<parameter=KEY>`, the value, then
    `</parameter>`; required ones must come, optional ones may. Values as the template writes them
    (Jinja's string filter): an integer or a number as JSON, a boolean `true` / `false` or Python's
    `True` / `False`, one of a string enum's values; a string, an object or an array as any text up
    to the first `</parameter>` (a lazy lexeme: an agent's file contents are free, and the template
    writes objects as Python's repr, which the parser reads as vLLM's does)."""
    properties = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
    required = set(schema.get("required") or ())
    lines, steps = [], []
    for j, (key, sub) in enumerate(properties.items()):
        sub = sub if isinstance(sub, dict) else {}
        kind, enum = sub.get("type"), sub.get("enum")
        if isinstance(enum, list) and enum and all(isinstance(v, str) for v in enum):
            value = "(" + " | ".join(json.dumps(v) for v in enum) + ")"
        elif kind in ("integer", "number"):
            lines.append(f"value_{i}_{j}: %json {json.dumps({**sub, 'x-guidance': _JSON_OPTIONS})}")
            value = f"value_{i}_{j}"
        elif kind == "boolean":
            value = '("true" | "false" | "True" | "False")'
        else:
            value = ""
        closed = f"WS {value} WS \"</parameter>\"" if value else "xml_text"  # xml_text ends with the tag
        lines.append(f"param_{i}_{j}: {json.dumps(f'<parameter={key}>')} {closed} WS")
        steps.append(f"param_{i}_{j}" + ("" if key in required else "?"))
    lines.append(f"xml_rest_{i}: WS {' '.join(steps)} \"</function>\"")
    return lines


@lru_cache(maxsize=8)
def _special_tags(tokenizer_id: int, tokenizer: Any, tags: tuple[str, ...]) -> frozenset[str] | None:
    try:
        ll = ll_tokenizer(tokenizer)
    except Exception:  # not a fast Hugging Face tokenizer: llguidance cannot read it
        return None
    found = set()
    for tag in tags:
        token = tokenizer.convert_tokens_to_ids(tag)
        if isinstance(token, int) and tokenizer.convert_ids_to_tokens(token) == tag and ll.is_special_token(token):
            found.add(tag)
    return frozenset(found)


def special_tags(tokenizer: Any, tags: Sequence[str] = TAGS) -> frozenset[str] | None:
    """The call tags (`tags`: `TAGS`, or another format's, such as harmony's) that are one special
    token each in `tokenizer` (Qwen2.5: both; SmolLM2: none);
    None for a tokenizer llguidance cannot read (no grammar can run on it).

    llguidance reads such a token as a special token, not as its text: the grammar must name it
    as `<tool_call>`, where a tokenizer without it spells the tag as text, "<tool_call>".
    """
    return _special_tags(id(tokenizer), tokenizer, tuple(tags))


@lru_cache(maxsize=16)
def _compiled(tokenizer_id: int, tokenizer: Any, grammar: str) -> Any:
    import llguidance

    matcher = llguidance.LLMatcher(ll_tokenizer(tokenizer), grammar, log_level=0)
    if matcher.is_error():
        raise ValueError(f"invalid grammar: {matcher.get_error()}")
    return matcher


class LazyCallConstraint:
    """One reply's lazy tool-call grammar: `choose` a row's token, `advance` with the committed one."""

    def __init__(self, tokenizer: Any, grammar: str, eos_token_ids: Collection[int]) -> None:
        self.ll = ll_tokenizer(tokenizer)
        self.matcher = _compiled(id(tokenizer), tokenizer, grammar).deep_copy()  # compiled once per grammar
        self.eos = frozenset(int(t) for t in eos_token_ids)
        self.live = True  # False once the grammar cannot follow the reply (never by design; a guard)
        self.masked_rows = 0  # rows whose raw choice the grammar refused (telemetry, tests)

    def choose(self, row: np.ndarray, position: int, params: SamplingParams) -> int:
        token = choose(row, position, params)
        if not self.live or self._allows(token):
            return token
        allowed = GrammarConstraint.bits(self.matcher, row.shape[0])
        if self.matcher.is_accepting():
            allowed[[t for t in self.eos if t < allowed.shape[0]]] = True
        if not allowed.any():
            self.live = False
            return token
        self.masked_rows += 1
        return choose(np.where(allowed, row, np.float32(-np.inf)).astype(row.dtype, copy=False), position, params)

    def _allows(self, token: int) -> bool:
        if token in self.eos:
            return self.matcher.is_accepting()
        if self.matcher.validate_tokens([token]) == 1:
            return True
        return self.matcher.is_accepting() and self.ll.is_special_token(token)  # free text: passes unseen

    def advance(self, token: int) -> None:
        token = int(token)
        if not self.live or token in self.eos:
            return
        if self.matcher.validate_tokens([token]) == 0:
            if not (self.matcher.is_accepting() and self.ll.is_special_token(token)):
                self.live = False  # only reachable when `choose` gave up: the rest is free
            return
        self.matcher.consume_token(token)
        if self.matcher.is_error():
            self.live = False

    @property
    def in_call(self) -> bool:
        """Whether the committed text has started a call that is not finished yet."""
        return self.live and not self.matcher.is_accepting()
