"""The transport: Envoy's protos <-> the runtime's types, and how outcomes look over HTTP.

- adapters/access_log.py: an access-log entry -> an ExchangeReport (or nothing);
- adapters/ext_authz.py: a Check -> an Arrival; a grant or a refusal -> a CheckResponse;
- adapters/outcomes.py: the one table from Outcome to HTTP status, OpenAI error and message;
- adapters/admin.py: the queue and status documents.
The servicers run against a real Coordinator (tests/flow.py).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from flow import PEER, FakeServicerContext, Flow, check_request, current_loop, virtual_time
from google.protobuf import duration_pb2, struct_pb2
from google.rpc import code_pb2
from llamaswap._proto.envoy.config.core.v3 import base_pb2
from llamaswap._proto.envoy.data.accesslog.v3 import accesslog_pb2
from llamaswap._proto.envoy.service.accesslog.v3 import als_pb2
from llamaswap._proto.envoy.service.auth.v3.external_auth_pb2 import CheckResponse
from llamaswap.core import Band, Decision, Outcome, Priority, PrioritySource
from llamaswap.envoy.contract import GRANT_NAMESPACE, MODEL_NAMESPACE, TICKET_KEY
from llamaswap.runtime.coordinator import Refusal
from llamaswap.runtime.ticket import Arrival, ExchangeEnd, ExchangeReport, Ticket
from llamaswap.adapters.access_log import AccessLogs, exchange_end, report_of, ticket_of
from llamaswap.adapters.admin import queue_document, status_document
from llamaswap.adapters.ext_authz import MAX_MODEL_NAME, Authorization, decision_headers, denied, granted, model_of
from llamaswap.adapters.outcomes import REFUSALS, http_error, openai_error_body
from test_coordinator import ENDINGS, RaisesOnEnqueue, Scenario

# -- access log ------------------------------------------------------------------------------

NOT_SENT_FLAGS = ["upstream_connection_failure", "no_healthy_upstream", "upstream_overflow", "no_route_found",
                  "no_cluster_found", "dns_resolution_failure", "overload_manager"]
CLIENT_LEFT_FLAGS = ["downstream_connection_termination", "downstream_remote_reset"]
UPSTREAM_FAILED_FLAGS = ["upstream_remote_reset", "upstream_connection_termination", "upstream_request_timeout",
                         "local_reset", "upstream_protocol_error", "stream_idle_timeout", "duration_timeout",
                         "upstream_max_stream_duration_reached"]
OTHER_FLAGS = ["failed_local_healthcheck", "delay_injected", "fault_injected", "rate_limited",
               "rate_limit_service_error", "upstream_retry_limit_exceeded", "invalid_envoy_request_headers",
               "downstream_protocol_error", "response_from_cache_filter", "no_filter_config_found"]


def test_the_flag_families_cover_every_response_flag() -> None:
    every = {field.name for field in accesslog_pb2.ResponseFlags.DESCRIPTOR.fields if field.type == field.TYPE_BOOL}
    families = [NOT_SENT_FLAGS, CLIENT_LEFT_FLAGS, UPSTREAM_FAILED_FLAGS, OTHER_FLAGS]
    assert sorted(flag for family in families for flag in family) == sorted(every)
    assert sum(len(f) for f in families) == len(every)  # no flag in two families


def duration(seconds: float) -> duration_pb2.Duration:
    value = duration_pb2.Duration()
    value.FromNanoseconds(round(seconds * 1e9))
    return value


def log_entry(kind: int = accesslog_pb2.DownstreamEnd, *, status: int | None = 200, flags: tuple[str, ...] = (),
              tx_s: float | None = 0.01, rx_s: float | None = None, ticket: str | None = "the-ticket",
              namespace: str = GRANT_NAMESPACE, cluster: str = "") -> accesslog_pb2.HTTPAccessLogEntry:
    entry = accesslog_pb2.HTTPAccessLogEntry()
    common = entry.common_properties
    common.upstream_cluster = cluster
    common.access_log_type = kind
    for flag in flags:
        setattr(common.response_flags, flag, True)
    if tx_s is not None:
        common.time_to_first_upstream_tx_byte.CopyFrom(duration(tx_s))
    if rx_s is not None:
        common.time_to_first_upstream_rx_byte.CopyFrom(duration(rx_s))
    if status is not None:
        entry.response.response_code.value = status
    if ticket is not None:
        common.metadata.filter_metadata[namespace].fields[TICKET_KEY].string_value = ticket
    return entry


def test_ticket_of() -> None:
    assert ticket_of(log_entry(ticket="tok-1")) == "tok-1"
    assert ticket_of(log_entry(ticket=None)) is None
    assert ticket_of(log_entry(ticket="tok", namespace="envoy.filters.http.other")) is None
    assert ticket_of(log_entry(ticket="")) is None
    no_key = log_entry(ticket=None)
    no_key.common_properties.metadata.filter_metadata[GRANT_NAMESPACE].fields["other"].string_value = "x"
    assert ticket_of(no_key) is None
    number = log_entry(ticket=None)
    number.common_properties.metadata.filter_metadata[GRANT_NAMESPACE].fields[TICKET_KEY].number_value = 7
    assert ticket_of(number) is None


def test_a_periodic_entry_is_a_renewal() -> None:
    report = report_of(log_entry(accesslog_pb2.DownstreamPeriodic, status=200, flags=("downstream_remote_reset",),
                                 tx_s=0.5, rx_s=2.0))
    assert report == ExchangeReport(final=False, end=None, status=0, first_byte_s=1.5)


@pytest.mark.parametrize("kind", [accesslog_pb2.DownstreamEnd, accesslog_pb2.NotSet])
def test_an_end_entry_is_final(kind: int) -> None:
    report = report_of(log_entry(kind, status=201, tx_s=0.25, rx_s=1.0))
    assert report == ExchangeReport(final=True, end=ExchangeEnd.COMPLETE, status=201, first_byte_s=0.75)


@pytest.mark.parametrize("kind", [accesslog_pb2.DownstreamStart, accesslog_pb2.UpstreamPeriodic,
                                  accesslog_pb2.UpstreamEnd, accesslog_pb2.TcpPeriodic,
                                  accesslog_pb2.TcpConnectionStart, accesslog_pb2.UpstreamPoolReady])
def test_other_entry_kinds_report_nothing(kind: int) -> None:
    assert report_of(log_entry(kind)) is None


@pytest.mark.parametrize("kind", [accesslog_pb2.DownstreamPeriodic, accesslog_pb2.DownstreamEnd])
def test_the_entry_says_which_upstream_served(kind: int) -> None:
    assert report_of(log_entry(kind, cluster="upstream-gpu1")).gpu == "gpu1"
    assert report_of(log_entry(kind, cluster="upstream-big-gpu-0")).gpu == "big-gpu-0"
    # No cluster (the route chose none) or not an upstream's: nobody served it.
    for cluster in ("", "upstream-", "llamaswap_unrouted", "llamaswap_admin", "gpu1"):
        assert report_of(log_entry(kind, cluster=cluster)).gpu is None


def test_the_first_byte_comes_from_the_two_durations() -> None:
    assert report_of(log_entry(tx_s=0.1, rx_s=None)).first_byte_s is None
    assert report_of(log_entry(tx_s=None, rx_s=1.0)).first_byte_s is None
    assert report_of(log_entry(tx_s=2.0, rx_s=1.0)).first_byte_s == 0.0  # never negative
    assert report_of(log_entry(tx_s=0.0, rx_s=0.000_001)).first_byte_s == pytest.approx(1e-6)


@pytest.mark.parametrize("flag", NOT_SENT_FLAGS)
def test_flags_that_say_the_request_never_reached_the_upstream(flag: str) -> None:
    assert exchange_end(log_entry(flags=(flag,)), 503) is ExchangeEnd.NOT_SENT
    # But a client gone too ended it first: it counts as the client's.
    assert exchange_end(log_entry(flags=(flag, "downstream_remote_reset")), 0) is ExchangeEnd.CLIENT_LEFT


@pytest.mark.parametrize("flag", CLIENT_LEFT_FLAGS)
def test_flags_that_say_the_client_left(flag: str) -> None:
    assert exchange_end(log_entry(flags=(flag,)), 200) is ExchangeEnd.CLIENT_LEFT
    assert exchange_end(log_entry(flags=(flag, "upstream_remote_reset")), 0) is ExchangeEnd.CLIENT_LEFT


@pytest.mark.parametrize("flag", UPSTREAM_FAILED_FLAGS)
def test_flags_that_say_the_upstream_failed(flag: str) -> None:
    assert exchange_end(log_entry(flags=(flag,)), 200) is ExchangeEnd.UPSTREAM_FAILED


@pytest.mark.parametrize("flag", OTHER_FLAGS)
def test_other_flags_do_not_change_a_complete_exchange(flag: str) -> None:
    assert exchange_end(log_entry(flags=(flag,)), 200) is ExchangeEnd.COMPLETE


def test_complete_exchanges_and_their_edges() -> None:
    assert exchange_end(log_entry(), 200) is ExchangeEnd.COMPLETE
    assert exchange_end(log_entry(), 503) is ExchangeEnd.COMPLETE  # the status decides the outcome later
    assert exchange_end(log_entry(), 0) is ExchangeEnd.UPSTREAM_FAILED  # no response at all
    assert exchange_end(log_entry(tx_s=None), 200) is ExchangeEnd.NOT_SENT  # no upstream tx byte
    assert exchange_end(log_entry(tx_s=None), 0) is ExchangeEnd.NOT_SENT  # never sent comes before no response
    assert exchange_end(log_entry(tx_s=None, flags=("downstream_remote_reset",)), 0) is ExchangeEnd.CLIENT_LEFT
    assert report_of(log_entry(status=None)) == ExchangeReport(final=True, end=ExchangeEnd.UPSTREAM_FAILED, status=0,
                                                               first_byte_s=None)


def test_an_empty_flags_message_and_a_zero_status_read_as_none() -> None:
    """Envoy may send response_flags present with no flag set, and a response_code of 0: the
    same ends as no flags and no status."""
    for tx_s in (0.01, None):
        for status in (200, 0):
            entry = log_entry(status=status, tx_s=tx_s)
            entry.common_properties.response_flags.SetInParent()
            assert entry.common_properties.HasField("response_flags")
            assert exchange_end(entry, status) is exchange_end(log_entry(status=status, tx_s=tx_s), status)
            assert report_of(entry) == report_of(log_entry(status=status, tx_s=tx_s))
    assert report_of(log_entry(status=0)) == report_of(log_entry(status=None))


def test_the_exchange_age_counts_from_its_first_upstream_byte() -> None:
    """start_time is the arrival; the wait for the grant (here 30 s) is not the exchange's age."""
    entry = log_entry(accesslog_pb2.DownstreamPeriodic, tx_s=30.0)
    assert report_of(entry).elapsed_s is None  # an entry without a start time says nothing
    entry.common_properties.start_time.FromNanoseconds(1_700_000_000 * 1_000_000_000)
    later = (1_700_000_000 + 42) * 1_000_000_000 + 500_000_000
    assert report_of(entry, now_unix_ns=later).elapsed_s == pytest.approx(12.5)
    # Clocks a hair apart: never negative.
    assert report_of(entry, now_unix_ns=later - 20 * 1_000_000_000).elapsed_s == 0.0
    end = log_entry(accesslog_pb2.DownstreamEnd, tx_s=30.0)
    end.common_properties.start_time.FromNanoseconds(1_700_000_000 * 1_000_000_000)
    assert report_of(end, now_unix_ns=later).elapsed_s == pytest.approx(12.5)
    not_sent = log_entry(accesslog_pb2.DownstreamPeriodic, tx_s=None)  # granted, not at the upstream yet
    not_sent.common_properties.start_time.FromNanoseconds(1_700_000_000 * 1_000_000_000)
    assert report_of(not_sent, now_unix_ns=later).elapsed_s == 0.0


