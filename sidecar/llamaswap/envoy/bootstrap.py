"""The Envoy bootstrap for a configuration: the one definition, used by `llamaswap up`,
`llamaswap envoy-config` and the Helm chart (whose init container runs `envoy-config`).

The data path (see docs/architecture.md), one held gRPC call per request and no body in
the sidecar:

    buffer -> json_to_metadata -> ext_authz -> router        + the gRPC access log

- buffer reads the whole body first: a clear 413 above the limit, and a slow sender never
  holds a place in the queue while it sends;
- json_to_metadata puts the body's top-level `model` (and `max_tokens` / `max_completion_tokens` /
  `n_predict`, `stream`, `service_tier`, Ollama's `keep_alive`) into dynamic metadata (namespace
  `llamaswap`), keeping its JSON type so that only a string counts as a model;
- ext_authz's Check carries that metadata and a few headers (no body) and is held until the
  scheduler grants the GPU; its OK adds the x-llamaswap-* response headers, names the granted
  upstream in the request header x-llamaswap-upstream (the route then sends the request to that
  upstream's cluster, `upstream-<name>`, and no other) and writes the grant's unguessable ticket
  into dynamic metadata (namespace `envoy.filters.http.ext_authz`);
- the gRPC access log, limited to exchanges that carry a ticket, reports each granted exchange
  every leaseSeconds/3 while it runs (lease renewals) and once when it ends (the release).

Scheduled routes have no route or idle timeout: the wait is bounded by the scheduler
(maxWaitSeconds) and a generation by maxRunSeconds. ext_authz, unlike an ext_proc message, has
no one-hour cap on a held call.
"""

from __future__ import annotations

import ipaddress
import re
from typing import Any, Protocol
from urllib.parse import urlsplit

import yaml

from llamaswap.config import Config, ManagementApi
from llamaswap.core import SHUTDOWN_RETRY_AFTER_S
from llamaswap.envoy.contract import (
    ACCESS_LOG_NAME,
    BATCH_API_PREFIXES,
    AUTHORIZATION_HEADER,
    CLIENT_REQUEST_ID_HEADER,
    CONTENT_LENGTH_HEADER,
    MAX_DIGESTED_BODY,
    RETRY_AFTER_MS_HEADER,
    RETRY_COUNT_HEADER,
    SHOULD_RETRY_HEADER,
    BYPASS_PATHS,
    GRANT_NAMESPACE,
    MANAGEMENT_PATHS,
    MANAGEMENT_PREFIXES,
    METRICS_PATH,
    KEEP_ALIVE_KEY,
    MAX_TOKENS_KEYS,
    MODEL_KEY,
    MODEL_NAMESPACE,
    OBJECTIVE_HEADER,
    OLD_OBJECTIVE_HEADER,
    PICKER_METRICS_PATH,
    PRIORITY_HEADER,
    PROPS_PATH,
    RENEWALS_PER_LEASE,
    REQUEST_ID_HEADER,
    SERVICE_TIER_KEY,
    STATUS_PREFIX,
    STREAM_KEY,
    TICKET_KEY,
    UPSTREAM_HEADER,
    UPSTREAM_METRICS_PATH,
    openai_error_body,
    upstream_cluster,
)
from llamaswap.envoy.overload import heap_budget, overload_manager

# Where a scheduled request goes that names no configured upstream without envoy.failOpen: a
# cluster with no endpoints (503, flag UH). Only a Check's OK names an upstream, and it always
# does, so nothing is ever sent here; it makes sure nothing unscheduled reaches a GPU.
UNROUTED_CLUSTER = "llamaswap_unrouted"
# One request per upstream connection. llama-server (cpp-httplib) gives each open connection one
# of its HTTP threads (--threads-http; the default is --parallel + 4 in the version tested) until
# the connection closes, 5 s after its last request; Envoy keeps a pool per worker, so with W
# workers and N slots it may hold W x N idle connections: past the upstream's threads, a granted
# request's new connection waited unread for up to 5 s (and so did the sidecar's own asks). A new
# loopback connection per request costs about 0.4 ms of handoff (bench/README.md, slots).
UPSTREAM_REQUESTS_PER_CONNECTION = 1
SIDECAR_GRPC_CLUSTER = "llamaswap_grpc"
SIDECAR_ADMIN_CLUSTER = "llamaswap_admin"
OTLP_CLUSTER = "otlp_collector"

