"""One HTTP request's generations: the prompts of a batch times `n` choices, their seeds, and
their admission at the verifier's session limit.

Owns how a request fans out into gateway generations (`plan`), the seed of each choice
(`choice_seed`), and `Admission`, which runs a request's generations concurrently without
refusing the request halfway when the verifier is full. It never builds a response body
(`responses` does) and never validates a field (the request models do).

Choices: prompt i, choice j of n has index i * n + j (OpenAI's order) and request id
`<response id>-<index>` at the gateway (just `<response id>` when the request has one choice).
Seeds: choice j of a request with seed s samples with `choice_seed(s, j)`: s itself for j = 0
(so n = 1 is the plain request), else the top 53 bits of SHA-256("dspark-choice" || s as 8
bytes little-endian || j as 4 bytes little-endian), read little-endian. Every prompt of a
batch uses the same seeds. A request that fans out without a seed gets one drawn here (53
bits, `secrets`), returned as the response's `seed`, so replaying it gives the same choices.
"""

from __future__ import annotations

import asyncio
import hashlib
import secrets
import time
from dataclasses import dataclass
from typing import AsyncIterator, Callable

from dspark_proto.v1 import common_pb2, gateway_pb2
from services.http.errors import ApiError
from services.http.gateway_client import GatewayClient

SEED_BITS = 53  # a drawn or derived seed survives JSON clients that read numbers as doubles
RETRY_S, RETRY_MAX_S = 0.05, 1.0  # back-off of a refused generation while none of its request runs
NO_FINAL = "the gateway's stream ended without a final message"


def choice_seed(seed: int, j: int) -> int:
    """The seed of choice j (0-based) of a request whose seed is `seed` (in [0, 2**63)):
    `seed` for j = 0, else 53 bits of SHA-256 (the module docstring gives the bytes)."""
    if j == 0:
        return seed
    digest = hashlib.sha256(b"dspark-choice" + seed.to_bytes(8, "little") + j.to_bytes(4, "little")).digest()
    return int.from_bytes(digest[:8], "little") >> (64 - SEED_BITS)


@dataclass(frozen=True)
class Choice:
    """One generation of a request: its choice `index`, `j` (which of the prompt's n it is)
    and its gateway request."""

    index: int
    j: int
    request: gateway_pb2.GenerateRequest


def plan(prompts: list[gateway_pb2.GenerateRequest], n: int, seed: int | None,
         response_id: str) -> tuple[list[Choice], int | None]:
    """(the request's choices in index order, the seed they derive from) for one gateway
    request per prompt, n choices each. seed: the request's (in [0, 2**63); None: none, and
    one is drawn when there is more than one choice). A single choice keeps its request as
    given (the gateway draws its seed when it has none)."""
    if len(prompts) * n == 1:
        return [Choice(0, 0, prompts[0])], seed
    if seed is None:
        seed = secrets.randbits(SEED_BITS)
    choices = []
    for i, prompt in enumerate(prompts):
        for j in range(n):
            req = gateway_pb2.GenerateRequest()
            req.CopyFrom(prompt)
            req.seed = choice_seed(seed, j)
            req.request_id = f"{response_id}-{i * n + j}"
            choices.append(Choice(i * n + j, j, req))
    return choices, seed


