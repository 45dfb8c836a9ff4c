"""The Batch API's routes on their own (aiohttp's test client, no Envoy): every refusal in the
OpenAI error shape with nothing kept, lists and cursors, the API turned off."""

from __future__ import annotations

import json
import pathlib
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from llamaswap.batches.access import Access
from llamaswap.batches.api import BatchService, add_batch_routes
from llamaswap.batches.feeder import Feeder, FeedSettings
from llamaswap.batches.store import Store
from llamaswap.config import parse_config

ENDPOINT = "/v1/chat/completions"


def line(custom_id: str) -> bytes:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": ENDPOINT,
                       "body": {"model": "m", "messages": []}}).encode() + b"\n"


@pytest.fixture
async def api(tmp_path: pathlib.Path) -> AsyncIterator[tuple[TestClient, Store]]:
    config = parse_config({"batches": {"dir": str(tmp_path), "maxFileBytes": 2000, "maxRequests": 5},
                           "security": {"priority": {"mode": "clamp", "min": -100, "max": 50}}})
    store = Store(tmp_path)
    feeder = Feeder(store, FeedSettings("http://127.0.0.1:9", lambda: 1, lambda: 5))
    app = web.Application()
    add_batch_routes(app, BatchService(store, feeder, lambda: config, lambda: ("1" * 32, "2" * 16)))
    async with TestClient(TestServer(app)) as client:
        yield client, store
    store.close()


async def upload(client: TestClient, data: bytes, purpose: str = "batch") -> aiohttp.ClientResponse:
    form = aiohttp.FormData()
    form.add_field("purpose", purpose)
    form.add_field("file", data, filename="in.jsonl", content_type="application/jsonl")
    return await client.post("/v1/files", data=form)


async def error_of(response: aiohttp.ClientResponse, status: int) -> dict[str, Any]:
    assert response.status == status, await response.text()
    assert response.content_type == "application/json"
    body = await response.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]  # type: ignore[no-any-return]


def kept_files(tmp_path: pathlib.Path) -> list[str]:
    return sorted(path.name for path in (tmp_path / "files").iterdir())


async def test_refused_uploads_keep_nothing(api: tuple[TestClient, Store], tmp_path: pathlib.Path) -> None:
    client, store = api
    assert (await error_of(await upload(client, line("a") * 40), 413))["code"] == "file_too_large"
    too_many = b"".join(line(f"r{n}") for n in range(6))
    error = await error_of(await upload(client, too_many), 400)
    assert error["code"] == "too_many_requests" and "batches.maxRequests" in error["message"]
    assert (await error_of(await upload(client, line("a"), purpose="fine-tune"), 400))["param"] == "purpose"
    form = aiohttp.FormData(default_to_multipart=True)
    form.add_field("purpose", "batch")
    assert (await error_of(await client.post("/v1/files", data=form), 400))["param"] == "file"
    assert (await error_of(await client.post("/v1/files", json={}), 400))["code"] == "invalid_content_type"
    assert kept_files(tmp_path) == [] and store.files() == []


async def test_files_are_listed_newest_first_with_a_cursor(api: tuple[TestClient, Store]) -> None:
    client, _ = api
    ids = [(await (await upload(client, line(f"f{n}"))).json())["id"] for n in range(3)]
    first = await (await client.get("/v1/files?limit=2")).json()
    assert [item["id"] for item in first["data"]] == ids[::-1][:2] and first["has_more"]
    rest = await (await client.get(f"/v1/files?limit=2&after={first['last_id']}")).json()
    assert [item["id"] for item in rest["data"]] == [ids[0]] and not rest["has_more"]
    assert (await error_of(await client.get("/v1/files?after=file-none"), 400))["param"] == "after"
    content = await client.get(f"/v1/files/{ids[1]}/content")
    assert await content.read() == line("f1")
    assert (await (await client.delete(f"/v1/files/{ids[1]}")).json()) == {"id": ids[1], "object": "file",
                                                                            "deleted": True}
    assert (await error_of(await client.get(f"/v1/files/{ids[1]}"), 404))["code"] == "file_not_found"


