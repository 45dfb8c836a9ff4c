"""llama-server's own metrics through the sidecar (sidecar/llamaswap/adapters/upstream_metrics.py),
against a fake router that, like llama-server, LOADS a model whose metrics are asked for: only
the loaded model is read (labelled with its name), nothing when none is loaded, a plain upstream
as it is, and a failing upstream is a 502. With several upstreams (`upstreams:`): every one is
read, at once, each sample labelled with its upstream; one down leaves only itself out (a
comment line says so), all down is a 502."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator

import pytest
from aiohttp.test_utils import TestClient, TestServer
from aiohttp import web

from fake_llama import FakeLlamaServer
from llamaswap.envoy.contract import UPSTREAM_METRICS_PATH
from llamaswap.adapters.upstream_metrics import add_upstream_metrics, loaded_models, merged, with_model_label


@pytest.fixture
def router() -> Iterator[FakeLlamaServer]:
    fake = FakeLlamaServer(router=True, models=("qwen3-8b", "gemma3")).started()
    try:
        yield fake
    finally:
        fake.close()


async def _scrape(upstream: str | dict[str, str]) -> tuple[int, str]:
    """GET the route of an admin app reading ``upstream`` (a URL: the one upstream, gpu0)."""
    app = web.Application()
    add_upstream_metrics(app, {"gpu0": upstream} if isinstance(upstream, str) else upstream)
    async with TestClient(TestServer(app)) as client:
        response = await client.get(UPSTREAM_METRICS_PATH)
        return response.status, await response.text()


async def test_only_the_loaded_model_is_read(router: FakeLlamaServer) -> None:
    router.states["gemma3"] = "loaded"
    status, text = await _scrape(router.url)
    assert status == 200
    assert 'llamacpp:tokens_predicted_total{upstream="gpu0",model="gemma3"} 42' in text.splitlines()
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
        assert status == 200 and 'llamacpp:tokens_predicted_total{upstream="gpu0"} 42' in text.splitlines()
        assert plain.metrics_asked == [None]
    finally:
        plain.close()


def _nobody_listening() -> str:
    """The URL of a loopback port that no server listens on."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return f"http://127.0.0.1:{port}"


async def test_an_upstream_that_does_not_answer_is_a_502() -> None:
    status, text = await _scrape(_nobody_listening())
    assert status == 502 and text.startswith("llama-server's metrics: upstream not answering")


@pytest.fixture
def plain() -> Iterator[FakeLlamaServer]:
    fake = FakeLlamaServer().started()
    try:
        yield fake
    finally:
        fake.close()


async def test_every_upstream_is_read_each_sample_labelled_with_its_upstream(
        router: FakeLlamaServer, plain: FakeLlamaServer) -> None:
    router.states["gemma3"] = "loaded"
    status, text = await _scrape({"gpu0": router.url, "gpu1": plain.url})
    assert status == 200
    assert text == ("# HELP llamacpp:tokens_predicted_total Generated tokens\n"
                    "# TYPE llamacpp:tokens_predicted_total counter\n"
                    'llamacpp:tokens_predicted_total{upstream="gpu0",model="gemma3"} 42\n'
                    'llamacpp:tokens_predicted_total{upstream="gpu1"} 42\n')
    assert router.metrics_asked == ["gemma3"] and plain.metrics_asked == [None]
    assert router.states == {"qwen3-8b": "unloaded", "gemma3": "loaded"}


async def test_an_upstream_down_leaves_out_only_itself_and_says_so(plain: FakeLlamaServer) -> None:
    status, text = await _scrape({"gpu0": _nobody_listening(), "gpu1": plain.url})
    assert status == 200
    lines = text.splitlines()
    assert lines[0].startswith("# llamaswap: upstream gpu0 not read: upstream not answering"), lines
    assert 'llamacpp:tokens_predicted_total{upstream="gpu1"} 42' in lines
    assert 'upstream="gpu0"' not in text


