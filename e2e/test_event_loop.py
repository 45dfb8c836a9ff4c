"""The event loop `llamaswap serve` runs on (`commands/event_loop.py`): uvloop by default where it
is installed (a dependency), asyncio's own with LLAMASWAP_EVENT_LOOP=asyncio, and on either the
admin server answers, the Batch API's worker threads answer, a SIGHUP reloads and a SIGTERM
stops the sidecar gracefully (exit 0). A value that names no loop is a configuration error."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess

import pytest

from fake_llama import FakeLlamaServer
from harness import SidecarProcess, get_json, http_get, sidecar_command, wait_for, write_config

EVENT_LOOP_ENV = "LLAMASWAP_EVENT_LOOP"


@pytest.mark.parametrize(("setting", "loop"), [("", "uvloop"), ("asyncio", "asyncio"), ("uvloop", "uvloop")])
def test_the_sidecar_runs_on_the_loop_asked_for_and_stops_gracefully(tmp_path: pathlib.Path, setting: str,
                                                                      loop: str) -> None:
    pytest.importorskip("uvloop")  # a dependency: installed wherever the project is
    fake = FakeLlamaServer().started()
    document = {"listen": {"http": "127.0.0.1:0", "grpc": "127.0.0.1:0", "admin": "127.0.0.1:0"},
                "upstream": {"url": fake.url, "modelsPollSeconds": 0},
                "batches": {"dir": str(tmp_path / "batches")}}
    sidecar = SidecarProcess(write_config(tmp_path, document), tmp_path, env={EVENT_LOOP_ENV: setting})
    try:
        assert f"scheduler serial, event loop {loop}" in sidecar.log()
        assert get_json(f"{sidecar.admin_url}/queue")["waiting"] == []  # the admin server (aiohttp)
        # The Batch API's store answers from a worker thread (asyncio.to_thread).
        status, body = http_get(f"{sidecar.admin_url}/v1/files")
        assert status == 200, body
        files = json.loads(body)
        assert (files["object"], files["data"]) == ("list", []), files
        sidecar.signal(signal.SIGHUP)  # a signal handler on the loop
        wait_for(lambda: "configuration re-read from" in sidecar.log(), what="the reload after SIGHUP")
        assert sidecar.alive()
    except BaseException:
        sidecar.dump()
        raise
    finally:
        status_code = sidecar.stop()
        fake.close()
    assert status_code == 0, sidecar.log()[-4000:]
    assert "shutting down: no new requests" in sidecar.log()


def test_a_loop_that_is_not_one_is_a_configuration_error(tmp_path: pathlib.Path) -> None:
    document = {"listen": {"http": "127.0.0.1:0", "grpc": "127.0.0.1:0", "admin": "127.0.0.1:0"},
                "upstream": {"url": "http://127.0.0.1:9", "modelsPollSeconds": 0}}
    done = subprocess.run([*sidecar_command(), "serve", "-c", str(write_config(tmp_path, document))],
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, EVENT_LOOP_ENV: "tokio"})
    assert done.returncode == 2, done.stderr
    assert f"{EVENT_LOOP_ENV}='tokio' is not a loop: set it to auto, uvloop, asyncio" in done.stderr

