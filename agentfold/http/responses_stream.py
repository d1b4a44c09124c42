"""A Responses reply's objects (`ResponseShape`: the response, its output items) and its event stream
(`_ResponseStream`: `response.created` ... `response.completed`, the reasoning, message and call
items' own events), apart from the request parsing in `responses_api`."""

from __future__ import annotations

import itertools
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request

from agentfold.chat.harmony import ReasoningPiece
from agentfold.chat.plan import ChatPlan
from agentfold.chat.tool_calls import TextPiece
from agentfold.chat.tools import ToolCall
from agentfold.http.errors import ApiError
from agentfold.http.response_store import ResponseStore
from agentfold.http.stream import Heartbeat, Outcome, drive, new_id, now, sse
from agentfold.serve.chat_turn import PreparedTurn

log = logging.getLogger(__name__)

@dataclass
class ResponseShape:
    """What every Responses object of one reply carries (its id, the request's echo) and its item builders."""

    body: dict[str, Any]
    plan: ChatPlan
    custom: set[str]  # custom tools: their calls are `custom_tool_call` items
    model: str
    instructions: str | None
    previous_id: str | None = None
    store: ResponseStore | None = None  # where the reply is kept for `previous_response_id` (None: store false)
    new_items: list[dict[str, Any]] = field(default_factory=list)  # this request's input, kept with the reply
    resp_id: str = field(default_factory=lambda: new_id("resp_"))
    created: int = field(default_factory=now)

    def response(self, status: str, output: list[dict[str, Any]], outcome: Outcome | None = None) -> dict[str, Any]:
        """The `response` object, with usage and telemetry once the turn has its Outcome."""
        body, plan = self.body, self.plan
        metadata = body.get("metadata") if isinstance(body.get("metadata"), dict) else {}
        obj: dict[str, Any] = {
            "id": self.resp_id, "object": "response", "created_at": self.created, "status": status,
            "model": self.model, "output": output, "error": None, "incomplete_details": None,
            "instructions": self.instructions,
            "max_output_tokens": plan.max_tokens, "parallel_tool_calls": plan.parallel_tool_calls,
            "tool_choice": body.get("tool_choice") or "auto", "tools": body.get("tools") or [],
            "temperature": plan.temperature, "top_p": plan.top_p, "metadata": metadata,
            "previous_response_id": self.previous_id, "store": self.store is not None, "truncation": "disabled",
            "usage": None,
            "text": {"format": plan.response_format or {"type": "text"}},
        }
        if outcome is not None:
            obj["usage"] = {"input_tokens": outcome.prompt_tokens,
                            "input_tokens_details": {"cached_tokens": outcome.cached_tokens},
                            "output_tokens": outcome.completion_tokens,
                            "output_tokens_details": {"reasoning_tokens": outcome.reasoning_tokens},
                            "total_tokens": outcome.prompt_tokens + outcome.completion_tokens}
            if outcome.finish == "length":
                obj["status"] = "incomplete"
                obj["incomplete_details"] = {"reason": "max_output_tokens"}
            obj["timings"] = outcome.timings
            obj["agentfold"] = outcome.agentfold
        return obj

    def keep(self, output: list[dict[str, Any]], outcome: Outcome) -> None:
        """Keep this reply (its new input and its output) for a later `previous_response_id`."""
        if self.store is not None:
            session = outcome.agentfold.get("session_id") if isinstance(outcome.agentfold, dict) else None
            self.store.put(self.resp_id, self.previous_id, [*self.new_items, *output], session or self.plan.session_id)

    @staticmethod
    def message_item(text: str, status: str = "completed", item_id: str | None = None) -> dict[str, Any]:
        """An assistant `message` item (its content only once completed)."""
        content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if status == "completed" else []
        return {"type": "message", "id": item_id or new_id("msg_"), "status": status, "role": "assistant",
                "content": content}

    @staticmethod
    def reasoning_item(text: str, status: str = "completed", item_id: str | None = None) -> dict[str, Any]:
        """A `reasoning` item holding a harmony reply's analysis text (its content only once completed)."""
        content = [{"type": "reasoning_text", "text": text}] if status == "completed" else []
        return {"type": "reasoning", "id": item_id or new_id("rs_"), "summary": [], "content": content,
                "status": status}

    def output_items(self, outcome: Outcome) -> list[dict[str, Any]]:
        """The reply's output items: a harmony reply's in the order written (reasoning first, as the
        model writes it), else the message (when it has text or no call) and then the calls."""
        if outcome.blocks is None:
            output = [self.message_item(outcome.content)] if outcome.content or not outcome.calls else []
            return output + [self.call_item(call) for call in outcome.calls]
        output = []
        for block in outcome.blocks:
            if isinstance(block, ReasoningPiece):
                output.append(self.reasoning_item(block.text))
            elif isinstance(block, TextPiece):
                output.append(self.message_item(block.text))
            else:
                output.append(self.call_item(block))
        if not outcome.content and not outcome.calls:
            output.append(self.message_item(""))
        return output

    def call_item(self, call: ToolCall, status: str = "completed") -> dict[str, Any]:
        """A `function_call` item, or a `custom_tool_call` carrying the free-form `input` text."""
        call.id = call.id or new_id("call_")
        if call.name in self.custom:
            text = call.arguments_obj.get("input", "")
            return {"type": "custom_tool_call", "id": new_id("ctc_"), "call_id": call.id, "name": call.name,
                    "input": text if isinstance(text, str) else str(text), "status": status}
        return {"type": "function_call", "id": new_id("fc_"), "call_id": call.id, "name": call.name,
                "arguments": call.arguments, "status": status}


