"""The one error type that the serving endpoint turns into a 4xx answer.

Every check on a client's request raises `RequestError(status, code, message)`;
infer/serving/api.py renders it as `{"error": {"code", "message", "request_id"}}` with
that HTTP status. Anything else that escapes is a server bug and becomes a 500
carrying only the request id. Pure python.
"""

from __future__ import annotations


class RequestError(Exception):
    """A request the server refuses; `status` is a 4xx, `code` a short token, `message` says why."""

    def __init__(self, status: int, code: str, message: str):
        if not 400 <= status < 500:
            raise ValueError(f"RequestError status must be a 4xx, got {status}")
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message

    def __repr__(self) -> str:
        return f"RequestError({self.status}, {self.code!r}, {self.message!r})"
