"""The floor of the data-path figures: the same bootstrap in front of a do-nothing grpc.aio server
with llamaswap's protocol (`python bench/floor.py PORTS_FILE UPSTREAM [--serial]`), or a toy FIFO one."""

from __future__ import annotations

import asyncio
import json
import os
import pathlib
import sys
from typing import Any

import bench_paths  # noqa: F401 - puts e2e/ on the path
from harness import EnvoyProcess, wait_for
from llamaswap.config import parse_config
from llamaswap.envoy.bootstrap import build_bootstrap


def _null_sidecar_main(ports_file: str, upstream: str, serial: bool) -> None:
    """The least a Python sidecar on this chain can do, as a floor for the figures.

    The same protocol as llamaswap, and nothing else: a grpc.aio server with the two services
    Envoy calls (ext_authz Check, the access-log stream). Plain: every Check is answered OK at
    once with a ticket in dynamic metadata (so Envoy's access log reports the exchange, as it
    does for llamaswap's grants) and the request header x-llamaswap-upstream naming `upstream`
    (the route to its cluster, as llamaswap's OK names the granted upstream; without it Envoy
    sends the request to the endpoint-less cluster: a 503). Serial (`--serial`): a toy FIFO that
    holds each Check until the GPU is free and frees it on the access log's final entry for the
    running ticket; no priorities, telemetry, logging or bookkeeping.
    """
    import collections
    import secrets

    import grpc
    from google.protobuf import struct_pb2
    from google.rpc import code_pb2, status_pb2

    from llamaswap._proto.envoy.data.accesslog.v3 import accesslog_pb2
    from llamaswap._proto.envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc
    from llamaswap._proto.envoy.service.auth.v3 import external_auth_pb2 as authz_pb2
    from llamaswap._proto.envoy.service.auth.v3 import external_auth_pb2_grpc as authz_grpc
    from llamaswap._proto.envoy.config.core.v3 import base_pb2
    from llamaswap.envoy.contract import GRANT_NAMESPACE, TICKET_KEY, UPSTREAM_HEADER

    ok = status_pb2.Status(code=code_pb2.OK)
    routed = authz_pb2.OkHttpResponse(headers=[base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=UPSTREAM_HEADER, value=upstream),
        append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD)])
    waiting: collections.deque[tuple[str, asyncio.Future[None]]] = collections.deque()
    running: list[str | None] = [None]

    def grant(token: str) -> authz_pb2.CheckResponse:
        metadata = struct_pb2.Struct()
        metadata.fields[TICKET_KEY].string_value = token
        return authz_pb2.CheckResponse(status=ok, ok_response=routed, dynamic_metadata=metadata)

    def pump() -> None:
        while running[0] is None and waiting:
            token, future = waiting.popleft()
            if not future.done():  # a cancelled Check (its client left) is skipped
                running[0] = token
                future.set_result(None)

    # BENCH_CAPTURE=DIR: keep the last Check and final access-log message Envoy sent, as bytes
    # (bench/hotpath.py replays them; the sidecar's protos are trimmed, unknown fields are kept).
    capture = os.environ.get("BENCH_CAPTURE")

    class Authorization(authz_grpc.AuthorizationServicer):
        async def Check(self, request, context):  # noqa: N802
            token = secrets.token_urlsafe(18)
            if capture:
                pathlib.Path(capture, "check.bin").write_bytes(request.SerializeToString())
            if serial:
                future = asyncio.get_running_loop().create_future()
                waiting.append((token, future))
                pump()
                await future
            return grant(token)

    class AccessLogs(als_pb2_grpc.AccessLogServiceServicer):
        async def StreamAccessLogs(self, request_iterator, context):  # noqa: N802
            async for message in request_iterator:
                for entry in message.http_logs.log_entry:
                    common = entry.common_properties
                    if common.access_log_type == accesslog_pb2.DownstreamPeriodic:
                        continue
                    if capture:
                        pathlib.Path(capture, "access-log.bin").write_bytes(message.SerializeToString())
                    token = common.metadata.filter_metadata[GRANT_NAMESPACE].fields[TICKET_KEY].string_value
                    if token and running[0] == token:
                        running[0] = None
                        pump()
            return als_pb2.StreamAccessLogsResponse()

    async def serve() -> None:
        server = grpc.aio.server(options=[("grpc.max_concurrent_streams", 1 << 30), ("grpc.so_reuseport", 0),
                                          ("grpc.server.max_pending_requests", 1 << 20),
                                          ("grpc.server.max_pending_requests_hard_limit", 1 << 20)])
        authz_grpc.add_AuthorizationServicer_to_server(Authorization(), server)
        als_pb2_grpc.add_AccessLogServiceServicer_to_server(AccessLogs(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        tmp = f"{ports_file}.tmp"
        pathlib.Path(tmp).write_text(json.dumps({"grpc": port}))
        os.replace(tmp, ports_file)
        await server.wait_for_termination()

    asyncio.run(serve())


class NullSidecar:
    """The do-nothing (or toy FIFO) sidecar in a child process, and an Envoy (same bootstrap) in front."""

    def __init__(self, workdir: pathlib.Path, document: dict[str, Any], env: dict[str, str] | None = None,
                 *, serial: bool = False) -> None:
        from harness import Process

        name = "toy-fifo" if serial else "floor"
        ports_file = workdir / f"{name}-ports.json"
        ports_file.unlink(missing_ok=True)
        upstream = parse_config(document).gpu_entries[0].name  # the one its OK names
        self.process = Process(name, [sys.executable, __file__, str(ports_file), upstream,
                                      *(["--serial"] if serial else [])],
                               workdir / f"{name}.log", env)
        self.envoy: EnvoyProcess | None = None
        try:
            port = wait_for(lambda: ports_file.exists() and json.loads(ports_file.read_text())["grpc"],
                            what=f"{name} sidecar port")
            bootstrap = build_bootstrap(parse_config(document), grpc_port=port, admin_port=1, envoy_admin_port=0)
            self.envoy = EnvoyProcess(bootstrap, workdir, name=f"envoy-{name}")
        except BaseException:
            self.process.dump()
            self.close()
            raise

    @property
    def pid(self) -> int:
        return self.process.popen.pid

    @property
    def url(self) -> str:
        assert self.envoy is not None
        return self.envoy.url

    def close(self) -> None:
        if self.envoy is not None:
            self.envoy.stop()
        self.process.stop()




if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit("usage: floor.py PORTS_FILE UPSTREAM [--serial]")
    _null_sidecar_main(sys.argv[1], sys.argv[2], "--serial" in sys.argv[3:])
