import datetime

from llamaswap._proto.envoy.config.core.v3 import base_pb2 as _base_pb2
from google.protobuf import duration_pb2 as _duration_pb2
from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf import wrappers_pb2 as _wrappers_pb2
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class AccessLogType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    NotSet: _ClassVar[AccessLogType]
    TcpUpstreamConnected: _ClassVar[AccessLogType]
    TcpPeriodic: _ClassVar[AccessLogType]
    TcpConnectionStart: _ClassVar[AccessLogType]
    TcpConnectionEnd: _ClassVar[AccessLogType]
    DownstreamStart: _ClassVar[AccessLogType]
    DownstreamPeriodic: _ClassVar[AccessLogType]
    DownstreamEnd: _ClassVar[AccessLogType]
    UpstreamPoolReady: _ClassVar[AccessLogType]
    UpstreamPeriodic: _ClassVar[AccessLogType]
    UpstreamEnd: _ClassVar[AccessLogType]
    DownstreamTunnelSuccessfullyEstablished: _ClassVar[AccessLogType]
    UdpTunnelUpstreamConnected: _ClassVar[AccessLogType]
    UdpPeriodic: _ClassVar[AccessLogType]
    UdpSessionEnd: _ClassVar[AccessLogType]
NotSet: AccessLogType
TcpUpstreamConnected: AccessLogType
TcpPeriodic: AccessLogType
TcpConnectionStart: AccessLogType
TcpConnectionEnd: AccessLogType
DownstreamStart: AccessLogType
DownstreamPeriodic: AccessLogType
DownstreamEnd: AccessLogType
UpstreamPoolReady: AccessLogType
UpstreamPeriodic: AccessLogType
UpstreamEnd: AccessLogType
DownstreamTunnelSuccessfullyEstablished: AccessLogType
UdpTunnelUpstreamConnected: AccessLogType
UdpPeriodic: AccessLogType
UdpSessionEnd: AccessLogType

class HTTPAccessLogEntry(_message.Message):
    __slots__ = ("common_properties", "response")
    COMMON_PROPERTIES_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    common_properties: AccessLogCommon
    response: HTTPResponseProperties
    def __init__(self, common_properties: _Optional[_Union[AccessLogCommon, _Mapping]] = ..., response: _Optional[_Union[HTTPResponseProperties, _Mapping]] = ...) -> None: ...

