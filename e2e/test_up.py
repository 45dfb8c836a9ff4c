"""`llamaswap up`: the whole stack in one command, stopped cleanly by SIGTERM."""

from __future__ import annotations

import json
import pathlib
import signal
import subprocess
import sys
import urllib.request

import yaml

from harness import free_port, http_get, wait_for

HERE = pathlib.Path(__file__).parent


def test_up_serves_and_stops_cleanly(tmp_path: pathlib.Path) -> None:
    http, grpc, admin, upstream = (free_port() for _ in range(4))
    config = {
        "listen": {"http": f"127.0.0.1:{http}", "grpc": f"127.0.0.1:{grpc}", "admin": f"127.0.0.1:{admin}"},
        "upstream": {"url": f"http://127.0.0.1:{upstream}", "command": [sys.executable, str(HERE / "harness.py"),
                                                                         str(upstream)],
                     "modelsPollSeconds": 0, "startupTimeoutSeconds": 60},
    }
    config_path = tmp_path / "up.yaml"
    config_path.write_text(yaml.safe_dump(config))
    log_path = tmp_path / "up.log"
    with open(log_path, "wb") as log:
        up = subprocess.Popen([sys.executable, "-m", "llamaswap", "up", "-c", str(config_path), "--workdir",
                               str(tmp_path / "work"), "--grace", "5"], stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_for(lambda: b"llamaswap is up" in log_path.read_bytes() or up.poll() is not None,
                     what="the 'llamaswap is up' line")
            assert up.poll() is None, log_path.read_text()
            assert f"http://127.0.0.1:{http}/v1/chat/completions" in log_path.read_text()
            request = urllib.request.Request(
                f"http://127.0.0.1:{http}/v1/chat/completions",
                data=json.dumps({"model": "model-a", "messages": []}).encode(),
                headers={"content-type": "application/json", "x-llamaswap-priority": "interactive"})
            with urllib.request.urlopen(request, timeout=30) as response:
                assert response.status == 200
                assert response.headers["x-llamaswap-band"] == "interactive"
            up.send_signal(signal.SIGTERM)
            assert up.wait(60) == 0, log_path.read_text()
        finally:
            if up.poll() is None:
                up.kill()
                up.wait()
    # Every part is gone: nothing answers on the upstream or the listener.
    for port in (upstream, http):
        try:
            status, _ = http_get(f"http://127.0.0.1:{port}/health", timeout=2)
        except OSError:
            status = None
        assert status is None, f"port {port} still answers after shutdown"
