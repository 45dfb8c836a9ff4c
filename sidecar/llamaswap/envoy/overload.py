"""Envoy's overload manager for the bootstrap (llamaswap.envoy.bootstrap.build_bootstrap): a heap budget
from envoy.maxHeapBytes or from Envoy's container memory limit.

Each waiting request's body is buffered in Envoy (up to envoy.maxRequestBytes) and the queue
may be unlimited: without a budget Envoy grows until the kernel kills it, and every waiting
request dies with it. With one, the fixed_heap monitor measures Envoy's heap and, near the
budget, Envoy answers new requests 503 (the bootstrap's local-reply mapper adds Retry-After),
stops keep-alive so clients reconnect (possibly to another pod) and returns free memory to the
system; requests already accepted go on.
"""

from __future__ import annotations

from typing import Any

from llamaswap.config import Config

# The overload manager (see overload_manager()): thresholds as shares of Envoy's heap budget,
# and the share of a container memory limit that budget is (the rest: the binary, thread
# stacks, allocator fragmentation, bodies arriving while the monitor samples).
HEAP_SHARE_OF_MEMORY_LIMIT = 0.75
SHRINK_HEAP_AT = 0.90
STOP_ACCEPTING_REQUESTS_AT = 0.95
OVERLOAD_REFRESH = "0.1s"
FIXED_HEAP = "envoy.resource_monitors.fixed_heap"


def heap_budget(config: Config, memory_limit_bytes: int | None) -> int:
    """Envoy's heap budget in bytes: envoy.maxHeapBytes, else a share of the memory limit; 0 = none."""
    if config.envoy.max_heap_bytes:
        return config.envoy.max_heap_bytes
    return int(memory_limit_bytes * HEAP_SHARE_OF_MEMORY_LIMIT) if memory_limit_bytes else 0


def overload_manager(max_heap_bytes: int) -> dict[str, Any]:
    """Each waiting request's body is buffered in Envoy: near its heap budget Envoy answers new
    requests 503 (with the Retry-After of the local-reply mapper) and returns free memory to the
    system, instead of growing until the kernel kills it with every waiting request."""
    def action(name: str, threshold: float) -> dict[str, Any]:
        return {"name": f"envoy.overload_actions.{name}",
                "triggers": [{"name": FIXED_HEAP, "threshold": {"value": threshold}}]}

    return {
        "refresh_interval": OVERLOAD_REFRESH,
        "resource_monitors": [{"name": FIXED_HEAP, "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.resource_monitors.fixed_heap.v3.FixedHeapConfig",
            "max_heap_size_bytes": max_heap_bytes}}],
        "actions": [action("shrink_heap", SHRINK_HEAP_AT),
                    action("stop_accepting_requests", STOP_ACCEPTING_REQUESTS_AT),
                    action("disable_http_keepalive", STOP_ACCEPTING_REQUESTS_AT)],
    }
