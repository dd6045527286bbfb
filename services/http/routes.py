"""The FastAPI application of the HTTP front: routes, auth, and the SSE event stream.

Owns the endpoints (`POST /v1/completions`, `POST /v1/chat/completions`, `GET /v1/models`,
`GET /v1/models/{id}`, `GET|HEAD /health`, `GET /metrics` when the gateway has metrics, and
vLLM's tokenizer endpoints from `tokenizer_api`), the bearer-token check and the order of the
streamed events. Every choice is one `Gateway.Generate` call through a `GatewayClient`, run
by `batch.Admission`; this module validates nothing the request models or the gateway
validate. The body limit and the access log wrap the application (`middleware`).

Streaming: the first gateway message of any choice is awaited before the response starts,
so a request the gateway refuses gets its HTTP status and error JSON, never a 200 stream. A
failure after the stream started is sent as one `data: {"error": ...}` event, then `data:
[DONE]`. A client that disconnects cancels the gRPC calls, which closes the generations'
backend sessions: while a whole (non-streamed) response is being generated or a stream
awaits its first message, a watcher of the connection notices the disconnect; once a stream
has started, its failed write does.
"""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass
from typing import AsyncIterator, Awaitable, Callable, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from dspark_proto.v1 import gateway_pb2
from services.gateway.auth import MISSING, BearerTokenInterceptor
from services.gateway.tokenizer import Tokenizer
from services.http.batch import Admission, Choice, plan
from services.http.echo import PromptPart, PromptScoring, first_records, score_once, with_first_records
from services.http.chat import ChatTemplate
from services.http.errors import (ApiError, api_error_handler, internal_error_handler,
                                  validation_error_handler)
from services.http.gateway_client import GatewayClient
from services.http.logprobs import LogprobFormatter
from services.http.middleware import DEFAULT_MAX_BODY_BYTES, AccessLog, BodyLimit
from services.http.responses import DONE, Shape, sse
from services.http.schemas import DEFAULT_COMPLETION_MAX_TOKENS, ChatCompletionRequest, CompletionRequest
from services.http.tokenizer_api import add_tokenizer_routes

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
    completion), its creation time (s since the epoch) and its vocabulary size (ids)."""

    id: str
    max_seq_len: int
    created: int
    vocab_size: int = 0

    def body(self) -> dict:
        """The model object of /v1/models."""
        return {"id": self.id, "object": "model", "created": self.created, "owned_by": "dspark",
                "max_model_len": self.max_seq_len}


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
        and the header does not carry it (the message never echoes what was sent), 400 when it
        holds a character that gRPC metadata cannot carry (not printable ASCII)."""
        header = request.headers.get("authorization")
        if self.auth is not None:
            reason = self.auth.check([("authorization", header)] if header is not None else [])
            if reason is not None:
                raise ApiError(401, MISSING_HEADER if reason == MISSING else reason, code="invalid_api_key")
        if header is not None:
            bad = next((i for i, ch in enumerate(header) if not " " <= ch <= "~"), None)
            if bad is not None:  # gRPC metadata carries printable ASCII only: forwarding it would fail as a 500
                raise ApiError(400, f"Authorization header: character {bad} is not printable ASCII "
                                    f"(U+{ord(header[bad]):04X}); send the bearer token as printable ASCII",
                               code="invalid_header")
        return header

    def template(self) -> ChatTemplate:
        """The chat template. Raises ApiError 400 `chat_template_missing` when there is none."""
        if self.chat_template is None:
            raise ApiError(400, NO_TEMPLATE, param="messages", code="chat_template_missing")
        return self.chat_template

    def check_model(self, name: str | None) -> None:
        """Raises ApiError 404 naming `name` when it is given and is not the served model."""
        if name and name != self.model.id:
            raise ApiError(404, f"model={name!r}: not served here; this server serves {self.model.id!r}",
                           param="model", code="model_not_found")


