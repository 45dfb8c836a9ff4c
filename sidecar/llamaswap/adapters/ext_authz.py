"""Envoy ext_authz: the Check call that is answered only when the request gets the GPU.

The Check carries no body: Envoy's json_to_metadata filter has already put the body's `model`,
its `max_tokens` (or `max_completion_tokens`, `n_predict`), `stream`, `service_tier` and Ollama's
`keep_alive` (read only where routing.keepAlive.honour is on; a value that is not a duration is
ignored, never refused) into dynamic metadata, which arrives in `metadata_context`; only the
headers scheduling reads are sent. A request is scheduled as what it makes the upstream load or unload (`scheduled_as`):
the body's model, else the model its query names (router-mode llama-server loads it), and an
unload runs alone. A grant answers OK with the x-llamaswap-* response headers, the granted
upstream's name in the request header x-llamaswap-upstream (Envoy's route sends the request to
that upstream) and the grant's ticket in dynamic metadata (the access log reports it back); a
refusal is a DeniedHttpResponse in the OpenAI error shape. A cancelled Check means the client
left while waiting.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
from typing import Final
from urllib.parse import parse_qs

import grpc
from google.protobuf import struct_pb2
from google.protobuf.descriptor import Descriptor
from google.rpc import code_pb2, status_pb2

from llamaswap._proto.envoy.config.core.v3 import base_pb2
from llamaswap._proto.envoy.service.auth.v3 import external_auth_pb2 as authz_pb2
from llamaswap._proto.envoy.type.v3 import http_status_pb2
from llamaswap.core import Decision, Outcome
from llamaswap.core.keep_alive import KeepAliveError, parse_keep_alive
from llamaswap.envoy.contract import (
    AUTHORIZATION_HEADER,
    CLIENT_REQUEST_ID_HEADER,
    CONTENT_LENGTH_HEADER,
    KEEP_ALIVE_KEY,
    MAX_TOKENS_KEYS,
    MAX_REQUEST_ID,
    MODEL_KEY,
    MODEL_NAMESPACE,
    OBJECTIVE_HEADER,
    OLD_OBJECTIVE_HEADER,
    PRIORITY_HEADER,
    REQUEST_ID_HEADER,
    RETRY_AFTER_MS_HEADER,
    RETRY_COUNT_HEADER,
    SERVICE_TIER_KEY,
    SHOULD_RETRY_HEADER,
    STREAM_KEY,
    TICKET_KEY,
    UNLOAD_PATH,
    UPSTREAM_HEADER,
)
from llamaswap.runtime.coordinator import Coordinator, Refusal
from llamaswap.runtime.kept import RetryKeys, parse_attempt
from llamaswap.runtime.ticket import Arrival, Ticket, new_arrival
from llamaswap.adapters.metadata import Fields, namespace_fields
from llamaswap.adapters.outcomes import http_error

_log = logging.getLogger(__name__)

# A model name longer than this is not a model name (json_to_metadata stops at 8 KiB anyway).
MAX_MODEL_NAME = 512
# Longer than any tier's name: not kept on the request (it would be ignored anyway).
MAX_SERVICE_TIER = 32
# More output tokens than any context holds is not a request's size.
MAX_TOKENS = 10_000_000
_OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD


def _header(key: str, value: str) -> base_pb2.HeaderValueOption:
    # ext_authz reads `value`, not `raw_value` (facts/envoy.md).
    return base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key=key, value=value), append_action=_OVERWRITE)


# The x-llamaswap-* headers that tell the client what the scheduler decided, in this order.
DECISION_HEADER_KEYS = (PRIORITY_HEADER, "x-llamaswap-band", "x-llamaswap-score", "x-llamaswap-queue-wait-ms")


def _decision_values(decision: Decision) -> tuple[str, str, str, str]:
    """The values of DECISION_HEADER_KEYS, in its order."""
    return (str(decision.priority), decision.band.value, f"{decision.score:.3f}",
            f"{decision.queue_wait_ns / 1e6:.1f}")


def decision_headers(decision: Decision) -> list[tuple[str, str]]:
    """The x-llamaswap-* headers that tell the client what the scheduler decided."""
    return list(zip(DECISION_HEADER_KEYS, _decision_values(decision)))


def gpu_of(decision: Decision) -> str:
    """The name of the upstream the grant runs on."""
    return decision.gpu


def _ok_template() -> authz_pb2.CheckResponse:
    """Every OK's fixed part: its status, the headers' names and how they are added, the
    granted upstream's header (ext_authz reads `value`, not `raw_value`: facts/envoy.md)."""
    response = authz_pb2.CheckResponse()
    response.status.code = code_pb2.OK
    ok = response.ok_response
    for key in DECISION_HEADER_KEYS:
        option = ok.response_headers_to_add.add()
        option.header.key = key
        option.append_action = _OVERWRITE
    # A request header: the route reads it (it overwrites any copy, though the bootstrap removed
    # the client's before Envoy matched a route).
    option = ok.headers.add()
    option.header.key = UPSTREAM_HEADER
    option.append_action = _OVERWRITE
    return response


