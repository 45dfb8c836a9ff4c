"""The fake llama-server's router mode with several models in memory (`models_max`, as
llama-server's `--models-max`): what the tests of several resident models lean on. A load beyond
the limit unloads the least recently used model, an explicit unload ends only that model's work,
and with the default of one model a load replaces the other as before."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from fake_llama import LOADED, UNLOADED, FakeLlamaServer


def _post(fake: FakeLlamaServer, path: str, body: dict[str, Any], headers: dict[str, str] | None = None,
          ) -> tuple[int, Any]:
    request = urllib.request.Request(fake.url + path, data=json.dumps(body).encode(), method="POST",
                                     headers={"content-type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _complete(fake: FakeLlamaServer, model: str, test_id: str, **headers: str) -> tuple[int, Any]:
    return _post(fake, "/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": "hi"}]},
                 {"x-test-id": test_id, **headers})


def _resident(fake: FakeLlamaServer) -> set[str]:
    return {name for name, state in fake.states.items() if state != UNLOADED}


@pytest.fixture
def three_models() -> Iterator[FakeLlamaServer]:
    fake = FakeLlamaServer(router=True, models=("a", "b", "c"), models_max=2).started()
    try:
        yield fake
    finally:
        fake.close()


def test_two_models_stay_loaded_and_a_third_unloads_the_least_recently_used(three_models: FakeLlamaServer) -> None:
    fake = three_models
    assert _complete(fake, "a", "a1")[0] == 200
    assert _complete(fake, "b", "b1")[0] == 200
    assert _resident(fake) == {"a", "b"} and fake.evicted == []
    assert _complete(fake, "a", "a2")[0] == 200  # a used after b: b is now the least recently used
    assert _complete(fake, "c", "c1")[0] == 200
    assert _resident(fake) == {"a", "c"} and fake.evicted == ["b"]
    assert [hit.loaded for hit in fake.hits] == [True, True, False, True]


def test_a_load_request_beyond_the_limit_evicts_too(three_models: FakeLlamaServer) -> None:
    fake = three_models
    for model in ("a", "b"):
        assert _post(fake, "/models/load", {"model": model})[0] == 200
    assert _post(fake, "/models/load", {"model": "c"})[0] == 200
    assert fake.states["c"] != UNLOADED and len(_resident(fake)) == 2 and len(fake.evicted) == 1


def test_an_unload_ends_only_that_models_work(three_models: FakeLlamaServer) -> None:
    fake = three_models
    answers: dict[str, int] = {}

    def run(model: str, test_id: str) -> None:
        answers[test_id] = _complete(fake, model, test_id, **{"x-test-hold": "1"})[0]

    threads = [threading.Thread(target=run, args=(model, f"{model}-held")) for model in ("a", "b")]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 10
    while fake.active < 2:
        assert time.monotonic() < deadline, "the two held completions never started"
        time.sleep(0.01)
    assert _post(fake, "/models/unload", {"model": "a"})[0] == 200
    threads[0].join(10)
    assert answers == {"a-held": 500}  # a's child process ended; b still computes
    assert fake.states == {"a": UNLOADED, "b": LOADED, "c": UNLOADED}
    fake.release("b-held")
    threads[1].join(10)
    assert answers["b-held"] == 200


def test_by_default_one_model_and_a_load_replaces_it() -> None:
    fake = FakeLlamaServer(router=True, models=("a", "b")).started()
    try:
        assert _complete(fake, "a", "a1")[0] == 200
        assert _complete(fake, "b", "b1")[0] == 200
        assert _resident(fake) == {"b"} and fake.evicted == ["a"]
    finally:
        fake.close()