@virtual_time
async def test_the_ticket_goes_out_and_comes_back_unchanged() -> None:
    """The grant's token (`<epoch>.<random>`) is what the OK's dynamic metadata carries and what
    the access log reads back, character for character."""
    flow = Flow()
    a = await flow.arrive("a", model="a")
    token = a.ticket.token
    epoch, _, random_part = token.partition(".")
    assert len(epoch) == 8 and len(random_part) == 32 and int(epoch, 16) >= 0 and int(random_part, 16) >= 0
    metadata = granted(a.ticket).dynamic_metadata
    entry = log_entry(accesslog_pb2.DownstreamEnd)
    entry.common_properties.metadata.filter_metadata[GRANT_NAMESPACE].CopyFrom(metadata)
    assert ticket_of(entry) == token


def _message(*entries: accesslog_pb2.HTTPAccessLogEntry) -> als_pb2.StreamAccessLogsMessage:
    message = als_pb2.StreamAccessLogsMessage()
    message.http_logs.log_entry.extend(entries)
    return message


@virtual_time
async def test_the_access_log_servicer_reports_renewals_ends_and_the_streams_end() -> None:
    flow = Flow()
    a = await flow.arrive("a", model="a", peer="ipv4:10.0.0.1:1")
    b = await flow.arrive("b", model="a", peer="ipv4:10.0.0.1:1")
    stream: asyncio.Queue[als_pb2.StreamAccessLogsMessage | None] = asyncio.Queue()

    async def messages() -> AsyncIterator[als_pb2.StreamAccessLogsMessage]:
        while (message := await stream.get()) is not None:
            yield message

    servicer = AccessLogs(flow.coordinator)
    call = asyncio.ensure_future(servicer.StreamAccessLogs(messages(), FakeServicerContext("ipv4:10.0.0.1:1")))
    await flow.advance(2)
    stream.put_nowait(_message(log_entry(accesslog_pb2.DownstreamPeriodic, ticket=a.ticket.token),
                               log_entry(accesslog_pb2.DownstreamEnd, ticket=None),  # no ticket: ignored
                               log_entry(accesslog_pb2.DownstreamStart, ticket=a.ticket.token)))  # ignored
    await flow.idle()
    assert a.ticket.lease_deadline_ns == flow.now_ns + 3 * 1_000_000_000
    await flow.advance(2)
    assert a.outcome is None  # renewed
    stream.put_nowait(_message(log_entry(status=200, tx_s=0.01, rx_s=0.51, ticket=a.ticket.token)))
    await flow.idle()
    assert a.outcome is Outcome.SERVED and a.ticket.first_byte_s == pytest.approx(0.5)
    assert b.granted
    stream.put_nowait(None)  # Envoy's stream ends: the grant it carried is gone with it
    await flow.idle()
    assert call.done() and call.result() == als_pb2.StreamAccessLogsResponse()
    assert b.outcome is Outcome.PROXY_GONE


