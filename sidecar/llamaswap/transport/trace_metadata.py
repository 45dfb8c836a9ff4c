"""Keep only the W3C trace context of a call's gRPC metadata: a waiting request should not
carry every metadata entry for hours (memory per waiting request is a budget)."""

from __future__ import annotations

import grpc

_TRACE_KEYS = frozenset({"traceparent", "tracestate"})


def trace_metadata(context: grpc.aio.ServicerContext) -> tuple[tuple[str, str], ...]:
    return tuple((key, value) for key, value in (context.invocation_metadata() or ())
                 if key in _TRACE_KEYS and isinstance(value, str))
