"""The page at GET /ui and the JSON it polls, on the admin server (same origin as /queue).

- GET /ui (and /ui/app.js, /ui/style.css): the page, shipped in the package (llamaswap/ui/);
- GET /ui/state: the GPU now, the first UI_WAITING_ROWS waiting requests with their score's
  terms, the depth per band, the counters, and the Batch API's recent batches (null: the API is
  off); built at most once per change of the queue, the history or the batches (its ETag is the
  change counters, so a poll that finds nothing new gets a 304);
- GET /ui/timeline?since_ms=UNIX_MS&after=SEQ: the timeline entries that ended since then;
- GET /ui/request/{request_id}: one request: live state, records, positions while watched,
  and a link to its trace when `ui.jaegerUrl` is set.
"""

from __future__ import annotations

import asyncio
import collections
import importlib.resources
import json
import logging
import math
import os
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from aiohttp import web

from llamaswap.core import PolicyName
from llamaswap.runtime.coordinator import Coordinator
from llamaswap.runtime.views import QueueView, RunningRow, WaitingRow
from llamaswap.runtime.history import History
from llamaswap.adapters.admin import (
    idle_document,
    kept_document,
    running_document,
    status_document,
    waiting_document,
)
from llamaswap.adapters.outcomes import openai_error_body

# Rows of the queue the page gets: enough to read, few enough to stay quick at 10,000 waiting
# (the depth per band covers the rest).
UI_WAITING_ROWS = 300
# Building the state walks the whole queue (about 20 ms per 1,000 waiting): while the queue keeps
# changing, it is rebuilt at most once per (its last build time / this share), so pages polling a
# deep, busy queue cost the sidecar at most this share of a core (at 10,000 waiting: about once a second).
UI_CPU_SHARE = 0.2
# Requests whose position is recorded while someone watches them, and the points kept of each.
WATCHED_REQUESTS = 32
POSITIONS_KEPT = 600
NOW_HEADER = "x-llamaswap-now-ms"
# The batches on the page (the Batch API, when batches.dir is set): the UI_BATCHES newest, less
# those that ended over UI_BATCHES_KEPT_S ago. Asked of their store (SQLite, in a worker thread)
# at most every UI_BATCHES_REFRESH_S while a page polls, however many pages do.
UI_BATCHES = 20
UI_BATCHES_KEPT_S = 86400
UI_BATCHES_REFRESH_S = 2.0
_BATCH_ENDED = ("completed", "failed", "expired", "cancelled")
# The Batch API's batch objects (GET /v1/batches/{id}) of the newest batches, newest first.
BatchesProvider = Callable[[], list[dict[str, Any]]]
# The space the Batch API's files take (used_bytes, files, max_bytes, left_bytes, disk_free_bytes).
StorageProvider = Callable[[], dict[str, Any]]

_log = logging.getLogger(__name__)
ASSETS = {"index.html": "text/html", "app.js": "text/javascript", "style.css": "text/css"}


def _error(status: int, code: str, message: str) -> web.Response:
    return web.Response(status=status, body=openai_error_body(message, "invalid_request_error", code),
                        content_type="application/json")