@virtual_time
async def test_a_broken_entry_does_not_end_the_stream() -> None:
    flow = Flow()
    a = await flow.arrive("a", model="a")
    original = flow.coordinator.report
    calls: list[str] = []

    def report(token: str, report: ExchangeReport) -> None:  # fails on the first entry only
        calls.append(token)
        if len(calls) == 1:
            raise RuntimeError("a bug handling one entry")
        original(token, report)

    flow.coordinator.report = report  # type: ignore[method-assign]

    async def messages() -> AsyncIterator[als_pb2.StreamAccessLogsMessage]:
        yield _message(log_entry(accesslog_pb2.DownstreamPeriodic, ticket=a.ticket.token))
        yield _message(log_entry(ticket=a.ticket.token, status=200))

    await AccessLogs(flow.coordinator).StreamAccessLogs(messages(), FakeServicerContext("another-peer"))
    await flow.idle()
    assert calls == [a.ticket.token, a.ticket.token]
    assert a.outcome is Outcome.SERVED


# -- ext_authz -------------------------------------------------------------------------------


def value_of(**kind: object) -> struct_pb2.Value:
    value = struct_pb2.Value()
    [(name, content)] = kind.items()
    if name == "struct_value":
        value.struct_value.update(content)  # type: ignore[arg-type]
    elif name == "list_value":
        value.list_value.extend(content)  # type: ignore[arg-type]
    else:
        setattr(value, name, content)
    return value