class Admission:
    """Runs one request's generations through `client`, as many at a time as the verifier admits.

    A generation refused for the verifier's session limit (429 before its first message) is
    retried while another generation of the same request was admitted or is still being
    admitted: it waits until one of them ends (or, when none runs, RETRY_S doubling up to
    RETRY_MAX_S) and starts again, until `deadline_s` after the request began. So a batch
    larger than the session limit queues within the request; only a request none of whose
    generations gets in is refused (429), as a single request is. After a refusal the request
    keeps at most as many generations in flight as it had when refused (the fewest so far).

    authorization: the client's header, forwarded; clock: seconds, monotonic.
    """

    def __init__(self, client: GatewayClient, authorization: str | None, deadline_s: float,
                 clock: Callable[[], float] = time.monotonic):
        self.client, self.authorization, self.clock = client, authorization, clock
        self.deadline = clock() + deadline_s
        self.cap: int | None = None  # started at once; None: no refusal seen yet
        self.active = 0   # started and not yet ended (admitted or being admitted)
        self.running = 0  # admitted (sent a first message) and not yet ended
        self.admitted = False
        self._changed = asyncio.Condition()

    async def open(self, req: gateway_pb2.GenerateRequest
                   ) -> tuple[gateway_pb2.GenerateResponse, AsyncIterator[gateway_pb2.GenerateResponse]]:
        """(first message, the rest of the stream) of `req` once admitted; `close` the stream.

        Raises:
            ApiError: the gateway refused it (429 only when no generation of the request
                runs or is starting, or the deadline passed), or the stream ended at once (502).
        """
        delay = RETRY_S
        while True:
            async with self._changed:
                await self._changed.wait_for(lambda: self.cap is None or self.active < self.cap)
                self.active += 1
            stream = self.client.generate(req, self.authorization)
            try:
                first = await anext(stream, None)
                if first is None:
                    raise ApiError(502, NO_FINAL, code="bad_gateway")
            except ApiError as exc:
                await self._end(stream, admitted=False)
                if exc.status != 429 or not (self.admitted or self.active) or self.clock() >= self.deadline:
                    raise
                await self._wait_for_room(delay)
                delay = min(2 * delay, RETRY_MAX_S)
                continue
            except BaseException:
                await self._end(stream, admitted=False)
                raise
            self.admitted = True
            self.running += 1
            return first, stream

    async def close(self, stream: AsyncIterator) -> None:
        """End an admitted generation's stream (cancelling its call if it still runs)."""
        await self._end(stream, admitted=True)

    async def _end(self, stream, admitted: bool) -> None:
        try:
            await stream.aclose()
        finally:
            async with self._changed:
                self.active -= 1
                self.running -= admitted
                self._changed.notify_all()

    async def _wait_for_room(self, delay: float) -> None:
        """After a refusal: cap the request at what it has in flight (admitted or being
        admitted, never raising the cap), then wait for a generation of the request to end,
        or `delay` s."""
        async with self._changed:
            self.cap = max(1, min(self.active, self.cap if self.cap is not None else self.active))
            try:
                await asyncio.wait_for(self._changed.wait(), delay)
            except asyncio.TimeoutError:
                pass

    async def collect(self, choice: Choice) -> tuple[gateway_pb2.GenerateResponse, list[int],
                                                     list[common_pb2.TokenLogprob], list[common_pb2.TokenLogprob]]:
        """The final message of `choice`, its completion token ids, their logprobs and its
        prompt logprobs (those its first message carries; empty when not asked).
        Raises ApiError as `open` does, or 502 when the stream ends without a final message."""
        message, stream = await self.open(choice.request)
        token_ids: list[int] = []
        logprobs: list[common_pb2.TokenLogprob] = []
        prompt_logprobs = list(message.prompt_logprobs)
        try:
            while message is not None:
                token_ids.extend(message.token_ids)
                logprobs.extend(message.logprobs)
                if message.finished:
                    return message, token_ids, logprobs, prompt_logprobs
                message = await anext(stream, None)
        finally:
            await self.close(stream)
        raise ApiError(502, NO_FINAL, code="bad_gateway")

    async def collect_all(self, choices: list[Choice]) -> list[tuple]:
        """`collect` of every choice, concurrently, in `choices`' order. The first failure
        cancels the others (their gRPC calls, so their backend sessions close) and is raised."""
        tasks = [asyncio.ensure_future(self.collect(c)) for c in choices]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        finally:
            await _cancel(tasks)
        for task in tasks:
            if not task.cancelled() and task.exception() is not None:
                raise task.exception()
        return [task.result() for task in tasks]

    async def stream_all(self, choices: list[Choice]
                         ) -> AsyncIterator[tuple[int, gateway_pb2.GenerateResponse]]:
        """(choice index, message) of every choice's stream as they arrive, each choice's in
        order, ending after the last final message. A failure of any choice cancels the
        others and is raised; so does closing this iterator early."""
        queue: asyncio.Queue = asyncio.Queue(maxsize=4 * len(choices))

        async def pump(choice: Choice) -> None:
            message, stream = await self.open(choice.request)
            try:
                while message is not None:
                    await queue.put((choice.index, message))
                    if message.finished:
                        return
                    message = await anext(stream, None)
                raise ApiError(502, NO_FINAL, code="bad_gateway")
            finally:
                await self.close(stream)

        async def guarded(choice: Choice) -> None:
            try:
                await pump(choice)
                await queue.put(None)
            except Exception as exc:  # handed to the reader, which raises it
                await queue.put(exc)

        tasks = [asyncio.ensure_future(guarded(c)) for c in choices]
        try:
            for _ in range(len(choices)):
                while (item := await queue.get()) is not None:
                    if isinstance(item, Exception):
                        raise item
                    yield item
        finally:
            await _cancel(tasks)


async def _cancel(tasks: list[asyncio.Future]) -> None:
    """Cancel what still runs of `tasks` and wait until their cleanup has run."""
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
