"""llamaswap as an InferencePool endpoint, through the real Envoy: the pod's /metrics read the way
llm-d's router reads it, through the chart's own engine config (each spec parsed as the picker
parses it, its series chosen as the picker chooses), while requests wait and run; and the
priority headers a Gateway and the picker pass on reach the pod unchanged."""

from __future__ import annotations

import asyncio
import pathlib
import urllib.request
from typing import Any

import aiohttp
import yaml

import chart_tools as ct
from client import chat
from fake_llama import FakeLlamaServer
from harness import async_wait_for, running_stack
from inference_kinds import EngineConfig, read_picker_config
from llamaswap.envoy.contract import PICKER_METRICS_PATH
from picker import Adapters, parse_exposition, read_adapters, read_gauge

OBJECTIVE = "x-llm-d-inference-objective"


def engine_config() -> EngineConfig:
    """The engine config the chart renders for llamaswap's pods (their llm-d.ai/engine-type)."""
    rendered = ct.render(ct.load_values(ct.CHART / "ci" / "inference-pool-values.yaml"))
    label = rendered.deployment["spec"]["template"]["metadata"]["labels"]["llm-d.ai/engine-type"]
    config = read_picker_config(yaml.safe_load(rendered.configmap_file("-epp", "llamaswap-epp.yaml")))
    assert config.metrics_path == PICKER_METRICS_PATH  # where the chart points the picker
    return config.engines[label]


def scrape(url: str, engine: EngineConfig, path: str = "/metrics") -> tuple[float, float, float, Adapters | None]:
    """What the picker reads from the pod's port (Envoy's listener), spec by spec."""
    with urllib.request.urlopen(f"{url}{path}", timeout=5) as response:
        families = parse_exposition(response.read().decode())
    specs = engine.specs
    return (read_gauge(families, specs["queuedRequestsSpec"]), read_gauge(families, specs["runningRequestsSpec"]),
            read_gauge(families, specs["kvUsageSpec"]), read_adapters(families, specs["loraSpec"]))


def scrape_beside_queue(stack: Any, engine: EngineConfig) -> tuple[tuple[float, float, float, Adapters | None],
                                                                  dict[str, Any]]:
    """A scrape between two reads of /queue that agree: the queue as it was at the scrape."""
    for _ in range(50):
        before = stack.sidecar.queue()
        figures = scrape(stack.url, engine, PICKER_METRICS_PATH)
        whole = scrape(stack.url, engine)
        after = stack.sidecar.queue()
        if _counts(before) == _counts(after):
            assert whole == figures  # the whole /metrics reads the same
            return figures, after
    raise AssertionError("the queue never held still for a scrape")


def _counts(queue: dict[str, Any]) -> tuple[Any, ...]:
    return (len(queue["waiting"]), len(queue["running_all"]), queue["slots_total"], queue["resident_models"],
            sorted({row["model"] for row in queue["waiting"]}))


def assert_matches(figures: tuple[float, float, float, Adapters | None], queue: dict[str, Any]) -> None:
    waiting, running, saturation, adapters = figures
    assert waiting == len(queue["waiting"])
    assert running == len(queue["running_all"]) == queue["slots_busy"]
    assert saturation == queue["slots_busy"] / queue["slots_total"]
    models = sorted({row["model"] for row in queue["waiting"] if row["model"]})
    assert adapters is not None
    assert adapters.running == tuple(queue["resident_models"])
    assert sorted(adapters.waiting) == models
    assert adapters.max_adapters == 1