class AccessLogCommon(_message.Message):
    __slots__ = ("start_time", "time_to_last_rx_byte", "time_to_first_upstream_tx_byte", "time_to_last_upstream_tx_byte", "time_to_first_upstream_rx_byte", "time_to_last_upstream_rx_byte", "time_to_first_downstream_tx_byte", "time_to_last_downstream_tx_byte", "upstream_cluster", "response_flags", "metadata", "duration", "upstream_request_attempt_count", "access_log_type")
    START_TIME_FIELD_NUMBER: _ClassVar[int]
    TIME_TO_LAST_RX_BYTE_FIELD_NUMBER: _ClassVar[int]
    TIME_TO_FIRST_UPSTREAM_TX_BYTE_FIELD_NUMBER: _ClassVar[int]
    TIME_TO_LAST_UPSTREAM_TX_BYTE_FIELD_NUMBER: _ClassVar[int]
    TIME_TO_FIRST_UPSTREAM_RX_BYTE_FIELD_NUMBER: _ClassVar[int]
    TIME_TO_LAST_UPSTREAM_RX_BYTE_FIELD_NUMBER: _ClassVar[int]
    TIME_TO_FIRST_DOWNSTREAM_TX_BYTE_FIELD_NUMBER: _ClassVar[int]
    TIME_TO_LAST_DOWNSTREAM_TX_BYTE_FIELD_NUMBER: _ClassVar[int]
    UPSTREAM_CLUSTER_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FLAGS_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    DURATION_FIELD_NUMBER: _ClassVar[int]
    UPSTREAM_REQUEST_ATTEMPT_COUNT_FIELD_NUMBER: _ClassVar[int]
    ACCESS_LOG_TYPE_FIELD_NUMBER: _ClassVar[int]
    start_time: _timestamp_pb2.Timestamp
    time_to_last_rx_byte: _duration_pb2.Duration
    time_to_first_upstream_tx_byte: _duration_pb2.Duration
    time_to_last_upstream_tx_byte: _duration_pb2.Duration
    time_to_first_upstream_rx_byte: _duration_pb2.Duration
    time_to_last_upstream_rx_byte: _duration_pb2.Duration
    time_to_first_downstream_tx_byte: _duration_pb2.Duration
    time_to_last_downstream_tx_byte: _duration_pb2.Duration
    upstream_cluster: str
    response_flags: ResponseFlags
    metadata: _base_pb2.Metadata
    duration: _duration_pb2.Duration
    upstream_request_attempt_count: int
    access_log_type: AccessLogType
    def __init__(self, start_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., time_to_last_rx_byte: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., time_to_first_upstream_tx_byte: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., time_to_last_upstream_tx_byte: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., time_to_first_upstream_rx_byte: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., time_to_last_upstream_rx_byte: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., time_to_first_downstream_tx_byte: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., time_to_last_downstream_tx_byte: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., upstream_cluster: _Optional[str] = ..., response_flags: _Optional[_Union[ResponseFlags, _Mapping]] = ..., metadata: _Optional[_Union[_base_pb2.Metadata, _Mapping]] = ..., duration: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., upstream_request_attempt_count: _Optional[int] = ..., access_log_type: _Optional[_Union[AccessLogType, str]] = ...) -> None: ...

