"""The upstream of the data-path benchmarks: FakeLlamaServer (e2e/fake_llama.py) in a process of
its own (`python bench/fake_upstream.py`), so the client's event loop and the upstream's do not share a
GIL. It records each hit's start and end (CLOCK_MONOTONIC) and answers a few commands on stdin."""

from __future__ import annotations

import contextlib
import json
import pathlib
import subprocess
import sys
import threading
from typing import Any

import bench_paths  # noqa: F401 - puts e2e/ on the path
from fake_llama import FakeLlamaServer


class UpstreamProcess:
    """FakeLlamaServer (e2e/fake_llama.py) in a child process, driven over stdin/stdout."""

    def __init__(self, log_dir: pathlib.Path) -> None:
        self._stderr = open(log_dir / "upstream.log", "wb")  # noqa: SIM115 - closed in close()
        self.popen = subprocess.Popen([sys.executable, __file__], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=self._stderr, text=True, bufsize=1)
        self._lock = threading.Lock()
        self.port = int(self._ask("port"))

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        return self.popen.pid

    def _ask(self, command: str) -> str:
        assert self.popen.stdin is not None and self.popen.stdout is not None
        with self._lock:
            self.popen.stdin.write(command + "\n")
            self.popen.stdin.flush()
            line = self.popen.stdout.readline()
        if not line:
            raise RuntimeError(f"upstream process died (command {command!r})")
        return line.strip()

    def hits(self) -> list[dict[str, Any]]:
        """[{id, start_ns, end_ns}] in arrival order."""
        return json.loads(self._ask("hits"))

    def clear(self) -> None:
        self._ask("clear")

    def release(self, test_id: str) -> None:
        self._ask(f"release {test_id}")

    def count(self) -> int:
        return int(self._ask("count"))

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._ask("quit")
        try:
            self.popen.wait(10)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait(10)
        self._stderr.close()


def _upstream_main() -> None:
    server = FakeLlamaServer().started()
    for line in sys.stdin:
        command, _, argument = line.strip().partition(" ")
        if command == "port":
            answer: Any = server.port
        elif command == "hits":
            with server.lock:
                answer = json.dumps([{"id": h.test_id, "start_ns": h.start_ns, "end_ns": h.end_ns}
                                     for h in server.hits])
        elif command == "count":
            with server.lock:
                answer = len(server.hits)
        elif command == "clear":
            with server.lock:
                server.hits.clear()
                server.max_active = server.active
            answer = "ok"
        elif command == "release":
            server.release(argument)
            answer = "ok"
        elif command == "quit":
            sys.stdout.write("bye\n")
            sys.stdout.flush()
            break
        else:
            answer = f"unknown command {command!r}"
        sys.stdout.write(f"{answer}\n")
        sys.stdout.flush()
    server.close()




if __name__ == "__main__":
    _upstream_main()
