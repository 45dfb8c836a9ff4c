"""The Batch API's HTTP routes, on the admin server (Envoy's listener routes `/v1/files` and
`/v1/batches` here): the OpenAI shapes, errors in the OpenAI error JSON."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import pathlib
import re
import sqlite3
import urllib.parse
from collections.abc import Callable
from typing import Any

from aiohttp import BodyPartReader, web

from llamaswap.batches.access import OPEN, Access, Caller, Unidentified
from llamaswap.batches.documents import LIST_DEFAULT, LIST_MOST, batch_document, file_document, list_page
from llamaswap.batches.feeder import Feeder, out_of_space
from llamaswap.batches.files import QuotaExceeded, Storage
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
    bounded_priority,
    estimated_finish,
    trusted_ceiling,
)
from llamaswap.batches.store import BatchRecord, FileInUse, FileRecord, Store
from llamaswap.batches.validate import count_requests
from llamaswap.config import Config
from llamaswap.config.batches import EXPIRY_MAX_S, EXPIRY_MIN_S
from llamaswap.config.types import size_text
from llamaswap.envoy.contract import openai_error_body

_log = logging.getLogger(__name__)

FILES_PATH = "/v1/files"
BATCHES_PATH = "/v1/batches"
# Every batch of every caller and the space the files take: on the admin server only (Envoy's
# listener routes /v1/files and /v1/batches, not this), for `llamaswap batches`.
SUMMARY_PATH = "/batches"
PURPOSES = ("batch",)
CHUNK_BYTES = 1 << 20
# The most bytes a multipart field other than the file may have (purpose, expires_after[...]).
FIELD_MOST_BYTES = 64
EXPIRES_ANCHOR = "expires_after[anchor]"
EXPIRES_SECONDS = "expires_after[seconds]"
FIELDS = ("purpose", EXPIRES_ANCHOR, EXPIRES_SECONDS)
# How often expired files are looked for and deleted.
SWEEP_S = 60.0
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
    # Who may call, and what each caller sees (batches.apiKeys, callerHeader; upstream.apiKey).
    access: Access = Access()

    def line_priority(self, batch: BatchRecord) -> int:
        """The priority the batch's lines run at now: its own under the policy in force, never
        above its creator's trusted ceiling (the feeder sends each line at this)."""
        return bounded_priority(batch.metadata, batch.priority_ceiling, self.config().priority_policy())

    def document(self, batch: BatchRecord) -> dict[str, Any]:
        counts = self.store.counts(batch.id, batch.total)
        finish = None
        if batch.status is BatchStatus.IN_PROGRESS:
            finish = estimated_finish(self.store.now(), self.store.recent_ends(batch.id, RATE_WINDOW),
                                      counts.total - counts.done)
        priority = batch.priority if batch.status.ended else self.line_priority(batch)
        return batch_document(batch, counts, in_flight=self.feeder.in_flight(batch.id), estimated_finish_at=finish,
                              priority=priority)

    def storage(self) -> Storage:
        """The space the files take, beside batches.maxStoredBytes and the disk's free space."""
        return self.store.storage(self.config().batches.max_stored_bytes)

    async def sweep_expired_files(self, every_s: float = SWEEP_S) -> None:
        """Delete expired files now and every ``every_s`` seconds (the store's clock says which)."""
        while True:
            try:
                expired = await asyncio.to_thread(self.store.expire_files)
            except Exception:  # noqa: BLE001 - the next sweep tries again; the sidecar goes on
                _log.exception("batches: expired files could not be deleted; trying again in %.0f s", every_s)
            else:
                if expired:
                    _log.info("batches: %d expired file(s) deleted: %s", len(expired), ", ".join(expired))
            await asyncio.sleep(every_s)


