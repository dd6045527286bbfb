"""The servicer side of a backend `Session` stream, shared by the verifier and the drafter.

This module owns the stream's life cycle: one engine session per stream, opened when the
stream starts and freed when it ends, whether the client half-closes, cancels or the
handler fails; each request is answered in order by one handler call. It does not know
the messages: the servicers turn requests into engine calls and results into responses.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import AsyncIterable, AsyncIterator, Awaitable, Callable, TypeVar

import grpc

from services.common.errors import message_for, status_for

# The longest a refused stream waits for its first request before the refusal is sent (s).
REFUSE_WAIT_S = 1.0

Req = TypeVar("Req")
Resp = TypeVar("Resp")

# handler(session id, request, perf_counter time the request was received in s) -> response
Handler = Callable[[int, Req, float], Awaitable[Resp]]


async def serve_session(requests: AsyncIterable[Req], context: grpc.aio.ServicerContext,
                        open_session: Callable[[], int], close_session: Callable[[int], None],
                        handle: Handler) -> AsyncIterator[Resp]:
    """Run one `Session` bidi stream: open a session, answer each request, close it.

    Args:
        requests: the stream's request iterator.
        context: the stream's servicer context (used to abort with a status).
        open_session: opens an engine session and returns its id (may raise
            SessionLimitError, which aborts the stream with RESOURCE_EXHAUSTED once its first
            request came: `_first_request`).
        close_session: frees the session; called exactly once after a successful open.
        handle: answers one request; ValueError / TypeError (bad input) abort the stream
            with the status `services.common.errors.status_for` gives and the message.
    Yields:
        One response per request, in request order.
    Raises:
        grpc.aio.AbortError: via `context.abort` on the errors above; anything else the
            handler raises propagates (the server reports it as UNKNOWN / INTERNAL).
    """
    try:
        sid = open_session()
    except Exception as exc:  # the session limit, or an engine that cannot open one
        await _first_request(requests)
        await context.abort(status_for(exc), message_for(exc))
    try:
        async for request in requests:
            received = time.perf_counter()
            try:
                response = await handle(sid, request, received)
            except (ValueError, TypeError) as exc:
                await context.abort(status_for(exc), message_for(exc))
            yield response
    finally:
        close_session(sid)


async def _first_request(requests: AsyncIterable[Req]) -> None:
    """Wait for the refused stream's first request (or its end), at most REFUSE_WAIT_S.

    A client that opens a stream writes its first request at once (the gateway primes a new
    session with a commit). When the status arrives before the client's write was issued,
    grpcio's asyncio client fails the write and reports INTERNAL "Internal error from Core"
    instead of the status (grpc/grpc#36066): a full drafter (RESOURCE_EXHAUSTED: ask again
    later) then looked broken (INTERNAL: plain decode for good). Read first, then refuse."""
    try:
        await asyncio.wait_for(anext(aiter(requests), None), REFUSE_WAIT_S)
    except (asyncio.TimeoutError, StopAsyncIteration, grpc.RpcError):
        pass


class SessionStreamServicer:
    """Mixin giving a backend servicer its `Session` bidi stream over `serve_session`.

    The servicer provides `engine` (with `open_session() -> int` and `close_session(sid)`),
    `steps` (its step loop, or None) and `_handle(sid, request, received_s) -> response`;
    list this class before the generated servicer base so its `Session` replaces the
    UNIMPLEMENTED one. A closed session is forgotten by the step loop, whose next step then
    does not wait for it (`services.common.step_queue`).
    """

    async def Session(self, request_iterator, context):
        engine, steps = self.engine, self.steps

        def close(sid: int) -> None:
            try:
                engine.close_session(sid)
            finally:
                if steps is not None:
                    steps.forget(sid)

        stream = serve_session(request_iterator, context, engine.open_session, close, self._handle)
        async with contextlib.aclosing(stream):  # a cancelled stream frees its session now, not at GC
            async for response in stream:
                yield response
