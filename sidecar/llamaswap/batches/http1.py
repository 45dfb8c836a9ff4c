"""A small HTTP/1.1 client for the feeder's lines: keep-alive connections to one host (Envoy's
listener), one request at a time on each, the request written in one piece.

Why not aiohttp's client: the feeder runs on the sidecar's event loop, beside the Checks, and
sends every line of every batch; aiohttp's general client (cookies, redirects, URL objects,
payload classes, a stream reader per response) cost about twice the CPU per request of this one
(measured: bench/README.md, batches). What it needs is narrow: POST a known body to a known path,
read the status, a few headers and the body (content-length, chunked, or up to the close).

A request that is cancelled closes its connection at once (abort): Envoy then sees the client
leave, as with any client that hangs up (a waiting line leaves the queue, a running one is
settled as an abandoned generation). So does an answer longer than the request's bound
(batches.maxAnswerBytes), as soon as its length is known to pass it: a content-length over it at
once, a chunked answer or one that ends with the connection when its bytes so far pass it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import cast

from llamaswap.config.batches import MAX_ANSWER_BYTES_DEFAULT

CONNECT_TIMEOUT_S = 10.0
# The most header bytes of an answer (Envoy's own limit on what it sends is 60 KiB by default).
MAX_HEAD_BYTES = 256 * 1024


class ProtocolError(OSError):
    """The other end answered something that is not HTTP/1.1 this client reads."""


class AnswerTooLarge(Exception):
    """The answer's body is longer than the request allowed (not an OSError: asking again would
    get the same answer)."""

    def __init__(self, most: int, length: int | None) -> None:
        self.most, self.length = most, length
        super().__init__(f"the answer has {length} bytes, more than {most}" if length is not None else
                         f"the answer has more than {most} bytes")


class Answer:
    """A response: its status, headers (names lower-case, the last of a repeated one) and body."""

    __slots__ = ("status", "headers", "body")

    def __init__(self, status: int, headers: dict[str, str], body: bytes) -> None:
        self.status, self.headers, self.body = status, headers, body


def header_block(headers: Mapping[str, str]) -> bytes:
    """Headers as the request's bytes; a name or value that would break the framing is refused."""
    out = []
    for name, value in headers.items():
        if any(c in name for c in ":\r\n ") or "\r" in value or "\n" in value:
            raise ValueError(f"header {name!r} cannot be sent over HTTP/1.1 as it is")
        out.append(f"{name}: {value}\r\n")
    return "".join(out).encode("latin-1")


