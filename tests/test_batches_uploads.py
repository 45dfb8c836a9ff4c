"""What the Batch API keeps on disk: the quota on stored files (batches.maxStoredBytes), files
that expire (expires_after, batches.outputExpirySeconds) and the sweep that deletes them (an
injected clock), uploads on disk before their rows, temporary files a kill left, and the
multipart body read with bounds (one file part, small fields, safe filenames)."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import pathlib
import sqlite3
import urllib.parse
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from test_batches_disk import fill, small_disk  # noqa: F401 - small_disk is a fixture
from test_batches_orphans import FullAtCommit

from llamaswap.batches import api as api_module
from llamaswap.batches import files as files_module
from llamaswap.batches.api import FIELD_MOST_BYTES, BatchService, add_batch_routes, content_disposition
from llamaswap.batches.feeder import Feeder, FeedSettings
from llamaswap.batches.files import UPLOAD_PREFIX, QuotaExceeded
from llamaswap.batches.lifecycle import BatchStatus
from llamaswap.batches.store import Store
from llamaswap.config import parse_config

ENDPOINT = "/v1/chat/completions"
HOUR = 3600


def line(custom_id: str) -> bytes:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": ENDPOINT,
                       "body": {"model": "m", "messages": []}}).encode() + b"\n"


class Clock:
    def __init__(self) -> None:
        self.now = 1_800_000_000.0

    def __call__(self) -> float:
        return self.now


class Rig:
    def __init__(self, client: TestClient, store: Store, clock: Clock, directory: pathlib.Path) -> None:
        self.client, self.store, self.clock, self.directory = client, store, clock, directory

    def leftovers(self) -> list[str]:
        """Every name in the files' directory that no file row names."""
        rows = {record.id for record in self.store.files()}
        return sorted(path.name for path in (self.directory / "files").iterdir() if path.name not in rows)


@contextlib.asynccontextmanager
async def serving(directory: pathlib.Path) -> AsyncIterator[Rig]:
    config = parse_config({"batches": {"dir": str(directory), "maxStoredBytes": 1000, "maxFileBytes": 800,
                                       "outputExpirySeconds": 2 * HOUR}})
    clock = Clock()
    store = Store(directory, now=clock)
    store.output_expiry_s = lambda: config.batches.output_expiry_seconds
    service = BatchService(store, Feeder(store, FeedSettings("http://127.0.0.1:9", lambda: 1, lambda: 100)),
                           lambda: config, lambda: ("1" * 32, "2" * 16))
    app = web.Application()
    add_batch_routes(app, service)
    try:
        async with TestClient(TestServer(app)) as client:
            yield Rig(client, store, clock, directory)
    finally:
        store.close()


@pytest.fixture
async def rig(tmp_path: pathlib.Path) -> AsyncIterator[Rig]:
    async with serving(tmp_path) as served:
        yield served


def form(data: bytes, *, filename: str = "in.jsonl", **fields: str) -> aiohttp.FormData:
    body = aiohttp.FormData()
    body.add_field("purpose", "batch")
    for name, value in fields.items():
        body.add_field(name, value)
    body.add_field("file", data, filename=filename, content_type="application/jsonl")
    return body


def raw_multipart(parts: list[tuple[str, str | None, bytes]]) -> tuple[bytes, str]:
    """A multipart body written by hand (name, filename, content): what a client may send that
    aiohttp's own FormData would not (a repeated part, a filename with a quote or a newline)."""
    boundary = "llamaswap-test-boundary"
    out = b""
    for name, filename, content in parts:
        disposition = f'form-data; name="{name}"'
        if filename is not None:
            disposition += f'; filename="{filename}"'
        out += f"--{boundary}\r\nContent-Disposition: {disposition}\r\n\r\n".encode() + content + b"\r\n"
    return out + f"--{boundary}--\r\n".encode(), f"multipart/form-data; boundary={boundary}"


async def error_of(response: aiohttp.ClientResponse, status: int) -> dict[str, Any]:
    assert response.status == status, await response.text()
    body = await response.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]  # type: ignore[no-any-return]


# -- the quota ---------------------------------------------------------------------------------