async def test_every_upstream_down_is_a_502_naming_each() -> None:
    status, text = await _scrape({"gpu0": _nobody_listening(), "gpu1": _nobody_listening()})
    assert status == 502
    assert text.startswith("llama-server's metrics: no upstream answered: gpu0: upstream not answering"), text
    assert "; gpu1: upstream not answering" in text


async def test_the_upstreams_are_read_at_once() -> None:
    """Each fake answers its GET /v1/models only once both were asked: read one after the
    other, the first would time out and be left out."""
    asked: list[str] = []
    both_asked = asyncio.Event()

    def upstream(name: str) -> web.Application:
        async def models(_: web.Request) -> web.Response:
            asked.append(name)
            if len(asked) == 2:
                both_asked.set()
            try:
                await asyncio.wait_for(both_asked.wait(), 30)
            except TimeoutError:
                return web.Response(status=503)
            return web.json_response({"data": [{"id": f"{name}.gguf"}]})

        async def metrics(_: web.Request) -> web.Response:
            return web.Response(text="llamacpp:requests_processing 1\n")

        app = web.Application()
        app.router.add_get("/v1/models", models)
        app.router.add_get("/metrics", metrics)
        return app

    async with TestServer(upstream("gpu0")) as gpu0, TestServer(upstream("gpu1")) as gpu1:
        status, text = await _scrape({"gpu0": str(gpu0.make_url("")), "gpu1": str(gpu1.make_url(""))})
    assert status == 200 and sorted(asked) == ["gpu0", "gpu1"]
    assert text.splitlines() == ['llamacpp:requests_processing{upstream="gpu0"} 1',
                                 'llamacpp:requests_processing{upstream="gpu1"} 1']


def test_labels_and_states() -> None:
    text = '# HELP a x\na 1\nb{le="0.5"} 2\nc_total{x="y",z="w"} 3 1700000000\n'
    assert with_model_label(text, 'q"1') == (
        '# HELP a x\na{model="q\\"1"} 1\nb{model="q\\"1",le="0.5"} 2\n'
        'c_total{model="q\\"1",x="y",z="w"} 3 1700000000\n')
    listed = {"data": [{"id": "a", "status": {"value": "loaded"}}, {"id": "b", "status": {"value": "x"}}]}
    assert loaded_models(listed) == ["a"]
    assert loaded_models({"data": [{"id": "a"}]}) is None


def test_pages_merge_by_family() -> None:
    gpu0 = ('# HELP h x\n# TYPE h histogram\nh_bucket{upstream="gpu0",le="1"} 1\nh_sum{upstream="gpu0"} 2\n'
            'h_count{upstream="gpu0"} 1\n# TYPE c counter\nc_total{upstream="gpu0"} 3\nu{upstream="gpu0"} 4\n')
    gpu1 = ('# HELP h x\n# TYPE h histogram\nh_bucket{upstream="gpu1",le="1"} 5\nh_sum{upstream="gpu1"} 6\n'
            'h_count{upstream="gpu1"} 5\n# TYPE c counter\nc_total{upstream="gpu1"} 7\nu{upstream="gpu1"} 8\n')
    assert merged([gpu0, gpu1]).splitlines() == [
        "# HELP h x", "# TYPE h histogram",
        'h_bucket{upstream="gpu0",le="1"} 1', 'h_sum{upstream="gpu0"} 2', 'h_count{upstream="gpu0"} 1',
        'h_bucket{upstream="gpu1",le="1"} 5', 'h_sum{upstream="gpu1"} 6', 'h_count{upstream="gpu1"} 5',
        "# TYPE c counter", 'c_total{upstream="gpu0"} 3', 'c_total{upstream="gpu1"} 7',
        'u{upstream="gpu0"} 4', 'u{upstream="gpu1"} 8']
    assert merged([gpu0]) == gpu0 and merged([]) == ""
