"""A forwarding HTTP proxy for tests, on 127.0.0.1, that can hold chosen requests before they
reach the upstream until the test releases them, and tells the test when one has arrived.

Put between the sidecar (and Envoy) and a real llama-server, it makes a race deterministic: a
request the sidecar sends (an idle unload's `POST /models/unload`) or one Envoy forwards (a
completion) is held open at the proxy, so the test can act while it is under way and then let it
go on. Everything else is forwarded as it comes, streamed responses relayed as they are read.

Stdlib only: a threaded `http.server` (HTTP/1.1 keep-alive, as Envoy and aiohttp use it) and one
`http.client` connection to the upstream per request.
"""

from __future__ import annotations

import dataclasses
import http.client
import http.server
import json
import threading
import urllib.parse
from typing import Any

# The most a held request waits for its release: a test that fails before releasing it must not
# leave the proxy's threads (and its upstream's caller) waiting for ever.
HOLD_LIMIT_S = 120.0
UPSTREAM_TIMEOUT_S = 300.0
# Headers of one hop, never forwarded (RFC 9110 7.6.1); the proxy frames each message itself.
_HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer",
                         "upgrade", "content-length"})


@dataclasses.dataclass(frozen=True)
class Seen:
    """A request the proxy received: its method, its path without the query, the body's `model`
    (None where it names none)."""

    method: str
    path: str
    model: str | None


class Hold:
    """Requests matching ``method``, ``path`` and (if given) the body's ``model`` are held before
    they reach the upstream, from when the hold is made until `release`. ``arrived`` is set when
    the first one is held; ``held`` counts them."""

    def __init__(self, method: str, path: str, model: str | None) -> None:
        self.method = method
        self.path = path
        self.model = model
        self.arrived = threading.Event()
        self._released = threading.Event()
        self._lock = threading.Lock()
        self.held = 0

    def matches(self, seen: Seen) -> bool:
        return (not self._released.is_set() and seen.method == self.method and seen.path == self.path
                and (self.model is None or seen.model == self.model))

    def wait(self) -> None:
        """Called by the proxy's thread of a matching request: counted, then held."""
        with self._lock:
            self.held += 1
        self.arrived.set()
        self._released.wait(HOLD_LIMIT_S)

    def release(self) -> None:
        self._released.set()


def _model_of(body: bytes) -> str | None:
    try:
        document: Any = json.loads(body)
    except ValueError:
        return None
    model = document.get("model") if isinstance(document, dict) else None
    return model if isinstance(model, str) else None


class HoldingProxy:
    """See the module. Use as a context manager; ``url`` is what the sidecar is given as its
    upstream. ``seen``: every request received, in order of arrival."""

    def __init__(self, upstream_url: str) -> None:
        parsed = urllib.parse.urlsplit(upstream_url)
        self._upstream = (parsed.hostname or "127.0.0.1", parsed.port or 80)
        self._holds: list[Hold] = []
        self._lock = threading.Lock()
        self._seen: list[Seen] = []
        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), self._handler_class())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="holding-proxy", daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    @property
    def seen(self) -> list[Seen]:
        with self._lock:
            return list(self._seen)

    def hold(self, method: str, path: str, model: str | None = None) -> Hold:
        """Hold the matching requests from now until the hold's `release` (see `Hold`)."""
        hold = Hold(method, path, model)
        with self._lock:
            self._holds.append(hold)
        return hold

    def __enter__(self) -> HoldingProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        with self._lock:
            holds = list(self._holds)
        for hold in holds:
            hold.release()
        self._server.shutdown()
        self._server.server_close()

    def _arrived(self, seen: Seen) -> None:
        with self._lock:
            self._seen.append(seen)
            holds = [hold for hold in self._holds if hold.matches(seen)]
        for hold in holds:
            hold.wait()

    def _handler_class(self) -> type[http.server.BaseHTTPRequestHandler]:
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
                pass  # quiet: the test's output is the sidecar's and the upstream's logs

            def _body(self) -> bytes:
                if self.headers.get("transfer-encoding", "").lower() == "chunked":
                    parts: list[bytes] = []
                    while True:
                        size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                        if size == 0:
                            while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                                pass  # trailers
                            return b"".join(parts)
                        parts.append(self.rfile.read(size))
                        self.rfile.readline()
                return self.rfile.read(int(self.headers.get("content-length") or 0))

            def _forward(self) -> None:
                body = self._body()
                path = self.path.partition("?")[0]
                proxy._arrived(Seen(self.command, path, _model_of(body)))
                headers = {name: value for name, value in self.headers.items() if name.lower() not in _HOP_BY_HOP}
                upstream = http.client.HTTPConnection(*proxy._upstream, timeout=UPSTREAM_TIMEOUT_S)
                try:
                    upstream.request(self.command, self.path, body=body if body or self.command == "POST" else None,
                                     headers=headers)
                    response = upstream.getresponse()
                    self.send_response_only(response.status, response.reason)
                    for name, value in response.getheaders():
                        if name.lower() not in _HOP_BY_HOP:
                            self.send_header(name, value)
                    length = response.getheader("content-length")
                    if response.status in (204, 304) or self.command == "HEAD":
                        self.end_headers()
                    elif length is not None:
                        self.send_header("Content-Length", length)
                        self.end_headers()
                        self.wfile.write(response.read())
                    else:  # streamed (server-sent events): relayed chunk by chunk as read
                        self.send_header("Transfer-Encoding", "chunked")
                        self.end_headers()
                        while chunk := response.read1(65536):
                            self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                            self.wfile.flush()
                        self.wfile.write(b"0\r\n\r\n")
                    self.wfile.flush()
                finally:
                    upstream.close()

            do_GET = do_POST = do_PUT = do_DELETE = _forward

        return Handler