class _ResponseStream:
    """The event sequence of one streamed reply: numbered events, the output items so far."""

    def __init__(self, shape: ResponseShape) -> None:
        self.shape = shape
        self.seq = itertools.count()
        self.output: list[dict[str, Any]] = []
        self.open_message: dict[str, Any] | None = None
        self.text_parts: list[str] = []
        self.open_reasoning: dict[str, Any] | None = None
        self.reasoning_parts: list[str] = []

    def event(self, kind: str, **fields: Any) -> str:
        return sse({"type": kind, "sequence_number": next(self.seq), **fields}, event=kind)

    def reasoning(self, piece: ReasoningPiece) -> list[str]:
        """Reasoning text: opens a reasoning item (and its reasoning_text part) on the first piece."""
        lines = self.close_message()
        if self.open_reasoning is None:
            self.open_reasoning = self.shape.reasoning_item("", "in_progress")
            self.reasoning_parts.clear()
            lines.append(self.event("response.output_item.added", output_index=len(self.output),
                                    item=self.open_reasoning))
            lines.append(self.event("response.content_part.added", item_id=self.open_reasoning["id"],
                                    output_index=len(self.output), content_index=0,
                                    part={"type": "reasoning_text", "text": ""}))
        self.reasoning_parts.append(piece.text)
        lines.append(self.event("response.reasoning_text.delta", item_id=self.open_reasoning["id"],
                                output_index=len(self.output), content_index=0, delta=piece.text))
        return lines

    def close_reasoning(self) -> list[str]:
        """Finish the open reasoning item, if any: its text, part and item `done` events."""
        if self.open_reasoning is None:
            return []
        index, item_id, text = len(self.output), self.open_reasoning["id"], "".join(self.reasoning_parts)
        done = self.shape.reasoning_item(text, item_id=item_id)
        self.output.append(done)
        self.open_reasoning = None
        return [self.event("response.reasoning_text.done", item_id=item_id, output_index=index, content_index=0,
                           text=text),
                self.event("response.content_part.done", item_id=item_id, output_index=index, content_index=0,
                           part={"type": "reasoning_text", "text": text}),
                self.event("response.output_item.done", output_index=index, item=done)]

    def text(self, piece: TextPiece) -> list[str]:
        """Content text: opens a message item (and its text part) on the first piece."""
        lines = self.close_reasoning()
        if self.open_message is None:
            self.open_message = self.shape.message_item("", "in_progress")
            self.text_parts.clear()
            lines.append(self.event("response.output_item.added", output_index=len(self.output),
                                    item=self.open_message))
            lines.append(self.event("response.content_part.added", item_id=self.open_message["id"],
                                    output_index=len(self.output), content_index=0,
                                    part={"type": "output_text", "text": "", "annotations": [], "logprobs": []}))
        self.text_parts.append(piece.text)
        lines.append(self.event("response.output_text.delta", item_id=self.open_message["id"],
                                output_index=len(self.output), content_index=0, delta=piece.text, logprobs=[]))
        return lines

    def close_message(self) -> list[str]:
        """Finish the open message item, if any: its text, part and item `done` events."""
        if self.open_message is None:
            return []
        index, item_id, text = len(self.output), self.open_message["id"], "".join(self.text_parts)
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
        done = self.shape.message_item(text, item_id=item_id)
        self.output.append(done)
        self.open_message = None
        return [self.event("response.output_text.done", item_id=item_id, output_index=index, content_index=0,
                           text=text, logprobs=[]),
                self.event("response.content_part.done", item_id=item_id, output_index=index, content_index=0,
                           part=part),
                self.event("response.output_item.done", output_index=index, item=done)]

    def tool_call(self, call: ToolCall) -> list[str]:
        """A settled call as one item: added, its whole arguments (or input) as one delta, done."""
        lines = self.close_reasoning() + self.close_message()
        done = self.shape.call_item(call)
        index = len(self.output)
        started = {**done, "status": "in_progress"}
        custom_call = done["type"] == "custom_tool_call"
        if custom_call:
            started["input"] = ""
        else:
            started["arguments"] = ""
        lines.append(self.event("response.output_item.added", output_index=index, item=started))
        if custom_call:
            lines.append(self.event("response.custom_tool_call_input.delta", item_id=done["id"], output_index=index,
                                    delta=done["input"]))
            lines.append(self.event("response.custom_tool_call_input.done", item_id=done["id"], output_index=index,
                                    input=done["input"]))
        else:
            lines.append(self.event("response.function_call_arguments.delta", item_id=done["id"],
                                    output_index=index, delta=done["arguments"]))
            lines.append(self.event("response.function_call_arguments.done", item_id=done["id"],
                                    output_index=index, name=done["name"], arguments=done["arguments"]))
        self.output.append(done)
        lines.append(self.event("response.output_item.done", output_index=index, item=done))
        return lines

    def completed(self, outcome: Outcome) -> list[str]:
        lines = self.close_reasoning() + self.close_message()
        if outcome.blocks is not None and not outcome.content and not outcome.calls:
            lines += self.text(TextPiece("")) + self.close_message()  # an empty answer is still a message item
        self.shape.keep(self.output, outcome)
        return [*lines, self.event("response.completed", response=self.shape.response("completed", self.output, outcome))]

    def failed(self, error: Exception) -> str:
        """`response.failed` with the error's code and message (an ApiError's own, else server_error)."""
        status_error = error if isinstance(error, ApiError) else None
        if status_error is None:
            log.exception("responses stream failed")
        failed = self.shape.response("failed", self.output)
        failed["error"] = {"code": (status_error.code if status_error else None) or "server_error",
                           "message": status_error.message if status_error else f"generation failed: {error}"}
        return self.event("response.failed", response=failed)


