"""Several upstreams through the real Envoy: the Check's OK names the upstream in
x-llamaswap-upstream and the request goes there and only there; a client's own copy of the
header steers nothing, not even when a failed Check lets a request through (envoy.failOpen); the
access log says which upstream served.

The sidecar is a stub here (a gRPC server in the test answering Check and taking the access
log), so that the test decides each grant's upstream; two fakes are the upstreams.
"""

from __future__ import annotations

import contextlib
import dataclasses
import pathlib
from collections.abc import AsyncIterator, Iterator

import aiohttp
import grpc

from client import chat
from fake_llama import FakeLlamaServer
from harness import EnvoyProcess, async_wait_for
from llamaswap._proto.envoy.data.accesslog.v3 import accesslog_pb2
from llamaswap._proto.envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc
from llamaswap._proto.envoy.service.auth.v3 import external_auth_pb2 as authz_pb2
from llamaswap._proto.envoy.service.auth.v3 import external_auth_pb2_grpc as authz_grpc
from llamaswap.adapters.access_log import report_of, ticket_of
from llamaswap.config import parse_config
from llamaswap.envoy.bootstrap import build_bootstrap

UPSTREAM_HEADER = "x-llamaswap-upstream"


class StubSidecar(authz_grpc.AuthorizationServicer, als_pb2_grpc.AccessLogServiceServicer):
    """Grants every Check at once on `upstream` (None: an OK that names none), or fails it
    (`fail`); keeps every access-log entry."""

    def __init__(self) -> None:
        self.upstream: str | None = "gpu1"
        self.fail = False
        self.entries: list[accesslog_pb2.HTTPAccessLogEntry] = []

    async def Check(self, request: authz_pb2.CheckRequest,  # noqa: N802 - the gRPC method name
                    context: grpc.aio.ServicerContext) -> authz_pb2.CheckResponse:
        if self.fail:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the stub is down")
        response = authz_pb2.CheckResponse()
        response.status.code = 0  # OK
        if self.upstream is not None:
            option = response.ok_response.headers.add()
            option.header.key, option.header.value = UPSTREAM_HEADER, self.upstream
        # The access log reports only exchanges that carry a ticket.
        response.dynamic_metadata.fields["ticket"].string_value = "ticket-" + request.attributes.request.http.headers[
            "x-request-id"]
        return response

    async def StreamAccessLogs(self, request_iterator: AsyncIterator[als_pb2.StreamAccessLogsMessage],  # noqa: N802
                               context: grpc.aio.ServicerContext) -> als_pb2.StreamAccessLogsResponse:
        async for message in request_iterator:
            self.entries.extend(message.http_logs.log_entry)
        return als_pb2.StreamAccessLogsResponse()

    def final_entry(self, ticket: str) -> accesslog_pb2.HTTPAccessLogEntry | None:
        for entry in self.entries:
            if ticket_of(entry) == ticket and entry.common_properties.access_log_type == accesslog_pb2.DownstreamEnd:
                return entry
        return None


@dataclasses.dataclass
class TwoUpstreams:
    gpu0: FakeLlamaServer
    gpu1: FakeLlamaServer
    stub: StubSidecar
    envoy: EnvoyProcess


@contextlib.contextmanager
def _fakes() -> Iterator[tuple[FakeLlamaServer, FakeLlamaServer]]:
    first = FakeLlamaServer().started()
    try:
        second = FakeLlamaServer().started()
        try:
            yield first, second
        finally:
            second.close()
    finally:
        first.close()


@contextlib.asynccontextmanager
async def two_upstreams(workdir: pathlib.Path, *, fail_open: bool) -> AsyncIterator[TwoUpstreams]:
    stub = StubSidecar()
    server = grpc.aio.server()
    authz_grpc.add_AuthorizationServicer_to_server(stub, server)
    als_pb2_grpc.add_AccessLogServiceServicer_to_server(stub, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        with _fakes() as (gpu0, gpu1):
            config = parse_config({
                "listen": {"http": "127.0.0.1:0", "grpc": f"127.0.0.1:{port}", "admin": "127.0.0.1:0"},
                "upstreams": [{"name": "gpu0", "url": gpu0.url}, {"name": "gpu1", "url": gpu1.url}],
                "envoy": {"failOpen": fail_open}})
            bootstrap = build_bootstrap(config, admin_port=port, envoy_admin_port=0)
            envoy = EnvoyProcess(bootstrap, workdir)
            failed = True
            try:
                yield TwoUpstreams(gpu0, gpu1, stub, envoy)
                failed = False
            finally:
                if failed:
                    envoy.dump()
                envoy.stop()
    finally:
        await server.stop(None)


async def test_the_request_goes_to_the_upstream_the_check_named_and_only_there(tmp_path: pathlib.Path) -> None:
    async with two_upstreams(tmp_path, fail_open=False) as stack, aiohttp.ClientSession() as session:
        # The client asks for gpu0; the grant says gpu1.
        reply = await chat(session, stack.envoy.url, "r1", extra_headers={UPSTREAM_HEADER: "gpu0"})
        assert reply.status == 200, reply.body
        assert (stack.gpu0.order(), stack.gpu1.order()) == ([], ["r1"])
        assert stack.gpu1.hits[0].headers[UPSTREAM_HEADER] == "gpu1"  # the client's copy is gone
        entry = await async_wait_for(lambda: stack.stub.final_entry("ticket-r1"), what="r1's final access-log entry")
        report = report_of(entry)
        assert report is not None and (report.status, report.gpu) == (200, "gpu1")

        # The grant decides, whichever upstream it names.
        stack.stub.upstream = "gpu0"
        reply = await chat(session, stack.envoy.url, "r2", extra_headers={UPSTREAM_HEADER: "gpu1"})
        assert reply.status == 200, reply.body
        assert (stack.gpu0.order(), stack.gpu1.order()) == (["r2"], ["r1"])
        entry = await async_wait_for(lambda: stack.stub.final_entry("ticket-r2"), what="r2's final access-log entry")
        assert report_of(entry).gpu == "gpu0"

        # An OK that names no upstream (or one Envoy does not know) reaches none: 503.
        for name, test_id in ((None, "r3"), ("gpu7", "r4")):
            stack.stub.upstream = name
            reply = await chat(session, stack.envoy.url, test_id, extra_headers={UPSTREAM_HEADER: "gpu1"})
            assert reply.status == 503, reply.body
            entry = await async_wait_for(lambda t=test_id: stack.stub.final_entry(f"ticket-{t}"),
                                         what=f"{test_id}'s final access-log entry")
            assert report_of(entry).gpu is None
        assert (stack.gpu0.order(), stack.gpu1.order()) == (["r2"], ["r1"])


async def test_fail_open_goes_to_the_first_upstream_whatever_the_client_says(tmp_path: pathlib.Path) -> None:
    async with two_upstreams(tmp_path, fail_open=True) as stack, aiohttp.ClientSession() as session:
        stack.stub.fail = True
        reply = await chat(session, stack.envoy.url, "unscheduled", extra_headers={UPSTREAM_HEADER: "gpu1"})
        assert reply.status == 200, reply.body
        assert (stack.gpu0.order(), stack.gpu1.order()) == (["unscheduled"], [])
        assert UPSTREAM_HEADER not in stack.gpu0.hits[0].headers
        # A Check that answers still routes.
        stack.stub.fail = False
        reply = await chat(session, stack.envoy.url, "granted")
        assert reply.status == 200, reply.body
        assert (stack.gpu0.order(), stack.gpu1.order()) == (["unscheduled"], ["granted"])