_OK = _ok_template()


def granted(ticket: Ticket) -> authz_pb2.CheckResponse:
    """The OK: the decision's headers for the client, the granted upstream for Envoy's route and
    the ticket for Envoy's metadata. A copy of the fixed part with the values set in it. The Check
    sends its bytes as `granted_wire` splices them, held to this message by the tests."""
    decision = ticket.decision
    assert decision is not None
    response = authz_pb2.CheckResponse()
    response.CopyFrom(_OK)
    ok = response.ok_response
    headers = ok.response_headers_to_add
    priority, band, score, queue_wait = _decision_values(decision)
    headers[0].header.value = priority
    headers[1].header.value = band
    headers[2].header.value = score
    headers[3].header.value = queue_wait
    ok.headers[0].header.value = gpu_of(decision)
    response.dynamic_metadata.fields[TICKET_KEY].string_value = ticket.token
    return response


# -- the OK on the wire ----------------------------------------------------------------------
# grpc.aio writes the bytes a handler returns as they are where no response serializer is
# registered (`add_authorization_to_server`): the OK is spliced into protobuf's encoding here (a
# field is its tag, its payload's length as a varint, its payload), in about half the time of
# `granted` and its serialization (2.6 against 4.7 us). tests/test_check_wire holds it to
# `granted(ticket).SerializeToString()`, byte for byte.


def _varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _delimited(tag: bytes, payload: bytes) -> bytes:
    """A length-delimited field (a string or a message): its tag, its payload's length, the payload."""
    return tag + _varint(len(payload)) + payload


def _tag(message: Descriptor, field: str) -> bytes:
    """The tag of `message`'s length-delimited `field`, from the schema (wire type 2)."""
    return _varint(message.fields_by_name[field].number << 3 | 2)


# Every byte of a framed string but the string's own depends only on its length: the bytes before
# it are made once for each length up to this, and reused.
_CACHED_LENGTHS = 128


class _Framed:
    """One string field inside nested message fields, as one length-delimited run of bytes: each
    level (outermost first) is a field's tag and the bytes of its payload before and after the
    next level; `omit_empty` for a plain proto3 string (an empty one is not written), not for a
    oneof member."""

    def __init__(self, levels: tuple[tuple[bytes, bytes, bytes], ...], tag: bytes, *, omit_empty: bool) -> None:
        self._levels = levels
        self._tag = tag
        self._omit_empty = omit_empty
        self._tail = b"".join(after for _, _, after in reversed(levels))
        self._heads = [b""] + [self.framed(bytes(size))[:-(size + len(self._tail))] for size in
                               range(1, _CACHED_LENGTHS)]

    def framed(self, value: bytes) -> bytes:
        """The fields, each made from the one inside it."""
        payload = b"" if self._omit_empty and not value else _delimited(self._tag, value)
        for tag, before, after in reversed(self._levels):
            payload = _delimited(tag, before + payload + after)
        return payload

    def __call__(self, value: bytes) -> bytes:
        size = len(value)
        if 0 < size < _CACHED_LENGTHS:
            return self._heads[size] + value + self._tail
        return self.framed(value)


