"""llama-server's own metrics through the sidecar (sidecar/llamaswap/upstream_metrics.py), against
a fake router that, like llama-server, LOADS a model whose metrics are asked for: only the
loaded model is read (labelled with its name), nothing when none is loaded, a plain upstream
as it is, and a failing upstream is a 502."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from aiohttp.test_utils import TestClient, TestServer
from aiohttp import web

from fake_llama import FakeLlamaServer
from llamaswap.envoy.contract import UPSTREAM_METRICS_PATH
from llamaswap.adapters.upstream_metrics import add_upstream_metrics, loaded_models, with_model_label


@pytest.fixture
def router() -> Iterator[FakeLlamaServer]:
    fake = FakeLlamaServer(router=True, models=("qwen3-8b", "gemma3")).started()
    try:
        yield fake
    finally:
        fake.close()


async def _scrape(upstream: str) -> tuple[int, str]:
    app = web.Application()
    add_upstream_metrics(app, upstream)
    async with TestClient(TestServer(app)) as client:
        response = await client.get(UPSTREAM_METRICS_PATH)
        return response.status, await response.text()


async def test_only_the_loaded_model_is_read(router: FakeLlamaServer) -> None:
    router.states["gemma3"] = "loaded"
    status, text = await _scrape(router.url)
    assert status == 200
    assert 'llamacpp:tokens_predicted_total{model="gemma3"} 42' in text.splitlines()
    assert "# TYPE llamacpp:tokens_predicted_total counter" in text
    assert router.metrics_asked == ["gemma3"]
    assert router.states == {"qwen3-8b": "unloaded", "gemma3": "loaded"}  # the scrape loaded nothing


async def test_a_model_unloaded_since_the_list_was_read_is_not_loaded_again(router: FakeLlamaServer) -> None:
    router.states["gemma3"] = "loaded"
    router.listed_loaded = {"qwen3-8b"}  # listed loaded, unloaded by the time its metrics are asked
    status, text = await _scrape(router.url)
    assert status == 200 and 'model="gemma3"' in text and "qwen3-8b" not in text
    assert router.autoloaded == [] and router.states["qwen3-8b"] == "unloaded"


async def test_nothing_loaded_reads_nothing_and_loads_nothing(router: FakeLlamaServer) -> None:
    status, text = await _scrape(router.url)
    assert (status, text) == (200, "")
    assert router.metrics_asked == [] and set(router.states.values()) == {"unloaded"}


async def test_an_upstream_without_router_mode_is_read_as_it_is() -> None:
    plain = FakeLlamaServer().started()
    try:
        status, text = await _scrape(plain.url)
        assert status == 200 and "llamacpp:tokens_predicted_total 42" in text.splitlines()
        assert plain.metrics_asked == [None]
    finally:
        plain.close()


async def test_an_upstream_that_does_not_answer_is_a_502() -> None:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    status, text = await _scrape(f"http://127.0.0.1:{port}")
    assert status == 502 and text.startswith("llama-server's metrics: upstream not answering")


def test_labels_and_states() -> None:
    text = '# HELP a x\na 1\nb{le="0.5"} 2\nc_total{x="y",z="w"} 3 1700000000\n'
    assert with_model_label(text, 'q"1') == (
        '# HELP a x\na{model="q\\"1"} 1\nb{model="q\\"1",le="0.5"} 2\nc_total{model="q\\"1",x="y",z="w"} 3 1700000000\n')
    assert loaded_models({"data": [{"id": "a", "status": {"value": "loaded"}}, {"id": "b", "status": {"value": "x"}}]}) == ["a"]
    assert loaded_models({"data": [{"id": "a"}]}) is None
