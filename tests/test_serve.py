"""`Sidecar.start` (commands/serve.py): what a restarted sidecar does before its first grant."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest
from flow import check_request
from fake_llama import FakeLlamaServer
from harness import async_wait_for
from llamaswap._proto.envoy.service.auth.v3 import external_auth_pb2_grpc as authz_grpc
from llamaswap.commands.serve import Sidecar
from llamaswap.config import parse_config


def _config(upstream_url: str) -> Any:
    return parse_config({"listen": {"http": "127.0.0.1:0", "grpc": "127.0.0.1:0", "admin": "127.0.0.1:0"},
                         "upstream": {"url": upstream_url, "modelsPollSeconds": 0}})


@pytest.fixture
def upstream():
    server = FakeLlamaServer().started()
    yield server
    server.close()


async def test_the_startup_settle_begins_before_the_grpc_server_serves(monkeypatch, upstream) -> None:
    """A Check that arrives the moment the gRPC server serves must find the GPU settling."""
    sidecar = Sidecar(_config(upstream.url))
    state_when_serving: list[str] = []
    real_server = grpc.aio.server

    def server(*args: Any, **kwargs: Any) -> grpc.aio.Server:
        made = real_server(*args, **kwargs)
        real_start = made.start

        async def start() -> None:
            state_when_serving.append(str(sidecar.coordinator.gpu_state))
            await real_start()

        made.start = start  # type: ignore[method-assign]
        return made

    monkeypatch.setattr(grpc.aio, "server", server)
    try:
        await sidecar.start()
    finally:
        await sidecar.close()
    assert state_when_serving == ["settling"]


async def test_the_first_grant_waits_for_an_upstream_that_answers_500_for_a_while(upstream) -> None:
    """A restart while llama-server cannot answer /slots: the first Check is held, not granted at
    the first error, and granted once /slots says idle."""
    upstream.slots_failures = 1_000_000
    sidecar = Sidecar(_config(upstream.url))
    await sidecar.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{sidecar.grpc_port}") as channel:
            check = asyncio.ensure_future(authz_grpc.AuthorizationStub(channel).Check(check_request()))
            await async_wait_for(lambda: upstream.slots_queries >= 5, what="the settle asking again")
            assert not check.done() and sidecar.coordinator.gpu_state == "settling"
            upstream.slots_failures = 0
            response = await asyncio.wait_for(check, 30)
        assert response.status.code == 0  # granted
        assert sidecar.coordinator.gpu_state == "running"
    finally:
        await sidecar.close()


@pytest.mark.parametrize("settling", [False, True])
async def test_a_drain_names_running_requests_only(upstream, caplog, settling: bool) -> None:
    """`up` failing at start drains with no grace: nothing running (or only the startup settle,
    against an upstream that cannot answer /slots) is no request cut off."""
    upstream.slots_failures = 1_000_000 if settling else 0
    sidecar = Sidecar(_config(upstream.url))
    await sidecar.start()
    try:
        if not settling:
            await async_wait_for(lambda: sidecar.coordinator.gpu_state == "idle", what="the startup settle")
        assert (sidecar.coordinator.gpu_state == "settling") is settling
        await sidecar.drain(0.0)
    finally:
        await sidecar.close()
    assert "still running" not in caplog.text
