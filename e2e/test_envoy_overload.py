"""Envoy's overload manager (envoy.maxHeapBytes, llamaswap/envoy_overload.py) on the real Envoy:
a small heap budget and a burst of large bodies waiting behind a held generation. Near the
budget Envoy answers new requests 503 with Retry-After; it does not crash; every request it
accepted is served once the GPU frees; and once the bodies are gone it accepts requests again.
"""

from __future__ import annotations

import json
import pathlib
import urllib.error
import urllib.request
from concurrent import futures

from harness import http_get, running_stack, wait_for

BODY_BYTES = 2 * 1024 * 1024
# Envoy idles at about 6-10 MB of heap here (server.memory_allocated / memory_heap_size): room
# for about a dozen 2 MiB bodies before 95% of this budget.
HEAP_BUDGET = 40 * 1024 * 1024
MAX_REQUESTS = 60
REFUSALS_WANTED = 3


def _post(url: str, test_id: str, *, hold: bool = False) -> tuple[int, dict[str, str], bytes]:
    body = json.dumps({"model": "model-a", "messages": [{"role": "user", "content": "hi"}],
                       "padding": "x" * BODY_BYTES}).encode()
    headers = {"Content-Type": "application/json", "x-test-id": test_id}
    if hold:
        headers["x-test-hold"] = "1"
    request = urllib.request.Request(f"{url}/v1/chat/completions", data=body, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, {k.lower(): v for k, v in response.headers.items()}, response.read()
    except urllib.error.HTTPError as error:
        return error.code, {k.lower(): v for k, v in error.headers.items()}, error.read()


def _waiting(queue: dict) -> int:
    return len(queue.get("waiting") or [])


def test_a_burst_of_large_bodies_gets_503s_not_a_dead_envoy(tmp_path: pathlib.Path) -> None:
    # The pool outside the stack: on a failure the stack stops first and no client waits on.
    with futures.ThreadPoolExecutor(max_workers=MAX_REQUESTS + 1) as pool, \
            running_stack(tmp_path, {"envoy": {"maxHeapBytes": HEAP_BUDGET}}) as stack:
        upstream = stack.upstream
        assert upstream is not None
        bootstrap_budget = stack.envoy.stat("overload.envoy.resource_monitors.fixed_heap.pressure")
        assert bootstrap_budget < 95, "Envoy starts above the overload threshold: raise HEAP_BUDGET"
        held = pool.submit(_post, stack.url, "held", hold=True)
        wait_for(lambda: any(h.test_id == "held" for h in upstream.hits), what="the held generation")

        # One request after another, each once the previous one waits in the queue (its body
        # buffered in Envoy) or was refused, until Envoy has refused a few.
        sent: dict[str, futures.Future[tuple[int, dict[str, str], bytes]]] = {}
        refused: list[tuple[int, dict[str, str], bytes]] = []
        for index in range(MAX_REQUESTS):
            test_id = f"burst-{index}"
            sent[test_id] = pool.submit(_post, stack.url, test_id)
            accepted_before = len(sent) - 1 - len(refused)
            wait_for(lambda: sent[test_id].done() or _waiting(stack.sidecar.queue()) > accepted_before,
                     what=f"{test_id} queued or answered")
            if sent[test_id].done():
                reply = sent[test_id].result()
                assert reply[0] == 503, reply[:2]
                refused.append(reply)
                if len(refused) >= REFUSALS_WANTED:
                    break
        assert len(refused) >= REFUSALS_WANTED, (
            f"no overload 503 after {len(sent)} bodies of {BODY_BYTES} bytes: "
            f"pressure {stack.envoy.stat('overload.envoy.resource_monitors.fixed_heap.pressure')}%")
        for status, headers, body in refused:
            assert int(headers["retry-after"]) >= 1, headers
            assert body == b"envoy overloaded", (headers, body)
        assert stack.envoy.alive(), "Envoy died under the burst"

        # The GPU frees: every accepted request is served, in turn.
        upstream.release("held")
        assert held.result(timeout=60)[0] == 200
        accepted = {test_id: future for test_id, future in sent.items()
                    if not future.done() or future.result()[0] != 503}
        assert len(accepted) >= 5, len(accepted)
        for test_id, future in accepted.items():
            status, _, body = future.result(timeout=120)
            assert status == 200, (test_id, status, body[:200])
        assert {h.test_id for h in upstream.hits} >= set(accepted)
        assert stack.envoy.alive()

        # With the bodies gone the pressure falls and new requests are accepted again.
        wait_for(lambda: stack.envoy.stat("overload.envoy.overload_actions.stop_accepting_requests.active") == 0,
                 what="Envoy accepting requests again")
        assert _post(stack.url, "after")[0] == 200
        assert http_get(f"{stack.envoy.admin_url}/ready")[0] == 200