def add_batch_routes(app: web.Application, service: BatchService | None) -> None:
    """The routes; without a service (batches.dir unset) each answers 404 saying how to turn it on."""
    routes = _Routes(service)
    app.router.add_route("*", FILES_PATH, routes.files)
    app.router.add_route("*", FILES_PATH + "/{file_id}", routes.file)
    app.router.add_route("*", FILES_PATH + "/{file_id}/content", routes.content)
    app.router.add_route("*", BATCHES_PATH, routes.batches)
    app.router.add_route("*", BATCHES_PATH + "/{batch_id}", routes.batch)
    app.router.add_route("*", BATCHES_PATH + "/{batch_id}/cancel", routes.cancel)
    app.router.add_route("*", SUMMARY_PATH, routes.summary)


def _handler(method: str, *, callers: bool = True) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A route for one method; ApiError becomes its OpenAI error. With ``callers``, the caller
    is identified first (batches.apiKeys, callerHeader); without, the route is the admin
    server's own (not routed by Envoy's listener) and its caller sees all."""

    def wrap(function: Callable[..., Any]) -> Callable[..., Any]:
        async def handle(self: _Routes, request: web.Request) -> web.StreamResponse:
            try:
                if self.service is None:
                    raise ApiError(404, "the Batch API is off on this llamaswap: set batches.dir to a directory "
                                        "(a persistent volume) to turn it on", "batches_off")
                try:
                    caller = self.service.access.identify(request.headers) if callers else OPEN
                except Unidentified as exc:
                    raise ApiError(401, str(exc), exc.code, error_type="authentication_error") from exc
                if request.method not in method.split("|"):
                    raise ApiError(405, f"{request.path} answers {method.replace('|', ' and ')} only",
                                   "method_not_allowed")
                return await function(self, self.service, caller, request)  # type: ignore[no-any-return]
            except ApiError as exc:
                return exc.response()
        return handle
    return wrap


class _Routes:
    def __init__(self, service: BatchService | None) -> None:
        self.service = service

    # -- files -------------------------------------------------------------------------------

    @_handler("GET|POST")
    async def files(self, service: BatchService, caller: Caller, request: web.Request) -> web.StreamResponse:
        if request.method == "POST":
            record = await _receive_file(service, caller, request)
            return web.json_response(file_document(record))
        purpose = request.query.get("purpose")
        order = request.query.get("order", "desc")
        if order not in ("asc", "desc"):
            raise ApiError(400, f"order must be asc or desc, got {order!r}", "invalid_order", "order")
        records = await asyncio.to_thread(service.store.files, purpose=purpose, owner=caller.only)
        if order == "asc":
            records.reverse()
        page = list_page(records, after=request.query.get("after"), limit=_limit(request, default=10_000,
                                                                                  most=10_000),
                         key=lambda record: record.id, document=file_document)
        if page is None:
            raise ApiError(400, f"after={request.query.get('after')!r} names no file", "invalid_cursor", "after")
        return web.json_response(page)

    @_handler("GET|DELETE")
    async def file(self, service: BatchService, caller: Caller, request: web.Request) -> web.StreamResponse:
        record = _file_or_404(service, caller, request.match_info["file_id"])
        if request.method == "DELETE":
            try:
                await asyncio.to_thread(service.store.delete_file, record.id)
            except FileInUse as exc:
                raise ApiError(409, str(exc), "file_in_use") from exc
            return web.json_response({"id": record.id, "object": "file", "deleted": True})
        return web.json_response(file_document(record))

    @_handler("GET")
    async def content(self, service: BatchService, caller: Caller, request: web.Request) -> web.StreamResponse:
        record = _file_or_404(service, caller, request.match_info["file_id"])
        return web.FileResponse(service.store.file_path(record.id), headers={
            "content-type": "application/jsonl" if record.filename.endswith(".jsonl") else "application/octet-stream",
            "content-disposition": content_disposition(record.filename)})

    # -- batches -----------------------------------------------------------------------------

    @_handler("GET|POST")
    async def batches(self, service: BatchService, caller: Caller, request: web.Request) -> web.StreamResponse:
        if request.method == "POST":
            batch = await _create_batch(service, caller, request)
            service.feeder.wake()
            return web.json_response(service.document(batch))
        records = [record for record in await asyncio.to_thread(service.store.batches) if caller.sees(record.owner)]
        page = list_page(records, after=request.query.get("after"), limit=_limit(request), key=lambda b: b.id,
                         document=service.document)
        if page is None:
            raise ApiError(400, f"after={request.query.get('after')!r} names no batch", "invalid_cursor", "after")
        return web.json_response(page)

    @_handler("GET")
    async def batch(self, service: BatchService, caller: Caller, request: web.Request) -> web.StreamResponse:
        return web.json_response(service.document(_batch_or_404(service, caller, request.match_info["batch_id"])))

    @_handler("POST")
    async def cancel(self, service: BatchService, caller: Caller, request: web.Request) -> web.StreamResponse:
        batch = _batch_or_404(service, caller, request.match_info["batch_id"])
        if batch.status in (BatchStatus.CANCELLING, BatchStatus.CANCELLED):
            return web.json_response(service.document(batch))
        if not service.store.set_status(batch.id, BatchStatus.CANCELLING,
                                        only_from=(BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS)):
            now = _batch_or_404(service, caller, batch.id)
            raise ApiError(409, f"the batch {batch.id} is {now.status.value}: only a validating or in_progress batch "
                                "can be cancelled", "batch_not_cancellable")
        _log.info("batch %s: cancelling", batch.id)
        service.feeder.stop_feeding(batch.id)
        return web.json_response(service.document(_batch_or_404(service, caller, batch.id)))

    # -- the admin server's summary ----------------------------------------------------------

    @_handler("GET", callers=False)
    async def summary(self, service: BatchService, caller: Caller, request: web.Request) -> web.StreamResponse:
        """Every caller's batches (a list page, as GET /v1/batches) and the space the files take."""
        records = await asyncio.to_thread(service.store.batches)
        page = list_page(records, after=request.query.get("after"), limit=_limit(request), key=lambda b: b.id,
                         document=service.document)
        if page is None:
            raise ApiError(400, f"after={request.query.get('after')!r} names no batch", "invalid_cursor", "after")
        storage = await asyncio.to_thread(service.storage)
        return web.json_response({**page, "storage": storage.document()})


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


