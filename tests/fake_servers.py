"""Small HTTP servers on 127.0.0.1 for the tests of the chart's programs: a file server with
Range requests (what `llamaswap fetch-models` downloads from) and a fake llama-server router
(`/v1/models` with model states, `POST /models/load`, what `llamaswap load-model` drives)."""

from __future__ import annotations

import http.server
import json
import re
import socket
import threading
from typing import Any


class FileServer:
    """GET /NAME serves `files[NAME]`, honouring `Range: bytes=N-` (206, or 416 past the end);
    records each request's Range header. `ignore_range` answers 200 with the whole file;
    `break_after` closes the connection after that many body bytes of the next response."""

    def __init__(self, files: dict[str, bytes]) -> None:
        self.files = files
        self.ranges: list[str | None] = []
        self.ignore_range = False
        self.break_after: int | None = None
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:  # noqa: N802
                name = self.path.lstrip("/")
                outer.ranges.append(self.headers.get("Range"))
                if name not in outer.files:
                    self.send_error(404, "Not Found")
                    return
                data = outer.files[name]
                start = 0
                match = re.fullmatch(r"bytes=(\d+)-", self.headers.get("Range") or "")
                if match and not outer.ignore_range:
                    start = int(match.group(1))
                    if start >= len(data):
                        self.send_response(416)
                        self.send_header("Content-Range", f"bytes */{len(data)}")
                        self.send_header("Content-Length", "0")
                        self.end_headers()
                        return
                    self.send_response(206)
                    self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
                else:
                    self.send_response(200)
                body = data[start:]
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if outer.break_after is not None:
                    cut, outer.break_after = outer.break_after, None
                    self.wfile.write(body[:cut])
                    self.wfile.flush()
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                self.wfile.write(body)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/{name}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class FakeRouter:
    """GET /v1/models lists `states` (id -> status value, router mode) or plain ids
    (router=False); POST /models/load records the model and sets it `loading`; GET /metrics
    (?model=NAME in router mode, which loads NAME like llama-server does) serves one counter. The test moves a
    model to `loaded` itself, as the real router does when its child is up."""

    def __init__(self, states: dict[str, str], *, router: bool = True) -> None:
        self.states = dict(states)
        self.router = router
        self.loads: list[str] = []
        self.metrics_asked: list[str | None] = []
        # GET /props answers total_slots (router mode: ?model=NAME, which loads NAME).
        self.total_slots = 4
        self.props_asked: list[str | None] = []
        # GETs of /v1/models so far; with load_takes_looks set, a loading model is loaded after that many.
        self.looks = 0
        self.load_takes_looks: int | None = None
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def _json(self, status: int, document: Any) -> None:
                body = json.dumps(document).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:  # noqa: N802
                if self.path.startswith("/metrics"):
                    self._metrics()
                    return
                if self.path.startswith("/props"):
                    model = self.path.partition("?model=")[2] or None
                    outer.props_asked.append(model)
                    if model is not None:
                        outer.states[model] = "loaded"
                    self._json(200, {"total_slots": outer.total_slots, "model_path": "/models/x.gguf"})
                    return
                if self.path != "/v1/models":
                    self._json(404, {"error": "not found"})
                    return
                outer.looks += 1
                if outer.load_takes_looks is not None and outer.looks > outer.load_takes_looks:
                    outer.states.update({name: "loaded" for name, state in outer.states.items() if state == "loading"})
                data = [{"id": name, "object": "model", **({"status": {"value": state}} if outer.router else {})}
                        for name, state in outer.states.items()]
                self._json(200, {"object": "list", "data": data})

            def _metrics(self) -> None:
                """Like llama-server --metrics: router mode wants ?model= and LOADS that model."""
                model = self.path.partition("?model=")[2] or None
                outer.metrics_asked.append(model)
                if outer.router and model is None:
                    self._json(400, {"error": {"message": "model name is missing from the request"}})
                    return
                if model is not None:
                    outer.states[model] = "loaded"
                body = b"# HELP llamacpp:tokens_predicted_total Generated tokens\n" \
                       b"# TYPE llamacpp:tokens_predicted_total counter\nllamacpp:tokens_predicted_total 42\n"
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_POST(self) -> None:  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
                if self.path != "/models/load" or body.get("model") not in outer.states:
                    self._json(400, {"error": {"message": "bad load"}})
                    return
                outer.loads.append(body["model"])
                outer.states[body["model"]] = "loading"
                self._json(200, {"success": True})

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
