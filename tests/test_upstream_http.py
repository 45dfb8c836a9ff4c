"""What the upstream's GET /v1/models says (shapes as llama-server b11434 and llama-swap answer)."""

from __future__ import annotations

import asyncio

from fake_servers import FakeRouter
from llamaswap.runtime.upstream import UpstreamKind
from llamaswap.adapters.upstream_http import HttpUpstream, catalog_from


def router(*states: tuple[str, str]) -> dict:
    return {"data": [{"id": name, "aliases": [f"{name}-alias"], "object": "model", "owned_by": "llamacpp",
                      "status": {"value": value, "args": ["llama-server"]}} for name, value in states]}


def test_router_mode_lists_models_aliases_and_the_loaded_one():
    catalog = catalog_from(router(("tiny-a", "unloaded"), ("tiny-b", "loaded")))
    assert catalog is not None
    assert catalog.kind is UpstreamKind.ROUTER
    assert catalog.models == {"tiny-a", "tiny-a-alias", "tiny-b", "tiny-b-alias"}
    assert (catalog.loaded, catalog.loaded_known) == ("tiny-b", True)


def test_router_mode_with_nothing_loaded_says_so():
    catalog = catalog_from(router(("tiny-a", "unloaded"), ("tiny-b", "unloaded")))
    assert catalog is not None and (catalog.loaded, catalog.loaded_known) == (None, True)


def test_router_mode_loading_counts_as_loaded():
    catalog = catalog_from(router(("tiny-a", "loading"), ("tiny-b", "unloaded")))
    assert catalog is not None and (catalog.loaded, catalog.loaded_known) == ("tiny-a", True)


def test_router_mode_with_several_loaded_does_not_guess():
    catalog = catalog_from(router(("tiny-a", "loaded"), ("tiny-b", "loaded")))
    assert catalog is not None and catalog.loaded_known is False


def test_single_model_llama_server_serves_any_name():
    document = {"models": [{"name": "/m/tiny-a.gguf"}], "object": "list",
                "data": [{"id": "/m/tiny-a.gguf", "aliases": ["/m/tiny-a.gguf"], "object": "model"}]}
    catalog = catalog_from(document)
    assert catalog is not None
    assert catalog.kind is UpstreamKind.SINGLE
    assert catalog.models == {"/m/tiny-a.gguf"}
    assert catalog.loaded_known is False


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


# -- total_slots (upstream.slots: auto) ------------------------------------------------------


def _total_slots(url: str) -> int | None:
    async def ask() -> int | None:
        upstream = HttpUpstream(url)
        try:
            return await upstream.total_slots()
        finally:
            await upstream.close()

    return asyncio.run(ask())


def test_total_slots_of_a_single_model_llama_server() -> None:
    fake = FakeRouter({"m": "loaded"}, router=False)
    try:
        fake.total_slots = 3
        assert _total_slots(fake.url) == 3
        assert fake.props_asked == [None]
    finally:
        fake.close()


def test_total_slots_in_router_mode_asks_only_about_the_loaded_model() -> None:
    fake = FakeRouter({"a": "unloaded", "b": "loaded"})
    try:
        assert _total_slots(fake.url) == 4
        assert fake.props_asked == ["b"] and fake.states["a"] == "unloaded"
    finally:
        fake.close()


def test_total_slots_in_router_mode_with_nothing_loaded_loads_nothing() -> None:
    fake = FakeRouter({"a": "unloaded"})
    try:
        assert _total_slots(fake.url) is None
        assert fake.props_asked == [] and fake.states == {"a": "unloaded"}
    finally:
        fake.close()


def test_total_slots_of_an_upstream_that_cannot_tell() -> None:
    assert _total_slots("http://127.0.0.1:9") is None  # nothing listens: None, no exception