@pytest.mark.parametrize(("model", "expected"), [
    (value_of(string_value="llama-3"), "llama-3"),
    (value_of(string_value="x" * MAX_MODEL_NAME), "x" * MAX_MODEL_NAME),
    (value_of(string_value="x" * (MAX_MODEL_NAME + 1)), None),
    (value_of(string_value=""), None),
    (value_of(string_value=" "), " "),
    (value_of(string_value="модель"), "модель"),
    (value_of(number_value=7), None),
    (value_of(bool_value=True), None),
    (value_of(null_value=struct_pb2.NULL_VALUE), None),
    (value_of(struct_value={"name": "m"}), None),
    (value_of(list_value=["m"]), None),
    (struct_pb2.Value(), None),  # no kind set at all
])
def test_model_of(model: struct_pb2.Value, expected: str | None) -> None:
    assert model_of(check_request(model=model)) == expected


def test_model_of_without_the_namespace_or_the_key() -> None:
    assert model_of(check_request()) is None
    assert model_of(check_request(model="m", namespace="some.other.filter")) is None
    request = check_request()
    request.attributes.metadata_context.filter_metadata[MODEL_NAMESPACE].fields["not_model"].string_value = "m"
    assert model_of(request) is None
    assert MODEL_NAMESPACE == "llamaswap"


def _decision() -> Decision:
    return Decision(request_id="tok", priority=-7, band=Band.NORMAL, score=12.34567, arrival_ns=1_000_000_000,
                    granted_ns=3_523_460_000, model="m", swap_affinity=True, aging=0.1, load=False, swap=False,
                    residents_before=frozenset({"m"}), reordered_by=frozenset(), overtook=(), queue_depth_after=0)


def test_granted_carries_the_decision_headers_and_the_ticket() -> None:
    ticket = Ticket("secret-token", Arrival("r", None, None, "m", PEER, None, None),
                    Priority(-7, PrioritySource.NUMBER), 1_000_000_000)
    ticket.decision = _decision()
    response = granted(ticket)
    assert response.status.code == code_pb2.OK
    assert response.WhichOneof("http_response") == "ok_response"
    headers = [(h.header.key, h.header.value) for h in response.ok_response.response_headers_to_add]
    assert headers == [("x-llamaswap-priority", "-7"), ("x-llamaswap-band", "normal"),
                       ("x-llamaswap-score", "12.346"), ("x-llamaswap-queue-wait-ms", "2523.5")]
    assert headers == decision_headers(ticket.decision)
    for option in response.ok_response.response_headers_to_add:
        assert option.append_action == base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
        assert option.header.raw_value == b""  # ext_authz reads `value`
    # For Envoy's route: the one upstream (the core's decision names none yet).
    (upstream,) = response.ok_response.headers
    assert (upstream.header.key, upstream.header.value) == ("x-llamaswap-upstream", "gpu0")
    assert upstream.append_action == base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
    assert dict(response.dynamic_metadata) == {TICKET_KEY: "secret-token"}