async def test_bad_batch_requests_are_refused_before_anything_is_kept(api: tuple[TestClient, Store]) -> None:
    client, store = api
    file_id = (await (await upload(client, line("a"))).json())["id"]
    good = {"input_file_id": file_id, "endpoint": ENDPOINT, "completion_window": "24h"}
    cases: list[tuple[Any, int, str]] = [
        ({**good, "endpoint": "/v1/responses"}, 400, "invalid_endpoint"),
        ({**good, "completion_window": "1h"}, 400, "invalid_completion_window"),
        ({**good, "input_file_id": None}, 400, "missing_required_parameter"),
        ({**good, "input_file_id": "file-none"}, 404, "file_not_found"),
        ({**good, "metadata": {"k": 1}}, 400, "invalid_metadata"),
        ({**good, "metadata": {str(n): "v" for n in range(17)}}, 400, "invalid_metadata"),
        ({**good, "metadata": {"priority": "soon"}}, 400, "invalid_priority"),
        ([good], 400, "invalid_json"),
    ]
    for body, status, code in cases:
        assert (await error_of(await client.post("/v1/batches", json=body), status))["code"] == code, body
    assert (await error_of(await client.post("/v1/batches", data=b"{"), 400))["code"] == "invalid_json"
    assert store.batches() == []
    # The operator's clamp applies to metadata.priority as to the header.
    created = await (await client.post("/v1/batches", json={**good, "metadata": {"priority": "interactive"}})).json()
    assert created["status"] == "validating" and created["llamaswap"]["priority"] == 50
    assert created["request_counts"] == {"total": 0, "completed": 0, "failed": 0}
    assert (await error_of(await client.delete(f"/v1/files/{file_id}"), 409))["code"] == "file_in_use"


async def test_batches_are_listed_and_cancelled_once(api: tuple[TestClient, Store]) -> None:
    client, _ = api
    file_id = (await (await upload(client, line("a"))).json())["id"]
    body = {"input_file_id": file_id, "endpoint": ENDPOINT, "completion_window": "24h"}
    ids = [(await (await client.post("/v1/batches", json=body)).json())["id"] for _ in range(3)]
    listed = await (await client.get("/v1/batches?limit=2")).json()
    assert listed["object"] == "list" and [b["id"] for b in listed["data"]] == ids[::-1][:2] and listed["has_more"]
    assert (await error_of(await client.get("/v1/batches?limit=101"), 400))["param"] == "limit"
    cancelled = await (await client.post(f"/v1/batches/{ids[0]}/cancel")).json()
    assert cancelled["status"] == "cancelling" and cancelled["cancelling_at"] is not None
    again = await (await client.post(f"/v1/batches/{ids[0]}/cancel")).json()
    assert again["cancelling_at"] == cancelled["cancelling_at"]
    assert (await error_of(await client.post("/v1/batches/batch_none/cancel"), 404))["code"] == "batch_not_found"
    assert (await error_of(await client.get(f"/v1/batches/{ids[1]}/cancel"), 405))["code"] == "method_not_allowed"


async def test_without_a_directory_every_route_says_how_to_turn_it_on() -> None:
    app = web.Application()
    add_batch_routes(app, None)
    async with TestClient(TestServer(app)) as client:
        for method, path in (("GET", "/v1/batches"), ("POST", "/v1/files"), ("GET", "/v1/files/x/content")):
            error = await error_of(await client.request(method, path), 404)
            assert error["code"] == "batches_off" and "batches.dir" in error["message"]


async def test_with_an_upstream_key_the_api_wants_it(tmp_path: pathlib.Path) -> None:
    config = parse_config({"batches": {"dir": str(tmp_path)}})
    store = Store(tmp_path)
    app = web.Application()
    service = BatchService(store, Feeder(store, FeedSettings("http://127.0.0.1:9", lambda: 1, lambda: 5)),
                           lambda: config, lambda: ("1" * 32, "2" * 16),
                           access=Access(config.batches.read_keys("sekrit")))
    add_batch_routes(app, service)
    async with TestClient(TestServer(app)) as client:
        error = await error_of(await client.get("/v1/batches"), 401)
        assert error["code"] == "invalid_api_key" and "sekrit" not in error["message"]
        assert (await client.get("/v1/batches", headers={"authorization": "Bearer wrong"})).status == 401
        assert (await client.get("/v1/batches", headers={"authorization": "Bearer sekrit"})).status == 200
    store.close()


def test_an_unusable_batches_dir_stops_serve_with_exit_2(tmp_path: pathlib.Path) -> None:
    import subprocess
    import sys

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    config = tmp_path / "llamaswap.yaml"
    config.write_text(f"batches: {{dir: {blocker / 'below'}}}\nupstream: {{url: http://127.0.0.1:9}}\n"
                      "listen: {grpc: 127.0.0.1:0, admin: 127.0.0.1:0}\n")
    result = subprocess.run([sys.executable, "-m", "llamaswap", "serve", "-c", str(config)], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 2, result.stderr
    assert "batches.dir" in result.stderr and "Traceback" not in result.stderr