async def test_an_upload_that_would_pass_the_quota_is_refused_and_says_how_to_free_space(rig: Rig) -> None:
    first = b"".join(line(f"a{n}") for n in range(6))  # about 600 bytes
    assert 500 < len(first) <= 800
    kept = await rig.client.post("/v1/files", data=form(first))
    assert kept.status == 200
    refused = await rig.client.post("/v1/files", data=form(first))
    error = await error_of(refused, 413)
    assert error["code"] == "storage_quota_exceeded" and error["param"] == "file"
    assert "batches.maxStoredBytes" in error["message"] and "1000 B" in error["message"]
    assert f"{len(first)} B are used" in error["message"] and "DELETE /v1/files" in error["message"]
    assert len(rig.store.files()) == 1 and rig.leftovers() == []
    # Space freed: the same upload fits.
    await rig.client.delete(f"/v1/files/{(await kept.json())['id']}")
    assert (await rig.client.post("/v1/files", data=form(first))).status == 200


def test_the_quota_is_checked_where_the_row_is_added(tmp_path: pathlib.Path) -> None:
    """Two uploads received at once both saw room; the second to be kept is refused, and its
    bytes are left to the caller to remove."""
    store = Store(tmp_path)
    for name in ("a", "b"):
        (tmp_path / name).write_bytes(b"x" * 600)
    store.add_file(tmp_path / "a", filename="a", purpose="batch", quota=1000)
    with pytest.raises(QuotaExceeded) as caught:
        store.add_file(tmp_path / "b", filename="b", purpose="batch", quota=1000)
    assert (caught.value.size, caught.value.used, caught.value.quota) == (600, 600, 1000)
    assert (tmp_path / "b").exists() and len(store.files()) == 1
    assert store.storage(1000).document() | {"disk_free_bytes": None} == {
        "used_bytes": 600, "files": 1, "max_bytes": 1000, "left_bytes": 400, "disk_free_bytes": None}
    store.close()


# -- expiry ------------------------------------------------------------------------------------

async def test_expires_after_sets_expires_at_and_bad_values_are_refused(rig: Rig) -> None:
    response = await rig.client.post("/v1/files", data=form(line("a"), **{
        "expires_after[anchor]": "created_at", "expires_after[seconds]": str(HOUR)}))
    document = await response.json()
    assert document["expires_at"] == document["created_at"] + HOUR
    plain = await (await rig.client.post("/v1/files", data=form(line("b")))).json()
    assert plain["expires_at"] is None
    for fields, param in (({"expires_after[anchor]": "last_active_at", "expires_after[seconds]": "3600"},
                           "expires_after.anchor"),
                          ({"expires_after[anchor]": "created_at", "expires_after[seconds]": "59"},
                           "expires_after.seconds"),
                          ({"expires_after[anchor]": "created_at", "expires_after[seconds]": "2592001"},
                           "expires_after.seconds"),
                          ({"expires_after[anchor]": "created_at", "expires_after[seconds]": "1e4"},
                           "expires_after.seconds"),
                          ({"expires_after[seconds]": "3600"}, "expires_after.anchor")):
        error = await error_of(await rig.client.post("/v1/files", data=form(line("c"), **fields)), 400)
        assert (error["code"], error["param"]) == ("invalid_expires_after", param), fields
    assert len(rig.store.files()) == 2 and rig.leftovers() == []


def test_the_sweep_deletes_expired_files_rows_and_bytes_when_their_time_comes(tmp_path: pathlib.Path) -> None:
    clock = Clock()
    store = Store(tmp_path, now=clock)
    store.output_expiry_s = lambda: 2 * HOUR
    ids = {}
    for name, purpose, after in (("short", "batch", HOUR), ("kept", "batch", None), ("output", "batch_output", None)):
        (tmp_path / name).write_bytes(line(name))
        ids[name] = store.add_file(tmp_path / name, filename=name, purpose=purpose, expires_after_s=after).id
    assert store.file(ids["output"]).expires_at == int(clock.now) + 2 * HOUR  # type: ignore[union-attr]
    clock.now += HOUR - 1
    assert store.expire_files() == []
    clock.now += 1
    assert store.expire_files() == [ids["short"]]
    assert store.file(ids["short"]) is None and not store.file_path(ids["short"]).exists()
    clock.now += HOUR
    assert store.expire_files() == [ids["output"]]
    clock.now += 365 * 86400
    assert store.expire_files() == [] and store.file(ids["kept"]) is not None
    store.close()


