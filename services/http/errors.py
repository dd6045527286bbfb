"""OpenAI's error JSON and the HTTP status of every failure of the HTTP front.

Owns the mapping from a gRPC status (what the gateway answered) to an HTTP status and an
OpenAI error `type`, and the one error body every endpoint returns:
`{"error": {"message", "type", "param", "code"}}`. It never decides whether a request is
valid (the request models and the gateway do) and never puts a traceback in a body.
"""

from __future__ import annotations

import logging
import re
import secrets

import grpc
from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

log = logging.getLogger("dspark.http")

# gRPC status -> HTTP status. 499 is the de-facto "client closed request" status (nginx).
HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409,  # a request id that is already running
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.CANCELLED: 499,
    grpc.StatusCode.UNIMPLEMENTED: 501,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
# HTTP status -> OpenAI error type (the names OpenAI's API and its clients use).
ERROR_TYPE = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
              404: "not_found_error", 429: "rate_limit_error", 499: "cancelled", 501: "not_implemented",
              503: "service_unavailable", 504: "timeout"}


def error_type(status: int) -> str:
    """The OpenAI error `type` of an HTTP status: ERROR_TYPE's name, else by class (a 4xx is
    the client's fault, "invalid_request_error"; anything else "server_error")."""
    if status in ERROR_TYPE:
        return ERROR_TYPE[status]
    return "invalid_request_error" if 400 <= status < 500 else "server_error"


class ApiError(Exception):
    """A failure answered with OpenAI's error JSON.

    status: the HTTP status; message: says what was wrong, naming the value; param: the
    request field at fault (None when none is); code: a short machine-readable name.
    """

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        """The error JSON: {"error": {"message", "type", "param", "code"}}."""
        return {"error": {"message": self.message, "type": error_type(self.status),
                          "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def invalid(param: str, message: str) -> ApiError:
    """A 400 naming the request field `param`."""
    return ApiError(400, message, param=param, code="invalid_value")


# The gateway's GenerateRequest fields that the HTTP API carries under the same name: a
# gateway refusal whose message starts with one of them ("min_tokens=30: must be <= ...",
# "bad_words: a word of 40 tokens", "prompt of 1030 tokens + ...") names that field as
# `param`, as the front's own checks do, so OpenAI clients read it from `err.param`.
GATEWAY_FIELDS = frozenset({
    "prompt", "max_tokens", "temperature", "stop", "stop_token_ids", "top_p", "top_k", "min_p", "seed",
    "logprobs", "prompt_logprobs", "logit_bias", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "min_tokens", "bad_words"})
_LEADING_NAME = re.compile(r"([a-z_]+)(?=[=\[: ]|$)")
# messages whose first words are not the field's name
_MESSAGE_PREFIX_PARAMS = (("stop token id ", "stop_token_ids"),)


def from_rpc_error(exc: grpc.aio.AioRpcError) -> ApiError:
    """The ApiError of a failed Generate call: the status mapped by HTTP_STATUS (500 for any
    other code), the gateway's message (which names the value at fault), code = the gRPC
    status name in lower case; `param` the field the message starts with when the call was
    refused as INVALID_ARGUMENT and that name is one of GATEWAY_FIELDS, else None."""
    status = HTTP_STATUS.get(exc.code(), 500)
    message = exc.details() or exc.code().name
    param = None
    if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
        named = [field for prefix, field in _MESSAGE_PREFIX_PARAMS if message.startswith(prefix)]
        m = _LEADING_NAME.match(message)
        param = named[0] if named else (m.group(1) if m and m.group(1) in GATEWAY_FIELDS else None)
    return ApiError(status, message, param=param, code=exc.code().name.lower())


async def api_error_handler(request: Request, exc: ApiError) -> JSONResponse:
    return exc.response()


# Pydantic names the member of a union it tried in `loc` ("str", "list[int]", a model's class
# name): not a field of the request.
_UNION_TAGS = ("body", "str", "int", "float", "bool", "none", "TextPart", "StreamOptions",
               "TokenizeChat", "TokenizeCompletion")


def _field_path(loc) -> str:
    """The dotted path of a validation error's `loc` without "body" and union member tags."""
    return ".".join(str(p) for p in loc if p not in _UNION_TAGS and not (isinstance(p, str) and "[" in p))


async def validation_error_handler(request: Request, exc: RequestValidationError) -> JSONResponse:
    """A request body that does not match its model: 400 naming the top-level field at fault;
    the message joins what each accepted form of the field objected to."""
    errors = exc.errors()
    if not errors:
        return ApiError(400, "invalid request body", code="invalid_value").response()
    if errors[0].get("type") == "json_invalid":  # its loc is a character offset, not a field
        reason = errors[0].get("ctx", {}).get("error", "")
        return ApiError(400, f"request body: not valid JSON ({reason}, at character {errors[0]['loc'][-1]})",
                        code="invalid_json").response()
    path = _field_path(errors[0].get("loc", ()))
    param = path.split(".")[0] or None
    reasons = list(dict.fromkeys(e.get("msg", "") for e in errors if _field_path(e.get("loc", ())) == path))
    text = "; ".join(reasons)
    # an empty path: the body as a whole is at fault (absent, or JSON that is not an object)
    return ApiError(400, f"{path or 'request body'}: {text}", param=param, code="invalid_value").response()


async def internal_error_handler(request: Request, exc: Exception) -> JSONResponse:
    """Anything unexpected: logged with its traceback under a reference; the client gets only
    the exception's class and that reference."""
    ref = secrets.token_hex(4)
    log.error("internal error in %s %s (ref %s)", request.method, request.url.path, ref, exc_info=exc)
    return ApiError(500, f"internal error ({type(exc).__name__}); see the server log, ref {ref}",
                    code="internal").response()
