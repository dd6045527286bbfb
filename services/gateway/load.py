"""The gateway's copy of the verifier's step table: `VerifierLoad`.

The verifier times every batch step against the rows it forwarded and reports the table (ms
against rows, `services.verifier.step_table`) in its Info. The gateway's model regime prices a
drafted and a plain step with it (docs/gate.md §14), and the step budget's pre-draft check
reads the copy a generation takes at its start (§15). This module only fetches it, with a
deadline and at most every `refresh_s`; it decides nothing and never reads the environment.
"""

from __future__ import annotations

import logging
import math
import time

import grpc

from dspark_proto.v1 import common_pb2
from services.common.budget import StepTimes

log = logging.getLogger("dspark.gateway.load")


class VerifierLoad:
    """The gateway-wide step table, refreshed from the verifier's Info at most every
    `refresh_s` (s), each call with `timeout_s` (s). `table` is None until a verifier reports
    one. A failed refresh keeps the last table and logs at debug level (the round's own
    replies still carry the rate and rows)."""

    def __init__(self, stub, timeout_s: float, refresh_s: float = 2.0):
        self.stub, self.timeout_s, self.refresh_s = stub, timeout_s, refresh_s
        self.table: StepTimes | None = None
        self._last = -math.inf
        self._busy = False

    def update(self, identity: common_pb2.ModelIdentity) -> None:
        """Take the table of an Info reply (a malformed one is logged and ignored)."""
        try:
            table = StepTimes.from_identity(identity)
        except ValueError as exc:
            log.warning("verifier step table ignored: %s", exc)
            return
        if table is not None:
            self.table = table

    async def refresh(self) -> None:
        """Fetch Info when the table is older than `refresh_s` and no fetch is running."""
        now = time.monotonic()
        if self._busy or now - self._last < self.refresh_s:
            return
        self._busy, self._last = True, now
        try:
            self.update(await self.stub.Info(common_pb2.InfoRequest(), timeout=self.timeout_s))
        except grpc.aio.AioRpcError as exc:
            log.debug("verifier Info for the step table failed: %s", exc.code().name)
        finally:
            self._busy = False