class ResponseFlags(_message.Message):
    __slots__ = ("failed_local_healthcheck", "no_healthy_upstream", "upstream_request_timeout", "local_reset", "upstream_remote_reset", "upstream_connection_failure", "upstream_connection_termination", "upstream_overflow", "no_route_found", "delay_injected", "fault_injected", "rate_limited", "rate_limit_service_error", "downstream_connection_termination", "upstream_retry_limit_exceeded", "stream_idle_timeout", "invalid_envoy_request_headers", "downstream_protocol_error", "upstream_max_stream_duration_reached", "response_from_cache_filter", "no_filter_config_found", "duration_timeout", "upstream_protocol_error", "no_cluster_found", "overload_manager", "dns_resolution_failure", "downstream_remote_reset")
    FAILED_LOCAL_HEALTHCHECK_FIELD_NUMBER: _ClassVar[int]
    NO_HEALTHY_UPSTREAM_FIELD_NUMBER: _ClassVar[int]
    UPSTREAM_REQUEST_TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    LOCAL_RESET_FIELD_NUMBER: _ClassVar[int]
    UPSTREAM_REMOTE_RESET_FIELD_NUMBER: _ClassVar[int]
    UPSTREAM_CONNECTION_FAILURE_FIELD_NUMBER: _ClassVar[int]
    UPSTREAM_CONNECTION_TERMINATION_FIELD_NUMBER: _ClassVar[int]
    UPSTREAM_OVERFLOW_FIELD_NUMBER: _ClassVar[int]
    NO_ROUTE_FOUND_FIELD_NUMBER: _ClassVar[int]
    DELAY_INJECTED_FIELD_NUMBER: _ClassVar[int]
    FAULT_INJECTED_FIELD_NUMBER: _ClassVar[int]
    RATE_LIMITED_FIELD_NUMBER: _ClassVar[int]
    RATE_LIMIT_SERVICE_ERROR_FIELD_NUMBER: _ClassVar[int]
    DOWNSTREAM_CONNECTION_TERMINATION_FIELD_NUMBER: _ClassVar[int]
    UPSTREAM_RETRY_LIMIT_EXCEEDED_FIELD_NUMBER: _ClassVar[int]
    STREAM_IDLE_TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    INVALID_ENVOY_REQUEST_HEADERS_FIELD_NUMBER: _ClassVar[int]
    DOWNSTREAM_PROTOCOL_ERROR_FIELD_NUMBER: _ClassVar[int]
    UPSTREAM_MAX_STREAM_DURATION_REACHED_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FROM_CACHE_FILTER_FIELD_NUMBER: _ClassVar[int]
    NO_FILTER_CONFIG_FOUND_FIELD_NUMBER: _ClassVar[int]
    DURATION_TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    UPSTREAM_PROTOCOL_ERROR_FIELD_NUMBER: _ClassVar[int]
    NO_CLUSTER_FOUND_FIELD_NUMBER: _ClassVar[int]
    OVERLOAD_MANAGER_FIELD_NUMBER: _ClassVar[int]
    DNS_RESOLUTION_FAILURE_FIELD_NUMBER: _ClassVar[int]
    DOWNSTREAM_REMOTE_RESET_FIELD_NUMBER: _ClassVar[int]
    failed_local_healthcheck: bool
    no_healthy_upstream: bool
    upstream_request_timeout: bool
    local_reset: bool
    upstream_remote_reset: bool
    upstream_connection_failure: bool
    upstream_connection_termination: bool
    upstream_overflow: bool
    no_route_found: bool
    delay_injected: bool
    fault_injected: bool
    rate_limited: bool
    rate_limit_service_error: bool
    downstream_connection_termination: bool
    upstream_retry_limit_exceeded: bool
    stream_idle_timeout: bool
    invalid_envoy_request_headers: bool
    downstream_protocol_error: bool
    upstream_max_stream_duration_reached: bool
    response_from_cache_filter: bool
    no_filter_config_found: bool
    duration_timeout: bool
    upstream_protocol_error: bool
    no_cluster_found: bool
    overload_manager: bool
    dns_resolution_failure: bool
    downstream_remote_reset: bool
    def __init__(self, failed_local_healthcheck: _Optional[bool] = ..., no_healthy_upstream: _Optional[bool] = ..., upstream_request_timeout: _Optional[bool] = ..., local_reset: _Optional[bool] = ..., upstream_remote_reset: _Optional[bool] = ..., upstream_connection_failure: _Optional[bool] = ..., upstream_connection_termination: _Optional[bool] = ..., upstream_overflow: _Optional[bool] = ..., no_route_found: _Optional[bool] = ..., delay_injected: _Optional[bool] = ..., fault_injected: _Optional[bool] = ..., rate_limited: _Optional[bool] = ..., rate_limit_service_error: _Optional[bool] = ..., downstream_connection_termination: _Optional[bool] = ..., upstream_retry_limit_exceeded: _Optional[bool] = ..., stream_idle_timeout: _Optional[bool] = ..., invalid_envoy_request_headers: _Optional[bool] = ..., downstream_protocol_error: _Optional[bool] = ..., upstream_max_stream_duration_reached: _Optional[bool] = ..., response_from_cache_filter: _Optional[bool] = ..., no_filter_config_found: _Optional[bool] = ..., duration_timeout: _Optional[bool] = ..., upstream_protocol_error: _Optional[bool] = ..., no_cluster_found: _Optional[bool] = ..., overload_manager: _Optional[bool] = ..., dns_resolution_failure: _Optional[bool] = ..., downstream_remote_reset: _Optional[bool] = ...) -> None: ...

class HTTPResponseProperties(_message.Message):
    __slots__ = ("response_code", "response_body_bytes", "response_code_details")
    RESPONSE_CODE_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_BODY_BYTES_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_CODE_DETAILS_FIELD_NUMBER: _ClassVar[int]
    response_code: _wrappers_pb2.UInt32Value
    response_body_bytes: int
    response_code_details: str
    def __init__(self, response_code: _Optional[_Union[_wrappers_pb2.UInt32Value, _Mapping]] = ..., response_body_bytes: _Optional[int] = ..., response_code_details: _Optional[str] = ...) -> None: ...