async def overflow_events(shape: ResponseShape, error: ApiError) -> AsyncIterator[str]:
    """A streamed request whose prompt does not fit: `response.failed` with `context_length_exceeded`,
    the one form of it Codex (0.171) reads as a full context window (an HTTP 400 is an invalid request
    to it); non-streamed requests get the 400 with that code."""
    stream = _ResponseStream(shape)
    yield stream.event("response.created", response=shape.response("in_progress", []))
    yield stream.failed(error)


async def response_events(server: Any, prepared: PreparedTurn, request: Request, shape: ResponseShape) -> AsyncIterator[str]:
    stream = _ResponseStream(shape)
    yield stream.event("response.created", response=shape.response("in_progress", []))
    yield stream.event("response.in_progress", response=shape.response("in_progress", []))
    try:
        async for item in drive(server.runtime, prepared, request):
            if isinstance(item, Heartbeat):  # a long prefill: the response is still in progress
                lines = [stream.event("response.in_progress", response=shape.response("in_progress", stream.output))]
            elif isinstance(item, TextPiece):
                lines = stream.text(item)
            elif isinstance(item, ReasoningPiece):
                lines = stream.reasoning(item)
            elif isinstance(item, ToolCall):
                lines = stream.tool_call(item)
            else:
                lines = stream.completed(item)
            for line in lines:
                yield line
    except Exception as error:
        yield stream.failed(error)