def _file_or_404(service: BatchService, caller: Caller, file_id: str) -> FileRecord:
    """The file, when this caller may see it; another caller's is as absent as one that never was."""
    record = service.store.file(file_id)
    if record is None or not caller.sees(record.owner):
        raise ApiError(404, f"no file has the id {file_id!r}", "file_not_found", "file_id")
    return record


def _batch_or_404(service: BatchService, caller: Caller, batch_id: str) -> BatchRecord:
    record = service.store.batch(batch_id)
    if record is None or not caller.sees(record.owner):
        raise ApiError(404, f"no batch has the id {batch_id!r}", "batch_not_found", "batch_id")
    return record


async def _receive_file(service: BatchService, caller: Caller, request: web.Request) -> FileRecord:
    """A multipart upload (fields ``purpose``, ``file`` and optionally ``expires_after[anchor]``
    and ``expires_after[seconds]``), streamed to disk within batches.maxFileBytes and the quota
    (batches.maxStoredBytes); a batch file over batches.maxRequests lines is refused. A refused
    upload leaves nothing behind."""
    limits = service.config().batches
    if not request.content_type.startswith("multipart/"):
        raise ApiError(400, "POST /v1/files takes multipart/form-data with the fields purpose and file",
                       "invalid_content_type")
    received: pathlib.Path | None = None
    fields: dict[str, str] = {}
    filename: str | None = None
    size = 0
    room = await _quota_room(service, limits.max_stored_bytes)
    try:
        reader = await request.multipart()
        while (part := await reader.next()) is not None:
            if not isinstance(part, BodyPartReader):
                continue
            if part.name in fields or part.name == "file" and received is not None:
                raise ApiError(400, f"the field {part.name} is given more than once: send it once",
                               "duplicate_field", part.name)
            if part.name in FIELDS:
                fields[part.name] = await _field_text(part, part.name)
            elif part.name == "file":
                filename = part.filename or "upload.jsonl"
                received = service.store.upload_path()
                size = await _write_part(part, received, limits.max_file_bytes, room)
        purpose = fields.get("purpose")
        if purpose is None:
            raise ApiError(400, "the field purpose is missing (purpose=batch)", "missing_required_parameter",
                           "purpose")
        if purpose not in PURPOSES:
            raise ApiError(400, f"purpose must be batch, got {purpose!r}: llamaswap keeps batch input files only",
                           "invalid_purpose", "purpose")
        expires_after_s = _expires_after(fields)
        if received is None or filename is None:
            raise ApiError(400, "the field file is missing", "missing_required_parameter", "file")
        lines = await asyncio.to_thread(_count_requests, received)
        if lines > limits.max_requests:
            raise ApiError(400, f"the file has {lines} requests; a batch may have at most {limits.max_requests} "
                                "(batches.maxRequests): split it into several files", "too_many_requests", "file")
        try:
            record = await asyncio.to_thread(service.store.add_file, received, filename=filename, purpose=purpose,
                                             owner=caller.name, expires_after_s=expires_after_s,
                                             quota=limits.max_stored_bytes)
        except QuotaExceeded as exc:
            raise _quota_error(exc.size, exc.used, exc.quota) from exc
        received = None
        _log.info("file %s received from %s: %s, %d bytes, %d requests", record.id, caller.name or "a caller",
                  filename, size, lines)
        return record
    except ValueError as exc:  # a malformed multipart body
        raise ApiError(400, f"the multipart body cannot be read: {exc}", "invalid_multipart") from exc
    except (OSError, sqlite3.Error) as exc:  # writing the bytes or adding the row
        if not out_of_space(exc):
            raise
        _log.error("batches: an upload from %s could not be stored: the disk of batches.dir %s is full (%s)",
                   caller.name or "a caller", service.store.directory, exc)
        raise _disk_full_error() from exc
    finally:
        if received is not None:
            with contextlib.suppress(OSError):
                received.unlink()


