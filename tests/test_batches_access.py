"""Who sees what in the Batch API, and the priority a batch's creator may give its lines: callers
told apart by their keys (batches.apiKeys) or by the header an authenticating proxy sets
(batches.callerHeader); another caller's file or batch is 404; an admin sees all. The trusted
priority of the creating request bounds the lines, and so does the clamp in force when each
line is sent (a reload that tightens it bounds running batches)."""

from __future__ import annotations

import asyncio
import json
import pathlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from llamaswap.batches.access import OPEN, Access, Caller, Unidentified
from llamaswap.batches.api import BatchService, add_batch_routes
from llamaswap.batches.feeder import Feeder, FeedSettings
from llamaswap.batches.lifecycle import bounded_priority, trusted_ceiling
from llamaswap.batches.store import Store
from llamaswap.config import Config, ConfigError, parse_config
from llamaswap.config.batches import KnownKey

ENDPOINT = "/v1/chat/completions"
TRUSTED = "x-trusted-priority"
KEYS = {"ALICE_KEY": "sk-alice", "BOB_KEY": "sk-bob", "OPS_KEY": "sk-ops"}


def line(custom_id: str) -> bytes:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": ENDPOINT,
                       "body": {"model": "m", "messages": [{"role": "user", "content": custom_id}]}}).encode() + b"\n"


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


class Settings:
    """The configuration in effect, as the sidecar holds it: a reload replaces it."""

    def __init__(self, document: dict[str, Any]) -> None:
        self.config = parse_config(document)

    def __call__(self) -> Config:
        return self.config


class Api:
    def __init__(self, client: TestClient, store: Store, service: BatchService) -> None:
        self.client, self.store, self.service = client, store, service

    async def upload(self, headers: dict[str, str], data: bytes = b"", **fields: str) -> aiohttp.ClientResponse:
        form = aiohttp.FormData()
        form.add_field("purpose", "batch")
        for name, value in fields.items():
            form.add_field(name, value)
        form.add_field("file", data or line("a"), filename="in.jsonl", content_type="application/jsonl")
        return await self.client.post("/v1/files", data=form, headers=headers)

    async def file_id(self, headers: dict[str, str]) -> str:
        response = await self.upload(headers)
        assert response.status == 200, await response.text()
        return (await response.json())["id"]  # type: ignore[no-any-return]

    async def batch(self, headers: dict[str, str], file_id: str, **extra: Any) -> dict[str, Any]:
        response = await self.client.post("/v1/batches", headers=headers, json={
            "input_file_id": file_id, "endpoint": ENDPOINT, "completion_window": "24h", **extra})
        assert response.status == 200, await response.text()
        return await response.json()  # type: ignore[no-any-return]


async def api_over(tmp_path: pathlib.Path, settings: Settings, *, upstream_key: str | None = None,
                   feed: FeedSettings | None = None) -> AsyncIterator[Api]:
    batches = settings().batches
    store = Store(tmp_path / "batches")
    feeder = Feeder(store, feed or FeedSettings("http://127.0.0.1:9", lambda: 1, lambda: 100))
    service = BatchService(store, feeder, settings, lambda: ("1" * 32, "2" * 16),
                           access=Access(batches.read_keys(upstream_key), batches.caller_header,
                                         frozenset(batches.admin_callers)))
    app = web.Application()
    add_batch_routes(app, service)
    async with TestClient(TestServer(app)) as client:
        yield Api(client, store, service)
    store.close()


@pytest.fixture
async def keyed(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Api]:
    for name, value in KEYS.items():
        monkeypatch.setenv(name, value)
    settings = Settings({"batches": {"dir": str(tmp_path), "apiKeys": [
        {"name": "alice", "key": "env:ALICE_KEY"}, {"name": "bob", "key": "env:BOB_KEY"},
        {"name": "ops", "key": "env:OPS_KEY", "admin": True}]}})
    async for api in api_over(tmp_path, settings):
        yield api


async def error_of(response: aiohttp.ClientResponse, status: int) -> dict[str, Any]:
    assert response.status == status, await response.text()
    body = await response.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]  # type: ignore[no-any-return]


# -- owners ------------------------------------------------------------------------------------