def build_app(front: Front, metrics_registry=None, tokenizer_info: dict | None = None,
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> FastAPI:
    """The ASGI application over `front`; `metrics_registry`: a prometheus_client registry
    served at /metrics (None: no /metrics); tokenizer_info: the /tokenizer_info body (None:
    just `tokenizer_class`); max_body_bytes: larger request bodies get 413.
    Raises ValueError: max_body_bytes < 1."""
    if max_body_bytes < 1:  # checked here: Starlette builds the middleware at the first request
        raise ValueError(f"max_body_bytes={max_body_bytes}: must be >= 1")
    app = FastAPI(title="dspark OpenAI-compatible API", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_exception_handler(ApiError, api_error_handler)
    app.add_exception_handler(RequestValidationError, validation_error_handler)
    app.add_exception_handler(StarletteHTTPException, _http_error_handler)
    app.add_exception_handler(Exception, internal_error_handler)
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    app.add_middleware(AccessLog)  # added last: the outermost, so it sees the body limit's 413 too
    _add_generation_routes(app, front)

    @app.get("/v1/models")
    async def models(request: Request):
        front.authorize(request)
        return {"object": "list", "data": [front.model.body()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request):
        front.authorize(request)
        if model_id != front.model.id:
            raise ApiError(404, f"model {model_id!r}: not served here; this server serves {front.model.id!r}",
                           param="model", code="model_not_found")
        return front.model.body()

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health():
        if await front.client.serving():
            return {"status": "ok"}
        raise ApiError(503, "the gateway is not serving", code="unavailable")

    add_tokenizer_routes(app, front, tokenizer_info or {"tokenizer_class": type(front.tokenizer).__name__})
    if metrics_registry is not None:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        @app.get("/metrics")
        async def metrics():
            return Response(generate_latest(metrics_registry), media_type=CONTENT_TYPE_LATEST)
    return app


def _add_generation_routes(app: FastAPI, front: Front) -> None:
    """POST /v1/completions and /v1/chat/completions over `front`."""

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        authorization = front.authorize(request)
        front.check_model(body.model)
        prompts = body.checked()
        max_tokens = DEFAULT_COMPLETION_MAX_TOKENS if body.max_tokens is None else body.max_tokens
        scoring = PromptScoring(body.echo, body.logprobs, body.prompt_logprobs, prompts, body.n)
        scored = scoring.alternatives(max_tokens)
        if scoring.asked:  # the prompt's tokens as the gateway will score them, to name them in the reply
            # Off the event loop: a long prompt takes seconds to tokenize, and the loop streams for everyone.
            prompts = await asyncio.to_thread(lambda: [(text, ids or front.tokenizer.encode(text)) for text, ids in prompts])
            scoring = dataclasses.replace(scoring, prompts=prompts)
        shape = Shape(front.model.id, chat=False)
        reqs = [body.generate_request(shape.id, max_tokens, "" if scoring.asked else text, ids, body.top_alternatives,
                                      scored) for text, ids in prompts]
        choices, seed = plan(reqs, body.n, body.internal_seed, shape.id)
        if scoring.asked:
            score_once(choices, max_tokens)  # every choice of a prompt returns its first choice's records
        fmt = (lambda: LogprobFormatter(front.tokenizer, chat=False, top=body.logprobs)) \
            if body.logprobs is not None else None
        return await _respond(front.client, choices, seed, body, shape, authorization, request, fmt,
                              scoring if scoring.asked else None, front.tokenizer)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        authorization = front.authorize(request)
        front.check_model(body.model)
        messages = body.checked()
        ids = await asyncio.to_thread(lambda: front.tokenizer.encode(front.template().render(messages)))
        max_tokens = body.requested_max_tokens or max(1, front.model.max_seq_len - len(ids))
        shape = Shape(front.model.id, chat=True)
        req = body.generate_request(shape.id, max_tokens, prompt_ids=ids, logprobs=body.top_alternatives)
        choices, seed = plan([req], body.n, body.internal_seed, shape.id)
        fmt = (lambda: LogprobFormatter(front.tokenizer, chat=True)) if body.logprobs else None
        return await _respond(front.client, choices, seed, body, shape, authorization, request, fmt)


async def _http_error_handler(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    """Starlette's own refusals (unknown path, wrong method) in OpenAI's error JSON."""
    return ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}").response()


async def _respond(client: GatewayClient, choices: list[Choice], seed: int | None, body, shape: Shape,
                   authorization: str | None, request: Request, fmt: Callable[[], LogprobFormatter] | None = None,
                   scoring: PromptScoring | None = None, tokenizer: Tokenizer | None = None):
    """The whole response, or the SSE stream once a first gateway message arrived; `choices`
    run concurrently through one `Admission`; seed: the request's (None: the gateway's draw,
    read from the final message); `fmt` makes a choice's logprob formatter (None: logprobs
    null); `scoring`: what each choice returns about its prompt (echo, prompt logprobs; None:
    nothing), with `tokenizer` to name its tokens. The response carries `x-request-id`: the
    response id.
    Raises ApiError: the calls failed before any message (the mapped status), or the client
    disconnected before the response started (499)."""
    admission = Admission(client, authorization, client.generate_timeout_s)
    headers = {"x-request-id": shape.id}
    if not body.stream:
        results = await _unless_disconnected(request, admission.collect_all(choices))
        if scoring is not None:
            results = [(*r[:3], records) for r, records in zip(results, first_records(results, choices))]
        out = [_whole_choice(shape, c.index, r, body.return_token_ids, fmt() if fmt is not None else None,
                             scoring, tokenizer) for c, r in zip(choices, results)]
        finals = [(c.j, r[0]) for c, r in zip(choices, results)]
        return JSONResponse(shape.whole(out, finals, results[0][0].seed if seed is None else seed),
                            headers=headers)
    stream = admission.stream_all(choices)
    try:
        first = await _unless_disconnected(request, anext(stream, None))
        if first is None:
            raise ApiError(502, "the gateway's stream ended without a message", code="bad_gateway")
    except BaseException:
        await stream.aclose()
        raise
    fmts = {c.index: fmt() for c in choices} if fmt is not None else None
    echo = None if scoring is None else (lambda index, records: scoring.part(
        index, records, tokenizer, fmts[index] if fmts is not None else None))
    return StreamingResponse(_events(stream, first, shape, body, {c.index: c.j for c in choices}, fmts, echo),
                             media_type="text/event-stream", headers={**SSE_HEADERS, **headers})


def _whole_choice(shape: Shape, index: int, result: tuple, with_ids: bool, fmt: LogprobFormatter | None,
                  scoring: PromptScoring | None, tokenizer: Tokenizer | None) -> dict:
    """Choice `index` of a whole response from its `Admission.collect` result; the prompt part
    (`scoring`) first, so the completion's text_offset continues after the prompt."""
    final, ids, logprobs, prompt_records = result
    part = None if scoring is None else _prompt_part(scoring, index, prompt_records, tokenizer, fmt)
    choice = shape.choice(index, final, ids if with_ids else None, fmt.body(logprobs) if fmt is not None else None)
    return choice if part is None else part.apply(choice, choice["logprobs"])


def _prompt_part(scoring: PromptScoring, index: int, records, tokenizer: Tokenizer,
                 fmt: LogprobFormatter | None) -> PromptPart:
    """`scoring.part`, a mismatch with the gateway's records answered 502 (the gateway's fault)."""
    try:
        return scoring.part(index, records, tokenizer, fmt)
    except ValueError as exc:
        raise ApiError(502, f"prompt logprobs: {exc}", code="bad_gateway") from None


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


async def _events(stream: AsyncIterator[tuple[int, gateway_pb2.GenerateResponse]],
                  first: tuple[int, gateway_pb2.GenerateResponse], shape: Shape, body, js: dict[int, int],
                  fmts: dict[int, LogprobFormatter] | None = None,
                  echo: Callable[[int, list], PromptPart] | None = None) -> AsyncIterator[bytes]:
    """The SSE events of a request's choices, as their messages arrive: per choice (chat: a
    role chunk first; completions with `echo`: a chunk of its prompt part, from the prompt
    records of the first message of its prompt's first choice, `with_first_records`), a chunk per gateway message with new text (or, with
    `return_token_ids` or logprobs asked for, new ids), its finish chunk; then
    (`include_usage`) the usage chunk over every choice (js: choice index -> which of its
    prompt's n it is), then [DONE]."""
    include_usage, token_ids = body.include_usage, body.return_token_ids
    started: set[int] = set()
    finals: list[tuple[int, gateway_pb2.GenerateResponse]] = []
    items = with_first_records(_after(first, stream), js) if echo is not None else \
        ((index, message, None) async for index, message in _after(first, stream))
    try:
        async for index, message, records in items:
            if shape.chat and index not in started:
                started.add(index)
                yield sse(shape.chunk("", first=True, with_usage_field=include_usage, index=index))
            if echo is not None and index not in started:
                started.add(index)
                try:
                    part = echo(index, records)
                except ValueError as exc:
                    raise ApiError(502, f"prompt logprobs: {exc}", code="bad_gateway") from None
                chunk = shape.chunk("", with_usage_field=include_usage, index=index)
                part.apply(chunk["choices"][0], None)
                yield sse(chunk)
            fmt = fmts[index] if fmts is not None else None
            if message.finished:
                finals.append((js[index], message))
                yield sse(shape.final_chunk(message, include_usage, token_ids, index=index))
            elif message.text_delta or ((token_ids or fmt is not None) and message.token_ids):
                yield sse(shape.chunk(message.text_delta, with_usage_field=include_usage,
                                      token_ids=list(message.token_ids) if token_ids else None,
                                      logprobs=fmt.body(message.logprobs) if fmt is not None else None,
                                      index=index))
        if include_usage:
            yield sse(shape.usage_chunk(finals))
    except ApiError as exc:
        yield sse(exc.body())
    finally:
        await items.aclose()
        await stream.aclose()  # cancels the calls when the client went away mid-stream
    yield DONE


async def _after(first: T, rest: AsyncIterator[T]) -> AsyncIterator[T]:
    """`first`, then the items of `rest`."""
    yield first
    async for item in rest:
        yield item
