"""Asking the running AgentFold server which model it serves (`GET /v1/models`).

Used when `--model` is not given; isolated here because it is the command's only network access,
and every failure must become one actionable line rather than a urllib traceback.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass

from agentfold.integrations.errors import IntegrateError


@dataclass(frozen=True)
class ServerModel:
    """The model a server lists first, its context window if it says, and the other models it lists."""

    id: str
    context_length: int | None
    others: tuple[str, ...] = ()


_CONTEXT_KEYS = ("context_length", "max_model_len", "context_window", "max_context_length", "n_ctx")


def fetch_model(base_url: str, timeout: float = 5.0) -> ServerModel:
    """The first model of the server's `GET /v1/models` (OpenAI list shape `{"data": [{"id": ...}]}`)."""
    url = base_url + "/v1/models"
    request = urllib.request.Request(url, headers={"Accept": "application/json", "Authorization": "Bearer agentfold"})
    host = urllib.parse.urlsplit(url).hostname or ""
    handlers = [urllib.request.ProxyHandler({})] if host in ("127.0.0.1", "localhost", "::1") else []
    opener = urllib.request.build_opener(*handlers)
    hint = "start it with `agentfold serve`, or pass --model NAME"
    try:
        with opener.open(request, timeout=timeout) as response:
            body = response.read()
    except urllib.error.HTTPError as error:
        raise IntegrateError(f"{url} answered HTTP {error.code}; is this an AgentFold server? Or pass --model NAME") from None
    except (urllib.error.URLError, OSError) as error:
        reason = getattr(error, "reason", error)
        reason = getattr(reason, "strerror", None) or reason
        raise IntegrateError(f"cannot reach the AgentFold server at {url} ({reason}); {hint}") from None
    try:
        payload = json.loads(body)
        entries = [entry for entry in payload["data"] if isinstance(entry, dict) and isinstance(entry.get("id"), str)]
    except (ValueError, KeyError, TypeError):
        raise IntegrateError(f"{url} did not answer with an OpenAI model list; pass --model NAME") from None
    if not entries:
        raise IntegrateError(f"{url} lists no model; pass --model NAME")
    first = entries[0]
    context = next((first[k] for k in _CONTEXT_KEYS if isinstance(first.get(k), int) and first[k] > 0), None)
    return ServerModel(first["id"], context, tuple(entry["id"] for entry in entries[1:]))