class _DecisionOn:
    """A decision that names the upstream it runs on (the core's Decision.gpu)."""

    def __init__(self, decision: Decision, gpu: str) -> None:
        self._decision, self.gpu = decision, gpu

    def __getattr__(self, name: str) -> Any:
        return getattr(self._decision, name)


def test_granted_names_the_decisions_upstream_for_envoys_route() -> None:
    ticket = Ticket("t", Arrival("r", None, None, "m", PEER, None, None), Priority(-7, PrioritySource.NUMBER), 0)
    ticket.decision = _DecisionOn(_decision(), "gpu1")  # type: ignore[assignment]
    (upstream,) = granted(ticket).ok_response.headers
    assert (upstream.header.key, upstream.header.value) == ("x-llamaswap-upstream", "gpu1")


@pytest.mark.parametrize("refusal", [
    Refusal(Outcome.REJECTED_FULL, 13, queue_depth=4, queue_limit=4),
    Refusal(Outcome.REJECTED_UNKNOWN_MODEL, model="nope"),
    Refusal(Outcome.EXPIRED, 7, max_wait_s=30.0),
    Refusal(Outcome.SHUTDOWN, 5),
    Refusal(Outcome.INTERNAL_ERROR),
])
def test_denied_is_an_openai_error(refusal: Refusal) -> None:
    response = denied(refusal)
    error, body = http_error(refusal)
    assert response.status.code == code_pb2.PERMISSION_DENIED and response.status.message == error.code
    assert response.WhichOneof("http_response") == "denied_response"
    assert response.denied_response.status.code == error.status
    headers = {h.header.key: h.header.value for h in response.denied_response.headers}
    expected = {"content-type": "application/json", "x-llamaswap-outcome": refusal.outcome.value}
    if refusal.retry_after_s is not None:
        expected["retry-after"] = str(refusal.retry_after_s)
        expected["retry-after-ms"] = str(refusal.retry_after_s * 1000)  # what the OpenAI SDKs read first
    if refusal.outcome is Outcome.REJECTED_UNKNOWN_MODEL:
        expected["x-should-retry"] = "false"  # the same model is unknown next time too
    assert headers == expected
    document = json.loads(response.denied_response.body)
    assert document == json.loads(body)
    assert set(document) == {"error"} and set(document["error"]) == {"message", "type", "param", "code"}
    assert document["error"]["type"] == error.error_type and document["error"]["code"] == error.code


def test_arrival_reads_the_headers_the_peer_and_the_trace() -> None:
    flow_config = {"security": {"priority": {"trustedHeader": "X-Tier"}}}
    from llamaswap.config import parse_config
    from llamaswap.runtime.coordinator import Coordinator

    coordinator = Coordinator(parse_config(flow_config), observe_after_grant=False)
    servicer = Authorization(coordinator)
    request = check_request({"x-request-id": "req-9", "x-llamaswap-priority": "batch", "x-tier": "interactive",
                             "authorization": "Bearer secret"}, model="m", http_id="stream-3")
    context = FakeServicerContext("ipv4:10.1.2.3:4567", (("traceparent", "00-" + "a" * 32 + "-" + "b" * 16 + "-01"),
                                                          ("tracestate", "k=v"), ("user-agent", "grpc-c++")))
    assert servicer._arrival(request, context) == Arrival(  # type: ignore[arg-type]
        request_id="req-9", priority_header="batch", trusted_header="interactive", model="m",
        peer="ipv4:10.1.2.3:4567", trace_parent="00-" + "a" * 32 + "-" + "b" * 16 + "-01", trace_state="k=v",
        method="POST", path="/v1/chat/completions")
    # Without the request id header: Envoy's stream id. Without metadata: no trace. Binary values: ignored.
    bare = servicer._arrival(check_request({}, http_id="stream-4"),  # type: ignore[arg-type]
                             FakeServicerContext("p", (("traceparent", b"\x00\x01"),)))
    assert bare == Arrival("stream-4", None, None, None, "p", None, None, "POST", "/v1/chat/completions")