BUFFER = "envoy.filters.http.buffer"
JSON_TO_METADATA = "envoy.filters.http.json_to_metadata"
EXT_AUTHZ = "envoy.filters.http.ext_authz"
ROUTER = "envoy.filters.http.router"
HEADER_MUTATION = "envoy.filters.http.header_mutation"

# Request headers by which a client could steer Envoy's router (Envoy's header sanitizing list).
CLIENT_ROUTER_CONTROLS = (
    "x-envoy-retry-on", "x-envoy-retry-grpc-on", "x-envoy-max-retries", "x-envoy-retriable-status-codes",
    "x-envoy-retriable-header-names", "x-envoy-upstream-rq-timeout-ms", "x-envoy-upstream-rq-per-try-timeout-ms",
    "x-envoy-upstream-rq-timeout-alt-response", "x-envoy-expected-rq-timeout-ms", "x-envoy-hedge-on-per-try-timeout",
    "x-envoy-upstream-stream-duration-ms", "x-envoy-upstream-alt-stat-name", "x-envoy-force-trace",
)

# Envoy's admin server by default (`llamaswap envoy-config --admin-port/--admin-host`).
ENVOY_ADMIN_PORT = 9901
ENVOY_ADMIN_HOST = "127.0.0.1"
# A circuit-breaker threshold that never trips (the field is a uint32).
UNLIMITED_STREAMS = 2**32 - 1
# ext_authz's limit on a held Check: 100 days (Envoy accepts it; the scheduler bounds waits).
UNLIMITED_HOLD_S = 8_640_000


class Upstream(Protocol):
    """What the bootstrap reads of an upstream (config's GpuEntry)."""

    @property
    def name(self) -> str: ...
    @property
    def host(self) -> str: ...
    @property
    def port(self) -> int: ...
    @property
    def tls(self) -> bool: ...


def _entries(config: Config) -> tuple[Upstream, ...]:
    """The configuration's upstreams, first one first (`Config.gpu_entries`)."""
    return tuple(config.gpu_entries)


def _duration(seconds: float) -> str:
    return f"{seconds:.3f}s"


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False


def _typed(type_name: str, **fields: Any) -> dict[str, Any]:
    return {"@type": f"type.googleapis.com/{type_name}", **fields}


def _cluster(name: str, host: str, port: int, *, http2: bool = False, buffer_bytes: int | None = None,
             max_requests: int | None = None, tls_sni: str | None = None,
             requests_per_connection: int | None = None) -> dict[str, Any]:
    cluster: dict[str, Any] = {
        "name": name,
        "type": "STATIC" if _is_ip(host) else "STRICT_DNS",
        "connect_timeout": "5s",
        "load_assignment": {
            "cluster_name": name,
            "endpoints": [{"lb_endpoints": [{"endpoint": {"address": {
                "socket_address": {"address": host, "port_value": port}}}}]}],
        },
    }
    if not _is_ip(host):
        cluster["dns_lookup_family"] = "V4_PREFERRED"
    if http2:
        cluster["typed_extension_protocol_options"] = {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": _typed(
                "envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                explicit_http_config={"http2_protocol_options": {
                    "initial_stream_window_size": 16 * 1024 * 1024,
                    "initial_connection_window_size": 64 * 1024 * 1024,
                }}),
        }
    elif requests_per_connection is not None:
        cluster["typed_extension_protocol_options"] = {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": _typed(
                "envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                common_http_protocol_options={"max_requests_per_connection": requests_per_connection},
                explicit_http_config={"http_protocol_options": {}}),
        }
    if buffer_bytes is not None:
        cluster["per_connection_buffer_limit_bytes"] = buffer_bytes
    if max_requests is not None:
        cluster["circuit_breakers"] = {"thresholds": [{
            "priority": "DEFAULT",
            "max_connections": max_requests,
            "max_pending_requests": max_requests,
            "max_requests": max_requests,
            "max_retries": 3,
        }]}
    if tls_sni is not None:
        cluster["transport_socket"] = {
            "name": "envoy.transport_sockets.tls",
            "typed_config": _typed("envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext", sni=tls_sni),
        }
    return cluster


