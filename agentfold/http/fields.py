"""Reading and checking HTTP request bodies: the JSON object itself, then its typed fields.

The body is counted while read (chunked bodies declare no length), decoded strictly (UTF-8, no
lone surrogates that no tokenizer, log or database can take) and must be an object. The getters
accept what clients actually send (an int written as 2.0, a stop string or list) and answer
anything else with an `ApiError` naming the field and what it must be.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.requests import Request

from agentfold.chat.plan import json_kind
from agentfold.http.errors import ApiError
from agentfold.serve.limits import DEFAULT_MAX_BODY_BYTES
from agentfold.sessions.ids import check_session_id


async def read_body(request: Request, limit: int) -> bytes:
    """The raw body, counted while read: past `limit` bytes it is a 413 (chunked bodies have no length)."""
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(f"The request body is larger than {limit} bytes, the most this server accepts "
                           "(raise it with --max-body-bytes).", status=413, code="request_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


async def read_json(request: Request, limit: int = DEFAULT_MAX_BODY_BYTES) -> dict[str, Any]:
    """The request body as a JSON object, or a 4xx that says what is wrong with it."""
    raw = await read_body(request, limit)
    if not raw.strip():
        raise ApiError("The request body is empty; send a JSON object.")
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        raise ApiError(f"The request body is not valid UTF-8 (byte {error.start}: {raw[error.start:error.start + 1]!r}); "
                       "send JSON encoded as UTF-8.") from error
    try:
        body = json.loads(text)
    except (ValueError, RecursionError) as error:
        raise ApiError(f"The request body is not valid JSON: {error}.") from error
    _check_strings(body)
    if not isinstance(body, dict):
        raise ApiError(f"The request body must be a JSON object, not {json_kind(body)}.")
    return body


def _check_strings(value: Any) -> None:
    """Refuse lone surrogates (JSON `\\ud800` escapes): no tokenizer, log or database can take them."""
    stack = [value]
    while stack:  # iterative: a deeply nested body must not exhaust the recursion limit
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError as error:
                raise ApiError("The request holds a string with an unpaired surrogate escape (e.g. \\ud800); "
                               "send valid Unicode text.") from error
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


def get_int(body: dict, key: str, minimum: int | None = None, maximum: int | None = None,
            default: int | None = None) -> int | None:
    """`body[key]` as an int within the bounds (2.0 counts as 2); absent or null gives `default`."""
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (
            isinstance(value, float) and not value.is_integer()):
        raise ApiError(f"'{key}' must be an integer, not {json_kind(value)} ({json.dumps(value)[:40]}).", param=key)
    value = int(value)
    if minimum is not None and value < minimum:
        raise ApiError(f"'{key}' must be >= {minimum}, not {value}.", param=key)
    if maximum is not None and value > maximum:
        raise ApiError(f"'{key}' must be <= {maximum}, not {value}.", param=key)
    return value


def get_float(body: dict, key: str, minimum: float | None = None, maximum: float | None = None,
              default: float | None = None, open_minimum: bool = False) -> float | None:
    """`body[key]` as a float within the bounds (`open_minimum`: strictly above the minimum)."""
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise ApiError(f"'{key}' must be a number, not {json_kind(value)}.", param=key)
    value = float(value)
    if minimum is not None and (value <= minimum if open_minimum else value < minimum):
        bound = f"> {minimum:g}" if open_minimum else f">= {minimum:g}"
        raise ApiError(f"'{key}' must be {bound}, not {value:g}.", param=key)
    if maximum is not None and value > maximum:
        raise ApiError(f"'{key}' must be <= {maximum:g}, not {value:g}.", param=key)
    return value


def get_bool(body: dict, key: str, default: bool) -> bool:
    """`body[key]` as a JSON boolean; absent or null gives `default`."""
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ApiError(f"'{key}' must be true or false, not {json_kind(value)}.", param=key)
    return value


def get_str(body: dict, key: str, default: str | None = None) -> str | None:
    """`body[key]` as a string; absent or null gives `default`."""
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, str):
        raise ApiError(f"'{key}' must be a string, not {json_kind(value)}.", param=key)
    return value


def get_stop(body: dict, key: str) -> list[str]:
    """Stop sequences: one string or up to 16 of them (empty ones dropped)."""
    value = body.get(key)
    if value is None:
        return []
    if isinstance(value, str):
        return [value] if value else []
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        if len(value) > 16:
            raise ApiError(f"'{key}' may hold at most 16 strings, not {len(value)}.", param=key)
        return [v for v in value if v]
    raise ApiError(f"'{key}' must be a string or an array of strings.", param=key)


def get_prediction(body: dict, key: str = "prediction") -> str:
    """OpenAI's Predicted Outputs: `{"type": "content", "content": text | [{"type": "text", "text": ...}]}`,
    the text the client expects the reply to repeat (a file being edited), joined; "" when absent."""
    value = body.get(key)
    if value is None:
        return ""
    if not isinstance(value, dict) or value.get("type") != "content":
        raise ApiError(f"'{key}' must be an object with \"type\": \"content\" and its 'content'.", param=key)
    content = value.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(part, dict) and part.get("type") == "text"
                                         and isinstance(part.get("text"), str) for part in content):
        return "".join(part["text"] for part in content)
    raise ApiError(f"'{key}.content' must be a string or an array of text parts.", param=f"{key}.content")


def get_seed(body: dict) -> int:
    """`seed` folded into 64 bits (negative and huge seeds are accepted, as OpenAI does)."""
    seed = get_int(body, "seed", default=0)
    return seed & 0xFFFFFFFFFFFFFFFF


def _checked_session(session: str, param: str) -> str:
    try:
        return check_session_id(session)
    except ValueError as error:
        raise ApiError(f"'{param}': {error}", param="session_id") from error


def get_session_id(body: dict, request: Request) -> str | None:
    """The session key, checked against the strict id pattern: `session_id`, else the X-Session-Id
    header, else X-Claude-Code-Session-Id (the session Claude Code sends with every request)."""
    session = get_str(body, "session_id")
    param = "session_id"
    if not session:
        session, param = request.headers.get("x-session-id"), "X-Session-Id"
    if not session:
        session, param = request.headers.get("x-claude-code-session-id"), "X-Claude-Code-Session-Id"
    return _checked_session(session, param) if session else None


def client_session_id(body: dict) -> str | None:
    """Anthropic's `metadata.user_id` when it is a JSON string with a `session_id` (Claude Code's
    own session), checked like any session id; None for other user ids, which are opaque."""
    metadata = body.get("metadata")
    user_id = metadata.get("user_id") if isinstance(metadata, dict) else None
    if not isinstance(user_id, str) or not user_id.lstrip().startswith("{"):
        return None
    try:
        session = json.loads(user_id).get("session_id")
    except (ValueError, AttributeError, RecursionError):
        return None
    return _checked_session(session, "metadata.user_id.session_id") if isinstance(session, str) and session else None


def read_turn_fields(plan: Any, body: dict, request: Request) -> None:
    """The fields every chat API shares onto `plan`: seed, draft, audit, session, stream, model."""
    plan.seed = get_seed(body)
    plan.draft = get_bool(body, "draft", True)
    plan.audit = get_bool(body, "audit", False)
    plan.session_id = get_session_id(body, request)
    plan.stream = get_bool(body, "stream", False)
    plan.model = get_str(body, "model", "") or ""
