"""A taken listen address names what holds it: another llamaswap, or another server (llama-server
listens on 8080, llamaswap's listen.http, unless given --port)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from llamaswap.commands.ports import is_llamaswap, port_holder
from llamaswap.commands.serve import PortInUse
from llamaswap.config import HostPort

LISTENER = ("import socket, sys\n"
            "s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen()\n"
            "print(s.getsockname()[1], flush=True); sys.stdin.read()\n")

pytestmark = pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="/proc is Linux's")


def test_the_holder_of_a_port_is_named_with_its_pid(tmp_path: Path) -> None:
    script = tmp_path / "other_server.py"
    script.write_text(LISTENER)
    with subprocess.Popen([sys.executable, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          text=True) as other:
        assert other.stdout is not None and other.stdin is not None
        port = int(other.stdout.readline())
        try:
            assert port_holder(port) == f"other_server.py (pid {other.pid})"
        finally:
            other.stdin.close()
    assert port_holder(port) is None  # nobody listens there any more


def test_the_message_says_whether_it_is_llamaswap() -> None:
    address = HostPort("127.0.0.1", 8080)
    foreign = str(PortInUse("listen.http", address, holder="llama-server (pid 7)"))
    assert "in use by llama-server (pid 7), not by llamaswap" in foreign
    assert "--port 8081" in foreign and "another llamaswap" not in foreign
    ours = str(PortInUse("listen.http", address, holder="envoy (pid 8)"))
    assert "in use by envoy (pid 8): is another llamaswap running?" in ours
    assert is_llamaswap("llamaswap (pid 9)") and not is_llamaswap("llama-server (pid 9)")


def test_up_names_a_foreign_server_on_its_port(tmp_path: Path) -> None:
    with subprocess.Popen([sys.executable, "-c", LISTENER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          text=True) as other:
        assert other.stdout is not None and other.stdin is not None
        port = int(other.stdout.readline())
        try:
            config = tmp_path / "mine.yaml"
            config.write_text(f"listen: {{http: '127.0.0.1:{port}'}}\nupstream: {{url: 'http://127.0.0.1:9'}}\n")
            result = subprocess.run([sys.executable, "-m", "llamaswap", "up", "-c", str(config)], capture_output=True,
                                    text=True, timeout=60, env=os.environ)
        finally:
            other.stdin.close()
    assert result.returncode == 1
    name = Path(sys.executable).name
    assert f"listen.http 127.0.0.1:{port} is already in use by {name} (pid {other.pid}), not by llamaswap" \
        in result.stderr, result.stderr


def test_the_documented_message_is_what_up_prints() -> None:
    """docs/operations.md shows the message for llama-server on 8080 as `up` prints it (one
    sentence, no "[Errno 98]" prefix)."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "operations.md").read_text()
    shown = text.split("naming what holds it:\n\n```\n", 1)[1].split("\n```", 1)[0]
    said = str(PortInUse("listen.http", HostPort("127.0.0.1", 8080), holder="llama-server (pid 4242)"))
    assert f"error: {said}" == " ".join(shown.split())
