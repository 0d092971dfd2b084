"""``ApiError``: an HTTP error in OpenAI's JSON shape (``{"error": {"message", "type", "param", "code"}}``)."""

from __future__ import annotations

from epmoe.server.protocol import ErrorInfo, ErrorResponse

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 413: "invalid_request_error", 500: "server_error", 503: "service_unavailable"}


class ApiError(Exception):
    """An error answered to the client.

    Args:
        status: HTTP status (400, 401, 404, 413, 500, 503).
        message: what is wrong, naming the field and the value.
        param: the request field at fault, if one is.
    """

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param

    def body(self) -> ErrorResponse:
        """The JSON body."""
        kind = _TYPES.get(self.status, "invalid_request_error" if self.status < 500 else "server_error")
        return ErrorResponse(error=ErrorInfo(message=self.message, type=kind, param=self.param, code=self.status))