def test_arrival_reads_the_size_asked_and_whether_it_streams() -> None:
    from google.protobuf import struct_pb2
    from llamaswap.config import parse_config
    from llamaswap.runtime.coordinator import Coordinator

    servicer = Authorization(Coordinator(parse_config({}), observe_after_grant=False))

    def arrival(**fields: struct_pb2.Value) -> Arrival:
        request = check_request({})
        for key, value in fields.items():
            request.attributes.metadata_context.filter_metadata["llamaswap"].fields[key].CopyFrom(value)
        return servicer._arrival(request, FakeServicerContext())  # type: ignore[arg-type]

    number, flag, text = (lambda n: struct_pb2.Value(number_value=n)), (lambda b: struct_pb2.Value(bool_value=b)), (
        lambda t: struct_pb2.Value(string_value=t))
    assert arrival(max_tokens=number(200)).max_tokens == 200
    assert arrival(n_predict=number(64)).max_tokens == 64
    assert arrival(max_completion_tokens=number(32)).max_tokens == 32
    assert arrival(max_tokens=number(8), n_predict=number(64)).max_tokens == 8  # OpenAI's name first
    # Not a count: absent, a string, unlimited (-1), zero, or absurd.
    for value in (text("200"), number(-1), number(0), number(1e12)):
        assert arrival(max_tokens=value).max_tokens is None
    assert arrival(stream=flag(True)).streamed is True
    assert arrival(stream=flag(False)).streamed is False
    assert arrival(stream=text("true")).streamed is False
    assert arrival().streamed is False and arrival().max_tokens is None


def test_arrival_ignores_a_trusted_header_that_is_not_configured() -> None:
    from llamaswap.config import parse_config
    from llamaswap.runtime.coordinator import Coordinator

    servicer = Authorization(Coordinator(parse_config({}), observe_after_grant=False))
    arrival = servicer._arrival(check_request({"x-tier": "500"}), FakeServicerContext())  # type: ignore[arg-type]
    assert arrival.trusted_header is None


@virtual_time
async def test_the_check_servicer_answers_when_the_gpu_is_granted() -> None:
    flow = Flow()
    authz = Authorization(flow.coordinator)
    first = asyncio.ensure_future(authz.Check(check_request({"x-request-id": "one"}, model="a"), FakeServicerContext()))
    second = asyncio.ensure_future(authz.Check(check_request({"x-request-id": "two"}, model="a"),
                                               FakeServicerContext()))
    await flow.idle()
    assert first.done() and not second.done()  # the second Check is held
    token = CheckResponse.FromString(first.result()).dynamic_metadata[TICKET_KEY]
    flow.coordinator.report(token, ExchangeReport(final=True, end=ExchangeEnd.COMPLETE, status=200, first_byte_s=None))
    await flow.idle()
    assert second.done() and CheckResponse.FromString(second.result()).status.code == code_pb2.OK
    flow.coordinator.stop_admitting()
    refused = CheckResponse.FromString(
        await authz.Check(check_request({"x-request-id": "three"}, model="a"), FakeServicerContext()))
    assert refused.denied_response.status.code == 503
    assert {h.header.key: h.header.value for h in refused.denied_response.headers}["retry-after"] == "5"


@virtual_time
async def test_the_check_servicer_answers_500_on_an_internal_error() -> None:
    flow = Flow(observers=[RaisesOnEnqueue("boom")])
    authz = Authorization(flow.coordinator)
    await flow.arrive("blocker", model="a")
    response = CheckResponse.FromString(
        await authz.Check(check_request({"x-request-id": "boom"}, model="a"), FakeServicerContext()))
    assert response.denied_response.status.code == 500
    assert json.loads(response.denied_response.body)["error"]["code"] == "internal_error"
    assert flow.recorder.tickets["boom"].outcome is Outcome.INTERNAL_ERROR


@virtual_time
async def test_a_cancelled_check_propagates_the_cancellation() -> None:
    flow = Flow()
    authz = Authorization(flow.coordinator)
    await flow.arrive("blocker", model="a")
    call = asyncio.ensure_future(authz.Check(check_request({"x-request-id": "gone"}, model="a"),
                                             FakeServicerContext()))
    await flow.idle()
    call.cancel()
    await flow.idle()
    assert call.cancelled()
    assert flow.recorder.tickets["gone"].outcome is Outcome.CANCELLED_WAITING


# -- outcomes --------------------------------------------------------------------------------


def test_the_outcome_table() -> None:
    table = {outcome: (e.status, e.error_type, e.code, e.param) for outcome, e in REFUSALS.items()}
    assert table == {
        Outcome.REJECTED_FULL: (429, "rate_limit_error", "queue_full", None),
        Outcome.REJECTED_UNKNOWN_MODEL: (404, "invalid_request_error", "model_not_found", "model"),
        Outcome.EXPIRED: (503, "server_error", "queue_wait_expired", None),
        Outcome.SHUTDOWN: (503, "server_error", "shutting_down", None),
        Outcome.UPSTREAM_ERROR: (503, "server_error", "model_unload_failed", None),
        Outcome.INTERNAL_ERROR: (500, "server_error", "internal_error", None),
        Outcome.CANCELLED_WAITING: (499, "invalid_request_error", "cancelled", None),
    }


