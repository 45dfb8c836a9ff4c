"""`llamaswap batches` against an admin server on 127.0.0.1: a fake one that pages a list of
batches as the admin's GET /batches does (the Batch API's own `list_page`, and the space the
files take), the real routes (with the Batch API off, and on with keys), and no server at all.
The command's HTTP calls block: it runs in a thread beside the server."""

from __future__ import annotations

import asyncio
import io
import json
import os
import socket
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from aiohttp import web

from llamaswap.batches.access import Access
from llamaswap.batches.api import BatchService, add_batch_routes
from llamaswap.batches.feeder import Feeder, FeedSettings
from llamaswap.batches.store import Store
from llamaswap.batches.documents import list_page
from llamaswap.commands import batches as command
from llamaswap.commands.main import build_parser
from llamaswap.config import parse_config

# 2026-12-04 14:00:00 UTC; the tests run in a zone two hours east of UTC, so local time shows.
T0 = 1796392800
ZONE = "LLT-2"


def batch(batch_id: str, status: str, counts: tuple[int, int, int], *, started: int | None, finish: int | None,
          priority: int = -100) -> dict[str, Any]:
    """A batch object as GET /v1/batches lists it (the fields the table reads, and a few more)."""
    completed, failed, total = counts
    return {"id": batch_id, "object": "batch", "endpoint": "/v1/chat/completions", "status": status,
            "created_at": T0 - 60, "in_progress_at": started, "completed_at": None, "metadata": None,
            "request_counts": {"total": total, "completed": completed, "failed": failed},
            "llamaswap": {"priority": priority, "in_flight": 2, "estimated_finish_at": finish}}


STORAGE = {"used_bytes": 3 << 30, "files": 14, "max_bytes": 4 << 30, "left_bytes": 1 << 30,
           "disk_free_bytes": 40 << 30}
BATCHES = [
    batch("batch_new", "in_progress", (12, 1, 50), started=T0, finish=T0 + 754),
    batch("batch_check", "validating", (0, 0, 0), started=None, finish=None, priority=0),
    batch("batch_old", "completed", (7, 0, 7), started=T0 - 3600, finish=None),
]


@pytest.fixture
def local_zone() -> Iterator[None]:
    saved = os.environ.get("TZ")
    os.environ["TZ"] = ZONE
    time.tzset()
    try:
        yield
    finally:
        if saved is None:
            del os.environ["TZ"]
        else:
            os.environ["TZ"] = saved
        time.tzset()


async def serve(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"


@pytest.fixture
async def admin() -> AsyncIterator[tuple[str, list[dict[str, str]]]]:
    """A fake admin server listing BATCHES, and the query of each GET /batches it answered."""
    asked: list[dict[str, str]] = []

    async def listing(request: web.Request) -> web.Response:
        asked.append(dict(request.query))
        page = list_page(BATCHES, after=request.query.get("after"), limit=int(request.query["limit"]),
                         key=lambda item: item["id"], document=lambda item: item)
        assert page is not None
        return web.json_response({**page, "storage": STORAGE})

    app = web.Application()
    app.router.add_get("/batches", listing)
    runner, url = await serve(app)
    try:
        yield url, asked
    finally:
        await runner.cleanup()


async def llamaswap_batches(*argv: str) -> tuple[int, str, str]:
    """Run `llamaswap batches ARGV` in a thread: (exit status, stdout, stderr)."""
    args = build_parser().parse_args(["batches", *argv])
    out, err = io.StringIO(), io.StringIO()
    status = await asyncio.to_thread(args.run, args, out=out, err=err)
    return status, out.getvalue(), err.getvalue()


async def test_the_table_shows_each_batch_with_its_progress_start_finish_and_priority(admin, local_zone):
    url, asked = admin
    status, out, err = await llamaswap_batches("--admin", url)
    assert (status, err) == (0, "")
    lines = out.splitlines()
    assert lines[0] == "3 batches: 1 in_progress, 1 validating, 1 completed"
    assert lines[1] == "files: 3.0 GiB in 14 (quota 4.0 GiB, 1.0 GiB left); disk: 40.0 GiB free"
    assert lines[2].split() == ["ID", "STATUS", "DONE/FAILED/TOTAL", "STARTED", "FINISH", "PRIORITY"]
    # Local time: two hours east of UTC's 14:00.
    assert lines[3].split() == ["batch_new", "in_progress", "12/1/50", "2026-12-04", "16:00:00",
                                "2026-12-04", "16:12:34", "-100"]
    assert lines[4].split() == ["batch_check", "validating", "0/0/0", "-", "-", "0"]
    assert lines[5].split() == ["batch_old", "completed", "7/0/7", "2026-12-04", "15:00:00", "-", "-100"]
    assert len(lines) == 6
    # Columns line up: each row's STATUS starts where its header does.
    assert len({line.index(word) for line, word in zip(lines[2:], ("STATUS", "in_progress", "validating",
                                                                       "completed"))}) == 1
    assert asked == [{"limit": str(command.PAGE)}]


async def test_it_follows_every_page(admin, monkeypatch):
    url, asked = admin
    monkeypatch.setattr(command, "PAGE", 2)
    status, out, _ = await llamaswap_batches("--admin", url)
    assert status == 0
    assert [line.split()[0] for line in out.splitlines()[3:]] == ["batch_new", "batch_check", "batch_old"]
    assert asked == [{"limit": "2"}, {"limit": "2", "after": "batch_check"}]


async def test_json_prints_the_list_of_every_batch(admin, monkeypatch):
    url, _ = admin
    monkeypatch.setattr(command, "PAGE", 2)
    status, out, _ = await llamaswap_batches("--admin", url, "--json")
    assert status == 0
    assert json.loads(out) == {"object": "list", "data": BATCHES, "first_id": "batch_new", "last_id": "batch_old",
                               "has_more": False, "storage": STORAGE}


async def test_none_yet():
    async def empty(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [], "first_id": None, "last_id": None, "has_more": False})

    app = web.Application()
    app.router.add_get("/batches", empty)
    runner, url = await serve(app)
    try:
        status, out, _ = await llamaswap_batches("--admin", url)
    finally:
        await runner.cleanup()
    assert status == 0
    assert out.splitlines() == ["0 batches", "ID  STATUS  DONE/FAILED/TOTAL  STARTED  FINISH  PRIORITY"]


