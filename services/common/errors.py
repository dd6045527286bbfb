"""Map engine exceptions to gRPC status codes (docs/architecture.md §6): client faults are never INTERNAL.

Owns the one mapping from an engine's exception to a status code and message, which both
backends' session loops use; it never decides whether a request is valid (the engines do) and
imports nothing from the gateway, verifier or drafter packages."""

from __future__ import annotations

import grpc

from services.common.sessions import SessionLimitError, UnknownSessionError


def status_for(exc: BaseException) -> grpc.StatusCode:
    """INVALID_ARGUMENT for ValueError/TypeError, RESOURCE_EXHAUSTED for a session limit,
    NOT_FOUND for an unknown session, INTERNAL otherwise."""
    if isinstance(exc, SessionLimitError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    if isinstance(exc, UnknownSessionError):
        return grpc.StatusCode.NOT_FOUND
    if isinstance(exc, (ValueError, TypeError)):
        return grpc.StatusCode.INVALID_ARGUMENT
    return grpc.StatusCode.INTERNAL


def message_for(exc: BaseException) -> str:
    """The exception's message without KeyError's quoting."""
    return str(exc.args[0]) if isinstance(exc, KeyError) and exc.args else str(exc)