async def test_a_second_caller_sees_none_of_the_firsts_files_or_batches(keyed: Api) -> None:
    alice, bob = bearer("sk-alice"), bearer("sk-bob")
    file_id = await keyed.file_id(alice)
    batch_id = (await keyed.batch(alice, file_id))["id"]
    assert keyed.store.file(file_id).owner == "alice"  # type: ignore[union-attr]
    assert keyed.store.batch(batch_id).owner == "alice"  # type: ignore[union-attr]

    assert (await (await keyed.client.get("/v1/files", headers=bob)).json())["data"] == []
    assert (await (await keyed.client.get("/v1/batches", headers=bob)).json())["data"] == []
    for method, path, code in (("GET", f"/v1/files/{file_id}", "file_not_found"),
                               ("GET", f"/v1/files/{file_id}/content", "file_not_found"),
                               ("DELETE", f"/v1/files/{file_id}", "file_not_found"),
                               ("GET", f"/v1/batches/{batch_id}", "batch_not_found"),
                               ("POST", f"/v1/batches/{batch_id}/cancel", "batch_not_found")):
        error = await error_of(await keyed.client.request(method, path, headers=bob), 404)
        assert error["code"] == code, path
    # Nor can it start a batch from the first's file: as if the file did not exist.
    response = await keyed.client.post("/v1/batches", headers=bob, json={
        "input_file_id": file_id, "endpoint": ENDPOINT, "completion_window": "24h"})
    assert (await error_of(response, 404))["code"] == "file_not_found"
    # Nothing of bob's doing changed alice's.
    assert keyed.store.file(file_id) is not None and keyed.store.batch(batch_id).status.value == "validating"  # type: ignore[union-attr]
    listed = await (await keyed.client.get("/v1/batches", headers=alice)).json()
    assert [item["id"] for item in listed["data"]] == [batch_id]


async def test_the_admin_key_sees_and_manages_every_callers(keyed: Api) -> None:
    alice, bob, ops = bearer("sk-alice"), bearer("sk-bob"), bearer("sk-ops")
    alices = await keyed.file_id(alice)
    files = {alices, await keyed.file_id(bob)}
    batch_id = (await keyed.batch(alice, alices))["id"]
    listed = await (await keyed.client.get("/v1/files", headers=ops)).json()
    assert {item["id"] for item in listed["data"]} == files
    assert [item["id"] for item in (await (await keyed.client.get("/v1/batches", headers=ops)).json())["data"]] == [
        batch_id]
    cancelled = await keyed.client.post(f"/v1/batches/{batch_id}/cancel", headers=ops)
    assert (await cancelled.json())["status"] == "cancelling"


async def test_a_request_without_an_accepted_key_is_401_and_names_no_key(keyed: Api) -> None:
    for headers in ({}, bearer("sk-nobody"), {"authorization": "sk-alice"}):
        error = await error_of(await keyed.client.get("/v1/files", headers=headers), 401)
        assert error["code"] == "invalid_api_key" and error["type"] == "authentication_error"
        assert "sk-" not in error["message"]


async def test_the_admin_servers_summary_lists_every_callers_batches_without_a_key(keyed: Api) -> None:
    for key in ("sk-alice", "sk-bob"):
        await keyed.batch(bearer(key), await keyed.file_id(bearer(key)))
    summary = await (await keyed.client.get("/batches")).json()
    assert len(summary["data"]) == 2
    assert summary["storage"]["files"] == 2 and summary["storage"]["used_bytes"] == 2 * len(line("a"))


async def test_the_caller_header_names_the_owner_and_admin_callers_see_all(tmp_path: pathlib.Path) -> None:
    settings = Settings({"batches": {"dir": str(tmp_path), "callerHeader": "X-Caller", "adminCallers": ["ops"]}})
    async for api in api_over(tmp_path, settings):
        error = await error_of(await api.client.get("/v1/files"), 401)
        assert error["code"] == "missing_caller" and "x-caller" in error["message"]
        file_id = await api.file_id({"x-caller": "alice"})
        assert api.store.file(file_id).owner == "alice"  # type: ignore[union-attr]
        assert (await (await api.client.get("/v1/files", headers={"x-caller": "bob"})).json())["data"] == []
        assert (await api.client.get(f"/v1/files/{file_id}", headers={"x-caller": "bob"})).status == 404
        assert (await api.client.get(f"/v1/files/{file_id}", headers={"x-caller": "alice"})).status == 200
        assert (await api.client.get(f"/v1/files/{file_id}", headers={"x-caller": "ops"})).status == 200