def _header_option(field: str, key: str) -> _Framed:
    """A header of the OK with its value framed: `field` of OkHttpResponse, a HeaderValueOption
    of `key`, added as `_OVERWRITE`."""
    option = base_pb2.HeaderValueOption
    return _Framed(((_tag(authz_pb2.OkHttpResponse.DESCRIPTOR, field), b"",
                     option(append_action=_OVERWRITE).SerializeToString()),
                    (_tag(option.DESCRIPTOR, "header"), base_pb2.HeaderValue(key=key).SerializeToString(), b"")),
                   _tag(base_pb2.HeaderValue.DESCRIPTOR, "value"), omit_empty=True)


def _ticket_metadata() -> _Framed:
    """The OK's dynamic_metadata with the ticket framed: a Struct whose one entry is TICKET_KEY's
    string value (a map entry: its key, then its value)."""
    entry = struct_pb2.Struct.DESCRIPTOR.fields_by_name["fields"].message_type
    return _Framed(((_tag(authz_pb2.CheckResponse.DESCRIPTOR, "dynamic_metadata"), b"", b""),
                    (_tag(struct_pb2.Struct.DESCRIPTOR, "fields"), _delimited(_tag(entry, "key"), TICKET_KEY.encode()),
                     b""),
                    (_tag(entry, "value"), b"", b"")),
                   _tag(struct_pb2.Value.DESCRIPTOR, "string_value"), omit_empty=False)


# The OK's fields in protobuf's order (by number): the status, ok_response's request header then
# the decision's response headers, the metadata.
_OK_STATUS: Final = authz_pb2.CheckResponse(status=status_pb2.Status(code=code_pb2.OK)).SerializeToString()
_OK_RESPONSE: Final = _tag(authz_pb2.CheckResponse.DESCRIPTOR, "ok_response")
_UPSTREAM_OPTION: Final = _header_option("headers", UPSTREAM_HEADER)
_DECISION_OPTIONS: Final = tuple(_header_option("response_headers_to_add", key) for key in DECISION_HEADER_KEYS)
_TICKET_METADATA: Final = _ticket_metadata()


def granted_wire(ticket: Ticket) -> bytes:
    """`granted(ticket)` as protobuf serializes it: what the Check answers on a grant."""
    decision = ticket.decision
    assert decision is not None
    priority, band, score, queue_wait = _decision_values(decision)
    priority_option, band_option, score_option, queue_wait_option = _DECISION_OPTIONS
    ok = b"".join((_UPSTREAM_OPTION(gpu_of(decision).encode()), priority_option(priority.encode()),
                   band_option(band.encode()), score_option(score.encode()), queue_wait_option(queue_wait.encode())))
    return _OK_STATUS + _delimited(_OK_RESPONSE, ok) + _TICKET_METADATA(ticket.token.encode())


def denied(refusal: Refusal) -> authz_pb2.CheckResponse:
    error, body = http_error(refusal)
    headers = [_header("content-type", "application/json"), _header("x-llamaswap-outcome", refusal.outcome.value)]
    if refusal.retry_after_s is not None:
        # The OpenAI SDKs read retry-after-ms first: both say the same.
        headers.append(_header("retry-after", str(refusal.retry_after_s)))
        headers.append(_header(RETRY_AFTER_MS_HEADER, str(refusal.retry_after_s * 1000)))
    if not error.retry_helps:
        headers.append(_header(SHOULD_RETRY_HEADER, "false"))
    return authz_pb2.CheckResponse(
        status=status_pb2.Status(code=code_pb2.PERMISSION_DENIED, message=error.code),
        denied_response=authz_pb2.DeniedHttpResponse(
            status=http_status_pb2.HttpStatus(code=http_status_pb2.StatusCode.ValueType(error.status)), headers=headers,
            body=body.decode()),
    )


