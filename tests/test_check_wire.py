"""The Check's OK spliced into protobuf's encoding (`ext_authz.granted_wire`) is the protobuf-built
`granted` serialized, byte for byte, whatever the decision; and the servicer registered by
`add_authorization_to_server` sends the bytes Check returns as they are."""

from __future__ import annotations

import dataclasses
import itertools
import math

import grpc
import pytest
from flow import PEER, FakeServicerContext, Flow, check_request, virtual_time
from llamaswap._proto.envoy.service.auth.v3 import external_auth_pb2 as authz_pb2
from llamaswap._proto.envoy.service.auth.v3 import external_auth_pb2_grpc as authz_grpc
from llamaswap.adapters.ext_authz import Authorization, add_authorization_to_server, granted, granted_wire
from llamaswap.core import Band, Decision, Priority, PrioritySource
from llamaswap.runtime.ticket import Arrival, Ticket

_BASE = Decision(request_id="r", priority=0, band=Band.NORMAL, score=0.0, arrival_ns=0, granted_ns=0, model="m",
                 swap_affinity=False, aging=0.0, load=False, swap=False, residents_before=frozenset(),
                 reordered_by=frozenset(), overtook=(), queue_depth_after=0)

# Each value's edges: empty (not written at all by protobuf), one byte, lengths around one and two
# varint bytes at each level of nesting, not ASCII.
_GPUS = ("", "g", "gpu0", "big-gpu-0", "é-gpu", *("x" * n for n in (90, 94, 95, 96, 110, 120, 121, 127, 128, 200,
                                                                   300, 20_000)))
_TOKENS = ("", "t", "50336c1d.789be6ea98280449287b09d9a277f47c", *("y" * n for n in (100, 120, 123, 124, 125, 127,
                                                                                    128, 130, 16_400)))
_PRIORITIES = (0, -7, 100, 10**30, -(10**40))
_SCORES = (0.0, -0.0, 12.34567, -1e-9, 1e20, 1e300, math.inf, -math.inf, math.nan)
_WAITS_NS = (0, 49_999, 2_523_460_000, 10**25)


def _ticket(token: str, decision: Decision) -> Ticket:
    ticket = Ticket(token, Arrival("r", None, None, "m", PEER, None, None), Priority(0, PrioritySource.NUMBER), 0)
    ticket.decision = decision
    return ticket


def test_the_ok_on_the_wire_is_the_protobuf_ok_serialized() -> None:
    cases = 0
    for gpu, token in itertools.product(_GPUS, _TOKENS):
        ticket = _ticket(token, dataclasses.replace(_BASE, gpu=gpu))
        assert granted_wire(ticket) == granted(ticket).SerializeToString(), (gpu, token)
        cases += 1
    for band, priority, score, wait_ns in itertools.product(Band, _PRIORITIES, _SCORES, _WAITS_NS):
        decision = dataclasses.replace(_BASE, band=band, priority=priority, score=score, granted_ns=wait_ns)
        ticket = _ticket("tok", decision)
        assert granted_wire(ticket) == granted(ticket).SerializeToString(), decision
        cases += 1
    assert cases > 500


class _Answers(Authorization):
    """Check answers these bytes."""

    def __init__(self, answer: bytes) -> None:
        self._answer = answer

    async def Check(self, request: authz_pb2.CheckRequest, context: grpc.aio.ServicerContext) -> bytes:  # noqa: N802
        return self._answer


@pytest.mark.parametrize("answer", [
    granted(_ticket("50336c1d.789be6ea98280449287b09d9a277f47c", dataclasses.replace(_BASE, gpu="gpu0"))),
    authz_pb2.CheckResponse(),
])
async def test_the_registered_check_sends_its_bytes_as_they_are(answer: authz_pb2.CheckResponse) -> None:
    wire = answer.SerializeToString()
    server = grpc.aio.server()
    add_authorization_to_server(_Answers(wire), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            raw = channel.unary_unary("/envoy.service.auth.v3.Authorization/Check",
                                      request_serializer=authz_pb2.CheckRequest.SerializeToString,
                                      response_deserializer=lambda data: data)
            assert await raw(check_request()) == wire
            assert await authz_grpc.AuthorizationStub(channel).Check(check_request()) == answer
    finally:
        await server.stop(None)


@virtual_time
async def test_the_check_answers_the_grant_and_the_refusal_serialized() -> None:
    flow = Flow()
    authz = Authorization(flow.coordinator)
    answer = authz_pb2.CheckResponse.FromString(await authz.Check(check_request({"x-request-id": "one"}, model="a"),
                                                                  FakeServicerContext()))
    assert answer.WhichOneof("http_response") == "ok_response"
    ticket = flow.recorder.tickets["one"]
    assert answer == granted(ticket)
    flow.coordinator.stop_admitting()
    refused = authz_pb2.CheckResponse.FromString(
        await authz.Check(check_request({"x-request-id": "two"}, model="a"), FakeServicerContext()))
    assert refused.WhichOneof("http_response") == "denied_response"
