"""From a chat plan to a `TurnRequest` on one runtime: render, tokenize, cut, size.

This is the part of answering a chat request that needs the runtime (its tokenizer, chat
template and context length) but nothing of the transport, so the HTTP APIs and the MCP server
render and cut a conversation the same way: a session resumed over one restores the snapshots
the other left. Problems the client must fix are `PlanError`s (agentfold.chat.plan) that each
transport answers in its own shape.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from agentfold.chat.cuts import memo_for, message_cuts, tools_salt
from agentfold.chat.harmony import holds_to_grammar, is_harmony
from agentfold.chat.harmony import special_tags as harmony_special_tags
from agentfold.chat.plan import ChatPlan, ContextOverflow, PlanError, checked_grammar, plan_instructions, sampling
from agentfold.chat.template import render_chat
from agentfold.chat.tools import TOOL_CALL_CLOSE, TOOL_CALL_OPEN, ToolSpec
from agentfold.engine.decode import GenerationConfig
from agentfold.engine.lazy_calls import special_tags
from agentfold.serve.scheduler import Runtime, TurnRequest

log = logging.getLogger(__name__)


@dataclass
class PreparedTurn:
    """A plan rendered for the model: the TurnRequest plus how to read the model's output."""

    request: TurnRequest
    tools_enabled: bool
    prefix: str  # output the prompt forced (parsed as if the model wrote it)
    user_stops: list[str]
    prompt_tokens: int
    tools: list[ToolSpec] | None = None  # the declared tools a call in the output must name and fit
    parallel: bool = True  # several calls in one reply are returned (False: the first only)
    harmony: bool = False  # the reply is harmony (gpt-oss): read by chat.harmony, not chat.tool_calls


def plan_cuts(runtime: Runtime, messages: list[dict[str, Any]], tools: Sequence[Any] | None,
              prompt: Sequence[int]) -> tuple[list[int], int]:
    """Prefill cuts at the shared head's end, each assistant message's start and this reply's, as the
    chat renders them; and the head's end (0 for none).

    Prefixes already rendered for an earlier turn of the conversation come from the runtime's memo.
    """
    return message_cuts(
        memo_for(runtime),
        lambda head: runtime.encode(render_chat(runtime.tokenizer, head, tools, add_generation_prompt=False)),
        messages, prompt, tools_salt(tools))


def _raw_prompt_ids(runtime: Runtime, raw_prompt: str | list[int]) -> list[int]:
    """/v1/completions-style prompts: text encoded as is, or token ids taken as given."""
    if isinstance(raw_prompt, str):
        prompt = runtime.encode(raw_prompt) if raw_prompt else []
    else:
        prompt = list(raw_prompt)
    if not prompt:
        raise PlanError("'prompt' is empty; send some text.", param="prompt")
    return prompt


def _chat_prompt(runtime: Runtime, plan: ChatPlan, tools_enabled: bool, harmony: bool = False
                 ) -> tuple[list[int], tuple[list[int], int], list[str]]:
    """The rendered conversation's ids, its prefill cuts and head, and the stops the tool choice needs
    (none for a harmony reply: its calls are not <tool_call> blocks, and one ends the reply)."""
    messages = list(plan.messages)
    note = plan_instructions(plan, harmony)  # after the shared history, outside it: the next turn reuses the cache
    try:
        text = render_chat(runtime.tokenizer, messages, plan.tools or None, trailing=note or None)
    except Exception as error:  # jinja errors of the model's own template
        raise PlanError(f"The model's chat template cannot render these messages: {error}") from error
    internal_stops: list[str] = []
    if tools_enabled and not harmony and (isinstance(plan.tool_choice, dict) or not plan.parallel_tool_calls):
        internal_stops.append(TOOL_CALL_CLOSE)  # one call wanted: stop as soon as it is written
    if plan.tools and plan.tool_choice == "none" and not harmony:
        internal_stops.append(TOOL_CALL_OPEN)
    prompt = runtime.encode(text)
    return prompt, plan_cuts(runtime, messages, plan.tools or None, prompt), internal_stops


