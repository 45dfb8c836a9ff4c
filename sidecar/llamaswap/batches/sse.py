"""A streamed POST for the token path (`batches/tokenpath.py`): the answer's lines read as they
come (server-sent events), and a stop that closes the connection at once, which Envoy passes on
as a client that leaves (llama-server then cancels the generation at its next token).

One connection per stream, closed after it: a stream is one part of a long generation, so a new
connection costs nothing beside it (the keep-alive client of `http1.py` serves the short calls).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from llamaswap.batches.http1 import MAX_HEAD_BYTES, AnswerTooLarge, ProtocolError

CONNECT_TIMEOUT_S = 10.0
# The longest line of an event stream (one event): a longer one is not read.
MAX_LINE_BYTES = 1024 * 1024


class Stream:
    """A request sent (`send`); `head()` reads the answer's `status` and `headers` (names
    lower-case), then its body's `lines()` (or `body()` whole); `close()` hangs up at any point."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader, self._writer = reader, writer
        self.status = 0
        self.headers: dict[str, str] = {}
        self._chunked = False
        self._left: int | None = None

    async def head(self) -> None:
        """Wait for the answer's head; an OSError when none came (the connection closed first)."""
        try:
            head = await self._reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError as exc:
            raise ConnectionResetError("the connection closed before the answer came") from exc
        except asyncio.LimitOverrunError as exc:
            raise ProtocolError("the answer's headers are too long") from exc
        lines = head.decode("latin-1").split("\r\n")
        version, _, rest = lines[0].partition(" ")
        if not version.startswith("HTTP/1.") or len(rest) < 3 or not rest[:3].isdigit():
            raise ProtocolError(f"not an HTTP/1.1 answer: {lines[0][:80]!r}")
        for line in lines[1:]:
            name, _, value = line.partition(":")
            if name:
                self.headers[name.strip().lower()] = value.strip()
        self.status = int(rest[:3])
        self._chunked = "chunked" in self.headers.get("transfer-encoding", "").lower()
        length = self.headers.get("content-length")
        self._left = int(length) if length is not None and not self._chunked else None
    async def _pieces(self) -> AsyncIterator[bytes]:
        try:
            async for piece in self._raw_pieces():
                yield piece
        except asyncio.IncompleteReadError as exc:
            raise ConnectionResetError("the connection closed before the answer ended") from exc
        except (asyncio.LimitOverrunError, ValueError) as exc:
            raise ProtocolError(f"the answer's chunks cannot be read: {exc}") from exc

    async def _raw_pieces(self) -> AsyncIterator[bytes]:
        if self._chunked:
            while True:
                size_line = await self._reader.readuntil(b"\r\n")
                size = int(size_line.split(b";")[0].strip(), 16)
                if size == 0:
                    return
                yield await self._reader.readexactly(size)
                await self._reader.readexactly(2)
        elif self._left is not None:
            while self._left > 0:
                piece = await self._reader.read(min(self._left, 65536))
                if not piece:
                    raise ConnectionResetError("the connection closed before the answer ended")
                self._left -= len(piece)
                yield piece
        else:
            while piece := await self._reader.read(65536):
                yield piece

    async def lines(self) -> AsyncIterator[bytes]:
        """The body's lines as they come (without their line ends)."""
        buffer = bytearray()
        async for piece in self._pieces():
            buffer += piece
            while (end := buffer.find(b"\n")) >= 0:
                line = bytes(buffer[:end]).rstrip(b"\r")
                del buffer[:end + 1]
                yield line
            if len(buffer) > MAX_LINE_BYTES:
                raise AnswerTooLarge(MAX_LINE_BYTES, None)
        if buffer:
            yield bytes(buffer)

    async def body(self, most: int) -> bytes:
        """The whole body (AnswerTooLarge past ``most`` bytes)."""
        out = bytearray()
        async for piece in self._pieces():
            out += piece
            if len(out) > most:
                raise AnswerTooLarge(most, None)
        return bytes(out)

    def close(self) -> None:
        """Hang up now (a stop: the other end sees the client leave)."""
        self._writer.transport.abort()


async def send(host: str, port: int, path: str, headers: bytes, body: bytes) -> Stream:
    """POST ``body`` to ``path`` with ``headers`` (`http1.header_block`) on a connection of its own;
    an OSError when it cannot be sent."""
    async with asyncio.timeout(CONNECT_TIMEOUT_S):  # not wait_for: 3.11's can swallow a cancel
        reader, writer = await asyncio.open_connection(host, port, limit=MAX_LINE_BYTES + MAX_HEAD_BYTES)
    writer.write(b"".join((b"POST ", path.encode("latin-1"), b" HTTP/1.1\r\nhost: ",
                           f"{host}:{port}".encode("latin-1"), b"\r\ncontent-length: ", str(len(body)).encode(),
                           b"\r\nconnection: close\r\n", headers, b"\r\n", body)))
    return Stream(reader, writer)
