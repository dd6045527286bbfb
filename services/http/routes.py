"""The FastAPI application of the HTTP front: routes, auth, and the SSE event stream.

Owns the endpoints (`POST /v1/completions`, `POST /v1/chat/completions`, `GET /v1/models`,
`GET /health`, `/metrics` when the gateway has metrics), the bearer-token check and the order
of the streamed events. Every generation is one `Gateway.Generate` call through a
`GatewayClient`; this module validates nothing the request models or the gateway validate.

Streaming: the first gateway message is awaited before the response starts, so a request the
gateway refuses gets its HTTP status and error JSON, never a 200 stream. A failure after the
stream started is sent as one `data: {"error": ...}` event, then `data: [DONE]`. A client that
disconnects cancels the gRPC call, which closes the generation's backend sessions: while a
whole (non-streamed) response is being generated or a stream awaits its first message, a
watcher of the connection notices the disconnect; once a stream has started, its failed
write does.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import AsyncIterator, Awaitable, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from dspark_proto.v1 import gateway_pb2
from services.gateway.auth import MISSING, BearerTokenInterceptor
from services.gateway.tokenizer import Tokenizer
from services.http.chat import ChatTemplate
from services.http.errors import (ApiError, api_error_handler, internal_error_handler,
                                  validation_error_handler)
from services.http.gateway_client import GatewayClient
from services.http.logprobs import LogprobFormatter
from services.http.responses import DONE, Shape, sse
from services.http.schemas import DEFAULT_COMPLETION_MAX_TOKENS, ChatCompletionRequest, CompletionRequest

MISSING_HEADER = "missing bearer token: send the header 'Authorization: Bearer <token>'"
# SSE through proxies: no caching, no buffering (nginx honours X-Accel-Buffering).
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
CLIENT_GONE = "the client closed the connection before the response"
T = TypeVar("T")
NO_TEMPLATE = ("this model has no chat template (its checkpoint has no chat_template in tokenizer_config.json "
               "and no chat_template.jinja); use /v1/completions with the prompt text")


@dataclass(frozen=True)
class ModelCard:
    """What /v1/models lists: the served model's id, its context length (tokens: prompt +
    completion) and its creation time (s since the epoch)."""

    id: str
    max_seq_len: int
    created: int


@dataclass(frozen=True)
class Front:
    """What the routes share: the gateway client, the model, the tokenizer (chat prompts), the
    chat template (None: chat answers 400) and the bearer check (None: no token required)."""

    client: GatewayClient
    model: ModelCard
    tokenizer: Tokenizer
    chat_template: ChatTemplate | None
    auth: BearerTokenInterceptor | None

    def authorize(self, request: Request) -> str | None:
        """The Authorization header to forward. Raises ApiError 401 when a token is required
        and the header does not carry it (the message never echoes what was sent)."""
        header = request.headers.get("authorization")
        if self.auth is not None:
            reason = self.auth.check([("authorization", header)] if header is not None else [])
            if reason is not None:
                raise ApiError(401, MISSING_HEADER if reason == MISSING else reason, code="invalid_api_key")
        return header

    def check_model(self, name: str | None) -> None:
        """Raises ApiError 404 naming `name` when it is given and is not the served model."""
        if name and name != self.model.id:
            raise ApiError(404, f"model={name!r}: not served here; this server serves {self.model.id!r}",
                           param="model", code="model_not_found")


def build_app(front: Front, metrics_registry=None) -> FastAPI:
    """The ASGI application over `front`; `metrics_registry`: a prometheus_client registry
    served at /metrics (None: no /metrics)."""
    app = FastAPI(title="dspark OpenAI-compatible API", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_exception_handler(ApiError, api_error_handler)
    app.add_exception_handler(RequestValidationError, validation_error_handler)
    app.add_exception_handler(StarletteHTTPException, _http_error_handler)
    app.add_exception_handler(Exception, internal_error_handler)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        authorization = front.authorize(request)
        front.check_model(body.model)
        prompt, ids = body.checked()
        shape = Shape(front.model.id, chat=False)
        req = body.generate_request(shape.id, body.max_tokens or DEFAULT_COMPLETION_MAX_TOKENS, prompt, ids,
                                    body.top_alternatives)
        fmt = LogprobFormatter(front.tokenizer, chat=False) if body.logprobs is not None else None
        return await _respond(front.client, req, body, shape, authorization, request, fmt)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        authorization = front.authorize(request)
        front.check_model(body.model)
        if front.chat_template is None:
            raise ApiError(400, NO_TEMPLATE, param="messages", code="chat_template_missing")
        ids = front.tokenizer.encode(front.chat_template.render(body.checked()))
        max_tokens = body.requested_max_tokens or max(1, front.model.max_seq_len - len(ids))
        shape = Shape(front.model.id, chat=True)
        req = body.generate_request(shape.id, max_tokens, prompt_ids=ids, logprobs=body.top_alternatives)
        fmt = LogprobFormatter(front.tokenizer, chat=True) if body.logprobs else None
        return await _respond(front.client, req, body, shape, authorization, request, fmt)

    @app.get("/v1/models")
    async def models(request: Request):
        front.authorize(request)
        m = front.model
        return {"object": "list", "data": [{"id": m.id, "object": "model", "created": m.created,
                                            "owned_by": "dspark", "max_model_len": m.max_seq_len}]}

    @app.get("/health")
    async def health():
        if await front.client.serving():
            return {"status": "ok"}
        raise ApiError(503, "the gateway is not serving", code="unavailable")

    if metrics_registry is not None:
        from prometheus_client import make_asgi_app
        app.mount("/metrics", make_asgi_app(registry=metrics_registry))
    return app


async def _http_error_handler(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    """Starlette's own refusals (unknown path, wrong method) in OpenAI's error JSON."""
    return ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}").response()


async def _respond(client: GatewayClient, req: gateway_pb2.GenerateRequest, body, shape: Shape,
                   authorization: str | None, request: Request, fmt: LogprobFormatter | None = None):
    """The whole response, or the SSE stream once the gateway's first message arrived; `fmt`
    formats the tokens' logprobs (None: logprobs null).
    Raises ApiError: the call failed before any message (its mapped status), or the client
    disconnected before the response started (499)."""
    if not body.stream:
        final, token_ids, logprobs = await _unless_disconnected(request, client.collect(req, authorization))
        return JSONResponse(shape.whole(final, token_ids if body.return_token_ids else None,
                                        fmt.body(logprobs) if fmt is not None else None))
    stream = client.generate(req, authorization)
    try:
        first = await _unless_disconnected(request, anext(stream, None))
        if first is None:
            raise ApiError(502, "the gateway's stream ended without a message", code="bad_gateway")
    except BaseException:
        await stream.aclose()
        raise
    return StreamingResponse(_events(stream, first, shape, body.include_usage, body.return_token_ids, fmt),
                             media_type="text/event-stream", headers=SSE_HEADERS)


async def _disconnected(request: Request) -> None:
    """Returns once the client has closed the connection. Only called after the body was
    read, so the next ASGI message the server delivers is the disconnect."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """The result of `work`, raced against the client's disconnect: without the race a
    client that gives up on a whole response would leave its generation running (and its
    backend sessions open) to the last token.

    Raises:
        ApiError: 499 when the client disconnected first (`work` is cancelled, which cancels
            the gRPC call); whatever `work` raised.
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:  # also when this handler itself is cancelled (server shutdown)
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)  # the call's cancel has run
    if task.cancelled():
        raise ApiError(499, CLIENT_GONE, code="cancelled")
    return task.result()


