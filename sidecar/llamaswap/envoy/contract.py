"""The contract between Envoy and the sidecar: what the bootstrap configures and the adapters read.

The bootstrap (`llamaswap.envoy.bootstrap`) puts the body's model into dynamic metadata and the
grant's ticket into ext_authz's; the adapters (`llamaswap.adapters`) read them back by these
names. Both import them from here, so the two sides cannot drift apart.
"""

from __future__ import annotations

import json

from llamaswap.config.sections import RENEWALS_PER_LEASE
from llamaswap.core.priority import HEADER as PRIORITY_HEADER
from llamaswap.core.priority import OBJECTIVE_HEADER, OLD_OBJECTIVE_HEADER

__all__ = [
    "ACCESS_LOG_NAME", "BATCH_API_PREFIXES", "BYPASS_PATHS", "GRANT_NAMESPACE", "MANAGEMENT_PATHS",
    "MANAGEMENT_PREFIXES", "MAX_REQUEST_ID", "MAX_TOKENS_KEYS", "METRICS_PATH", "MODEL_KEY", "PROPS_PATH",
    "SERVICE_TIER_KEY", "STREAM_KEY", "UNLOAD_PATH", "KEEP_ALIVE_KEY",
    "AUTHORIZATION_HEADER", "CLIENT_REQUEST_ID_HEADER", "CONTENT_LENGTH_HEADER", "RETRY_AFTER_MS_HEADER",
    "MAX_DIGESTED_BODY", "RETRY_COUNT_HEADER", "SHOULD_RETRY_HEADER",
    "MODEL_NAMESPACE", "OBJECTIVE_HEADER", "OLD_OBJECTIVE_HEADER", "PICKER_METRICS_PATH", "PRIORITY_HEADER",
    "RENEWALS_PER_LEASE", "REQUEST_ID_HEADER", "STATUS_PREFIX", "TICKET_KEY",
    "UPSTREAM_METRICS_PATH", "openai_error_body",
    "UPSTREAM_CLUSTER_PREFIX", "UPSTREAM_HEADER", "upstream_cluster", "gpu_of_cluster",
]

# Where the body's model goes, and where Envoy puts what the Check answered.
MODEL_NAMESPACE = "llamaswap"
MODEL_KEY = "model"
# Also read from the body into the same namespace: the output tokens asked for (the estimates
# scale with it; OpenAI's two names and llama.cpp's own, first present wins) and whether the
# response is streamed (only a streamed first byte times a model load), and OpenAI's
# `service_tier`, the priority of a request without X-LlamaSwap-Priority (core.priority.SERVICE_TIERS).
MAX_TOKENS_KEYS = ("max_tokens", "max_completion_tokens", "n_predict")
STREAM_KEY = "stream"
SERVICE_TIER_KEY = "service_tier"
# Ollama's keep_alive: how long its model stays loaded once idle (routing.keepAlive says whether it counts).
KEEP_ALIVE_KEY = "keep_alive"
GRANT_NAMESPACE = "envoy.filters.http.ext_authz"
TICKET_KEY = "ticket"
ACCESS_LOG_NAME = "llamaswap"

REQUEST_ID_HEADER = "x-request-id"
# Which upstream a grant runs on: the Check's OK sets it on the request (its value an upstream's
# name) and the scheduled routes send the request to that upstream's cluster. A client's own copy
# is removed before Envoy matches a route (an early header mutation).
UPSTREAM_HEADER = "x-llamaswap-upstream"
# Each upstream's Envoy cluster is this prefix and its name; the access log reads the name back.
UPSTREAM_CLUSTER_PREFIX = "upstream-"
# routing.retryGraceSeconds: Envoy copies the client's own x-request-id here before it generates
# one for a request that has none (an early header mutation, ahead of the request id), so the
# sidecar can tell a client-chosen id (the two are equal) from Envoy's.
CLIENT_REQUEST_ID_HEADER = "x-llamaswap-client-request-id"
# The caller's identity, the try (the OpenAI SDKs count them), and the body's full length (the
# Check may carry only the body's beginning): what a retry's match key is made of.
AUTHORIZATION_HEADER = "authorization"
RETRY_COUNT_HEADER = "x-stainless-retry-count"
CONTENT_LENGTH_HEADER = "content-length"
# The answer tells the OpenAI SDKs (and others that read it) whether a retry can help, and when.
SHOULD_RETRY_HEADER = "x-should-retry"
# Envoy sends the sidecar at most this much of a body (ext_authz `with_request_body`, partial): the
# digest covers these bytes and the body's length. A held Check keeps its request in memory, so
# this bounds what a waiting request costs beyond its headers (docs/architecture.md).
MAX_DIGESTED_BODY = 256 * 1024
RETRY_AFTER_MS_HEADER = "retry-after-ms"
# A client's x-request-id longer than this is replaced by Envoy's own id for the stream (the
# Check's `attributes.request.http.id`): it is stored in the ticket, the activity log and spans.
MAX_REQUEST_ID = 128

# Paths that never reach the GPU: answered by the upstream at once.
BYPASS_PATHS = ("/health", "/v1/models")
# llama-server's settings: skips the queue only as a GET without ?model= or with ?autoload=false.
# In router mode `GET /props?model=X` LOADS X (and unloads another with --models-max 1); with
# autoload=false, as llama.cpp's web UI asks, it answers 400 "model is not loaded" instead.
PROPS_PATH = "/props"
# llama-server's management API (upstream.managementApi): loads run on after their answer. An
# unload ends whatever its model computes, so it is scheduled to run alone.
UNLOAD_PATH = "/models/unload"
MANAGEMENT_PATHS = ("/models/load", UNLOAD_PATH)
MANAGEMENT_PREFIXES = ("/slots/",)  # POST /slots/N?action=save|restore|erase
# Answered by the sidecar through Envoy's listener: its metrics, and one client's own status.
METRICS_PATH = "/metrics"
STATUS_PREFIX = "/llamaswap/v1/requests/"
# The OpenAI Batch API, served by the sidecar (llamaswap.batches.api).
BATCH_API_PREFIXES = ("/v1/files", "/v1/batches")
# The endpoint picker's gauges alone (telemetry: Telemetry.picker_text), cheap to read every 50 ms.
PICKER_METRICS_PATH = "/llamaswap/v1/picker/metrics"
# llama-server's own metrics, for the loaded model, read by the sidecar (adapters/upstream_metrics.py).
UPSTREAM_METRICS_PATH = "/llamaswap/v1/upstream/metrics"


def openai_error_body(message: str, error_type: str, code: str, param: str | None = None) -> bytes:
    """An error in the OpenAI API's JSON shape: what the sidecar's refusals and Envoy's own local
    replies (configured by the bootstrap) both send a client."""
    return json.dumps({"error": {"message": message, "type": error_type, "param": param, "code": code}},
                      separators=(",", ":")).encode()


def upstream_cluster(name: str) -> str:
    """The Envoy cluster of the upstream called `name`."""
    return UPSTREAM_CLUSTER_PREFIX + name


def gpu_of_cluster(cluster: str) -> str | None:
    """The upstream's name from its cluster's (an access-log entry's upstream_cluster); None for
    another cluster or none (the request never reached an upstream)."""
    if not cluster.startswith(UPSTREAM_CLUSTER_PREFIX) or len(cluster) == len(UPSTREAM_CLUSTER_PREFIX):
        return None
    return cluster[len(UPSTREAM_CLUSTER_PREFIX):]
