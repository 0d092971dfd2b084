"""``ApiError``: an HTTP error in OpenAI's JSON shape (``{"error": {"message", "type", "param", "code"}}``)."""

from __future__ import annotations

import pydantic

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


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "none"})


def _is_tag(part: str) -> bool:
    """A pydantic location part naming a union member, not a field: a type (``str``, ``list[int]``,
    ``literal['auto']``) or a model (``NamedToolChoice``; the API's fields are lower case)."""
    return not part.isidentifier() or part in _TYPE_TAGS or part[0].isupper()


def _field_of(loc: tuple) -> str | None:
    """The request field of a pydantic error location, without the union members' type tags and model names
    (``("prompt", "str")`` -> ``prompt``, ``("messages", 0, "content", "list[ContentPart]")`` ->
    ``messages.0.content``, ``("tool_choice", "NamedToolChoice", "function")`` -> ``tool_choice.function``)."""
    parts = [str(p) for p in loc if isinstance(p, int) or not _is_tag(p)]
    return ".".join(parts) or None


def _union_members(errors: list) -> tuple[dict | None, list[str]]:
    """Where the first error is one member of a union failing (``("messages", 0, "content", "str")``): the error to
    report when the input got past exactly one member's own type and failed inside it (a content list whose part
    has no ``text``: ``messages.0.content.0.text``, not the ``str`` member's complaint about a list), else
    ``None`` and the names of every member tried, when more than one failed inside (``prompt: [1.5]``)."""
    loc = errors[0]["loc"]
    tag = next((i for i, p in enumerate(loc) if isinstance(p, str) and _is_tag(p)), None)
    if tag is None:
        return None, []
    members: dict[str, list] = {}
    for e in errors:
        if e["loc"][:tag] == loc[:tag] and len(e["loc"]) > tag:
            members.setdefault(str(e["loc"][tag]), []).append(e)
    inside = [m for m, errs in members.items() if any(len(e["loc"]) > tag + 1 for e in errs)]
    if len(inside) == 1:
        return next(e for e in members[inside[0]] if len(e["loc"]) > tag + 1), []
    return None, list(members) if len(inside) > 1 else []


def validation_error(exc: pydantic.ValidationError) -> ApiError:
    """The 400 of a request body pydantic refused: the field (union members' tags left out) and the value sent;
    for a union no member took, the kinds it takes; a ``protocol.UNSERVED`` field with its own message."""
    errors = exc.errors()
    if errors[0]["type"] == "unserved":  # a field at a value this server does not serve (protocol.UNSERVED)
        return ApiError(400, errors[0]["msg"], errors[0]["ctx"]["field"])
    inner, kinds = _union_members(errors)
    first = inner or errors[0]
    field = _field_of(first["loc"])
    value = repr(first.get("input"))
    value = value if len(value) <= 80 else value[:77] + "..."
    tried = [e for e in errors if _field_of(e["loc"]) == field]
    if inner is None and (kinds or len(tried) > 1):  # a union: no member matched
        kinds = kinds or [str(e["loc"][-1]) for e in tried]
        kinds = list(dict.fromkeys("an object" if k[0].isupper() else k for k in kinds))  # a model's name
        return ApiError(400, f"{field}: must be {' | '.join(kinds)} (got {value})", field)
    if first["type"] == "missing":  # nothing was sent to show
        return ApiError(400, f"{field}: {first['msg']}", field)
    return ApiError(400, f"{field}: {first['msg']} (got {value})", field)
