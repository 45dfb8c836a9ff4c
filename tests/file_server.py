"""A file server on 127.0.0.1 with Range requests: what `llamaswap fetch-models` downloads from
in its tests. (The fake llama-server is e2e/fake_llama.py.)"""

from __future__ import annotations

import http.server
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