def test_an_expired_input_waits_for_its_batch_to_end(tmp_path: pathlib.Path) -> None:
    clock = Clock()
    store = Store(tmp_path, now=clock)
    (tmp_path / "in").write_bytes(line("a"))
    file_id = store.add_file(tmp_path / "in", filename="in", purpose="batch", expires_after_s=HOUR).id
    batch = store.create_batch(endpoint=ENDPOINT, input_file_id=file_id, completion_window="24h", window_s=86400,
                               metadata=None, priority=-100, trace_id="1" * 32, span_id="2" * 16)
    clock.now += 2 * HOUR
    assert store.expire_files() == [] and store.file_path(file_id).exists()
    store.set_status(batch.id, BatchStatus.CANCELLED)
    assert store.expire_files() == [file_id]
    store.close()


async def test_the_periodic_sweep_runs_on_its_own(rig: Rig) -> None:
    response = await rig.client.post("/v1/files", data=form(line("a"), **{
        "expires_after[anchor]": "created_at", "expires_after[seconds]": str(HOUR)}))
    file_id = (await response.json())["id"]
    sweeper = BatchService(rig.store, Feeder(rig.store, FeedSettings("http://127.0.0.1:9", lambda: 1, lambda: 1)),
                           lambda: parse_config({}), lambda: ("1" * 32, "2" * 16))
    task = asyncio.create_task(sweeper.sweep_expired_files(every_s=0.01))
    try:
        rig.clock.now += HOUR
        deadline = asyncio.get_running_loop().time() + 30
        while rig.store.file(file_id) is not None:
            assert asyncio.get_running_loop().time() < deadline, "the sweep never deleted the expired file"
            await asyncio.sleep(0.01)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert (await rig.client.get(f"/v1/files/{file_id}")).status == 404
    assert not rig.store.file_path(file_id).exists()


# -- durable uploads ---------------------------------------------------------------------------