def test_the_messages_name_the_numbers() -> None:
    assert http_error(Refusal(Outcome.REJECTED_FULL, 13, queue_depth=4, queue_limit=4))[0].message(
        Refusal(Outcome.REJECTED_FULL, 13, queue_depth=4, queue_limit=4)) == (
        "the GPU queue is full (4 requests waiting, routing.scheduler.maxQueued is 4); retry after 13 s")
    _, body = http_error(Refusal(Outcome.EXPIRED, 7, max_wait_s=30.0))
    assert json.loads(body)["error"]["message"] == (
        "waited longer than routing.scheduler.maxWaitSeconds (30 s) for the GPU; retry after 7 s")
    _, body = http_error(Refusal(Outcome.REJECTED_UNKNOWN_MODEL, model="nope"))
    assert json.loads(body)["error"] == {
        "message": "the model 'nope' does not exist here: the upstream does not serve it "
                   "(GET /v1/models lists what it serves)",
        "type": "invalid_request_error", "param": "model", "code": "model_not_found"}
    _, body = http_error(Refusal(Outcome.UPSTREAM_ERROR, 4, model="c", evicting="a"))
    assert json.loads(body)["error"]["message"] == (
        "the upstream did not unload the model 'a' to make room for 'c' on its GPU; retry after 4 s")


@pytest.mark.parametrize("outcome", [o for o in Outcome if o not in REFUSALS])
def test_an_outcome_without_a_row_is_answered_as_internal_error(outcome: Outcome) -> None:
    error, body = http_error(Refusal(outcome))
    assert error is REFUSALS[Outcome.INTERNAL_ERROR]
    assert json.loads(body)["error"]["code"] == "internal_error"


REFUSED = [(s, o) for s, o in ENDINGS if s.__name__ in (
    "refused_full", "unknown_model", "expired", "shutdown_waiting", "shutdown_arriving")]


@pytest.mark.parametrize(("scenario", "outcome"), REFUSED, ids=[s.__name__ for s, _ in REFUSED])
@virtual_time
async def test_every_refusal_the_coordinator_makes_has_a_row(scenario: Scenario, outcome: Outcome) -> None:
    flow = Flow({"routing": {"scheduler": {"maxQueued": 1, "maxWaitSeconds": 2, "maxRunSeconds": 4}}})
    refusal = (await scenario(flow)).refusal
    assert refusal.outcome is outcome and outcome in REFUSALS
    assert denied(refusal).denied_response.status.code == REFUSALS[outcome].status


def test_openai_error_body() -> None:
    assert openai_error_body("m", "t", "c") == b'{"error":{"message":"m","type":"t","param":null,"code":"c"}}'


# -- admin documents -------------------------------------------------------------------------


@virtual_time
async def test_the_queue_and_status_documents() -> None:
    flow = Flow({"envoy": {"leaseSeconds": 1000}})
    await flow.arrive("run", model="a")
    await flow.arrive("wait", "batch", model="b")
    await flow.advance(1)
    document = queue_document(flow.coordinator.view())
    assert document["gpu"] == "running" and document["resident_models"] == ["a"] and document["policy"] == "serial"
    assert document["running"]["request_id"] == "run" and document["running"]["expected_remaining_s"] == 14.0
    assert [row["request_id"] for row in document["waiting"]] == ["wait"]
    assert document["waiting"][0]["estimated_start_s"] == 14.0
    assert document["bands"] == {"interactive": {"depth": 0, "oldest_wait_s": 0.0},
                                 "normal": {"depth": 0, "oldest_wait_s": 0.0},
                                 "batch": {"depth": 1, "oldest_wait_s": 1.0}}
    assert json.loads(json.dumps(document)) == document
    assert status_document(flow.coordinator, "wait") == {
        "request_id": "wait", "state": "waiting", "position": 1, "priority": -100, "band": "batch",
        "score": pytest.approx(-100 + 1 / 60), "waited_s": 1.0, "estimated_start_s": 14.0,
        "line": None}  # (not a Batch API line: tests/test_line_progress.py)
    running = status_document(flow.coordinator, "run")
    assert running["state"] == "running" and running["position"] == 0 and running["running_s"] == 1.0
    assert status_document(flow.coordinator, "nobody") is None
    tokens = {r.ticket.token for r in flow.requests.values()}
    assert not any(token in json.dumps(document) for token in tokens)


async def _status_route(flow: Flow, request_id: str, history: Any = None) -> tuple[int, dict]:
    """GET STATUS_PREFIX{id} through the admin app's own router (what Envoy's listener reaches)."""
    from aiohttp.test_utils import make_mocked_request

    from llamaswap.adapters.admin import build_admin_app
    from llamaswap.envoy.contract import STATUS_PREFIX
    from llamaswap.runtime.activity import ActivityLog

    app = build_admin_app(flow.coordinator, ActivityLog(flow.clock, capacity=0), history=history)
    request = make_mocked_request("GET", STATUS_PREFIX + request_id, app=app)
    match = await app.router.resolve(request)
    request._match_info = match
    match.add_app(app)
    response = await match.handler(request)
    return response.status, json.loads(response.body)


