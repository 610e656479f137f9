"""OpenAI-shaped errors: `{"error": {message, type, param, code}}`, and validation failures
turned into one 400 naming the first bad field (with a code for every kind)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ValidationError


class APIError(Exception):
    """An error the API returns as `{"error": {...}}` with `status`."""

    _TYPES = {400: "invalid_request_error", 401: "invalid_request_error",
              404: "invalid_request_error", 405: "invalid_request_error",
              413: "invalid_request_error", 500: "server_error", 503: "service_unavailable"}

    # Every error carries a code; these are the defaults where the raiser names none.
    _CODES = {400: "invalid_value", 401: "invalid_api_key", 404: "not_found",
              405: "method_not_allowed", 413: "request_too_large", 500: "internal",
              503: "unavailable"}

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, headers: dict | None = None,
                 detail: dict | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.code = code or self._CODES.get(status, "invalid_value")
        self.headers = headers
        self.detail = detail  # more keys of the error object (a failed generation's text)

    def body(self) -> dict:
        kind = self._TYPES.get(self.status, "invalid_request_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param,
                          "code": self.code, **(self.detail or {})}}


def parse_body(model: type[BaseModel], raw: bytes) -> Any:
    """Validate a JSON body; the first problem becomes a 400 naming the field."""
    try:
        return model.model_validate_json(raw, strict=True)
    except ValidationError as exc:
        raise validation_error(exc) from None


def validation_error(exc: ValidationError) -> APIError:
    err = _deepest(exc.errors(include_url=False))
    kind, msg = err["type"], err["msg"].removeprefix("Value error, ")
    if kind == "json_invalid":
        return APIError(400, f"request body is not valid JSON: {msg}", None, "invalid_json")
    if kind == "model_type" and not err["loc"]:
        return APIError(400, "request body must be a JSON object", None, "invalid_body")
    # Union members show up in the location ("stop.str"): keep only the field path.
    param = ".".join(str(p) for p in err["loc"] if not _is_type_tag(p)) or None
    if kind == "extra_forbidden":
        return APIError(400, f"unknown field '{param}'", param, "unknown_field")
    if kind == "missing":
        return APIError(400, f"'{param}' is required", param, "missing_field")
    if kind == "value_error" and param and msg.startswith(param.split(".")[-1]):
        return APIError(400, msg, param, "invalid_value")  # the message already names the field
    got = err.get("input")
    shown = repr(got) if len(repr(got)) <= 60 else repr(got)[:57] + "..."
    shows_input = kind.endswith(("_type", "_than", "_equal", "literal_error"))
    detail = f" (got {shown})" if shows_input else ""
    return APIError(400, f"'{param}': {msg}{detail}", param, "invalid_value")


def _deepest(errors: list) -> dict:
    """The first field's error from the union member that got furthest: an object sent as
    tool_choice fails the string choices at `tool_choice` and the named choice at
    `tool_choice.function.name`, and only the second says what to fix."""
    first = errors[0]
    same = [e for e in errors if e["loc"][:1] == first["loc"][:1]]
    return max(same, key=lambda e: sum(not _is_type_tag(p) for p in e["loc"]))


def _is_type_tag(part: Any) -> bool:
    # Union members name themselves in the location: a type ("str", "list[...]", a validator's
    # "function-after[...]") or a model's class name ("NamedToolChoice": fields are snake_case).
    return isinstance(part, str) and (part in ("str", "int", "float", "bool", "list", "dict")
                                      or "[" in part or part.startswith("function-")
                                      or (part[:1].isupper() and part.isidentifier()))
