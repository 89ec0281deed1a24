"""OpenAI-style errors: ``{"error": {"message", "type", "param", "code"}}``.

Every way a request can be wrong ends here as an :class:`ApiError` with an HTTP status, so the client gets
a JSON body naming the offending field and the server keeps serving. The engine, ``SamplingParams`` and
the chat encoder raise ``ValueError``s whose message starts with the field name
(``"max_tokens must be ..."``, ``"messages[0].role: ..."``); :func:`param_of` recovers that name.
"""

from __future__ import annotations

import json
import re
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

INVALID_REQUEST = "invalid_request_error"

# Union-typed fields produce one pydantic error per union member; this says what was expected instead.
_EXPECTED = {
    "prompt": "a string, a list of strings, a list of token ids or a list of token-id lists",
    "stop": "a string, a list of strings or null",
    "tool_choice": '"none", "auto" or an object',
    "messages": "a list of message objects",
}
_TYPE_TAGS = {"str", "int", "float", "bool", "none", "list", "dict"}

# "field must ...", "field: ...", "field (alias x) must ...", "field and other are ...". The name may be a
# path such as messages[0].content[1].type or prompt_token_ids[3].
_FIELD = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*(?:\[\d+\]|\.[A-Za-z_][A-Za-z0-9_]*)*)(?::| must\b| \(| and\b| are\b)")


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str = INVALID_REQUEST) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type

    def body(self) -> dict[str, Any]:
        return error_body(self.message, type=self.type, param=self.param, code=self.code)


def error_body(message: str, *, type: str = INVALID_REQUEST, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def param_of(message: str) -> str | None:
    """The field a deepinfer ``ValueError`` message names, or None when it names none."""
    m = _FIELD.match(message)
    return m.group(1) if m else None


def bad_request(exc: ValueError, renames: dict[str, str] | None = None) -> ApiError:
    """A 400 for a ``ValueError`` from the engine side, with ``param`` mapped to the OpenAI field name.

    ``renames`` maps an internal name (or its leading component) to the name the client used, e.g.
    ``seq_seed -> seed`` or, for chat, ``prompt -> messages``.
    """
    message = str(exc)
    param = original = param_of(message)
    if param is not None and renames:
        head = re.split(r"[\[.]", param, maxsplit=1)[0]
        if param in renames:
            param = renames[param]
        elif head in renames:
            param = renames[head] + param[len(head):]
        client_name = re.escape(renames.get(head, param).split("[")[0])
        if param != original and not re.search(rf"\b{client_name}\b", message):
            message = param + message[len(original):]  # speak of the field the client sent
    return ApiError(400, message, param=param, code="invalid_value" if param else None)


def not_found_model(model: str) -> ApiError:
    return ApiError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")


async def api_error_handler(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ApiError)
    headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)


async def http_error_handler(_: Request, exc: Exception) -> JSONResponse:
    """Starlette's own errors (unknown route -> 404, wrong method -> 405) in the OpenAI shape."""
    assert isinstance(exc, StarletteHTTPException)
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    message = "Unknown route." if exc.status_code == 404 else str(exc.detail)
    return JSONResponse(error_body(message, code=code), status_code=exc.status_code, headers=exc.headers)


async def internal_error_handler(_: Request, exc: Exception) -> JSONResponse:
    # Last resort: a bug in a route must not leak a stack trace, and must not stop the server.
    return JSONResponse(error_body(f"internal error: {type(exc).__name__}: {exc}", type="server_error"),
                        status_code=500)


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refusing (413) more than ``limit`` bytes before reading it all when possible."""
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            size = int(declared)
        except ValueError:
            raise ApiError(400, "Content-Length header is not an integer", code="invalid_header") from None
        if size > limit:
            raise ApiError(413, f"request body of {size} bytes exceeds the limit of {limit} bytes",
                           code="request_too_large")
    chunks, total = [], 0
    async for chunk in request.stream():  # chunked uploads carry no Content-Length: count as we go
        total += len(chunk)
        if total > limit:
            raise ApiError(413, f"request body exceeds the limit of {limit} bytes", code="request_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


def parse_body(model: type[BaseModel], body: bytes) -> Any:
    """JSON bytes -> a validated request model, or an ApiError 400 naming the field."""
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"invalid JSON body: {e}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise ApiError(400, f"request body must be a JSON object, got {type(data).__name__}", code="invalid_json")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        param = _param_path(err["loc"])
        top = str(err["loc"][0]) if err["loc"] else None
        if err["type"] == "missing":
            message = f"{param}: required field is missing"
        elif top in _EXPECTED and param == top:
            message = f"{param}: expected {_EXPECTED[top]}, got {_json_type(err.get('input'))}"
        else:
            message = f"{param}: {err['msg']} (got {_json_type(err.get('input'))})"
        raise ApiError(400, message, param=param, code="invalid_type" if "type" in err["type"] else "invalid_value") from None


def _param_path(loc: tuple[Any, ...]) -> str:
    """('stream_options', 'include_usage') -> 'stream_options.include_usage'; ('prompt', 'list[int]', 3) ->
    'prompt[3]'. Union member tags that pydantic puts in the location are dropped."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part.isidentifier() and part not in _TYPE_TAGS:
            out += ("." if out else "") + part
    return out or "body"


def _json_type(value: Any) -> str:
    names = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array",
             dict: "an object", type(None): "null"}
    return names.get(type(value), type(value).__name__)