async def _field_text(part: BodyPartReader, name: str) -> str:
    """A small field's text, read within FIELD_MOST_BYTES (a field is never read whole unbounded)."""
    data = bytearray()
    while chunk := await part.read_chunk(FIELD_MOST_BYTES + 1):
        data += chunk
        if len(data) > FIELD_MOST_BYTES:
            raise ApiError(400, f"the field {name} is longer than {FIELD_MOST_BYTES} bytes", "invalid_field", name)
    try:
        return data.decode("utf-8").strip()
    except UnicodeDecodeError as exc:
        raise ApiError(400, f"the field {name} is not UTF-8 text", "invalid_field", name) from exc


def _expires_after(fields: dict[str, str]) -> int | None:
    """expires_after[anchor] and expires_after[seconds], as the OpenAI files API takes them: the
    seconds after its creation a file is deleted (None: kept until deleted)."""
    anchor, seconds = fields.get(EXPIRES_ANCHOR), fields.get(EXPIRES_SECONDS)
    if anchor is None and seconds is None:
        return None
    if anchor != "created_at":
        raise ApiError(400, f"expires_after[anchor] must be created_at, got {anchor!r}", "invalid_expires_after",
                       "expires_after.anchor")
    if seconds is None or not re.fullmatch(r"[0-9]{1,12}", seconds) or not (
            EXPIRY_MIN_S <= int(seconds) <= EXPIRY_MAX_S):
        raise ApiError(400, f"expires_after[seconds] must be an integer from {EXPIRY_MIN_S} (an hour) to "
                            f"{EXPIRY_MAX_S} (30 days), got {seconds!r}", "invalid_expires_after",
                       "expires_after.seconds")
    return int(seconds)