def body_fields(request: authz_pb2.CheckRequest) -> Fields | None:
    """The body's fields json_to_metadata put into the Check's metadata, found once per Check
    (each reader below then looks up only its key); None when the namespace is not there."""
    return namespace_fields(request.attributes.metadata_context, MODEL_NAMESPACE)


# What scheduling reads from the body's fields (json_to_metadata's), each as taken: the model (a
# non-empty string, not too long), the output tokens (the first of MAX_TOKENS_KEYS that is a
# positive number not above MAX_TOKENS; -1 means unlimited: none), whether it is streamed
# (`"stream": true`) and the OpenAI `service_tier` (a short string; the core says which count:
# core.priority.SERVICE_TIERS). A plain tuple: a NamedTuple's construction costs 0.5 us more.
BodyValues = tuple[str | None, int | None, bool, str | None]  # model, max_tokens, streamed, service_tier


_NO_BODY_VALUES: Final[BodyValues] = (None, None, False, None)


def body_values(fields: Fields | None) -> BodyValues:
    """The body's values scheduling reads, each key looked up once (on every Check). A JSON value
    of another type reads as its kind's default ("", 0, false), which each rule refuses: no kind
    test but the tier's, where "" is a string kept as it is."""
    if fields is None:
        return _NO_BODY_VALUES
    model = fields[MODEL_KEY].string_value if MODEL_KEY in fields else None
    max_tokens = None
    for key in MAX_TOKENS_KEYS:
        if key in fields:
            number = fields[key].number_value
            if 1 <= number <= MAX_TOKENS:
                max_tokens = int(number)
                break
    tier = None
    if SERVICE_TIER_KEY in fields:
        value = fields[SERVICE_TIER_KEY]
        if value.HasField("string_value") and len(value.string_value) <= MAX_SERVICE_TIER:
            tier = value.string_value
    return (model if model and len(model) <= MAX_MODEL_NAME else None, max_tokens,
            STREAM_KEY in fields and fields[STREAM_KEY].bool_value, tier)


def model_of(request: authz_pb2.CheckRequest) -> str | None:
    """The body's top-level `model`, if it is a non-empty string (json_to_metadata put it there)."""
    return body_values(body_fields(request))[0]


@dataclasses.dataclass(frozen=True, slots=True)
class Scheduled:
    """What a request is scheduled as: the model it makes the upstream use or load (None: none),
    and whether it runs alone (it unloads that model under any generation of it)."""

    model: str | None
    alone: bool = False


def query_model(path: str) -> str | None:
    """The model a request's query string names for the upstream to load: router-mode
    llama-server loads the `?model=` of `GET /props`, `/slots`, `/metrics` unless `autoload` is
    false or 0 (any other path naming one is taken at its word: scheduling on a model is the
    safe side). None if it names none."""
    _, _, query = path.partition("?")
    if not query:
        return None
    params = parse_qs(query, keep_blank_values=True)
    model = params.get("model", [""])[0]  # the first, as llama-server reads it
    if not 0 < len(model) <= MAX_MODEL_NAME or params.get("autoload", [""])[0] in ("false", "0"):
        return None
    return model


def scheduled_as(method: str, path: str, body_model: str | None) -> Scheduled:
    """The rule that keeps one model at the upstream whatever the request's path: a request is
    scheduled on the model it makes the upstream use or load, the body's, else the one its
    query names; `POST /models/unload` (upstream.managementApi: schedule) runs alone, since it
    ends whatever its model computes (a load is a request for the model it loads)."""
    return Scheduled(_scheduled_model(path, body_model), _runs_alone(method, path))


