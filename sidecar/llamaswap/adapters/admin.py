"""The admin HTTP server: health, readiness, metrics, the live queue and the activity log; and,
through Envoy's listener, one client's own request status.

It binds to localhost by default and exposes nothing that changes state. Envoy's listener
routes only `/metrics`, `/llamaswap/v1/requests/` and `/llamaswap/v1/upstream/metrics` here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from aiohttp import web

from llamaswap.envoy.contract import PICKER_METRICS_PATH, STATUS_PREFIX
from llamaswap.runtime.activity import KEPT_EVENTS, REQUEST, ActivityLog
from llamaswap.runtime.coordinator import Coordinator
from llamaswap.runtime.history import History
from llamaswap.runtime.kept import KeptRow
from llamaswap.runtime.stops import LineProgress
from llamaswap.runtime.views import IdleRow, QueueView, RunningRow, WaitingRow
from llamaswap.adapters.outcomes import openai_error_body


def waiting_document(row: WaitingRow) -> dict[str, Any]:
    """One waiting request as GET /queue (and the page at /ui) shows it."""
    return {"request_id": row.request_id, "position": row.position, "priority": row.priority,
            "band": row.band.value, "score": row.score, "swap_affinity": row.swap_affinity,
            "waited_s": row.waited_s, "model": row.model, "estimated_start_s": row.estimated_start_s,
            "line": line_document(row.line)}


def line_document(line: LineProgress | None) -> dict[str, int | bool] | None:
    """A Batch API line that may be stopped: its stops so far, its tokens (those its stops kept,
    while it waits; with its running part's, while it runs) and whether a stop was asked of its
    running part that has not let go yet; null for any other request."""
    return None if line is None else {"stops": line.stops, "tokens": line.tokens, "stopping": line.stopping}


def kept_document(row: KeptRow) -> dict[str, Any]:
    """A place kept for a client's retry (routing.retryGraceSeconds), as GET /queue and the page show it."""
    return {"request_id": row.request_id, "state": "kept", "attempt": row.attempt, "priority": row.priority,
            "band": row.band.value, "model": row.model, "waited_s": row.waited_s, "away_s": row.away_s,
            "expires_in_s": row.expires_in_s}


def running_document(row: RunningRow) -> dict[str, Any]:
    """The running request as GET /queue (and the page at /ui) shows it."""
    return {"request_id": row.request_id, "priority": row.priority, "band": row.band.value, "score": row.score,
            "model": row.model, "queue_wait_s": row.queue_wait_s, "running_s": row.running_s,
            "expected_end_s": row.expected_end_s, "expected_remaining_s": row.expected_remaining_s,
            "upstream": row.gpu, "line": line_document(row.line)}


def queue_document(view: QueueView) -> dict[str, Any]:
    """GET /queue: the running requests, then the waiting ones in dispatch order, then the places
    kept for a client's retry (``kept``, oldest first). ``running`` is
    the earliest running request (null for none: the shape before slots); ``running_all`` is
    every one, earliest first, each with the ``upstream`` it runs on. The GPUs and the node
    (``gpus``, ``gpu``, ``resident_models``, ``slots_busy`` of ``slots_total``, ``per_gpu``) are
    the GPUs' projection as it is (`NodeProjection.document`)."""
    return {
        "policy": view.policy,
        **view.node.document(),
        "running": running_document(view.running[0]) if view.running else None,
        "running_all": [running_document(row) for row in view.running],
        "waiting": [waiting_document(row) for row in view.waiting],
        "kept": [kept_document(row) for row in view.kept],
        "idle": [idle_document(row) for row in view.idle],
        "bands": {band.value: {"depth": depth, "oldest_wait_s": oldest} for band, depth, oldest in view.bands},
    }


def idle_document(row: IdleRow) -> dict[str, Any]:
    """An idle resident model: how long it has sat idle, and in how long it will be unloaded for
    idleness (null: never)."""
    return {"upstream": row.gpu, "model": row.model, "idle_s": round(row.idle_s, 3),
            "unload_in_s": None if row.unload_in_s is None else round(row.unload_in_s, 3)}


def status_document(coordinator: Coordinator, request_id: str) -> dict[str, Any] | None:
    """One request's own state; nothing about any other request but how many are ahead."""
    found = coordinator.status_of(request_id)
    if found is None:
        return None
    _, row = found
    if isinstance(row, RunningRow):
        return {"request_id": request_id, "state": "running", "position": 0, "priority": row.priority,
                "band": row.band.value, "score": row.score, "waited_s": row.queue_wait_s, "running_s": row.running_s,
                "estimated_start_s": 0.0, "expected_remaining_s": row.expected_remaining_s, "upstream": row.gpu,
                "line": line_document(row.line)}
    return {"request_id": request_id, "state": "waiting", "position": row.position, "priority": row.priority,
            "band": row.band.value, "score": row.score, "waited_s": row.waited_s,
            "estimated_start_s": row.estimated_start_s, "line": line_document(row.line)}


def public_status_document(coordinator: Coordinator, request_id: str) -> dict[str, Any] | None:
    """What the public status route answers: only what the request's own client needs (its
    state, its place in the queue, when it is expected to start); nothing about priorities,
    scores or what else waits. The admin port's /ui shows the rest."""
    document = status_document(coordinator, request_id)
    if document is None:
        return None
    return {key: document[key] for key in PUBLIC_STATUS_KEYS}


# The public status answer's fields (Envoy's listener routes STATUS_PREFIX to this server).
PUBLIC_STATUS_KEYS = ("request_id", "state", "position", "estimated_start_s")
# GET /activity without ?limit=: this many of the most recent records (at most activity.recent).
ACTIVITY_DEFAULT_LIMIT = 100


def finished_status_document(history: History, request_id: str) -> dict[str, Any] | None:
    """A request that has ended, while the timeline keeps it (a day, TIMELINE_CAPACITY entries):
    its outcome and how long it waited, for its own client; None when it is not there."""
    ended = [entry for entry in history.of_request(request_id) if entry.kind in ("grant", "mark")]
    if not ended:
        return None
    record = ended[-1].document()  # the latest of a reused id
    wait_ms = record.get("serial_queue_wait_ms")
    return {"request_id": request_id, "state": "finished", "position": None, "estimated_start_s": None,
            "outcome": record.get("outcome"), "waited_s": round(wait_ms / 1000, 3) if wait_ms is not None else None}


def build_admin_app(
    coordinator: Coordinator,
    activity: ActivityLog,
    *,
    metrics: Callable[[], tuple[bytes, str]] | None = None,
    picker_metrics: Callable[[], tuple[bytes, str]] | None = None,
    ready: Callable[[], bool] = lambda: True,
    history: History | None = None,
) -> web.Application:
    async def healthz(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def readyz(_: web.Request) -> web.Response:
        if coordinator.admitting and ready():
            return web.json_response({"status": "ready"})
        return web.json_response({"status": "not ready"}, status=503)

    async def queue(_: web.Request) -> web.Response:
        return web.json_response(queue_document(coordinator.view()))

    async def recent(request: web.Request) -> web.Response:
        try:
            limit = int(request.query.get("limit", str(ACTIVITY_DEFAULT_LIMIT)))
        except ValueError:
            limit = ACTIVITY_DEFAULT_LIMIT
        # ?event=eviction: the models unloaded to make room (several resident); ?event=stop: the Batch
        # API lines stopped for a higher band; requests by default.
        event = request.query.get("event", REQUEST)
        if event not in KEPT_EVENTS:
            return _error(400, "invalid_request_error", "unknown_event",
                          f"event must be one of {', '.join(KEPT_EVENTS)}, not {event!r}")
        return web.json_response({"activity": activity.recent(max(1, limit), event)})

    async def metrics_handler(_: web.Request) -> web.Response:
        if metrics is None:
            return web.Response(status=404, text="metrics are not enabled\n")
        body, content_type = metrics()
        return web.Response(body=body, headers={"content-type": content_type})

    async def picker_metrics_handler(_: web.Request) -> web.Response:
        if picker_metrics is None:
            return web.Response(status=404, text="metrics are not enabled\n")
        body, content_type = picker_metrics()
        return web.Response(body=body, headers={"content-type": content_type})

    async def request_status(request: web.Request) -> web.Response:
        if request.method != "GET":
            return _error(405, "invalid_request_error", "method_not_allowed",
                          f"{STATUS_PREFIX}{{request-id}} only answers GET")
        request_id = request.match_info["request_id"]
        document = public_status_document(coordinator, request_id)
        if document is None and history is not None:
            document = finished_status_document(history, request_id)
        if document is None:
            return _error(404, "invalid_request_error", "request_not_found",
                          f"no waiting, running or recently finished request has the x-request-id '{request_id}'")
        return web.json_response(document, headers={"cache-control": "no-store"})

    app = web.Application()
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/queue", queue)
    app.router.add_get("/activity", recent)
    app.router.add_get("/metrics", metrics_handler)
    app.router.add_get(PICKER_METRICS_PATH, picker_metrics_handler)
    app.router.add_route("*", STATUS_PREFIX + "{request_id}", request_status)
    return app


def _error(status: int, error_type: str, code: str, message: str) -> web.Response:
    return web.Response(status=status, body=openai_error_body(message, error_type, code),
                        content_type="application/json")