async def _quota_room(service: BatchService, quota: int | None) -> Callable[[int], None]:
    """A check for an upload being received: ApiError once its bytes would pass the quota (the
    use read once, in a worker thread: the store's lock may be held by a long write)."""
    if quota is None:
        return lambda size: None
    used = (await asyncio.to_thread(service.store.storage)).used_bytes

    def check(size: int) -> None:
        if used + size > quota:
            raise _quota_error(size, used, quota)
    return check


def _quota_error(size: int, used: int, quota: int) -> ApiError:
    return ApiError(413, f"storing this file ({size_text(size)} so far) would pass the quota for stored files, "
                         f"{size_text(quota)} (batches.maxStoredBytes): {size_text(used)} are used by uploads and "
                         "batch outputs. Free space by deleting files you no longer need (DELETE /v1/files/ID) or "
                         "let them expire (expires_after)", "storage_quota_exceeded", "file")


def _disk_full_error() -> ApiError:
    return ApiError(507, "the file cannot be stored: the disk that holds batches.dir is full. Free space by deleting "
                         "files you no longer need (DELETE /v1/files/ID), then send it again; the operator may give "
                         "that disk more space or set batches.maxStoredBytes below its size, so uploads are refused "
                         "before it fills", "insufficient_storage", error_type="server_error")


async def _write_part(part: BodyPartReader, path: pathlib.Path, most: int, room: Callable[[int], None]) -> int:
    size = 0
    with open(path, "wb") as out:
        while chunk := await part.read_chunk(CHUNK_BYTES):
            size += len(chunk)
            if size > most:
                raise ApiError(413, f"the file is over {most} bytes (batches.maxFileBytes): split it into several "
                                    "files", "file_too_large", "file")
            room(size)
            await asyncio.to_thread(out.write, chunk)
    return size


def content_disposition(filename: str) -> str:
    """An attachment header for any filename: a plain-ASCII fallback (quotes, backslashes and
    controls replaced) and the exact name in RFC 6266's filename* (UTF-8, percent-encoded), so
    no name can end the header or add one."""
    fallback = re.sub(r'[^\x20-\x7e]|["\\]', "_", filename) or "file"
    return f"attachment; filename=\"{fallback}\"; filename*=UTF-8''{urllib.parse.quote(filename, safe='')}"


def _count_requests(path: pathlib.Path) -> int:
    with open(path, "rb") as source:
        return count_requests(source)  # in chunks: a 100 MB line is never held whole


async def _create_batch(service: BatchService, caller: Caller, request: web.Request) -> BatchRecord:
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
    if record is None or not caller.sees(record.owner):
        raise ApiError(404, f"no file has the id {input_file_id!r}", "file_not_found", "input_file_id")
    if record.purpose != "batch":
        raise ApiError(400, f"the file {input_file_id} has purpose {record.purpose}, not batch", "invalid_file",
                       "input_file_id")
    policy = service.config().priority_policy()
    try:
        priority = batch_priority(metadata, policy)
    except BadPriority as exc:
        raise ApiError(400, str(exc), "invalid_priority", "metadata.priority") from exc
    # The priority the operator's proxy gave this caller bounds the batch's lines, whatever its
    # metadata claims: a caller marked batch cannot run its lines as interactive by asking.
    ceiling = trusted_ceiling(request.headers.get(policy.trusted_header) if policy.trusted_header else None, policy)
    if ceiling is not None:
        priority = min(priority, ceiling)
    trace_id, span_id = service.trace_ids()
    batch = await asyncio.to_thread(
        service.store.create_batch, endpoint=endpoint, input_file_id=input_file_id, completion_window=window,
        window_s=COMPLETION_WINDOWS[window], metadata=metadata, priority=priority, trace_id=trace_id, span_id=span_id,
        owner=caller.name, priority_ceiling=ceiling)
    _log.info("batch %s created from %s by %s for %s at priority %d", batch.id, input_file_id,
              caller.name or "a caller", endpoint, priority)
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