def _scheduled_model(path: str, body_model: str | None) -> str | None:
    return body_model if body_model is not None else query_model(path)


def _runs_alone(method: str, path: str) -> bool:
    return method == "POST" and path.partition("?")[0] == UNLOAD_PATH


def max_tokens_of(request: authz_pb2.CheckRequest) -> int | None:
    """The output tokens the body asks for (`body_values`)."""
    return body_values(body_fields(request))[1]


def streamed_of(request: authz_pb2.CheckRequest) -> bool:
    """Whether the body asks for a streamed response (`"stream": true`)."""
    return body_values(body_fields(request))[2]


def service_tier_of(request: authz_pb2.CheckRequest) -> str | None:
    """The body's OpenAI `service_tier`, if it is a short string (the core says which count:
    core.priority.SERVICE_TIERS); None when absent or of another JSON type."""
    return body_values(body_fields(request))[3]


def keep_alive_in(fields: Fields | None) -> float | None:
    """The body's Ollama `keep_alive` in seconds (`core/keep_alive.py`: a negative one keeps the
    model); None when absent or null. KeepAliveError for one that is neither a string nor a number,
    or a string that is not a duration."""
    if fields is None or KEEP_ALIVE_KEY not in fields:
        return None
    value = fields[KEEP_ALIVE_KEY]
    kind = value.WhichOneof("kind")
    if kind == "null_value":
        return None
    if kind == "string_value":
        return parse_keep_alive(value.string_value)
    if kind == "number_value":
        return parse_keep_alive(value.number_value)
    raise KeepAliveError(f"keep_alive must be a duration such as \"5m\" or a number of seconds, not a JSON {kind}")


def retry_digest(request: authz_pb2.CheckRequest, keys: RetryKeys) -> bytes | None:
    """routing.retryGraceSeconds: the request's keyed digest (runtime/kept.py), computed when first
    read (`Ticket.retry_key`).

    The caller is the Authorization header and the client's address. A client-chosen x-request-id
    is one Envoy found on arrival (copied to CLIENT_REQUEST_ID_HEADER before Envoy makes one up for
    a request without); else the body, which the bootstrap sends (its beginning, and the full
    length in content-length, which the buffer filter sets) only while a grace period is set."""
    http = request.attributes.request.http
    headers = http.headers
    own = headers.get(REQUEST_ID_HEADER)
    chosen = own if own and headers.get(CLIENT_REQUEST_ID_HEADER) == own else None
    length = headers.get(CONTENT_LENGTH_HEADER)
    body = http.raw_body if length is not None else None
    caller = f"{headers.get(AUTHORIZATION_HEADER, '')}\n{request.attributes.source.address.socket_address.address}"
    digest = keys.digest(caller=caller, client_request_id=chosen, body=body, body_length=length,
                         route=f"{http.method} {http.path}")
    if body:
        http.ClearField("raw_body")  # hashed, never kept
    return digest


