"""`ApiError`: what the HTTP APIs answer with a 4xx / 5xx in each API's own error shape.

Validation is lenient about what it does not know (unknown fields are ignored) and strict about
what it does: a wrong type or out-of-range value is an `ApiError` whose message says what to fix,
never a 500. Problems found in the transport-neutral chat plan are `PlanError`s
(agentfold.chat.plan); `from_plan` gives them their HTTP form, a 400.
"""

from __future__ import annotations

from agentfold.chat.plan import PlanError


class ApiError(Exception):
    """A request the client must fix (or a server state it must wait out), with its HTTP status."""

    def __init__(self, message: str, status: int = 400, type: str = "invalid_request_error",
                 code: str | None = None, param: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = type
        self.code = code
        self.param = param
        self.headers = dict(headers or {})  # e.g. Retry-After on a 429

    @classmethod
    def from_plan(cls, error: PlanError) -> ApiError:
        """A chat plan the client must fix, as a 400 with the plan's message, code and field."""
        return cls(error.message, code=error.code, param=error.param)