class UiState:
    """The documents of the page, each computed once per change of what it shows."""

    def __init__(self, coordinator: Coordinator, history: History, *, jaeger_url: Callable[[], str],
                 waiting_rows: int = UI_WAITING_ROWS, batches: BatchesProvider | None = None,
                 batch_storage: StorageProvider | None = None) -> None:
        self._coordinator = coordinator
        self._history = history
        self._jaeger_url = jaeger_url
        self._waiting_rows = waiting_rows
        # None: the Batch API is off (the page says so).
        self._batches = batches
        self._batch_rows: list[dict[str, Any]] = []
        self._storage = batch_storage
        self._storage_document: dict[str, Any] | None = None
        self._batches_version = 0
        self._batches_asked_ns: int | None = None
        # A new sidecar process starts a new timeline: the page resets when this changes.
        self.instance = os.urandom(6).hex()
        self._cached: tuple[tuple[int, int, int, str], str, bytes] | None = None
        self._built_ns = 0
        self._rebuild_after_ns = 0  # how long a built state is kept while changes arrive
        self._positions: collections.OrderedDict[str, list[list[float]]] = collections.OrderedDict()

    def now_ms(self) -> float:
        """The sidecar's time now, in the documents' time base (Unix milliseconds)."""
        return self._history.now_ms()

    # -- /ui/state -------------------------------------------------------------------------

    def state(self) -> tuple[str, bytes]:
        """(ETag, body) of the state document; rebuilt only when a change counter moved, and
        not sooner than UI_CPU_SHARE allows after the last build."""
        key = (self._coordinator.version, self._history.seq, self._batches_version, self._jaeger_url())
        cached = self._cached
        clock = self._coordinator.clock
        started_ns = clock.now_ns()
        if cached is not None and (cached[0] == key or started_ns - self._built_ns < self._rebuild_after_ns):
            return cached[1], cached[2]
        etag = f'"{self.instance}-{key[0]}-{key[1]}-{key[2]}"'
        body = json.dumps(self.state_document(), separators=(",", ":")).encode()
        self._cached = (key, etag, body)
        self._built_ns = started_ns
        self._rebuild_after_ns = round((clock.now_ns() - started_ns) / UI_CPU_SHARE)
        return etag, body

    def state_document(self) -> dict[str, Any]:
        coordinator = self._coordinator
        view = coordinator.view()
        now_ms = self._history.now_ms()
        self._note_positions(view, now_ms)
        policy = coordinator.scheduler.policy
        return {
            "instance": self.instance,
            "version": coordinator.version,
            "as_of_ms": round(now_ms, 3),
            "policy": view.policy,
            "aging_divisor_s": policy.aging_divisor_s if policy.name is PolicyName.SERIAL else 0.0,
            # How fast each waiting request's aging term (and so its score) grows after as_of_ms:
            # the page adds this times the time since, and derives no term itself.
            "aging_per_s": policy.aging_per_s,
            "swap_affinity_bonus": policy.swap_affinity_bonus,
            "running": [self._running_row(row, now_ms) for row in view.running],
            # The GPUs' projection, as GET /queue has it: every GPU in the configured order (a
            # timeline row each, its models and slots in the header) and whether a line per GPU shows.
            **view.node.document(),
            "waiting": [self._waiting_row(row, now_ms) for row in view.waiting[:self._waiting_rows]],
            "waiting_total": len(view.waiting),
            "kept": [kept_document(row) for row in view.kept],
            "idle": [idle_document(row) for row in view.idle],  # idle resident models (idle unloads)
            "bands": {band.value: {"depth": depth, "oldest_wait_s": oldest} for band, depth, oldest in view.bands},
            "counters": self._history.counters(),
            "timeline_seq": self._history.seq,
            "jaeger_url": self._jaeger_url(),
            "batches": None if self._batches is None else self._batch_rows,
            "batches_storage": self._storage_document,
        }

    # -- the batches -----------------------------------------------------------------------

    async def refresh_batches(self) -> None:
        """Ask for the batches again once UI_BATCHES_REFRESH_S has passed since the last time (in
        a worker thread: the store reads SQLite); what the page shows changed: a new state."""
        if self._batches is None:
            return
        now_ns = self._coordinator.clock.now_ns()
        if self._batches_asked_ns is not None and now_ns - self._batches_asked_ns < UI_BATCHES_REFRESH_S * 1e9:
            return
        self._batches_asked_ns = now_ns  # before the wait: a concurrent poll does not ask again
        try:
            documents = await asyncio.to_thread(self._batches)
            storage = None if self._storage is None else await asyncio.to_thread(self._storage)
        except Exception as exc:  # the store failing: the page keeps the batches it has
            _log.warning("ui: the batches could not be read: %s", exc)
            return
        rows = batch_rows(documents, now_s=self._history.now_ms() / 1000)
        if rows != self._batch_rows or storage != self._storage_document:
            self._batch_rows, self._storage_document = rows, storage
            self._batches_version += 1

    def _waiting_row(self, row: WaitingRow, now_ms: float) -> dict[str, Any]:
        """GET /queue's row, with the score split into its terms (the aging term the scheduler's),
        and when it is expected to start (null: unknown; past that with no new state, unknown too:
        it waits for work that outran its estimate)."""
        affinity = self._coordinator.scheduler.policy.swap_affinity_bonus if row.swap_affinity else 0
        # The rest of the score: the priority (fifo adds the model's configured priority).
        terms = {"priority": round(row.score - affinity - row.aging, 6), "affinity": affinity,
                 "aging": round(row.aging, 6)}
        start = row.estimated_start_s
        start_ms = None if start is None else round(now_ms + start * 1000, 3)
        return {**waiting_document(row), "terms": terms, "estimated_start_ms": start_ms}

    @staticmethod
    def _running_row(row: RunningRow, now_ms: float) -> dict[str, Any]:
        """GET /queue's row, with its grant's time and its expected end (`estimate.grant_end_s`)."""
        granted_ms = now_ms - row.running_s * 1000
        # Past its expected run its end is unknown (null): a time already gone would be wrong.
        end_ms = None if row.expected_remaining_s is None else round(granted_ms + row.expected_end_s * 1000, 3)
        return {**running_document(row), "granted_ms": round(granted_ms, 3), "expected_end_ms": end_ms}

    # -- /ui/timeline ----------------------------------------------------------------------

    def timeline(self, *, since_ms: float | None, after_seq: int) -> bytes:
        entries = self._history.entries(since_ms=since_ms, after_seq=after_seq)
        head = (f'{{"instance":"{self.instance}","last_seq":{self._history.seq},'
                f'"now_ms":{round(self._history.now_ms(), 3)},"entries":[').encode()
        return head + b",".join(entry.body for entry in entries) + b"]}"

    # -- /ui/request/{id} ------------------------------------------------------------------

    def request_document(self, request_id: str) -> dict[str, Any] | None:
        """One request by its x-request-id; None if it is neither live nor in the timeline."""
        live = self._coordinator.status_of(request_id)
        records = [entry.document() for entry in self._history.of_request(request_id)]
        if live is None and not records:
            return None
        trace_id = live[0].trace_id if live is not None else None
        for record in records:
            trace_id = trace_id or record.get("trace_id")
        status = status_document(self._coordinator, request_id) if live is not None else None
        if status is not None and status["state"] == "waiting":
            self._watch(request_id, status["position"])
        jaeger = self._jaeger_url().rstrip("/")
        return {
            "request_id": request_id,
            "state": status["state"] if status is not None else "finished",
            "status": status,
            "records": records,
            "positions": list(self._positions.get(request_id, [])),
            "overtaken_by": self._overtaken_by(request_id),
            "trace_id": trace_id,
            "trace_url": f"{jaeger}/trace/{trace_id}" if jaeger and trace_id else None,
        }

    def _overtaken_by(self, request_id: str) -> list[dict[str, Any]]:
        """The grants in the timeline that went ahead of this request while it waited (the
        winner's `overtook`), oldest first."""
        needle = json.dumps(request_id).encode()
        found = []
        for entry in self._history.entries():
            if entry.kind != "grant" or needle not in entry.body:  # most entries: no decoding
                continue
            document = entry.document()
            if any(other.get("request_id") == request_id for other in document.get("overtook", ())):
                found.append({"request_id": document.get("request_id"), "priority": document.get("serial_priority"),
                              "band": document.get("serial_band"), "granted_ms": document.get("start_ms"),
                              "trace_id": document.get("trace_id")})
        return found

    def _watch(self, request_id: str, position: int) -> None:
        if request_id not in self._positions:
            self._positions[request_id] = []
            while len(self._positions) > WATCHED_REQUESTS:
                self._positions.popitem(last=False)
        self._positions.move_to_end(request_id)
        self._note(request_id, self._history.now_ms(), position)

    def _note_positions(self, view: QueueView, now_ms: float) -> None:
        """A watched request's position, each time the state is built (it changes only then)."""
        if not self._positions:
            return
        for row in view.waiting:
            if row.request_id in self._positions:
                self._note(row.request_id, now_ms, row.position)

    def _note(self, request_id: str, now_ms: float, position: int) -> None:
        points = self._positions[request_id]
        if points and points[-1][1] == position:
            return
        points.append([round(now_ms, 3), position])
        del points[:-POSITIONS_KEPT]