class _Connection(asyncio.Protocol):
    """One keep-alive connection; `exchange` sends a request and waits for its answer."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.reusable = True
        self.received_any = False
        self._buffer = bytearray()
        self._waiter: asyncio.Future[Answer] | None = None
        self._head: tuple[int, dict[str, str]] | None = None
        self._length: int | None = None  # the body's length (content-length); None: chunked or to the close
        self._chunked = False
        self._body = bytearray()
        self._most = 0  # the longest body the request under way accepts

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A TCP connection's transport; not an isinstance check: uvloop's transports do not derive
        # from asyncio.Transport (the check failed there, so no line was ever sent).
        self.transport = cast(asyncio.Transport, transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.reusable = False
        waiter = self._waiter
        if waiter is None or waiter.done():
            return
        if self._head is not None and self._length is None and not self._chunked:
            self._finish(bytes(self._buffer))  # a body that ends with the connection
        else:
            waiter.set_exception(ConnectionResetError(f"the connection closed before the answer ended ({exc})"))

    def abort(self) -> None:
        self.closed = True
        self.reusable = False
        if self.transport is not None:
            self.transport.abort()

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    async def exchange(self, request: bytes, most: int) -> Answer:
        assert self.transport is not None and self._waiter is None
        self._waiter = asyncio.get_running_loop().create_future()
        self._head, self._length, self._chunked, self._most = None, None, False, most
        self.received_any = False
        self._buffer.clear()
        self.transport.write(request)
        try:
            return await self._waiter
        finally:
            self._waiter = None

    def data_received(self, data: bytes) -> None:
        self.received_any = True
        waiter = self._waiter
        if waiter is None or waiter.done():
            self.abort()  # bytes nobody asked for: the framing is lost
            return
        self._buffer += data
        try:
            self._parse()
        except AnswerTooLarge as exc:
            self.abort()  # the rest is not read: the other end sees the client leave
            if not waiter.done():
                waiter.set_exception(exc)
        except (ProtocolError, ValueError) as exc:
            self.abort()
            if not waiter.done():
                waiter.set_exception(ProtocolError(str(exc)))

    def _parse(self) -> None:
        if self._head is None:
            end = self._buffer.find(b"\r\n\r\n")
            if end < 0:
                if len(self._buffer) > MAX_HEAD_BYTES:
                    raise ProtocolError("the answer's headers are too long")
                return
            lines = bytes(self._buffer[:end]).decode("latin-1").split("\r\n")
            del self._buffer[:end + 4]
            version, _, rest = lines[0].partition(" ")
            if not version.startswith("HTTP/1."):
                raise ProtocolError(f"not an HTTP/1.1 answer: {lines[0][:80]!r}")
            status = int(rest[:3])
            headers: dict[str, str] = {}
            for line in lines[1:]:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
            if 100 <= status < 200:  # an interim answer (not asked for): the real one follows
                self._parse()
                return
            self._head = (status, headers)
            connection = headers.get("connection", "").lower()
            if "close" in connection or version == "HTTP/1.0" and "keep-alive" not in connection:
                self.reusable = False
            if "chunked" in headers.get("transfer-encoding", "").lower():
                self._chunked = True
                self._body.clear()
            elif "content-length" in headers:
                self._length = int(headers["content-length"])
                if self._length > self._most:
                    raise AnswerTooLarge(self._most, self._length)
            elif status in (204, 304):
                self._length = 0
            else:
                self.reusable = False  # the body ends with the connection
        if self._chunked:
            self._parse_chunks()
        elif self._length is None and len(self._buffer) > self._most:  # a body that ends with the connection
            raise AnswerTooLarge(self._most, None)
        elif self._length is not None and len(self._buffer) >= self._length:
            if len(self._buffer) > self._length:
                raise ProtocolError("more bytes than the answer's content-length")
            self._finish(bytes(self._buffer))

    def _parse_chunks(self) -> None:
        # What waits to be parsed is one chunk's data and its framing: beyond that, a size line or
        # trailers that never end.
        if len(self._buffer) > self._most + MAX_HEAD_BYTES:
            raise AnswerTooLarge(self._most, None)
        while True:
            end = self._buffer.find(b"\r\n")
            if end < 0:
                return
            size = int(bytes(self._buffer[:end]).split(b";")[0], 16)
            if size == 0:  # the last chunk, then trailers (none, usually) up to an empty line
                if self._buffer.find(b"\r\n\r\n", end) >= 0:
                    self._finish(bytes(self._body))
                return
            if len(self._body) + size > self._most:
                raise AnswerTooLarge(self._most, None)
            if len(self._buffer) < end + 2 + size + 2:
                return
            self._body += self._buffer[end + 2:end + 2 + size]
            del self._buffer[:end + 2 + size + 2]

    def _finish(self, body: bytes) -> None:
        assert self._head is not None and self._waiter is not None
        self._buffer.clear()
        status, headers = self._head
        self._waiter.set_result(Answer(status, headers, body))


class Http1Client:
    """POSTs to ``host:port`` over keep-alive connections (as many as requests at once)."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self._host_header = f"host: {host}:{port}\r\n".encode("latin-1")
        self._idle: list[_Connection] = []
        self._open: set[_Connection] = set()

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(CONNECT_TIMEOUT_S):  # not wait_for: 3.11's can swallow a cancel
            _, connection = await loop.create_connection(_Connection, self.host, self.port)
        self._open.add(connection)
        return connection

    async def post(self, path: str, headers: bytes, body: bytes, *, most: int = MAX_ANSWER_BYTES_DEFAULT) -> Answer:
        """POST ``body`` to ``path`` with ``headers`` (from `header_block`); an OSError when no
        answer came; AnswerTooLarge when its body has more than ``most`` bytes (known from its
        content-length, or from its bytes so far: the rest is not read). A connection kept from
        before that the other end had closed is tried once more on a new one when nothing at all
        came back on it."""
        request = b"".join((b"POST ", path.encode("latin-1"), b" HTTP/1.1\r\n", self._host_header,
                            b"content-length: ", str(len(body)).encode(), b"\r\n", headers, b"\r\n", body))
        while True:
            kept = False
            while self._idle:
                connection = self._idle.pop()
                if not connection.closed:
                    kept = True
                    break
                self._open.discard(connection)
            else:
                connection = await self._connect()
            try:
                answer = await connection.exchange(request, most)
            except BaseException as exc:
                connection.abort()
                self._open.discard(connection)
                if kept and isinstance(exc, ConnectionResetError) and not connection.received_any:
                    continue
                raise
            if connection.reusable and not connection.closed:
                self._idle.append(connection)
            else:
                connection.close()
                self._open.discard(connection)
            return answer

    async def close(self) -> None:
        for connection in list(self._open):
            connection.close()
        self._open.clear()
        self._idle.clear()