def _reply_budget(plan: ChatPlan, prompt_tokens: int, limit: int,
                  default_max_tokens: int | None) -> tuple[int, dict[str, int] | None]:
    """The reply's token budget within the context, and the clamp when the plan asked for more.

    A budget beyond what the context leaves is clamped to it, as llama-server does (Claude Code
    asks for 32K-128K tokens whatever the model); a prompt that does not fit (the reply needs at
    least one token) is a `ContextOverflow`.
    """
    if prompt_tokens >= limit:
        raise ContextOverflow(prompt_tokens, limit)
    room = limit - prompt_tokens
    max_tokens = plan.max_tokens
    if max_tokens is None:
        return (min(room, default_max_tokens) if default_max_tokens else room), None
    if max_tokens <= room:
        return max_tokens, None
    clamp = {"requested": max_tokens, "granted": room, "prompt_tokens": prompt_tokens, "context_length": limit}
    log.info("'%s' %d clamped to %d: the prompt takes %d of the %d-token context",
             plan.max_tokens_param, max_tokens, room, prompt_tokens, limit)
    return room, clamp


def prepare_turn(runtime: Runtime, plan: ChatPlan, api: str, client: str = "",
                 default_max_tokens: int | None = None) -> PreparedTurn:
    """Render, tokenize and size a plan; a prompt that does not fit is a PlanError naming the limit,
    a reply budget that does not fit is clamped (`TurnRequest.max_tokens_clamped`).

    `api` and `client` label the turn's telemetry row; `default_max_tokens` caps a reply whose
    plan names no budget (else it may fill the context).
    """
    params = sampling(plan)
    tools_enabled = bool(plan.tools) and plan.tool_choice != "none" and plan.raw_prompt is None
    harmony = plan.raw_prompt is None and is_harmony(runtime.tokenizer)
    if plan.raw_prompt is not None:
        prompt, (cuts, head), internal_stops = _raw_prompt_ids(runtime, plan.raw_prompt), ([], 0), []
    else:
        prompt, (cuts, head), internal_stops = _chat_prompt(runtime, plan, tools_enabled, harmony)
    max_tokens, clamp = _reply_budget(plan, len(prompt), runtime.context_length, default_max_tokens)
    prefix = ""
    config = GenerationConfig(params=params, max_tokens=max_tokens,
                              stop=tuple(dict.fromkeys([*plan.stop, *internal_stops])), draft=plan.draft, logprobs=plan.logprobs,
                              grammar=_grammar(runtime, plan, tools_enabled, harmony),
                              prediction=_prediction_ids(runtime, plan))
    turn_request = TurnRequest(
        prompt=prompt, config=config, api=api, client=client,
        session_id=plan.session_id, audit=plan.audit, model=plan.model,
        cuts=cuts, head=head, outcome_follows=True, max_tokens_clamped=clamp,
    )
    return PreparedTurn(turn_request, tools_enabled, prefix, list(plan.stop), len(prompt),
                        tools=list(plan.tools) if tools_enabled else None, parallel=plan.parallel_tool_calls,
                        harmony=harmony)


def _prediction_ids(runtime: Runtime, plan: ChatPlan) -> tuple[int, ...]:
    """The request's predicted text as ids (no special tokens), for the reply's drafter; none when
    the reply is serial. Tokens at the text's edges may split otherwise in the reply: the drafter
    looks the reply's tail up in them, so it finds its place again."""
    if not plan.prediction or not plan.draft:
        return ()
    return tuple(runtime.tokenizer.encode(plan.prediction, add_special_tokens=False))


def _grammar(runtime: Runtime, plan: ChatPlan, tools_enabled: bool, harmony: bool = False) -> str | None:
    """The plan's grammar; the lazy tool-call grammar names the call tags as this tokenizer has them
    (a harmony grammar, its harmony tags)."""
    if plan.raw_prompt is not None:
        return None
    if harmony:
        if not (tools_enabled or holds_to_grammar(plan.tools, plan.tool_choice, plan.response_format)):
            return None
        tags = harmony_special_tags(runtime.tokenizer)
        return checked_grammar(plan, harmony=tags) if tags is not None else None
    return checked_grammar(plan, special_tags(runtime.tokenizer) if tools_enabled else frozenset())
