"""The gateway checks a verify reply's counts against the block it sent: a verifier that
reports more accepted drafts than it judged, or more judged than were sent, is an invalid
reply (DATA_LOSS), never drafts committed that nobody verified. A real gRPC server on port 0
plays a faulty verifier (a bug or a version skew)."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch

from dspark_proto.v1 import verifier_pb2, verifier_pb2_grpc
from services.common.tensors import to_proto
from services.gateway.backends import BackendError, GrpcVerifierSession


class _Faulty(verifier_pb2_grpc.VerifierServicer):
    """Answers every verify with the given counts and one tap row per committed position."""

    def __init__(self, accepted: int, admitted: int | None):
        self.accepted, self.admitted = accepted, admitted

    async def Session(self, requests, context):
        async for _ in requests:
            rows = to_proto(torch.zeros(max(self.accepted, 0) + 1, 4), "float32")
            reply = verifier_pb2.VerifierResponse(next_token=1, accepted=self.accepted, rows=rows)
            if self.admitted is not None:
                reply.admitted = self.admitted
            yield reply


def _against(servicer, call):
    """Run `call(session)` on a GrpcVerifierSession to `servicer` served on port 0; returns
    what it returns, or the BackendError it raises."""
    async def run():
        server = grpc.aio.server()
        verifier_pb2_grpc.add_VerifierServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                session = GrpcVerifierSession(verifier_pb2_grpc.VerifierStub(ch), 10.0, 30.0)
                try:
                    return await call(session)
                except BackendError as exc:
                    return exc
                finally:
                    await session.close()
        finally:
            await server.stop(0)
    return asyncio.run(run())


@pytest.mark.parametrize("accepted, admitted, ok", [
    (2, None, True), (1, 2, True), (0, 0, True),
    (4, None, False), (3, 2, False), (1, 5, False), (0, -1, False)])
def test_verify_reply_counts_are_checked_against_the_block(accepted, admitted, ok):
    out = _against(_Faulty(accepted, admitted), lambda s: s.verify(7, [1, 2, 3], 5, "batched", None))
    if ok:
        assert not isinstance(out, BackendError) and out.accepted == accepted
    else:
        assert isinstance(out, BackendError) and out.code == grpc.StatusCode.DATA_LOSS
        assert f"accepted={accepted}, admitted={admitted} for a block of 3 drafts" in str(out)


def test_a_reply_whose_rows_do_not_decode_is_an_invalid_reply():
    """A reply without a decodable rows tensor was a ValueError out of the session (a crash of
    the generation's task), not the backend failure it is."""
    class NoRows(_Faulty):
        async def Session(self, requests, context):
            async for _ in requests:
                yield verifier_pb2.VerifierResponse(next_token=1, accepted=0)

    out = _against(NoRows(0, None), lambda s: s.decode(5, 3, None))
    assert isinstance(out, BackendError) and out.code == grpc.StatusCode.DATA_LOSS
    assert "invalid reply: tensor dtype" in str(out)