def batch_rows(documents: Sequence[dict[str, Any]], *, now_s: float, most: int = UI_BATCHES,
               kept_s: float = UI_BATCHES_KEPT_S) -> list[dict[str, Any]]:
    """The page's row of each batch (its batch object's fields that the page shows), newest first:
    at most ``most``, none that ended more than ``kept_s`` ago."""
    rows = []
    for document in documents:
        status = str(document.get("status"))
        ended_at = document.get(f"{status}_at") if status in _BATCH_ENDED else None
        if isinstance(ended_at, (int, float)) and ended_at < now_s - kept_s:
            continue
        counts = document.get("request_counts") or {}
        own = document.get("llamaswap") or {}
        rows.append({"id": document.get("id"), "status": status, "endpoint": document.get("endpoint"),
                     "created_at": document.get("created_at"), "in_progress_at": document.get("in_progress_at"),
                     "ended_at": ended_at, "total": counts.get("total", 0), "completed": counts.get("completed", 0),
                     "failed": counts.get("failed", 0), "in_flight": own.get("in_flight", 0),
                     "priority": own.get("priority"), "estimated_finish_at": own.get("estimated_finish_at")})
        if len(rows) >= most:
            break
    return rows


class _BatchRecords(Protocol):
    def batches(self) -> Sequence[Any]: ...


