"""Request ids and the abort registry of the gateway's running generations.

This module owns a generation's `request_id` (validated or generated; the request's field,
else the call's `x-request-id` metadata), the registry that
`Gateway.Abort` looks ids up in, the step-by-step driving of a generation that lets an abort
interrupt it mid-round, and the log filter that tags the gateway's log lines with the id of
the request they are about. It must not build wire messages (the servicer does) or run a
round (the scheduler does).

Request ids are scoped per tenant (`services.gateway.auth.tenant_of`: the caller's bearer
token): two tenants may run the same id, and `abort(id, tenant)` finds only the tenant's own
generation, so an id never leaks across tenants (another tenant's id reads as unknown).

Abort semantics: `Registry.abort(id)` marks the generation aborted and cancels the step it is
awaiting (a draft, verify or decode call in flight), so it stops within one backend reply
rather than after its round; `Running.next` then raises `GenerationAborted` and the servicer
closes the backend sessions and ends the stream with a final message of finish_reason
"abort". An id that is unknown or already finished is not an error (`abort` returns False):
an abort that races the generation's natural end is expected and harmless.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import uuid
from typing import AsyncIterator, TypeVar

REQUEST_ID_MAX_CHARS = 128
# The call metadata a client may set the request id in (when the request's field is empty),
# and the trailing metadata the gateway returns it in on every Generate, refused calls included.
REQUEST_ID_METADATA = "x-request-id"
# The id of the request the current task serves; the gateway's log lines read it. A Generate
# call runs in its own task (and so its own context copy), and the tasks it starts inherit it.
CURRENT_REQUEST_ID: contextvars.ContextVar[str] = contextvars.ContextVar("dspark_request_id", default="")

T = TypeVar("T")
_END = object()


class GenerationAborted(Exception):
    """The generation was stopped by `Gateway.Abort`."""


class DuplicateRequestId(ValueError):
    """A running generation already has this request id."""


def request_id(given: str) -> str:
    """The request's id: `given` when set, else a new uuid4 hex (32 characters).

    Raises:
        ValueError: `given` is longer than REQUEST_ID_MAX_CHARS characters or holds a
            character that is not printable (control characters, line breaks), named.
    """
    if not given:
        return uuid.uuid4().hex
    if len(given) > REQUEST_ID_MAX_CHARS:
        raise ValueError(f"request_id of {len(given)} characters ({given[:32]!r}...): "
                         f"must be at most {REQUEST_ID_MAX_CHARS}")
    if not given.isprintable():
        raise ValueError(f"request_id={given!r}: must be printable (no control characters or line breaks)")
    return given


def metadata_request_id(metadata) -> str:
    """The first `x-request-id` value of a call's invocation metadata ((key, value) pairs, keys
    lower-case as gRPC delivers them), or "" without one. Not validated here (`request_id` is)."""
    for key, value in metadata or ():
        if key == REQUEST_ID_METADATA:
            return value if isinstance(value, str) else value.decode("ascii", "replace")
    return ""


class Running:
    """One running generation's abort handle: the step it awaits and whether it was aborted;
    `tenant` scopes its id."""

    def __init__(self, request_id: str, tenant: str = ""):
        self.request_id, self.tenant = request_id, tenant
        self.aborted = False
        self._step: asyncio.Future | None = None

    def abort(self) -> None:
        """Mark aborted and cancel the step in flight (the next `next` call raises otherwise)."""
        self.aborted = True
        if self._step is not None and not self._step.done():
            self._step.cancel()

    async def next(self, events: AsyncIterator[T]) -> T | None:
        """The next item of `events`, or None at its end. Each step runs as its own task so
        that `abort` can cancel it while it awaits a backend; the cancel ends `events` (the
        scheduler's generator closes its span on the way out).

        Raises:
            GenerationAborted: `abort` was called before or during this step.
            asyncio.CancelledError: the calling task itself was cancelled (a client cancel).
            whatever the step raised (e.g. BackendError).
        """
        if self.aborted:
            raise GenerationAborted(self.request_id)
        self._step = asyncio.ensure_future(_step(events))
        try:
            item = await self._step
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if self.aborted and self._step.cancelled() and (task is None or not task.cancelling()):
                raise GenerationAborted(self.request_id) from None
            raise
        finally:
            self._step = None
        return None if item is _END else item


async def _step(events: AsyncIterator[T]):
    """One `__anext__` of `events`, with the end as a sentinel: a task must not end in
    StopAsyncIteration."""
    try:
        return await events.__anext__()
    except StopAsyncIteration:
        return _END


class Registry:
    """The gateway's running generations by (tenant, request id) (one event loop; no lock needed)."""

    def __init__(self):
        self._running: dict[tuple[str, str], Running] = {}

    def __len__(self) -> int:
        return len(self._running)

    def register(self, request_id: str, tenant: str = "") -> Running:
        """A new handle for `request_id` of `tenant`, registered until `remove`.

        Raises:
            DuplicateRequestId: a running generation of the same tenant already has that id (named).
        """
        if (tenant, request_id) in self._running:
            raise DuplicateRequestId(f"request_id={request_id!r}: a generation with this id is already running")
        running = self._running[(tenant, request_id)] = Running(request_id, tenant)
        return running

    def remove(self, running: Running) -> None:
        """Forget `running` (its generation ended, however)."""
        if self._running.get((running.tenant, running.request_id)) is running:
            del self._running[(running.tenant, running.request_id)]

    def abort(self, request_id: str, tenant: str = "") -> bool:
        """Abort `tenant`'s generation with `request_id`; False when that tenant runs none
        under that id (another tenant's generation with the id is not touched)."""
        running = self._running.get((tenant, request_id))
        if running is None:
            return False
        running.abort()
        return True


class RequestIdLogFilter(logging.Filter):
    """Tags records logged while a request is served: sets `record.request_id` (for
    structured formatters) and prefixes the message with "[request <id>]" (for plain ones).
    Records outside any request pass unchanged."""

    def filter(self, record: logging.LogRecord) -> bool:
        rid = CURRENT_REQUEST_ID.get()
        if rid and not hasattr(record, "request_id"):
            record.request_id = rid
            # formatted once here, so a '%' in the id can never be taken for a placeholder
            record.msg, record.args = f"[request {rid}] {record.getMessage()}", ()
        return True