def test_identify_decides_who_calls() -> None:
    keys = (KnownKey("k1", "alice", False), KnownKey("k2", "root", True))
    both = Access(keys, "x-caller", frozenset({"ops"}))
    assert both.identify({"authorization": "Bearer k1"}) == Caller("alice", False)
    assert both.identify({"authorization": "Bearer k2"}) == Caller("root", True)
    # A header sent beside a key names the caller and its role: the key only admits it.
    assert both.identify({"authorization": "Bearer k2", "x-caller": "bob"}) == Caller("bob", False)
    assert both.identify({"authorization": "Bearer k1", "x-caller": "ops"}) == Caller("ops", True)
    with pytest.raises(Unidentified):
        both.identify({"x-caller": "bob"})  # the header alone does not pass where keys are set
    with pytest.raises(Unidentified):
        Access((), "x-caller").identify({"x-caller": "x" * 300})
    assert Access().identify({}) is OPEN and Access().open and not both.open
    assert OPEN.sees(None) and OPEN.sees("alice") and Caller("alice", False).only == "alice"
    assert not Caller("alice", False).sees(None) and not Caller("alice", False).sees("bob")


def test_the_upstream_key_alone_is_one_caller_who_sees_all(monkeypatch: pytest.MonkeyPatch) -> None:
    config = parse_config({})
    assert config.batches.read_keys("sk-up") == (KnownKey("sk-up", "upstream-key", True),)
    assert config.batches.read_keys(None) == ()
    assert config.batches.open_to_all


def test_a_key_that_cannot_be_read_names_its_entry(monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path) -> None:
    monkeypatch.delenv("NOPE_KEY", raising=False)
    monkeypatch.setenv("SAME_KEY", "sk-same")
    config = parse_config({"batches": {"apiKeys": [{"name": "a", "key": f"file:{tmp_path / 'missing'}"}]}})
    with pytest.raises(ConfigError) as caught:
        config.batches.read_keys(None)
    assert str(caught.value).startswith("batches.apiKeys[0].key: cannot read the file")
    config = parse_config({"batches": {"apiKeys": [{"name": "a", "key": "env:SAME_KEY"},
                                                   {"name": "b", "key": "env:NOPE_KEY"}]}})
    with pytest.raises(ConfigError) as caught:
        config.batches.read_keys(None)
    assert str(caught.value) == "batches.apiKeys[1].key: the environment variable NOPE_KEY is unset or empty"
    config = parse_config({"batches": {"apiKeys": [{"name": "a", "key": "env:SAME_KEY"},
                                                   {"name": "b", "key": "env:SAME_KEY"}]}})
    with pytest.raises(ConfigError) as caught:
        config.batches.read_keys(None)
    assert "sk-same" not in str(caught.value) and str(caught.value).startswith("batches.apiKeys[1].key: holds the same")


