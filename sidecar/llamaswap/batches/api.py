"""The Batch API's HTTP routes, on the admin server (Envoy's listener routes `/v1/files` and
`/v1/batches` here): the OpenAI shapes, errors in the OpenAI error JSON."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import logging
import pathlib
from collections.abc import Callable
from typing import Any

from aiohttp import BodyPartReader, web

from llamaswap.batches.documents import LIST_DEFAULT, LIST_MOST, batch_document, file_document, list_page
from llamaswap.batches.feeder import Feeder
from llamaswap.batches.lifecycle import (
    COMPLETION_WINDOWS,
    ENDPOINTS,
    MAX_METADATA_KEY,
    MAX_METADATA_PAIRS,
    MAX_METADATA_VALUE,
    RATE_WINDOW,
    BadPriority,
    BatchStatus,
    batch_priority,
    estimated_finish,
)
from llamaswap.batches.store import BatchRecord, FileInUse, FileRecord, Store
from llamaswap.batches.validate import numbered_lines
from llamaswap.config import Config
from llamaswap.envoy.contract import openai_error_body

_log = logging.getLogger(__name__)

FILES_PATH = "/v1/files"
BATCHES_PATH = "/v1/batches"
PURPOSES = ("batch",)
CHUNK_BYTES = 1 << 20
# A trace id and a span id for a batch, made by telemetry (a batch's lines join its trace).
TraceIds = Callable[[], tuple[str, str]]


class ApiError(Exception):
    """A request the API refuses: its HTTP status and the OpenAI error's fields."""

    def __init__(self, status: int, message: str, code: str, param: str | None = None,
                 error_type: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param, self.error_type = status, message, code, param, error_type

    def response(self) -> web.Response:
        return web.Response(status=self.status, content_type="application/json",
                            body=openai_error_body(self.message, self.error_type, self.code, self.param))


@dataclasses.dataclass
class BatchService:
    """What the routes need: the store, the feeder (to wake it and ask what is in flight), the
    configuration in effect (limits), and where a batch's trace ids come from."""

    store: Store
    feeder: Feeder
    config: Callable[[], Config]
    trace_ids: TraceIds
    # upstream.apiKey: where the upstream wants a key, so does the Batch API (its lines are sent with it).
    api_key: str | None = None

    def document(self, batch: BatchRecord) -> dict[str, Any]:
        counts = self.store.counts(batch.id, batch.total)
        finish = None
        if batch.status is BatchStatus.IN_PROGRESS:
            finish = estimated_finish(self.store.now(), self.store.recent_ends(batch.id, RATE_WINDOW),
                                      counts.total - counts.done)
        return batch_document(batch, counts, in_flight=self.feeder.in_flight(batch.id), estimated_finish_at=finish)


def add_batch_routes(app: web.Application, service: BatchService | None) -> None:
    """The routes; without a service (batches.dir unset) each answers 404 saying how to turn it on."""
    routes = _Routes(service)
    app.router.add_route("*", FILES_PATH, routes.files)
    app.router.add_route("*", FILES_PATH + "/{file_id}", routes.file)
    app.router.add_route("*", FILES_PATH + "/{file_id}/content", routes.content)
    app.router.add_route("*", BATCHES_PATH, routes.batches)
    app.router.add_route("*", BATCHES_PATH + "/{batch_id}", routes.batch)
    app.router.add_route("*", BATCHES_PATH + "/{batch_id}/cancel", routes.cancel)


def _handler(method: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A route for one method; ApiError becomes its OpenAI error."""

    def wrap(function: Callable[..., Any]) -> Callable[..., Any]:
        async def handle(self: _Routes, request: web.Request) -> web.StreamResponse:
            try:
                if self.service is None:
                    raise ApiError(404, "the Batch API is off on this llamaswap: set batches.dir to a directory "
                                        "(a persistent volume) to turn it on", "batches_off")
                if self.service.api_key is not None and not hmac.compare_digest(
                        request.headers.get("authorization", "").encode(), f"Bearer {self.service.api_key}".encode()):
                    raise ApiError(401, "the Batch API wants the upstream's API key (upstream.apiKey) as "
                                        "Authorization: Bearer KEY", "invalid_api_key",
                                   error_type="authentication_error")
                if request.method not in method.split("|"):
                    raise ApiError(405, f"{request.path} answers {method.replace('|', ' and ')} only",
                                   "method_not_allowed")
                return await function(self, self.service, request)  # type: ignore[no-any-return]
            except ApiError as exc:
                return exc.response()
        return handle
    return wrap


class _Routes:
    def __init__(self, service: BatchService | None) -> None:
        self.service = service

    # -- files -------------------------------------------------------------------------------

    @_handler("GET|POST")
    async def files(self, service: BatchService, request: web.Request) -> web.StreamResponse:
        if request.method == "POST":
            record = await _receive_file(service, request)
            return web.json_response(file_document(record))
        purpose = request.query.get("purpose")
        order = request.query.get("order", "desc")
        if order not in ("asc", "desc"):
            raise ApiError(400, f"order must be asc or desc, got {order!r}", "invalid_order", "order")
        records = await asyncio.to_thread(service.store.files, purpose=purpose)
        if order == "asc":
            records.reverse()
        page = list_page(records, after=request.query.get("after"), limit=_limit(request, default=10_000,
                                                                                  most=10_000),
                         key=lambda record: record.id, document=file_document)
        if page is None:
            raise ApiError(400, f"after={request.query.get('after')!r} names no file", "invalid_cursor", "after")
        return web.json_response(page)

    @_handler("GET|DELETE")
    async def file(self, service: BatchService, request: web.Request) -> web.StreamResponse:
        record = _file_or_404(service, request.match_info["file_id"])
        if request.method == "DELETE":
            try:
                await asyncio.to_thread(service.store.delete_file, record.id)
            except FileInUse as exc:
                raise ApiError(409, str(exc), "file_in_use") from exc
            return web.json_response({"id": record.id, "object": "file", "deleted": True})
        return web.json_response(file_document(record))

    @_handler("GET")
    async def content(self, service: BatchService, request: web.Request) -> web.StreamResponse:
        record = _file_or_404(service, request.match_info["file_id"])
        return web.FileResponse(service.store.file_path(record.id), headers={
            "content-type": "application/jsonl" if record.filename.endswith(".jsonl") else "application/octet-stream",
            "content-disposition": f'attachment; filename="{record.filename}"'})

    # -- batches -----------------------------------------------------------------------------

    @_handler("GET|POST")
    async def batches(self, service: BatchService, request: web.Request) -> web.StreamResponse:
        if request.method == "POST":
            batch = await _create_batch(service, request)
            service.feeder.wake()
            return web.json_response(service.document(batch))
        records = await asyncio.to_thread(service.store.batches)
        page = list_page(records, after=request.query.get("after"), limit=_limit(request), key=lambda b: b.id,
                         document=service.document)
        if page is None:
            raise ApiError(400, f"after={request.query.get('after')!r} names no batch", "invalid_cursor", "after")
        return web.json_response(page)

    @_handler("GET")
    async def batch(self, service: BatchService, request: web.Request) -> web.StreamResponse:
        return web.json_response(service.document(_batch_or_404(service, request.match_info["batch_id"])))

    @_handler("POST")
    async def cancel(self, service: BatchService, request: web.Request) -> web.StreamResponse:
        batch = _batch_or_404(service, request.match_info["batch_id"])
        if batch.status in (BatchStatus.CANCELLING, BatchStatus.CANCELLED):
            return web.json_response(service.document(batch))
        if not service.store.set_status(batch.id, BatchStatus.CANCELLING,
                                        only_from=(BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS)):
            now = _batch_or_404(service, batch.id)
            raise ApiError(409, f"the batch {batch.id} is {now.status.value}: only a validating or in_progress batch "
                                "can be cancelled", "batch_not_cancellable")
        _log.info("batch %s: cancelling", batch.id)
        service.feeder.stop_feeding(batch.id)
        return web.json_response(service.document(_batch_or_404(service, batch.id)))


def _limit(request: web.Request, *, default: int = LIST_DEFAULT, most: int = LIST_MOST) -> int:
    raw = request.query.get("limit")
    if raw is None:
        return default
    try:
        limit = int(raw)
    except ValueError:
        limit = 0
    if not 1 <= limit <= most:
        raise ApiError(400, f"limit must be an integer from 1 to {most}, got {raw!r}", "invalid_limit", "limit")
    return limit


def _file_or_404(service: BatchService, file_id: str) -> FileRecord:
    record = service.store.file(file_id)
    if record is None:
        raise ApiError(404, f"no file has the id {file_id!r}", "file_not_found", "file_id")
    return record


def _batch_or_404(service: BatchService, batch_id: str) -> BatchRecord:
    record = service.store.batch(batch_id)
    if record is None:
        raise ApiError(404, f"no batch has the id {batch_id!r}", "batch_not_found", "batch_id")
    return record


async def _receive_file(service: BatchService, request: web.Request) -> FileRecord:
    """A multipart upload (fields ``purpose`` and ``file``), streamed to disk within
    batches.maxFileBytes; a batch file over batches.maxRequests lines is refused. A refused
    upload leaves nothing behind."""
    limits = service.config().batches
    if not request.content_type.startswith("multipart/"):
        raise ApiError(400, "POST /v1/files takes multipart/form-data with the fields purpose and file",
                       "invalid_content_type")
    received: pathlib.Path | None = None
    purpose = filename = None
    size = 0
    try:
        reader = await request.multipart()
        while (part := await reader.next()) is not None:
            if not isinstance(part, BodyPartReader):
                continue
            if part.name == "purpose":
                purpose = (await part.text()).strip()
            elif part.name == "file":
                filename = part.filename or "upload.jsonl"
                received = service.store.upload_path()
                size = await _write_part(part, received, limits.max_file_bytes)
        if purpose is None:
            raise ApiError(400, "the field purpose is missing (purpose=batch)", "missing_required_parameter",
                           "purpose")
        if purpose not in PURPOSES:
            raise ApiError(400, f"purpose must be batch, got {purpose!r}: llamaswap keeps batch input files only",
                           "invalid_purpose", "purpose")
        if received is None or filename is None:
            raise ApiError(400, "the field file is missing", "missing_required_parameter", "file")
        lines = await asyncio.to_thread(_count_requests, received)
        if lines > limits.max_requests:
            raise ApiError(400, f"the file has {lines} requests; a batch may have at most {limits.max_requests} "
                                "(batches.maxRequests): split it into several files", "too_many_requests", "file")
        record = await asyncio.to_thread(service.store.add_file, received, filename=filename, purpose=purpose)
        received = None
        _log.info("file %s received: %s, %d bytes, %d requests", record.id, filename, size, lines)
        return record
    except ValueError as exc:  # a malformed multipart body
        raise ApiError(400, f"the multipart body cannot be read: {exc}", "invalid_multipart") from exc
    finally:
        if received is not None:
            with contextlib.suppress(OSError):
                received.unlink()


async def _write_part(part: BodyPartReader, path: pathlib.Path, most: int) -> int:
    size = 0
    with open(path, "wb") as out:
        while chunk := await part.read_chunk(CHUNK_BYTES):
            size += len(chunk)
            if size > most:
                raise ApiError(413, f"the file is over {most} bytes (batches.maxFileBytes): split it into several "
                                    "files", "file_too_large", "file")
            await asyncio.to_thread(out.write, chunk)
    return size


def _count_requests(path: pathlib.Path) -> int:
    with open(path, "rb") as source:
        return sum(1 for _, _, text in numbered_lines(source) if text.strip())


async def _create_batch(service: BatchService, request: web.Request) -> BatchRecord:
    try:
        document = await request.json()
    except ValueError as exc:
        raise ApiError(400, f"the body is not JSON: {exc}", "invalid_json") from exc
    if not isinstance(document, dict):
        raise ApiError(400, "the body must be a JSON object", "invalid_json")
    input_file_id = document.get("input_file_id")
    if not isinstance(input_file_id, str):
        raise ApiError(400, "input_file_id is missing (the id POST /v1/files returned)", "missing_required_parameter",
                       "input_file_id")
    endpoint = document.get("endpoint")
    if endpoint not in ENDPOINTS:
        raise ApiError(400, f"endpoint must be one of {', '.join(ENDPOINTS)}, got {endpoint!r}", "invalid_endpoint",
                       "endpoint")
    window = document.get("completion_window")
    if window not in COMPLETION_WINDOWS:
        raise ApiError(400, f"completion_window must be {', '.join(COMPLETION_WINDOWS)}, got {window!r}",
                       "invalid_completion_window", "completion_window")
    metadata = _metadata(document.get("metadata"))
    record = service.store.file(input_file_id)
    if record is None:
        raise ApiError(404, f"no file has the id {input_file_id!r}", "file_not_found", "input_file_id")
    if record.purpose != "batch":
        raise ApiError(400, f"the file {input_file_id} has purpose {record.purpose}, not batch", "invalid_file",
                       "input_file_id")
    try:
        priority = batch_priority(metadata, service.config().priority_policy())
    except BadPriority as exc:
        raise ApiError(400, str(exc), "invalid_priority", "metadata.priority") from exc
    trace_id, span_id = service.trace_ids()
    batch = await asyncio.to_thread(
        service.store.create_batch, endpoint=endpoint, input_file_id=input_file_id, completion_window=window,
        window_s=COMPLETION_WINDOWS[window], metadata=metadata, priority=priority, trace_id=trace_id, span_id=span_id)
    _log.info("batch %s created from %s for %s at priority %d", batch.id, input_file_id, endpoint, priority)
    return batch


def _metadata(value: Any) -> dict[str, str] | None:
    if value is None:
        return None
    if not isinstance(value, dict) or len(value) > MAX_METADATA_PAIRS or not all(
            isinstance(key, str) and isinstance(item, str) and len(key) <= MAX_METADATA_KEY
            and len(item) <= MAX_METADATA_VALUE for key, item in value.items()):
        raise ApiError(400, f"metadata must be an object of at most {MAX_METADATA_PAIRS} string pairs (keys up to "
                            f"{MAX_METADATA_KEY} characters, values up to {MAX_METADATA_VALUE})", "invalid_metadata",
                       "metadata")
    return dict(value)
