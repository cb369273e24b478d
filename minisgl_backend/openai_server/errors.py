"""OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}` with an HTTP status."""

from __future__ import annotations

from typing import Any


class OpenAIError(Exception):
    """A request the front door refuses or could not serve; `param` names the request field."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error", code: str | None = None) -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.kind, self.code = (
            message, param, status, kind, code)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}


def server_error(message: str) -> OpenAIError:
    """The engine or the server failed, not the request."""
    return OpenAIError(message, status=500, kind="server_error")
