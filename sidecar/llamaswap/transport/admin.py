"""The admin HTTP server: health, readiness, metrics, the live queue and the activity log.

It binds to localhost by default and exposes nothing that changes state.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from aiohttp import web

from llamaswap.runtime.activity import ActivityLog
from llamaswap.runtime.coordinator import Coordinator


def queue_document(coordinator: Coordinator) -> dict[str, Any]:
    snapshot = coordinator.scheduler.snapshot()

    def view(item: Any) -> dict[str, Any]:
        data = dataclasses.asdict(item)
        data["band"] = item.band.value
        # The core knows requests by their ticket, which is a secret: show the request id.
        ticket = coordinator.ticket(item.request_id)
        data["request_id"] = ticket.request_id if ticket is not None else "-"
        return data

    return {
        "policy": snapshot.policy,
        "loaded_model": snapshot.loaded_model,
        "running": view(snapshot.running) if snapshot.running else None,
        "waiting": [view(w) for w in snapshot.waiting],
        "bands": {band.value: dataclasses.asdict(stats) for band, stats in snapshot.bands.items()},
    }


def build_admin_app(
    coordinator: Coordinator,
    activity: ActivityLog,
    *,
    metrics: Callable[[], tuple[bytes, str]] | None = None,
    ready: Callable[[], bool] = lambda: True,
) -> web.Application:
    async def healthz(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def readyz(_: web.Request) -> web.Response:
        if coordinator.admitting and ready():
            return web.json_response({"status": "ready"})
        return web.json_response({"status": "not ready"}, status=503)

    async def queue(_: web.Request) -> web.Response:
        return web.json_response(queue_document(coordinator))

    async def recent(request: web.Request) -> web.Response:
        try:
            limit = int(request.query.get("limit", "100"))
        except ValueError:
            limit = 100
        return web.json_response({"activity": activity.recent(max(1, limit))})

    async def metrics_handler(_: web.Request) -> web.Response:
        if metrics is None:
            return web.Response(status=404, text="metrics are not enabled\n")
        body, content_type = metrics()
        return web.Response(body=body, headers={"content-type": content_type})

    app = web.Application()
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/queue", queue)
    app.router.add_get("/activity", recent)
    app.router.add_get("/metrics", metrics_handler)
    return app