def test_a_file_and_its_directory_are_synced_before_its_row_commits(tmp_path: pathlib.Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    store = Store(tmp_path)
    synced: list[tuple[str, bool]] = []  # what was synced, and whether a row named the file then
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        path = os.readlink(f"/proc/self/fd/{fd}")
        with sqlite3.connect(tmp_path / "batches.sqlite3") as reader:
            rows = reader.execute("SELECT COUNT(*) FROM files").fetchone()[0]
        synced.append((os.path.basename(path), rows > 0))
        real_fsync(fd)

    monkeypatch.setattr(files_module.os, "fsync", fsync)
    (tmp_path / "upload").write_bytes(line("a"))
    store.add_file(tmp_path / "upload", filename="in.jsonl", purpose="batch")
    assert synced == [("upload", False), ("files", False)]
    store.close()


def test_temporary_files_a_kill_left_are_removed_at_start(tmp_path: pathlib.Path) -> None:
    store = Store(tmp_path)
    (tmp_path / "kept").write_bytes(line("a"))
    kept = store.add_file(tmp_path / "kept", filename="in.jsonl", purpose="batch")
    store.close()
    for name in (f"{UPLOAD_PREFIX}abc", f"{UPLOAD_PREFIX}def"):
        (tmp_path / "files" / name).write_bytes(b"half an upload")
    store = Store(tmp_path)
    assert sorted(path.name for path in (tmp_path / "files").iterdir()) == [kept.id]
    store.close()


# -- a full disk -------------------------------------------------------------------------------

async def disk_full_error(response: aiohttp.ClientResponse) -> None:
    error = await error_of(response, 507)
    assert (error["code"], error["type"], error["param"]) == ("insufficient_storage", "server_error", None)
    assert "batches.dir is full" in error["message"] and "DELETE /v1/files" in error["message"]


async def test_a_full_disk_while_an_upload_is_written_is_a_507_and_leaves_nothing(
        rig: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    opened: list[pathlib.Path] = []
    real_open = open

    class FullDisk:
        def __init__(self, path: pathlib.Path, mode: str) -> None:
            opened.append(path)
            self.file = real_open(path, mode)

        def __enter__(self) -> FullDisk:
            return self

        def __exit__(self, *exc: object) -> None:
            self.file.close()

        def write(self, data: bytes) -> int:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(api_module, "open", FullDisk, raising=False)
    await disk_full_error(await rig.client.post("/v1/files", data=form(line("a"))))
    assert len(opened) == 1 and opened[0].name.startswith(UPLOAD_PREFIX)
    assert rig.store.files() == [] and rig.leftovers() == []


async def test_a_full_disk_when_an_upload_is_recorded_is_a_507_and_leaves_nothing(
        rig: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rig.store, "_db", FullAtCommit(rig.store._db))
    await disk_full_error(await rig.client.post("/v1/files", data=form(line("a"))))
    monkeypatch.undo()
    assert rig.store.files() == [] and rig.leftovers() == []
    assert (await rig.client.post("/v1/files", data=form(line("a")))).status == 200


async def test_an_upload_to_a_real_full_disk_is_a_507_until_space_returns(
        small_disk: pathlib.Path) -> None:  # noqa: F811 - the fixture imported above
    async with serving(small_disk) as served:
        filler = fill(small_disk)
        await disk_full_error(await served.client.post("/v1/files", data=form(line("a"))))
        assert served.store.files() == [] and served.leftovers() == []
        filler.unlink()
        assert (await served.client.post("/v1/files", data=form(line("a")))).status == 200


# -- input hygiene -----------------------------------------------------------------------------

async def test_a_second_file_part_is_refused_and_nothing_is_kept(rig: Rig) -> None:
    body, content_type = raw_multipart([("purpose", None, b"batch"), ("file", "a.jsonl", line("a")),
                                        ("file", "b.jsonl", line("b"))])
    response = await rig.client.post("/v1/files", data=body, headers={"content-type": content_type})
    error = await error_of(response, 400)
    assert (error["code"], error["param"]) == ("duplicate_field", "file")
    assert rig.store.files() == [] and rig.leftovers() == []
    body, content_type = raw_multipart([("purpose", None, b"batch"), ("purpose", None, b"batch"),
                                        ("file", "a.jsonl", line("a"))])
    response = await rig.client.post("/v1/files", data=body, headers={"content-type": content_type})
    assert (await error_of(response, 400))["param"] == "purpose"


async def test_a_long_purpose_is_refused_without_reading_it_whole(rig: Rig) -> None:
    response = await rig.client.post("/v1/files", data=form(line("a"), purpose_="x"))  # an unknown field is skipped
    assert response.status == 200
    body, content_type = raw_multipart([("purpose", None, b"b" * (FIELD_MOST_BYTES + 1)),
                                        ("file", "a.jsonl", line("a"))])
    response = await rig.client.post("/v1/files", data=body, headers={"content-type": content_type})
    error = await error_of(response, 400)
    assert (error["code"], error["param"]) == ("invalid_field", "purpose")
    assert len(rig.store.files()) == 1 and rig.leftovers() == []


@pytest.mark.parametrize("filename", ['say "hi".jsonl', "two\nlines\r\n.jsonl", "back\\slash", "naïve ☃.jsonl",
                                      '";x=y'])
def test_content_disposition_keeps_any_filename_inside_its_header(filename: str) -> None:
    header = content_disposition(filename)
    assert header.isascii() and "\r" not in header and "\n" not in header
    plain, _, encoded = header.partition("; filename*=UTF-8''")
    assert plain.startswith('attachment; filename="') and plain.count('"') == 2
    assert urllib.parse.unquote(encoded) == filename


async def test_a_filename_with_a_quote_or_a_newline_cannot_break_the_download_header(rig: Rig) -> None:
    # A filename holding a quote (escaped in the multipart header, as clients send it) and a
    # percent sign: kept as sent, and sent back only inside the header's quotes and filename*.
    body, content_type = raw_multipart([("purpose", None, b"batch"), ("file", 'a\\"b%0Ac.jsonl', line("a"))])
    response = await rig.client.post("/v1/files", data=body, headers={"content-type": content_type})
    assert response.status == 200, await response.text()
    record = await response.json()
    assert record["filename"] == 'a"b%0Ac.jsonl'
    content = await rig.client.get(f"/v1/files/{record['id']}/content")
    assert content.status == 200 and await content.read() == line("a")
    header = content.headers["content-disposition"]
    assert urllib.parse.unquote(header.partition("filename*=UTF-8''")[2]) == record["filename"]
    assert header.partition("; filename*=")[0].count('"') == 2
