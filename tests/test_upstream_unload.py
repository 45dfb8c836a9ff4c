"""The HTTP adapter's unload (several resident models, issue 37) and its per-model busy count,
against the fake llama-server in router mode: an unload waits until the model is listed
`unloaded`, and says so when the router refuses or the model stays past the deadline."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from fake_llama import LOADED, UNLOADED, FakeLlamaServer
from llamaswap.adapters.upstream_http import UNLOAD_POLL_FIRST_S, UNLOAD_POLL_MAX_S, HttpUpstream


@pytest.fixture
def fake() -> Iterator[FakeLlamaServer]:
    server = FakeLlamaServer(router=True, models=("a", "b", "c"), models_max=3).started()
    server.states.update(a=LOADED, b=LOADED)
    try:
        yield server
    finally:
        server.close()


async def test_an_unload_waits_until_the_model_is_listed_unloaded(fake: FakeLlamaServer) -> None:
    fake.unload_takes_looks = 3  # its process takes a while to exit
    client = HttpUpstream(fake.url)
    try:
        looks = fake.looks
        assert await client.unload("a", timeout_s=10.0)
        assert fake.unloads == ["a"] and fake.states["a"] == UNLOADED and fake.states["b"] == LOADED
        assert fake.looks - looks >= 4  # it read the list until the model was gone
        assert fake.evicted == []
    finally:
        await client.close()


async def test_an_unload_of_a_model_not_loaded_is_done(fake: FakeLlamaServer) -> None:
    client = HttpUpstream(fake.url)
    try:
        assert await client.unload("c", timeout_s=1.0)  # 400 "not running", listed unloaded: gone
        assert fake.unloads == []
    finally:
        await client.close()


class StepClock:
    """The unload's clock and its sleep: time moves only by the waits the unload asks for, so a
    deadline is reached after an exact count of looks, however slow the machine is."""

    def __init__(self) -> None:
        self.now_s = 0.0
        self.slept: list[float] = []

    def monotonic(self) -> float:
        return self.now_s

    async def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now_s += seconds
        await asyncio.sleep(0)


async def test_a_refused_unload_fails_at_once(fake: FakeLlamaServer) -> None:
    fake.unload_refused = {"a"}
    clock = StepClock()
    client = HttpUpstream(fake.url, monotonic=clock.monotonic, sleep=clock.sleep)
    try:
        assert not await client.unload("a", timeout_s=10.0)
        assert clock.slept == []  # it did not wait for a model nothing will unload
        assert fake.states["a"] == LOADED
    finally:
        await client.close()


async def test_an_unload_that_outlasts_its_deadline_fails(fake: FakeLlamaServer) -> None:
    fake.unload_takes_looks = 10_000
    clock = StepClock()
    client = HttpUpstream(fake.url, monotonic=clock.monotonic, sleep=clock.sleep)
    try:
        looks = fake.looks
        assert not await client.unload("a", timeout_s=0.3)
        # It waited exactly until its deadline, backing off between looks, and looked after each wait.
        assert clock.now_s == pytest.approx(0.3)
        assert clock.slept[0] == UNLOAD_POLL_FIRST_S and max(clock.slept) <= UNLOAD_POLL_MAX_S
        # One look tells it the upstream is a router; then one after the POST and one after each wait.
        assert fake.looks - looks == 1 + 1 + len(clock.slept)
        assert fake.states["a"] != UNLOADED
    finally:
        await client.close()


async def test_an_upstream_that_is_no_router_cannot_unload() -> None:
    server = FakeLlamaServer().started()
    client = HttpUpstream(server.url)
    try:
        assert not await client.unload("fake.gguf", timeout_s=1.0)
    finally:
        await client.close()
        server.close()


async def test_router_busy_counts_only_the_model_asked_about(fake: FakeLlamaServer) -> None:
    """Each resident model is a process of its own: a settle of one asks only its slots."""
    client = HttpUpstream(fake.url)
    try:
        assert await client.busy("a") == 0
        assert fake.slots_asked == ["a"]
        fake.slots_asked.clear()
        assert await client.busy(None) == 0  # no model named: every loaded one
        assert sorted(model for model in fake.slots_asked if model is not None) == ["a", "b"]
        fake.slots_asked.clear()
        assert await client.busy("a-alias") == 0  # a name the list has no status for: every loaded one
        assert sorted(model for model in fake.slots_asked if model is not None) == ["a", "b"]
    finally:
        await client.close()
