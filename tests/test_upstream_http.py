"""What the upstream's GET /v1/models says (shapes as llama-server b11434 and llama-swap answer)."""

from __future__ import annotations

from llamaswap.runtime.upstream import UpstreamKind
from llamaswap.adapters.upstream_http import catalog_from


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