async def test_the_picker_reads_what_the_queue_says(tmp_path: pathlib.Path) -> None:
    engine = engine_config()
    fake = FakeLlamaServer(slots=2, router=True)
    with running_stack(tmp_path, {"upstream": {"slots": 2}}, fake=fake) as stack:
        upstream = stack.upstream
        assert upstream is not None
        figures, queue = scrape_beside_queue(stack, engine)
        assert figures[:3] == (0, 0, 0)
        assert_matches(figures, queue)
        async with aiohttp.ClientSession() as session:
            held = [asyncio.create_task(chat(session, stack.url, f"a{i}", hold=True, model="model-a"))
                    for i in (1, 2)]
            await async_wait_for(lambda: upstream.active == 2, what="a1 and a2 running")
            # One at a time, each queued before the next is sent: the order they began waiting.
            waiting = []
            for test_id, model, headers in (("b1", "model-b", {OBJECTIVE: "batch"}),
                                            ("c1", "model-c", {OBJECTIVE: "interactive"}),
                                            ("a3", "model-a", {})):
                waiting.append(asyncio.create_task(chat(session, stack.url, test_id, model=model,
                                                        hold=test_id == "a3", extra_headers=headers)))
                await async_wait_for(lambda n=len(waiting): len(stack.sidecar.queue()["waiting"]) == n,
                                     what=f"{test_id} waiting")
            figures, queue = scrape_beside_queue(stack, engine)
            assert figures[:3] == (3, 2, 1.0)
            assert figures[3] is not None and figures[3].running == ("model-a",)
            assert figures[3].waiting == ("model-b", "model-c", "model-a")  # in the order they began waiting
            assert_matches(figures, queue)
            # The objective set each one's priority: c1 interactive first, then a3, then b1.
            assert [(row["request_id"], row["priority"]) for row in queue["waiting"]] == [
                ("c1", 100), ("a3", 0), ("b1", -100)]

            # A slot frees, but the best request (c1) needs another model: the pod is half busy.
            upstream.release("a1")
            await async_wait_for(lambda: len(stack.sidecar.queue()["running_all"]) == 1, what="a1 released")
            figures, queue = scrape_beside_queue(stack, engine)
            assert figures[:3] == (3, 1, 0.5)
            assert_matches(figures, queue)

            # a2 ends: c1 swaps in and is served, then a3 (model-a again) runs, held; b1 waits.
            upstream.release("a2")
            await async_wait_for(lambda: "a3" in upstream.order(), what="a3 granted after c1")
            figures, queue = scrape_beside_queue(stack, engine)
            assert figures[:3] == (1, 1, 0.5)
            assert figures[3] is not None and figures[3].running == ("model-a",)
            assert figures[3].waiting == ("model-b",)
            assert_matches(figures, queue)

            upstream.release("a3")
            replies = [await task for task in (*held, *waiting)]
            assert [reply.status for reply in replies] == [200] * 5
            await async_wait_for(lambda: not stack.sidecar.queue()["running_all"], what="every grant released")
            figures, queue = scrape_beside_queue(stack, engine)
            assert figures[:3] == (0, 0, 0)
            assert figures[3] is not None and len(queue["resident_models"]) == 1
            assert figures[3].running == tuple(queue["resident_models"]) and not figures[3].waiting
            assert_matches(figures, queue)


async def test_the_priority_headers_reach_the_pod_unchanged(tmp_path: pathlib.Path) -> None:
    with running_stack(tmp_path) as stack:
        upstream = stack.upstream
        assert upstream is not None
        async with aiohttp.ClientSession() as session:
            both = await chat(session, stack.url, "both", priority="7", extra_headers={OBJECTIVE: "batch"})
            objective = await chat(session, stack.url, "objective", extra_headers={OBJECTIVE: "batch"})
            unknown = await chat(session, stack.url, "unknown", extra_headers={OBJECTIVE: "nightly"})
        assert [reply.status for reply in (both, objective, unknown)] == [200] * 3
        # X-LlamaSwap-Priority wins over the objective; the objective stands in for it when absent.
        assert [reply.headers["x-llamaswap-priority"] for reply in (both, objective, unknown)] == ["7", "-100", "0"]
        hits = {hit.test_id: hit.headers for hit in upstream.hits}
        lowered = {test_id: {k.lower(): v for k, v in headers.items()} for test_id, headers in hits.items()}
        assert lowered["both"]["x-llamaswap-priority"] == "7"
        assert lowered["both"][OBJECTIVE] == "batch"
        assert lowered["objective"][OBJECTIVE] == "batch"
