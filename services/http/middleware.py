"""ASGI middleware of the HTTP front: the request body limit and the access log.

Owns two wrappers of the FastAPI application, outside any route, so they see every request,
refused ones too: `BodyLimit` answers 413 to a body over the limit without reading the rest
of it, and `AccessLog` writes one line per request. Neither decides anything about a request's
content.

Access log: logger `dspark.http.access`, INFO, one line per request when its response has
been sent (a stream: when it ended; the line is written just before the last byte is sent): `<method> <path> <status> <ms> ms request_id=<id>`, the
record carrying `method`, `path`, `status`, `ms` and `request_id` attributes for structured
formats. The id is the response's `x-request-id` header: a generation's response id
(`cmpl-…`, `chatcmpl-…`, the gateway's request id), else one made here (32 hex digits) and
added to the response as that header. A client that disconnects before any response is
logged with status 499.
"""

from __future__ import annotations

import logging
import time
import uuid

from starlette.exceptions import HTTPException

from services.common.settings import HTTP_MAX_BODY_BYTES

access_log = logging.getLogger("dspark.http.access")
DEFAULT_MAX_BODY_BYTES = HTTP_MAX_BODY_BYTES
REQUEST_ID_HEADER = b"x-request-id"


class BodyLimit:
    """Refuse request bodies over `max_bytes` bytes with 413: at once when Content-Length
    says so (the body is never read), else as soon as the bytes received pass the limit
    (a chunked body), through the app's HTTPException handler.

    Raises:
        ValueError: max_bytes < 1.
    """

    def __init__(self, app, max_bytes: int = DEFAULT_MAX_BODY_BYTES):
        if max_bytes < 1:
            raise ValueError(f"max_bytes={max_bytes}: must be >= 1")
        self.app, self.max_bytes = app, max_bytes

    def _message(self, size: str) -> str:
        return f"request body of {size} exceeds the limit of {self.max_bytes} bytes"

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await _too_large(scope, send, self._message(f"{int(length)} bytes"))
        received = 0

        async def limited():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise HTTPException(413, self._message(f"more than {received - 1} bytes"))
            return message

        await self.app(scope, limited, send)


async def _too_large(scope, send, message: str) -> None:
    """A 413 in OpenAI's error JSON, sent without reading the request body; the connection is
    closed after it, so the unread body is never read."""
    from services.http.errors import ApiError
    body = ApiError(413, f"{scope['method']} {scope['path']}: {message}", code="body_too_large").response()
    body.headers["connection"] = "close"
    await body(scope, _no_body, send)


async def _no_body():
    return {"type": "http.disconnect"}


class AccessLog:
    """One access log line per HTTP request (the module docstring gives its fields)."""

    def __init__(self, app, clock=time.perf_counter):
        self.app, self.clock = app, clock

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start = self.clock()
        seen = {"status": 499, "id": "", "logged": False}

        def log_once() -> None:
            if seen["logged"]:
                return
            seen["logged"] = True
            ms, rid = (self.clock() - start) * 1e3, seen["id"] or "-"
            access_log.info("%s %s %d %.1f ms request_id=%s", scope["method"], scope["path"], seen["status"], ms,
                            rid, extra={"method": scope["method"], "path": scope["path"],
                                        "status": seen["status"], "ms": round(ms, 1), "request_id": rid})

        async def logged_send(message):
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                given = [v for k, v in headers if k.lower() == REQUEST_ID_HEADER]
                if given:
                    seen["id"] = given[0].decode("latin-1")
                else:
                    seen["id"] = uuid.uuid4().hex
                    headers.append((REQUEST_ID_HEADER, seen["id"].encode()))
                    message = {**message, "headers": headers}
                seen["status"] = message["status"]
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                log_once()  # before the last byte leaves: a client that got its answer finds the line written
            await send(message)

        try:
            await self.app(scope, receive, logged_send)
        except BaseException:
            if seen["status"] == 499 and not seen["id"]:
                seen["status"] = 500  # an unhandled error; the error handler answers 500
            raise
        finally:
            log_once()