def _unscheduled(route: dict[str, Any]) -> dict[str, Any]:
    """A route that skips the queue: no model lookup, no Check."""
    disabled = _typed("envoy.config.route.v3.FilterConfig", disabled=True)
    route["typed_per_filter_config"] = {JSON_TO_METADATA: disabled, EXT_AUTHZ: disabled}
    return route


def _batch_api_routes() -> list[dict[str, Any]]:
    """The Batch API (`/v1/files`, `/v1/batches`) goes to the sidecar, unscheduled, without the
    buffer filter: an upload of up to batches.maxFileBytes streams through (the sidecar enforces
    the limit), and a line the sidecar feeds comes back through the scheduled routes."""
    routes = []
    for prefix in BATCH_API_PREFIXES:
        route = _unscheduled({"match": {"path_separated_prefix": prefix},
                              "route": {"cluster": SIDECAR_ADMIN_CLUSTER, "timeout": "600s", "idle_timeout": "60s"}})
        route["typed_per_filter_config"][BUFFER] = _typed("envoy.extensions.filters.http.buffer.v3.BufferPerRoute",
                                                          disabled=True)
        routes.append(route)
    return routes


def _http_filters(config: Config) -> list[dict[str, Any]]:
    e = config.envoy
    # The objective header always: routing.objectives may change on a reload, the bootstrap not.
    headers = [PRIORITY_HEADER, REQUEST_ID_HEADER, OBJECTIVE_HEADER, OLD_OBJECTIVE_HEADER]
    trusted = config.security.priority.trusted_header
    if trusted:
        headers.append(trusted)
    retry = _retry_material(config)
    if retry:
        headers += [AUTHORIZATION_HEADER, CLIENT_REQUEST_ID_HEADER, CONTENT_LENGTH_HEADER, RETRY_COUNT_HEADER]
    buffer = {"name": BUFFER, "typed_config": _typed("envoy.extensions.filters.http.buffer.v3.Buffer",
                                                      max_request_bytes=e.max_request_bytes)}
    json_to_metadata = {"name": JSON_TO_METADATA, "typed_config": _typed(
        "envoy.extensions.filters.http.json_to_metadata.v3.JsonToMetadata",
        request_rules={
            # PROTOBUF_VALUE keeps the JSON type: the sidecar takes only a string as a model, a
            # number as a token count, a bool as `stream`, a string as `service_tier`; `keep_alive`
            # is a string or a number (always sent: routing.keepAlive.honour reloads without a restart).
            "rules": [{
                "selectors": [{"key": key}],
                "on_present": {"metadata_namespace": MODEL_NAMESPACE, "key": key, "type": "PROTOBUF_VALUE"},
            } for key in (MODEL_KEY, *MAX_TOKENS_KEYS, STREAM_KEY, SERVICE_TIER_KEY, KEEP_ALIVE_KEY)],
            # Any content type: a body that is not JSON simply has no model (never an error).
            "allow_content_types_regex": {"regex": ".*"},
            "allow_empty_content_type": True,
        })}
    ext_authz = {"name": EXT_AUTHZ, "typed_config": _typed(
        "envoy.extensions.filters.http.ext_authz.v3.ExtAuthz",
        # The sidecar answers a held Check itself (maxWaitSeconds), so Envoy never cuts a hold:
        # a reload may change maxWaitSeconds without a new bootstrap.
        grpc_service={"envoy_grpc": {"cluster_name": SIDECAR_GRPC_CLUSTER}, "timeout": _duration(UNLIMITED_HOLD_S)},
        transport_api_version="V3",
        # The OK's x-llamaswap-upstream must choose the route again (Envoy matched one on arrival).
        clear_route_cache=True,
        failure_mode_allow=e.fail_open,
        status_on_error={"code": "ServiceUnavailable"},
        metadata_context_namespaces=[MODEL_NAMESPACE],
        # Only what scheduling reads: a held Check should cost the sidecar as little as possible.
        allowed_headers={"patterns": [{"exact": name} for name in headers]},
        **({"with_request_body": {
            # routing.retryGraceSeconds: the body's beginning, hashed by the sidecar to know a
            # client's retry (its full length comes in content-length); never stored.
            "max_request_bytes": min(MAX_DIGESTED_BODY, e.max_request_bytes),
            "allow_partial_message": True, "pack_as_bytes": True}} if retry else {}),
    )}
    # A client's router controls (retries, per-try timeouts) would give one grant several upstream
    # attempts. use_remote_address alone does not drop them: Envoy still counts a loopback or
    # RFC1918 client (every pod network) as internal and follows them. Removed before anything.
    strip = {"name": HEADER_MUTATION, "typed_config": _typed(
        "envoy.extensions.filters.http.header_mutation.v3.HeaderMutation",
        mutations={"request_mutations": [{"remove": name} for name in CLIENT_ROUTER_CONTROLS]})}
    router = {"name": ROUTER, "typed_config": _typed("envoy.extensions.filters.http.router.v3.Router")}
    return [strip, buffer, json_to_metadata, ext_authz, router]