class Authorization:
    """Envoy's Authorization service: its Check answers with the response's bytes, served as
    `add_authorization_to_server` registers it."""

    def __init__(self, coordinator: Coordinator, *, retry_keys: RetryKeys | None = None) -> None:
        self._coordinator = coordinator
        self._retry_keys = retry_keys or RetryKeys()
        self._bad_keep_alive_told = False  # the first keep_alive that is not a duration is a warning

    async def Check(  # noqa: N802 - the gRPC method name
        self, request: authz_pb2.CheckRequest, context: grpc.aio.ServicerContext
    ) -> bytes:
        """The serialized CheckResponse: the OK once the request is granted, else the refusal."""
        try:
            arrival = self._arrival(request, context)
            admission = await self._coordinator.admit(arrival)
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - answer the client rather than hang it
            _log.exception("admission failed")
            return denied(Refusal(Outcome.INTERNAL_ERROR)).SerializeToString()
        if isinstance(admission, Ticket):
            return granted_wire(admission)
        return denied(admission).SerializeToString()

    def _arrival(self, request: authz_pb2.CheckRequest, context: grpc.aio.ServicerContext) -> Arrival:
        # Each message read once (a protobuf field access builds a new wrapper each time).
        attributes = request.attributes
        http = attributes.request.http
        headers = http.headers
        config = self._coordinator.config
        trusted_header = config.security.priority.trusted_header
        trace_parent = trace_state = None
        for key, value in context.invocation_metadata() or ():
            if key == "traceparent":
                trace_parent = value
            elif key == "tracestate":
                trace_state = value
        request_id = headers.get(REQUEST_ID_HEADER) or http.id
        replaced = len(request_id) > MAX_REQUEST_ID
        if replaced:  # the ticket, the activity log and every span keep it: bounded
            request_id = http.id
        method, path = http.method, http.path
        fields = namespace_fields(attributes.metadata_context, MODEL_NAMESPACE)  # `body_fields`
        body_model, max_tokens, streamed, service_tier = body_values(fields)
        digest = attempt = None
        routing = config.routing
        keep_alive_s = self._keep_alive(fields, request_id) if routing.keep_alive.honour else None
        if routing.retry_grace_seconds > 0:
            # Hashed only if read: most requests find no kept place and are never cancelled waiting.
            digest = functools.partial(retry_digest, request, self._retry_keys)
            attempt = parse_attempt(headers.get(RETRY_COUNT_HEADER))
        # Every field, in the order of Arrival's (`ticket.new_arrival`: on every Check); the model
        # and `alone` are `scheduled_as`'s, without its value made.
        return new_arrival(
            request_id,  # request_id
            headers.get(PRIORITY_HEADER),  # priority_header
            headers.get(trusted_header) if trusted_header else None,  # trusted_header
            _scheduled_model(path, body_model),  # model
            context.peer(),  # peer
            trace_parent if isinstance(trace_parent, str) else None,  # trace_parent
            trace_state if isinstance(trace_state, str) else None,  # trace_state
            method,  # method
            path,  # path
            max_tokens,  # max_tokens
            streamed,  # streamed
            replaced,  # request_id_replaced
            _runs_alone(method, path),  # alone
            headers.get(OBJECTIVE_HEADER) or headers.get(OLD_OBJECTIVE_HEADER),  # objective
            service_tier,  # service_tier
            None,  # retry_key (the digest computes it when read)
            attempt,  # attempt
            keep_alive_s,  # keep_alive_s
            digest,  # retry_digest
        )

    def _keep_alive(self, fields: Fields | None, request_id: str) -> float | None:
        """`keep_alive_in`; a bad one is ignored (the request keeps its model's configured idle
        time): a hint about memory never costs a generation. Told once as a warning, then at debug."""
        try:
            return keep_alive_in(fields)
        except KeepAliveError as exc:
            level = logging.DEBUG if self._bad_keep_alive_told else logging.WARNING
            self._bad_keep_alive_told = True
            _log.log(level, "request %s: %s; ignored, its model keeps its configured idle time (further ones are "
                            "logged at debug level)", request_id, exc)
            return None


_SERVICE: Final = authz_pb2.DESCRIPTOR.services_by_name["Authorization"].full_name


def add_authorization_to_server(servicer: Authorization, server: grpc.aio.Server) -> None:
    """Serve `servicer` as Envoy's Authorization service, as the generated
    `add_AuthorizationServicer_to_server` does but without a response serializer: grpc.aio writes
    the bytes Check returns as they are."""
    handlers = {"Check": grpc.unary_unary_rpc_method_handler(
        servicer.Check, request_deserializer=authz_pb2.CheckRequest.FromString)}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(_SERVICE, handlers),))
    server.add_registered_method_handlers(_SERVICE, handlers)
