"""`llamaswap load-model` (sidecar/llamaswap/model_preload.py), the sidecar's startup probe in the
chart, against a fake llama-server router on 127.0.0.1: it asks for the load once, reports
"not yet" while the model loads, succeeds once /v1/models says loaded, and refuses an unknown
model or an upstream without router mode."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
from collections.abc import Iterator

import pytest

from fake_llama import FakeLlamaServer
from llamaswap.commands.load_model import PreloadError, model_state

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture
def router() -> Iterator[FakeLlamaServer]:
    fake = FakeLlamaServer(router=True, models=("qwen3-8b", "other")).started()
    try:
        yield fake
    finally:
        fake.close()


def load_model(url: str, model: str, *extra: str) -> subprocess.CompletedProcess[str]:
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(ROOT / "sidecar")}
    return subprocess.run([sys.executable, "-m", "llamaswap", "load-model", "--upstream", url, *extra, model],
                          env=env, capture_output=True, text=True, timeout=60, check=False)


def test_a_probe_run_asks_for_the_load_then_waits_for_loaded(router: FakeLlamaServer) -> None:
    first = load_model(router.url, "qwen3-8b")
    assert first.returncode == 1 and "qwen3-8b: not loaded yet: loading" in first.stderr
    assert router.loads == ["qwen3-8b"]
    # While it loads, further runs do not ask again.
    assert load_model(router.url, "qwen3-8b").returncode == 1
    assert router.loads == ["qwen3-8b"]
    router.states["qwen3-8b"] = "loaded"
    done = load_model(router.url, "qwen3-8b")
    assert done.returncode == 0 and done.stdout == "qwen3-8b: loaded\n"
    assert router.loads == ["qwen3-8b"]


def test_a_model_unloaded_again_is_asked_for_again(router: FakeLlamaServer) -> None:
    router.states["qwen3-8b"] = "loading"
    assert load_model(router.url, "qwen3-8b").returncode == 1 and router.loads == []
    router.states["qwen3-8b"] = "unloaded"  # e.g. its load failed
    assert load_model(router.url, "qwen3-8b").returncode == 1 and router.loads == ["qwen3-8b"]


def test_a_model_the_router_put_to_sleep_counts_as_loaded(router: FakeLlamaServer) -> None:
    """A load of a sleeping model is refused (400 `model is already running`): asking would never
    end the probe. It was loaded, and its next request wakes it."""
    router.states["qwen3-8b"] = "loaded"
    router.put_to_sleep("qwen3-8b")
    done = load_model(router.url, "qwen3-8b")
    assert done.returncode == 0 and router.loads == []
    assert done.stdout == "qwen3-8b: loaded, asleep (the router's --sleep-idle-seconds): its next request wakes it\n"


def test_an_unknown_model_exits_2(router: FakeLlamaServer) -> None:
    result = load_model(router.url, "nope")
    assert result.returncode == 2
    assert result.stderr == "error: nope: not among the upstream's models (a GGUF file name without .gguf)\n"
    assert router.loads == []


def test_an_upstream_without_router_mode_exits_2() -> None:
    plain = FakeLlamaServer().started()
    try:
        result = load_model(plain.url, "qwen3-8b")
        assert result.returncode == 2 and "not llama-server in router mode" in result.stderr, result.stderr
    finally:
        plain.close()


def test_an_upstream_not_up_yet_is_not_yet(tmp_path: pathlib.Path) -> None:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    result = load_model(f"http://127.0.0.1:{port}", "qwen3-8b")
    assert result.returncode == 1 and "upstream not answering" in result.stderr, result.stderr


def test_wait_polls_until_loaded(router: FakeLlamaServer) -> None:
    """--wait: one run that returns once the router says loaded (after two more looks)."""
    router.load_takes_looks = 2
    result = load_model(router.url, "qwen3-8b", "--wait", "30")
    assert result.returncode == 0, result.stderr
    assert router.looks == 3 and router.loads == ["qwen3-8b"]


def test_model_state_reads_router_statuses() -> None:
    document = {"data": [{"id": "a", "status": {"value": "loaded"}}, {"id": "b", "status": {"value": "unloaded"}}]}
    assert (model_state(document, "a"), model_state(document, "b"), model_state(document, "c")) == (
        "loaded", "unloaded", None)
    with pytest.raises(PreloadError):
        model_state({"nothing": 1}, "a")