class BatchSource(Protocol):
    """What the page reads of the Batch API (llamaswap.batches.api.BatchService)."""

    @property
    def store(self) -> _BatchRecords: ...

    def document(self, batch: Any) -> dict[str, Any]: ...


def batch_documents(service: BatchSource | None, most: int = UI_BATCHES) -> BatchesProvider | None:
    """UiState's ``batches`` over the Batch API: the objects of its ``most`` newest batches
    (None: the API is off)."""
    if service is None:
        return None
    return lambda: [service.document(batch) for batch in service.store.batches()[:most]]


class StorageSource(Protocol):
    def storage(self) -> Any: ...


def batch_storage(service: StorageSource | None) -> StorageProvider | None:
    """UiState's ``batch_storage`` over the Batch API: the space its files take (None: off)."""
    if service is None:
        return None
    return lambda: service.storage().document()  # type: ignore[no-any-return]


def _assets() -> dict[str, bytes]:
    folder = importlib.resources.files("llamaswap") / "ui"
    return {name: (folder / name).read_bytes() for name in ASSETS}


def add_ui_routes(app: web.Application, ui: UiState) -> None:
    assets = _assets()

    def asset(name: str) -> Callable[[web.Request], Any]:
        async def handler(_: web.Request) -> web.Response:
            # no-cache: a restarted sidecar of another version serves its own page.
            return web.Response(body=assets[name], content_type=ASSETS[name], headers={"cache-control": "no-cache"})

        return handler

    async def state(request: web.Request) -> web.Response:
        await ui.refresh_batches()
        etag, body = ui.state()
        # The document may be older than this answer (it is built once per change): the page
        # sets its clock from this header, and ages what the document says by its as_of_ms.
        headers = {"etag": etag, "cache-control": "no-cache", NOW_HEADER: f"{ui.now_ms():.3f}"}
        if request.headers.get("if-none-match") == etag:
            return web.Response(status=304, headers=headers)
        return web.Response(body=body, content_type="application/json", headers=headers)

    async def timeline(request: web.Request) -> web.Response:
        try:
            since_text = request.query.get("since_ms")
            since_ms = float(since_text) if since_text is not None else None
            after_seq = int(request.query.get("after", "0"))
        except ValueError:
            return _error(400, "invalid_parameter", "since_ms must be a number (Unix milliseconds) and after an "
                                                    "integer (the last entry's seq the page has)")
        if since_ms is not None and not math.isfinite(since_ms):
            return _error(400, "invalid_parameter", "since_ms must be a finite number (Unix milliseconds)")
        return web.Response(body=ui.timeline(since_ms=since_ms, after_seq=after_seq),
                            content_type="application/json", headers={"cache-control": "no-store"})

    async def one_request(request: web.Request) -> web.Response:
        request_id = request.match_info["request_id"]
        document = ui.request_document(request_id)
        if document is None:
            return _error(404, "request_not_found",
                          f"no request with the x-request-id '{request_id}' is waiting, running or in the timeline")
        return web.json_response(document, headers={"cache-control": "no-store"})

    async def page_root(_: web.Request) -> web.Response:
        raise web.HTTPFound("/ui")

    app.router.add_get("/ui", asset("index.html"))
    app.router.add_get("/ui/", page_root)
    app.router.add_get("/ui/app.js", asset("app.js"))
    app.router.add_get("/ui/style.css", asset("style.css"))
    app.router.add_get("/ui/state", state)
    app.router.add_get("/ui/timeline", timeline)
    app.router.add_get("/ui/request/{request_id}", one_request)