def _retry_material(config: Config) -> bool:
    """Whether the Check carries what tells a client's retry (routing.retryGraceSeconds > 0)."""
    return config.routing.retry_grace_seconds > 0


def _early_header_mutations(config: Config) -> dict[str, Any]:
    """Header changes made before Envoy matches a route or makes up a request id.

    A client's x-llamaswap-upstream is removed: Envoy matches the route on arrival, before any
    HTTP filter runs, and keeps that match unless the Check's OK changes a header; with
    envoy.failOpen a failed Check would then send the request wherever the client said.
    routing.retryGraceSeconds: the client's own x-request-id is copied before Envoy makes one up
    for a request that has none, so that the sidecar can tell a client-chosen id; a client's own
    copy of that header is overwritten."""
    mutations: list[dict[str, Any]] = [{"remove": UPSTREAM_HEADER}]
    if _retry_material(config):
        mutations += [{"remove": CLIENT_REQUEST_ID_HEADER}, {"append": {
            "header": {"key": CLIENT_REQUEST_ID_HEADER, "value": f"%REQ({REQUEST_ID_HEADER})%"},
            "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}}]
    return {"early_header_mutation_extensions": [{
        "name": "envoy.http.early_header_mutation.header_mutation",
        "typed_config": _typed(
            "envoy.extensions.http.early_header_mutation.header_mutation.v3.HeaderMutation", mutations=mutations),
    }]}


def _access_log(config: Config) -> dict[str, Any]:
    """The release signal: granted exchanges only (the ticket is in the ext_authz metadata)."""
    return {
        "name": "envoy.access_loggers.http_grpc",
        "filter": {"metadata_filter": {
            "matcher": {"filter": GRANT_NAMESPACE, "path": [{"key": TICKET_KEY}], "value": {"present_match": True}},
            "match_if_key_not_found": False,
        }},
        "typed_config": _typed(
            "envoy.extensions.access_loggers.grpc.v3.HttpGrpcAccessLogConfig",
            common_config={
                "log_name": ACCESS_LOG_NAME,
                "transport_api_version": "V3",
                "grpc_service": {"envoy_grpc": {"cluster_name": SIDECAR_GRPC_CLUSTER}},
                # Every entry as its own message, at once: the release must not wait for a batch.
                "buffer_size_bytes": 0,
                # Entries that end while the sidecar restarts are delivered when it is back.
                "grpc_stream_retry_policy": {"num_retries": 5, "retry_back_off": {
                    "base_interval": "0.1s", "max_interval": "1s"}},
            }),
    }


def _scheduled(match: dict[str, Any], config: Config) -> list[dict[str, Any]]:
    """The routes through the queue: the Check is held until an upstream is granted, and its OK
    names that upstream in x-llamaswap-upstream (and makes Envoy match the route again).

    One route per upstream, matched on the header's value (`cluster_header` would need the header
    to carry the cluster's full name), then one without it. A request matches that last one while
    its Check is held (nothing has named an upstream yet: a client's own header is gone), so it
    carries the same timers. Past the Check it is reached only with envoy.failOpen, by a request
    whose Check failed and that goes on unscheduled, as it went before there were several
    upstreams: to the first one. Without failOpen nothing goes there (every OK names an
    upstream), and should anything, it gets a 503 from a cluster with no endpoints: an
    unscheduled request never reaches a GPU."""
    # No route timeout or idle timer: the wait is bounded by the scheduler
    # (maxWaitSeconds) and a generation by maxRunSeconds, not by Envoy.
    timers = {"timeout": "0s", "idle_timeout": "0s"}
    routes = [{
        "match": {**match, "headers": [{"name": UPSTREAM_HEADER, "string_match": {"exact": upstream.name}}]},
        "route": {"cluster": upstream_cluster(upstream.name), **timers},
    } for upstream in _entries(config)]
    fallback = upstream_cluster(_entries(config)[0].name) if config.envoy.fail_open else UNROUTED_CLUSTER
    routes.append({"match": match, "route": {"cluster": fallback, **timers}})
    return routes


def _management_routes(config: Config) -> list[dict[str, Any]]:
    """llama-server's management API. A router-mode load answers at once and goes on loading in
    the background, so its grant would end while the GPU still works: refused by default."""
    if config.upstream.management_api is ManagementApi.SCHEDULE:
        return []  # the catch-all schedules them
    body = openai_error_body(
        "llama-server's management API is not served on this port (upstream.managementApi is refuse); "
        "send model requests instead, or call the upstream directly", "permission_error", "management_api_refused")
    refused = {"status": 403, "body": {"inline_string": body.decode()}}
    headers = [{"header": {"key": "content-type", "value": "application/json"},
                "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"},
               # Refused whatever the moment: the OpenAI SDKs would not retry a 403 anyway, others might.
               {"header": {"key": SHOULD_RETRY_HEADER, "value": "false"},
                "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}]
    matches = [{"path": path} for path in MANAGEMENT_PATHS] + [{"prefix": prefix} for prefix in MANAGEMENT_PREFIXES]
    return [_unscheduled({"match": match, "direct_response": refused, "response_headers_to_add": headers})
            for match in matches]


def _props_routes(first: str) -> list[dict[str, Any]]:
    """`GET /props` skips the queue only in the forms that cannot load a model: no query, or only
    `model=X` with `autoload=false` (llama.cpp's web UI; llama-server takes 0 for false too,
    measured). Everything else goes through the queue, a spelling Envoy does not recognise
    (a percent-encoded key, a repeated parameter) included, since llama-server decodes it."""
    query = r"(\?(model=[^&]*&autoload=(false|0)|autoload=(false|0)(&model=[^&]*)?))?"
    return [_unscheduled({
        "match": {"prefix": PROPS_PATH, "headers": [
            {"name": ":method", "string_match": {"exact": "GET"}},
            {"name": ":path", "string_match": {"safe_regex": {"regex": re.escape(PROPS_PATH) + query}}}]},
        "route": {"cluster": first, "timeout": "30s"},
    })]


def _routes(config: Config) -> list[dict[str, Any]]:
    # What skips the queue asks the first upstream, as it asked the only one before.
    first = upstream_cluster(_entries(config)[0].name)
    routes: list[dict[str, Any]] = [
        _unscheduled({"match": {"path": METRICS_PATH}, "route": {"cluster": SIDECAR_ADMIN_CLUSTER, "timeout": "10s"}}),
        _unscheduled({"match": {"path": PICKER_METRICS_PATH},
                      "route": {"cluster": SIDECAR_ADMIN_CLUSTER, "timeout": "10s"}}),
        _unscheduled({"match": {"path": UPSTREAM_METRICS_PATH},
                      "route": {"cluster": SIDECAR_ADMIN_CLUSTER, "timeout": "10s"}}),
        _unscheduled({"match": {"prefix": STATUS_PREFIX},
                      "route": {"cluster": SIDECAR_ADMIN_CLUSTER, "timeout": "10s"}}),
        *_batch_api_routes(),
        *_management_routes(config),
    ]
    routes += [_unscheduled({"match": {"path": path}, "route": {"cluster": first, "timeout": "30s"}})
               for path in BYPASS_PATHS]
    routes += _props_routes(first)
    routes.append(_unscheduled({
        "match": {"path": "/models", "headers": [{"name": ":method", "string_match": {"exact": "GET"}}]},
        "route": {"cluster": first, "timeout": "30s"},
    }))
    routes += _scheduled({"prefix": "/"}, config)
    return routes


def build_bootstrap(
    config: Config,
    *,
    grpc_port: int | None = None,
    admin_port: int | None = None,
    envoy_admin_port: int = ENVOY_ADMIN_PORT,
    envoy_admin_host: str = ENVOY_ADMIN_HOST,
    otlp_endpoint: str | None = None,
    service_name: str = "llamaswap-envoy",
    memory_limit_bytes: int | None = None,
) -> dict[str, Any]:
    """The bootstrap as a dict. Ports default to the configuration's listen addresses; an
    overload manager comes with envoy.maxHeapBytes or Envoy's memory limit."""
    e = config.envoy
    listen = config.listen
    hcm: dict[str, Any] = _typed(
        "envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        stat_prefix="ingress",
        codec_type="AUTO",
        stream_idle_timeout=_duration(e.stream_idle_timeout_seconds),
        route_config={"name": "llamaswap", "virtual_hosts": [{
            "name": "llm", "domains": ["*"], "routes": _routes(config),
            # The copy of the client's x-request-id is the sidecar's business, not the upstream's.
            **({"request_headers_to_remove": [CLIENT_REQUEST_ID_HEADER]} if _retry_material(config) else {})}]},
        http_filters=_http_filters(config),
        access_log=[_access_log(config)],
        # Periodic entries for the running exchange: they renew its lease.
        access_log_options={"access_log_flush_interval": _duration(e.lease_seconds / RENEWALS_PER_LEASE)},
        # The edge: every client is external, none is trusted. Envoy then drops a client's
        # x-envoy-* headers (x-envoy-retry-on, x-envoy-max-retries, per-try timeouts), so no
        # request can turn one grant into several upstream attempts. An explicit empty list:
        # without one, Envoy counts RFC 1918 and loopback peers as internal.
        use_remote_address=True,
        internal_address_config={"unix_sockets": False, "cidr_ranges": []},
        # An external request's x-request-id would be replaced: clients send their own to ask
        # the status route where they stand.
        preserve_external_request_id=True,
        # Every response says which request it was: clients find it in /queue, /activity, traces.
        always_set_request_id_in_response=True,
        # Envoy's own 503s (the sidecar unreachable, for one) tell clients when to come back;
        # the sidecar's refusals already carry their own Retry-After, which this keeps.
        # (retry-after-ms too: the OpenAI SDKs read it first.) A body over envoy.maxRequestBytes
        # (413, the buffer filter's) is too large whenever it is sent: `x-should-retry: false`.
        local_reply_config={"mappers": [{
            "filter": {"status_code_filter": {"comparison": {
                "op": "EQ", "value": {"default_value": 503, "runtime_key": "llamaswap.local_503"}}}},
            "headers_to_add": [{"header": {"key": "retry-after", "value": str(SHUTDOWN_RETRY_AFTER_S)},
                                "append_action": "ADD_IF_ABSENT"},
                               {"header": {"key": RETRY_AFTER_MS_HEADER, "value": str(SHUTDOWN_RETRY_AFTER_S * 1000)},
                                "append_action": "ADD_IF_ABSENT"}],
        }, {
            "filter": {"status_code_filter": {"comparison": {
                "op": "EQ", "value": {"default_value": 413, "runtime_key": "llamaswap.local_413"}}}},
            "headers_to_add": [{"header": {"key": SHOULD_RETRY_HEADER, "value": "false"},
                                "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}],
        }]},
        common_http_protocol_options={"headers_with_underscores_action": "ALLOW"},
        # Routes match the path llama-server will act on: it percent-decodes paths (measured:
        # POST /models/%6coad loads a model), so Envoy decodes, merges slashes and drops dot
        # segments before matching, or a refused or queued path would pass under another spelling.
        normalize_path=True,
        merge_slashes=True,
        path_with_escaped_slashes_action="UNESCAPE_AND_FORWARD",
        # A client's own non-UUID x-request-id must not switch tracing off for its request.
        request_id_extension={"typed_config": _typed(
            "envoy.extensions.request_id.uuid.v3.UuidRequestIdConfig", use_request_id_for_trace_sampling=False)},
        http2_protocol_options={"max_concurrent_streams": 100_000},
        **_early_header_mutations(config),
    )
    clusters = [
        *(_cluster(upstream_cluster(upstream.name), upstream.host, upstream.port, buffer_bytes=e.max_request_bytes,
                   max_requests=1024, tls_sni=upstream.host if upstream.tls else None,
                   requests_per_connection=UPSTREAM_REQUESTS_PER_CONNECTION) for upstream in _entries(config)),
        # failOpen: ext_authz fails open on any error, the circuit breaker's overflow too, so a
        # flood would pass unscheduled; the breaker is lifted and the sidecar refuses past the
        # limit itself (429). Without failOpen an overflow is a 503, which is what it should be.
        _cluster(SIDECAR_GRPC_CLUSTER, listen.grpc.connect_host,
                 grpc_port if grpc_port is not None else listen.grpc.port, http2=True, buffer_bytes=1024 * 1024,
                 max_requests=UNLIMITED_STREAMS if e.fail_open else e.max_sidecar_streams),
        _cluster(SIDECAR_ADMIN_CLUSTER, listen.admin.connect_host,
                 admin_port if admin_port is not None else listen.admin.port),
    ]
    if not e.fail_open:
        clusters.append({"name": UNROUTED_CLUSTER, "type": "STATIC", "connect_timeout": "1s",
                         "load_assignment": {"cluster_name": UNROUTED_CLUSTER, "endpoints": []}})
    if otlp_endpoint:
        parts = urlsplit(otlp_endpoint if "//" in otlp_endpoint else f"http://{otlp_endpoint}")
        clusters.append(_cluster(OTLP_CLUSTER, parts.hostname or "127.0.0.1", parts.port or 4317, http2=True))
        hcm["tracing"] = {
            "random_sampling": {"value": 100},
            "spawn_upstream_span": True,
            "provider": {
                "name": "envoy.tracers.opentelemetry",
                "typed_config": _typed("envoy.config.trace.v3.OpenTelemetryConfig",
                                       grpc_service={"envoy_grpc": {"cluster_name": OTLP_CLUSTER}, "timeout": "2s"},
                                       service_name=service_name),
            },
        }
    budget = heap_budget(config, memory_limit_bytes)
    return {
        "admin": {"address": {"socket_address": {"address": envoy_admin_host, "port_value": envoy_admin_port}}},
        **({"overload_manager": overload_manager(budget)} if budget else {}),
        "static_resources": {
            "listeners": [{
                "name": "ingress",
                "address": {"socket_address": {"address": listen.http.host, "port_value": listen.http.port}},
                # Envoy shares a port with another listener by default on Linux: a second stack
                # on the same port must fail to start instead of splitting the traffic.
                "enable_reuse_port": False,
                "per_connection_buffer_limit_bytes": e.max_request_bytes + 1024 * 1024,
                "filter_chains": [{"filters": [{
                    "name": "envoy.filters.network.http_connection_manager", "typed_config": hcm}]}],
            }],
            "clusters": clusters,
        },
    }


def bootstrap_changes(old: Config, new: Config) -> list[str]:
    """The configuration keys whose change needs a new Envoy bootstrap (a restart), not a reload."""
    changed = []
    if old.listen != new.listen:
        changed.append("listen")
    if old.upstream.url != new.upstream.url:
        changed.append("upstream.url")
    elif _clusters_of(old) != _clusters_of(new):
        changed.append("upstreams")
    if old.envoy != new.envoy:
        changed.append("envoy")
    if old.upstream.management_api != new.upstream.management_api:
        changed.append("upstream.managementApi")
    if old.security.priority.trusted_header != new.security.priority.trusted_header:
        changed.append("security.priority.trustedHeader")
    return changed


def _clusters_of(config: Config) -> list[tuple[str, str, int, bool]]:
    return [(u.name, u.host, u.port, u.tls) for u in _entries(config)]


def render_bootstrap(bootstrap: dict[str, Any]) -> str:
    return yaml.safe_dump(bootstrap, sort_keys=False, default_flow_style=False)
