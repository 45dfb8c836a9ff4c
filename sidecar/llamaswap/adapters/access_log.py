"""Envoy's gRPC access log: how the sidecar learns that a granted exchange still runs and when
it ended. One stream per Envoy worker (opened at that worker's first entry); only exchanges
that carry a grant's ticket are logged (the bootstrap's metadata filter).

Each entry is turned into an `ExchangeReport` in the runtime's terms: periodic entries renew
the grant's lease, the final one ends it, with what Envoy's response flags say about how. The
end of a stream means that Envoy connection is gone, and with it the grant it was carrying.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import AsyncIterator

import grpc
from google.protobuf import duration_pb2, timestamp_pb2

from llamaswap._proto.envoy.data.accesslog.v3 import accesslog_pb2
from llamaswap._proto.envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc
from llamaswap.envoy.contract import GRANT_NAMESPACE, TICKET_KEY, gpu_of_cluster
from llamaswap.runtime.coordinator import Coordinator
from llamaswap.runtime.ticket import ExchangeEnd, ExchangeReport, new_exchange_report
from llamaswap.adapters.metadata import namespace_fields

_log = logging.getLogger(__name__)

_PERIODIC = accesslog_pb2.DownstreamPeriodic
_END = accesslog_pb2.DownstreamEnd
_REPORTED = frozenset((_PERIODIC, _END, accesslog_pb2.NotSet))
# The few upstream clusters' GPU names, found once each (a bound: the cluster name is Envoy's).
_gpu_of_cluster = functools.lru_cache(maxsize=256)(gpu_of_cluster)


def _ns(value: timestamp_pb2.Timestamp | duration_pb2.Duration) -> int:
    return value.seconds * 1_000_000_000 + value.nanos


def ticket_of(entry: accesslog_pb2.HTTPAccessLogEntry) -> str | None:
    """The grant's ticket the OK put into ext_authz's metadata; None without a non-empty string
    there (a value of another JSON kind reads as "")."""
    fields = namespace_fields(entry.common_properties.metadata, GRANT_NAMESPACE)
    return (fields[TICKET_KEY].string_value or None) if fields is not None and TICKET_KEY in fields else None


def exchange_end(entry: accesslog_pb2.HTTPAccessLogEntry, status: int) -> ExchangeEnd:
    """How the exchange ended, from Envoy's response flags and timings."""
    common = entry.common_properties
    return _end_of(common, status, common.HasField("time_to_first_upstream_tx_byte"))


def _end_of(common: accesslog_pb2.AccessLogCommon, status: int, sent: bool) -> ExchangeEnd:
    """`exchange_end` of an entry's common properties, `sent` whether it has a first upstream byte."""
    if not common.HasField("response_flags") or not common.response_flags.ListFields():
        # No flag set, the usual end: the rules below without reading each flag (a tenth of the time).
        if not sent:
            return ExchangeEnd.NOT_SENT
        return ExchangeEnd.UPSTREAM_FAILED if status == 0 else ExchangeEnd.COMPLETE
    flags = common.response_flags
    # The client leaving comes first: even before the request reached the upstream, it was the
    # client who ended the exchange (and a settle that finds the upstream idle costs one ask).
    if flags.downstream_connection_termination or flags.downstream_remote_reset:
        return ExchangeEnd.CLIENT_LEFT
    if (flags.upstream_connection_failure or flags.no_healthy_upstream or flags.upstream_overflow
            or flags.no_route_found or flags.no_cluster_found or flags.dns_resolution_failure
            or flags.overload_manager or not sent):
        return ExchangeEnd.NOT_SENT
    if (status == 0 or flags.upstream_remote_reset or flags.upstream_connection_termination
            or flags.upstream_request_timeout or flags.local_reset or flags.upstream_protocol_error
            or flags.stream_idle_timeout or flags.duration_timeout or flags.upstream_max_stream_duration_reached):
        return ExchangeEnd.UPSTREAM_FAILED
    return ExchangeEnd.COMPLETE


def report_of(entry: accesslog_pb2.HTTPAccessLogEntry, now_unix_ns: int | None = None) -> ExchangeReport | None:
    """The entry in the runtime's terms; `now_unix_ns` (the wall clock by default) dates it, so that
    the exchange's age can be read from Envoy's timings (the same host's clock).

    The age counts from the request's first byte sent to the upstream, i.e. from its grant:
    start_time is its arrival, and the queue wait before the grant is no generation time. An
    entry with a start time but no upstream byte yet is an exchange that has not reached the
    upstream: age 0."""
    common = entry.common_properties
    kind = common.access_log_type
    if kind not in _REPORTED:
        return None
    # Each timing read once (a protobuf field access builds a new wrapper each time), and its
    # nanoseconds computed here: the well-known types' ToNanoseconds validates in Python first.
    sent = common.HasField("time_to_first_upstream_tx_byte")
    to_upstream = _ns(common.time_to_first_upstream_tx_byte) if sent else None
    elapsed_s = None
    if common.HasField("start_time"):
        now_ns = time.time_ns() if now_unix_ns is None else now_unix_ns
        started_ns = now_ns if to_upstream is None else _ns(common.start_time) + to_upstream
        elapsed_s = max(0, now_ns - started_ns) / 1e9
    first_byte_s = None
    if to_upstream is not None and common.HasField("time_to_first_upstream_rx_byte"):
        first_byte_s = max(0, _ns(common.time_to_first_upstream_rx_byte) - to_upstream) / 1e9
    # The GPU whose cluster the route chose (the OK's x-llamaswap-upstream).
    gpu = _gpu_of_cluster(common.upstream_cluster)
    # (Every field, in order: `new_exchange_report`, on every entry.)
    if kind == _PERIODIC:
        return new_exchange_report(False, None, 0, first_byte_s, elapsed_s, gpu)  # final, end, status
    status = entry.response.response_code.value  # an absent wrapper reads as 0: no response
    return new_exchange_report(True, _end_of(common, status, sent), status, first_byte_s, elapsed_s, gpu)


class AccessLogs(als_pb2_grpc.AccessLogServiceServicer):
    def __init__(self, coordinator: Coordinator) -> None:
        self._coordinator = coordinator

    async def StreamAccessLogs(  # noqa: N802 - the gRPC method name
        self, request_iterator: AsyncIterator[als_pb2.StreamAccessLogsMessage], context: grpc.aio.ServicerContext
    ) -> als_pb2.StreamAccessLogsResponse:
        coordinator = self._coordinator
        peer = context.peer()
        try:
            async for message in request_iterator:
                for entry in message.http_logs.log_entry:
                    try:
                        ticket = ticket_of(entry)
                        report = report_of(entry) if ticket is not None else None
                        if ticket is not None and report is not None:
                            coordinator.report(ticket, report)
                    except Exception:  # noqa: BLE001 - one bad entry must not end the stream
                        _log.exception("access-log entry could not be handled")
        finally:
            # However the stream ended (Envoy stopped, killed, or its connection broke), the
            # exchange that connection carried is gone with it.
            coordinator.peer_gone(peer)
        return als_pb2.StreamAccessLogsResponse()
