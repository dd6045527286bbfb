"""Session errors shared by the verifier and drafter engines (no gRPC here: engines import it).

`services.common.errors.status_for` maps them to RESOURCE_EXHAUSTED and NOT_FOUND.
"""


class SessionLimitError(RuntimeError):
    """No session slot free (the service maps this to RESOURCE_EXHAUSTED)."""


class UnknownSessionError(KeyError):
    """The session id is not open (closed, never opened, or from another engine)."""
