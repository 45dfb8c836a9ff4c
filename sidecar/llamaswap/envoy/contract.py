"""The contract between Envoy and the sidecar: what the bootstrap configures and the adapters read.

The bootstrap (`llamaswap.envoy.bootstrap`) puts the body's model into dynamic metadata and the
grant's ticket into ext_authz's; the adapters (`llamaswap.adapters`) read them back by these
names. Both import them from here, so the two sides cannot drift apart.
"""

from __future__ import annotations

from llamaswap.core.priority import HEADER as PRIORITY_HEADER

__all__ = [
    "ACCESS_LOG_NAME", "BYPASS_PATHS", "GRANT_NAMESPACE", "METRICS_PATH", "MODEL_KEY",
    "MODEL_NAMESPACE", "PRIORITY_HEADER", "RENEWALS_PER_LEASE", "REQUEST_ID_HEADER", "MAX_REQUEST_ID", "STATUS_PREFIX", "TICKET_KEY",
    "UPSTREAM_METRICS_PATH",
]

# Where the body's model goes, and where Envoy puts what the Check answered.
MODEL_NAMESPACE = "llamaswap"
MODEL_KEY = "model"
GRANT_NAMESPACE = "envoy.filters.http.ext_authz"
TICKET_KEY = "ticket"
ACCESS_LOG_NAME = "llamaswap"

REQUEST_ID_HEADER = "x-request-id"
# A client's x-request-id longer than this is replaced by Envoy's own id for the stream (the
# Check's `attributes.request.http.id`): it is stored in the ticket, the activity log and spans.
MAX_REQUEST_ID = 128

# Paths that never reach the GPU: answered by the upstream at once.
BYPASS_PATHS = ("/health", "/v1/models", "/props")
# Answered by the sidecar through Envoy's listener: its metrics, and one client's own status.
METRICS_PATH = "/metrics"
STATUS_PREFIX = "/llamaswap/v1/requests/"
# llama-server's own metrics, for the loaded model, read by the sidecar (adapters/upstream_metrics.py).
UPSTREAM_METRICS_PATH = "/llamaswap/v1/upstream/metrics"
# Envoy reports a running exchange this many times per lease.
RENEWALS_PER_LEASE = 3