async def _events(stream: AsyncIterator[gateway_pb2.GenerateResponse], first: gateway_pb2.GenerateResponse,
                  shape: Shape, include_usage: bool, token_ids: bool,
                  fmt: LogprobFormatter | None = None) -> AsyncIterator[bytes]:
    """The SSE events of one generation: (chat: a role chunk), a chunk per gateway message
    with new text (or, with `token_ids` or logprobs asked for, new ids), the finish chunk,
    (include_usage: the usage chunk), then [DONE]."""
    try:
        if shape.chat:
            yield sse(shape.chunk("", first=True, with_usage_field=include_usage))
        message: gateway_pb2.GenerateResponse | None = first
        while message is not None and not message.finished:
            if message.text_delta or ((token_ids or fmt is not None) and message.token_ids):
                yield sse(shape.chunk(message.text_delta, with_usage_field=include_usage,
                                      token_ids=list(message.token_ids) if token_ids else None,
                                      logprobs=fmt.body(message.logprobs) if fmt is not None else None))
            message = await anext(stream, None)
        if message is None:
            raise ApiError(502, "the gateway's stream ended without a final message", code="bad_gateway")
        yield sse(shape.final_chunk(message, include_usage, token_ids))
        if include_usage:
            yield sse(shape.usage_chunk(message))
    except ApiError as exc:
        yield sse(exc.body())
    finally:
        await stream.aclose()  # cancels the call when the client went away mid-stream
    yield DONE
