"""What the upstream's GET /v1/models says (shapes as llama-server b11434 and llama-swap answer)."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import web
from fake_llama import FakeLlamaServer
from llamaswap.adapters.upstream_http import HttpUpstream, catalog_from
from llamaswap.core import MonotonicClock
from llamaswap.runtime.observer import SettleReason, SettleResult
from llamaswap.runtime.settle import Settling, settle_upstream
from llamaswap.runtime.upstream import UpstreamKind, UpstreamUnanswered


def router(*states: tuple[str, str]) -> dict:
    return {"data": [{"id": name, "aliases": [f"{name}-alias"], "object": "model", "owned_by": "llamacpp",
                      "status": {"value": value, "args": ["llama-server"]}} for name, value in states]}


def test_router_mode_lists_models_aliases_and_the_loaded_one():
    catalog = catalog_from(router(("tiny-a", "unloaded"), ("tiny-b", "loaded")))
    assert catalog is not None
    assert catalog.kind is UpstreamKind.ROUTER
    assert catalog.models == {"tiny-a", "tiny-a-alias", "tiny-b", "tiny-b-alias"}
    assert (catalog.residents, catalog.residents_known) == (frozenset({"tiny-b"}), True)


def test_router_mode_with_nothing_loaded_says_so():
    catalog = catalog_from(router(("tiny-a", "unloaded"), ("tiny-b", "unloaded")))
    assert catalog is not None and (catalog.residents, catalog.residents_known) == (frozenset(), True)


def test_router_mode_loading_counts_as_loaded():
    catalog = catalog_from(router(("tiny-a", "loading"), ("tiny-b", "unloaded")))
    assert catalog is not None and (catalog.residents, catalog.residents_known) == (frozenset({"tiny-a"}), True)


def test_router_mode_with_several_loaded_says_each():
    """--models-max N keeps up to N models loaded: the resident set is every one of them."""
    catalog = catalog_from(router(("tiny-a", "loaded"), ("tiny-b", "loading"), ("tiny-c", "unloaded")))
    assert catalog is not None
    assert (catalog.residents, catalog.residents_known) == (frozenset({"tiny-a", "tiny-b"}), True)


def test_single_model_llama_server_serves_any_name():
    document = {"models": [{"name": "/m/tiny-a.gguf"}], "object": "list",
                "data": [{"id": "/m/tiny-a.gguf", "aliases": ["/m/tiny-a.gguf"], "object": "model"}]}
    catalog = catalog_from(document)
    assert catalog is not None
    assert catalog.kind is UpstreamKind.SINGLE
    assert catalog.models == {"/m/tiny-a.gguf"}
    assert catalog.residents_known is False


def test_llama_swap_is_recognised_by_its_owner():
    document = {"object": "list", "data": [{"id": "qwen", "object": "model", "owned_by": "llama-swap"},
                                           {"id": "llama", "object": "model", "owned_by": "llama-swap"}]}
    catalog = catalog_from(document)
    assert catalog is not None and catalog.kind is UpstreamKind.LLAMA_SWAP
    assert catalog.models == {"qwen", "llama"}


def test_answers_that_are_not_a_model_list():
    assert catalog_from({"error": "nope"}) is None
    assert catalog_from("text") is None
    empty = catalog_from({"data": [{"no": "id"}, 7]})
    assert empty is not None and empty.kind is UpstreamKind.SINGLE and empty.models == frozenset()


# -- busy(): "cannot tell" versus "no answer this time", against a fake llama-server ------------


async def test_busy_tells_no_answer_from_no_slots() -> None:
    upstream = FakeLlamaServer().started()
    client = HttpUpstream(upstream.url, timeout_s=0.2)
    try:
        assert await client.busy(None) == 0
        upstream.slots_failures = 1
        with pytest.raises(UpstreamUnanswered):  # a 5xx: ask again
            await client.busy(None)
        upstream.slots_stall_s = 1.0
        with pytest.raises(UpstreamUnanswered):  # a timeout: ask again
            await client.busy(None)
        upstream.slots_stall_s = 0.0
        assert await client.busy(None) == 0
    finally:
        await client.close()
        upstream.close()
    refused = HttpUpstream(upstream.url, timeout_s=0.2)  # nothing listens there any more
    try:
        with pytest.raises(UpstreamUnanswered):
            await refused.busy(None)
    finally:
        await refused.close()


async def test_busy_without_slots_is_unsupported() -> None:
    """A server with no GET /slots (404; llama-server --no-slots answers 501) cannot tell, ever."""
    async def models(_: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "m", "object": "model"}]})

    async def no_slots(_: web.Request) -> web.Response:
        return web.json_response({"error": "no slots"}, status=501)

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_get("/slots", no_slots)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    client = HttpUpstream(f"http://127.0.0.1:{port}")
    try:
        assert await client.busy(None) is None
    finally:
        await client.close()
        await runner.cleanup()


async def test_router_busy_asks_each_loaded_model_url_encoded() -> None:
    upstream = FakeLlamaServer(router=True, models=("a b&c", "other"), loaded="a b&c").started()
    client = HttpUpstream(upstream.url)
    try:
        assert await client.busy(None) == 0
        assert upstream.slots_asked == ["a b&c"]  # one parameter, the whole name
        upstream.slots_failures = 1
        with pytest.raises(UpstreamUnanswered):
            await client.busy(None)
    finally:
        await client.close()
        upstream.close()


async def test_busy_counts_the_slots_processing() -> None:
    """A settle compares the count with the grants it holds (issue 25): not only busy or idle."""
    for upstream in (FakeLlamaServer(slots=4), FakeLlamaServer(router=True, loaded="model-a", slots=4)):
        upstream.started()
        client = HttpUpstream(upstream.url)
        try:
            upstream.active = 3
            assert await client.busy(None) == 3
        finally:
            upstream.active = 0
            await client.close()
            upstream.close()


async def test_router_busy_never_asks_a_model_it_unloaded_while_listed_loaded() -> None:
    """llama-server still lists a model `loaded` while its instance exits after an unload, and a
    /slots?model= that reaches it then holds the exit 10 s (bench/swap_probe.py): a settle that
    stopped a generation must not ask it."""
    upstream = FakeLlamaServer(router=True, models=("model-a", "model-b"), loaded="model-a").started()
    client = HttpUpstream(upstream.url)
    try:
        assert await client.busy(None) == 0
        assert await client.stop("model-a")
        upstream.listed_loaded = {"model-a"}  # exiting, still listed loaded
        upstream.slots_asked.clear()
        assert await client.busy(None) == 0
        assert upstream.slots_asked == []
        upstream.listed_loaded = set()  # listed unloaded: forgotten, asked again once loaded
        assert await client.busy(None) == 0
        upstream.listed_loaded = {"model-a"}
        assert await client.busy(None) == 0
        assert upstream.slots_asked == ["model-a"]
    finally:
        await client.close()
        upstream.close()


async def test_router_busy_never_loads_a_model_unloaded_since_the_list_was_read() -> None:
    upstream = FakeLlamaServer(router=True, loaded="model-a").started()
    upstream.listed_loaded = {"model-b"}  # listed loaded, unloaded by the time /slots is asked
    client = HttpUpstream(upstream.url)
    try:
        assert await client.busy(None) == 0
        assert upstream.slots_asked == ["model-a", "model-b"]
        assert upstream.autoloaded == [] and upstream.states["model-b"] == "unloaded"
    finally:
        await client.close()
        upstream.close()


async def test_a_settle_against_a_failing_upstream_waits_for_its_answer() -> None:
    """The give-up-on-first-error bug, end to end in the sidecar's process: the real HTTP adapter
    and the real settle loop against a fake llama-server whose /slots answers 500 for a while."""
    upstream = FakeLlamaServer().started()
    upstream.slots_failures = 5
    client = HttpUpstream(upstream.url)
    settling = Settling(SettleReason.ABANDONED, "m", "r", None, MonotonicClock().now_ns())
    try:
        clock = MonotonicClock()
        settle = await settle_upstream(client, settling, stop=False, clock=clock,
                                       deadline_ns=clock.now_ns() + 60 * 1_000_000_000)
    finally:
        await client.close()
        upstream.close()
    assert settle.result is SettleResult.IDLE
    assert upstream.slots_queries == 6 and upstream.slots_failures == 0


# -- total_slots (upstream.slots: auto) ------------------------------------------------------


def _total_slots(url: str, model: str | None = None) -> int | None:
    async def ask() -> int | None:
        upstream = HttpUpstream(url)
        try:
            return await upstream.total_slots(model)
        finally:
            await upstream.close()

    return asyncio.run(ask())


def test_total_slots_of_a_single_model_llama_server() -> None:
    fake = FakeLlamaServer(slots=3).started()
    try:
        assert _total_slots(fake.url) == 3
        assert fake.props_asked == [None]
    finally:
        fake.close()


def test_total_slots_in_router_mode_are_the_named_models() -> None:
    fake = FakeLlamaServer(router=True, models=("a", "b"), loaded="b").started()
    fake.model_slots["b"] = 2
    try:
        assert _total_slots(fake.url, "b") == 2
        assert fake.props_asked == ["b"] and fake.states["a"] == "unloaded"
    finally:
        fake.close()


def test_total_slots_in_router_mode_never_load_a_model() -> None:
    fake = FakeLlamaServer(router=True, models=("a",)).started()
    try:
        assert _total_slots(fake.url) is None  # the router's own /props has no slots: not asked
        assert _total_slots(fake.url, "a") is None  # autoload=false: 400 "model is not loaded"
        assert fake.props_asked == ["a"] and fake.states == {"a": "unloaded"} and fake.autoloaded == []
    finally:
        fake.close()


def test_total_slots_of_an_upstream_that_cannot_tell() -> None:
    assert _total_slots("http://127.0.0.1:9") is None  # nothing listens: None, no exception