def test_a_bad_key_file_stops_serve_with_exit_2(tmp_path: pathlib.Path) -> None:
    import subprocess
    import sys

    config = tmp_path / "llamaswap.yaml"
    config.write_text(f"batches: {{dir: {tmp_path / 'b'}, apiKeys: [{{name: a, key: 'file:{tmp_path / 'none'}'}}]}}\n"
                      "upstream: {url: http://127.0.0.1:9}\nlisten: {grpc: 127.0.0.1:0, admin: 127.0.0.1:0}\n")
    result = subprocess.run([sys.executable, "-m", "llamaswap", "serve", "-c", str(config)], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 2, result.stderr
    assert "batches.apiKeys[0].key" in result.stderr and "Traceback" not in result.stderr


# -- priority: the creator's trusted ceiling, the clamp in force --------------------------------

def test_the_lines_priority_is_the_claim_under_the_policy_in_force_never_above_the_ceiling() -> None:
    clamp = parse_config({"security": {"priority": {"mode": "clamp", "min": -100, "max": 100,
                                                    "trustedHeader": TRUSTED}}}).priority_policy()
    tighter = parse_config({"security": {"priority": {"mode": "clamp", "min": -100, "max": 0,
                                                      "trustedHeader": TRUSTED}}}).priority_policy()
    interactive = {"priority": "interactive"}
    assert trusted_ceiling("-100", clamp) == -100 and trusted_ceiling("batch", clamp) == -100
    assert trusted_ceiling("soon", clamp) is None and trusted_ceiling(None, clamp) is None
    assert trusted_ceiling("5", parse_config({}).priority_policy()) is None  # no trusted header configured
    assert bounded_priority(interactive, -100, clamp) == -100
    assert bounded_priority(interactive, None, clamp) == 100
    assert bounded_priority(interactive, None, tighter) == 0
    assert bounded_priority(interactive, 50, tighter) == 0
    assert bounded_priority(None, 100, clamp) == -100  # no claim: the batch default, under the ceiling
    strip = parse_config({"security": {"priority": {"mode": "strip"}}}).priority_policy()
    assert bounded_priority(interactive, None, strip) == -100


class Listener:
    """Envoy's listener as the feeder sees it: records each line's priority header; each answer
    waits for ``gate``."""

    def __init__(self) -> None:
        self.priorities: list[str | None] = []
        self.gate = asyncio.Event()
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        async def handle(request: web.Request) -> web.Response:
            self.priorities.append(request.headers.get(TRUSTED))
            await self.gate.wait()
            return web.json_response({"ok": True})

        app = web.Application()
        app.router.add_post(ENDPOINT, handle)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]

    async def stop(self) -> None:
        self.gate.set()
        if self._runner is not None:
            await self._runner.cleanup()


async def wait_until(predicate: Callable[[], Any], what: str, timeout_s: float = 30.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


def priority_document(max_priority: int) -> dict[str, Any]:
    return {"security": {"priority": {"mode": "clamp", "min": -100, "max": max_priority, "trustedHeader": TRUSTED}}}


Reload = Callable[[Settings, "Listener"], None]


async def run_batch(tmp_path: pathlib.Path, trusted: str, lines: int,
                    during: Reload | None = None) -> tuple[list[str | None], dict[str, Any]]:
    """A batch created with ``trusted`` in the trusted header and metadata.priority interactive,
    fed one line at a time; ``during`` runs once the first line is in flight (a reload)."""
    settings = Settings({"batches": {"dir": str(tmp_path)}, **priority_document(100)})
    listener = Listener()
    await listener.start()
    holder: dict[str, BatchService] = {}
    feed = FeedSettings(listener.url, lambda: 1, lambda: 100, priority_header=TRUSTED,
                        line_priority=lambda batch: holder["service"].line_priority(batch))
    try:
        async for api in api_over(tmp_path, settings, feed=feed):
            holder["service"] = api.service
            form = aiohttp.FormData()
            form.add_field("purpose", "batch")
            form.add_field("file", b"".join(line(f"l{n}") for n in range(lines)), filename="in.jsonl")
            file_id = (await (await api.client.post("/v1/files", data=form)).json())["id"]
            created = await api.batch({TRUSTED: trusted}, file_id, metadata={"priority": "interactive"})
            task = asyncio.create_task(api.service.feeder.run())
            try:
                await wait_until(lambda: len(listener.priorities) == 1, "the first line")
                if during is not None:
                    during(settings, listener)
                listener.gate.set()
                await wait_until(lambda: api.store.batch(created["id"]).status.ended,  # type: ignore[union-attr]
                                 "the batch to end")
            finally:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
    finally:
        await listener.stop()
    return listener.priorities, created


async def test_a_caller_the_proxy_marks_batch_cannot_ask_for_interactive(tmp_path: pathlib.Path) -> None:
    priorities, created = await run_batch(tmp_path, "-100", 3)
    assert created["llamaswap"]["priority"] == -100
    assert priorities == ["-100"] * 3


async def test_a_reload_that_tightens_the_clamp_bounds_a_running_batch(tmp_path: pathlib.Path) -> None:
    def reload(settings: Settings, _: Listener) -> None:
        settings.config = parse_config({"batches": {"dir": str(tmp_path)}, **priority_document(0)})

    priorities, created = await run_batch(tmp_path, "100", 4, during=reload)
    assert created["llamaswap"]["priority"] == 100
    # The first line was sent before the reload; every later one at the tightened clamp.
    assert priorities == ["100", "0", "0", "0"]