@virtual_time
async def test_the_public_status_route_answers_only_what_its_client_needs() -> None:
    flow = Flow({"envoy": {"leaseSeconds": 1000}})
    await flow.arrive("run", model="a")
    await flow.arrive("wait", "batch", model="b")
    await flow.advance(1)
    assert await _status_route(flow, "wait") == (200, {
        "request_id": "wait", "state": "waiting", "position": 1, "estimated_start_s": 14.0})
    assert await _status_route(flow, "run") == (200, {
        "request_id": "run", "state": "running", "position": 0, "estimated_start_s": 0.0})
    status, body = await _status_route(flow, "nobody")
    assert status == 404 and body["error"]["code"] == "request_not_found"


@virtual_time
async def test_the_status_route_answers_for_a_finished_request_from_the_history() -> None:
    from llamaswap.runtime.activity import ActivityLog
    from llamaswap.runtime.history import History

    clock = current_loop().clock
    history = History(clock, ActivityLog(clock, capacity=0))
    flow = Flow({"envoy": {"leaseSeconds": 1000}}, observers=(history,))
    run = await flow.arrive("run", model="a")
    await flow.arrive("wait", "batch", model="a")
    gone = await flow.arrive("gone", model="a")
    await flow.advance(2)
    await flow.cancel(gone)
    await flow.complete(run)
    assert await _status_route(flow, "run", history) == (200, {
        "request_id": "run", "state": "finished", "position": None, "estimated_start_s": None,
        "outcome": "served", "waited_s": 0.0})
    status, body = await _status_route(flow, "gone", history)
    assert (status, body["outcome"], body["waited_s"]) == (200, "cancelled_waiting", 2.0)
    assert (await _status_route(flow, "wait", history))[1]["state"] == "running"  # the live one first
    assert (await _status_route(flow, "run"))[0] == 404  # without the history: only the live ones
    assert (await _status_route(flow, "nobody", history))[0] == 404


@virtual_time
async def test_a_reused_request_id_does_not_hide_the_first_request() -> None:
    flow = Flow({"envoy": {"leaseSeconds": 1000}})
    running = await flow.arrive("run", model="a")
    await flow.arrive("same", "batch", model="b")
    second = await flow.arrive("same", "interactive", model="b")  # another client, the same id, ahead of it
    await flow.advance(1)
    ticket, row = flow.coordinator.status_of("same")
    # Flow's Request.ticket is by id, ambiguous here: tell the two by their priorities.
    assert ticket.priority.value == -100 and row.position == 2  # the first one's place, not the second's (1)
    assert (await _status_route(flow, "same"))[1]["position"] == 2
    await flow.complete(running)
    assert second.granted and second.ticket.priority.value == 100
    ticket, row = flow.coordinator.status_of("same")
    assert ticket.priority.value == -100 and row.position == 1  # still the first's record while it lives
    first = ticket
    await flow.complete(second)
    assert flow.coordinator.status_of("same")[0] is first and first.decision is not None
    await flow.end(first.token, ExchangeEnd.COMPLETE, 200)
    assert flow.coordinator.status_of("same") is None


@virtual_time
async def test_the_later_request_with_a_reused_id_is_named_once_the_first_ends() -> None:
    flow = Flow({"envoy": {"leaseSeconds": 1000}})
    first = await flow.arrive("same", model="a")
    second = await flow.arrive("same", model="a")
    assert flow.coordinator.status_of("same")[0] is first.ticket
    await flow.complete(first)
    assert second.granted and flow.coordinator.status_of("same")[0] is second.ticket


@virtual_time
async def test_with_fail_open_the_sidecar_holds_the_stream_limit_itself() -> None:
    from llamaswap.adapters.outcomes import http_error
    from llamaswap.core import Outcome

    flow = Flow({"envoy": {"leaseSeconds": 1000, "failOpen": True, "maxSidecarStreams": 2}})
    first = await flow.arrive("a")  # granted: its Check is answered, its stream free
    waiting = [await flow.arrive("b"), await flow.arrive("c")]
    over = await flow.arrive("d")
    assert first.granted and all(r.waiting for r in waiting)
    assert over.refusal.outcome is Outcome.REJECTED_FULL
    error, body = http_error(over.refusal)
    assert error.status == 429 and b"envoy.maxSidecarStreams is 2" in body
    closed = Flow({"envoy": {"leaseSeconds": 1000, "maxSidecarStreams": 2}})  # Envoy's breaker answers 503
    await closed.arrive("a")
    assert all([(await closed.arrive(x)).waiting for x in "bcd"])