async def test_the_batch_api_off_says_so_and_exits_1():
    app = web.Application()
    add_batch_routes(app, None)  # the sidecar's own routes without batches.dir
    runner, url = await serve(app)
    try:
        status, out, err = await llamaswap_batches("--admin", url)
    finally:
        await runner.cleanup()
    assert (status, out) == (1, "")
    assert err == (f"error: the Batch API is off on the llamaswap at {url}: batches.dir is unset "
                   "(set it to a directory, a persistent volume, to turn it on)\n")


async def test_another_http_error_names_the_url_and_the_status():
    app = web.Application()  # an admin server without the Batch API's routes: aiohttp's 404
    runner, url = await serve(app)
    try:
        status, _, err = await llamaswap_batches("--admin", url)
    finally:
        await runner.cleanup()
    assert status == 1
    assert err == f"error: GET {url}/batches?limit={command.PAGE}: HTTP 404\n"


async def test_an_unreachable_admin_is_an_error_like_queue_s(tmp_path):
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    status, out, err = await llamaswap_batches("--admin", f"127.0.0.1:{port}")
    assert (status, out) == (1, "")
    assert err.startswith(f"error: GET http://127.0.0.1:{port}/batches?limit={command.PAGE}: ")
    assert "refused" in err.lower()
    # The same address in a configuration: the same error (listen.admin is asked).
    path = tmp_path / "c.yaml"
    path.write_text(f"listen:\n  admin: 127.0.0.1:{port}\n")
    assert (await llamaswap_batches("-c", str(path)))[:2] == (1, "")


async def test_with_keys_it_lists_every_callers_batches_and_the_space_without_a_key(tmp_path, monkeypatch):
    """The real routes with batches.apiKeys: /v1/batches wants a key and shows a caller its own,
    the admin's /batches (which Envoy's listener does not route) shows every caller's."""
    monkeypatch.setenv("ALICE_KEY", "sk-alice")
    config = parse_config({"batches": {"dir": str(tmp_path), "maxStoredBytes": 1 << 20,
                                       "apiKeys": [{"name": "alice", "key": "env:ALICE_KEY"}]}})
    store = Store(tmp_path)
    upload = tmp_path / "upload"
    upload.write_bytes(b"x" * 1000)
    record = store.add_file(upload, filename="in.jsonl", purpose="batch", owner="alice")
    for owner in ("alice", "bob"):
        store.create_batch(endpoint="/v1/chat/completions", input_file_id=record.id, completion_window="24h",
                           window_s=86400, metadata=None, priority=-100, trace_id="1" * 32, span_id="2" * 16,
                           owner=owner)
    app = web.Application()
    add_batch_routes(app, BatchService(store, Feeder(store, FeedSettings("http://127.0.0.1:9", lambda: 1, lambda: 5)),
                                       lambda: config, lambda: ("1" * 32, "2" * 16),
                                       access=Access(config.batches.read_keys(None))))
    runner, url = await serve(app)
    try:
        status, out, err = await llamaswap_batches("--admin", url, "--json")
    finally:
        await runner.cleanup()
        store.close()
    assert (status, err) == (0, "")
    document = json.loads(out)
    assert len(document["data"]) == 2
    storage = document["storage"]
    assert (storage["used_bytes"], storage["files"], storage["max_bytes"]) == (1000, 1, 1 << 20)
    assert storage["left_bytes"] <= (1 << 20) - 1000 and storage["disk_free_bytes"] > 0
