"""The feeder's HTTP/1.1 client against a scripted server: each framing of an answer, keep-alive
and its loss, a cancel that hangs up, and headers that would break the framing."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import pytest

from llamaswap.batches.http1 import MAX_HEAD_BYTES, AnswerTooLarge, Http1Client, ProtocolError, header_block
from llamaswap.commands.event_loop import EVENT_LOOP_ENV, loop_factory, loop_name, run

Script = Callable[[bytes], bytes | None]  # a request's head and body -> the bytes to answer (None: hang up)


class Server:
    """Answers each request as `script` says; counts connections and those that were closed."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.connections = 0
        self.closed = 0
        self.requests: list[bytes] = []
        self.got_request = asyncio.Event()
        self.port = 0
        self._server: asyncio.Server | None = None
        self._writers: list[asyncio.StreamWriter] = []

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self._writers.append(writer)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length:"))
                request = head + await reader.readexactly(length)
                self.requests.append(request)
                self.got_request.set()
                answer = self.script(request)
                if answer is None:
                    continue  # never answered: the client must hang up
                writer.write(answer)
                await writer.drain()
                if b"connection: close" in answer.lower() or b"content-length" not in answer.lower() \
                        and b"chunked" not in answer.lower():
                    writer.close()
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            self.closed += 1
        finally:
            writer.close()

    async def drop_idle(self) -> None:
        """Close every connection from the server's side (an idle timeout)."""
        for writer in self._writers:
            writer.close()
        self._writers.clear()
        await asyncio.sleep(0)

    async def stop(self) -> None:
        await self.drop_idle()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()


def ok(body: bytes = b'{"ok":true}', extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n%s\r\n%s" % (
        len(body), extra, body)


@pytest.fixture
async def serve() -> AsyncIterator[Callable[[Script], asyncio.Future[tuple[Server, Http1Client]]]]:
    made: list[tuple[Server, Http1Client]] = []

    async def start(script: Script) -> tuple[Server, Http1Client]:
        server = Server(script)
        await server.start()
        client = Http1Client("127.0.0.1", server.port)
        made.append((server, client))
        return server, client

    yield start  # type: ignore[misc]
    for server, client in made:
        await client.close()
        await server.stop()


HEADERS = header_block({"content-type": "application/json", "x-request-id": "batch_1:a"})


async def test_content_length_answers_reuse_one_connection(serve) -> None:  # type: ignore[no-untyped-def]
    server, client = await serve(lambda request: ok(b'{"n":%d}' % request.count(b"x"), b"x-llamaswap-outcome: ok\r\n"))
    for n in range(3):
        answer = await client.post("/v1/completions", HEADERS, b"x" * n)
        assert (answer.status, answer.body) == (200, b'{"n":%d}' % (n + 1))  # the request id's x too
        assert answer.headers["x-llamaswap-outcome"] == "ok"
    assert server.connections == 1
    head = server.requests[0].split(b"\r\n\r\n")[0].split(b"\r\n")
    assert head[0] == b"POST /v1/completions HTTP/1.1"
    assert f"host: 127.0.0.1:{server.port}".encode() in head and b"x-request-id: batch_1:a" in head


async def test_chunked_answer(serve) -> None:  # type: ignore[no-untyped-def]
    chunked = (b"HTTP/1.1 503 Service Unavailable\r\ntransfer-encoding: chunked\r\nretry-after-ms: 250\r\n\r\n"
               b"5\r\nhello\r\n7;ext=1\r\n, world\r\n0\r\n\r\n")
    server, client = await serve(lambda request: chunked)
    for _ in range(2):
        answer = await client.post("/v1/completions", HEADERS, b"{}")
        assert (answer.status, answer.body, answer.headers["retry-after-ms"]) == (503, b"hello, world", "250")
    assert server.connections == 1


async def test_an_answer_ended_by_the_close_and_connection_close(serve) -> None:  # type: ignore[no-untyped-def]
    answers = iter([b"HTTP/1.1 200 OK\r\n\r\nup to the close", ok(b"{}", b"connection: close\r\n"), ok(b"{}")])
    server, client = await serve(lambda request: next(answers))
    assert (await client.post("/v1/completions", HEADERS, b"{}")).body == b"up to the close"
    assert (await client.post("/v1/completions", HEADERS, b"{}")).body == b"{}"
    assert (await client.post("/v1/completions", HEADERS, b"{}")).body == b"{}"
    assert server.connections == 3


async def test_a_kept_connection_the_server_closed_is_replaced(serve) -> None:  # type: ignore[no-untyped-def]
    server, client = await serve(lambda request: ok())
    assert (await client.post("/v1/completions", HEADERS, b"{}")).status == 200
    await server.drop_idle()
    assert (await client.post("/v1/completions", HEADERS, b"{}")).status == 200
    assert server.connections == 2


async def test_a_cancelled_request_hangs_up(serve) -> None:  # type: ignore[no-untyped-def]
    server, client = await serve(lambda request: None)
    sending = asyncio.create_task(client.post("/v1/completions", HEADERS, b"{}"))
    await asyncio.wait_for(server.got_request.wait(), 30)
    sending.cancel()
    with pytest.raises(asyncio.CancelledError):
        await sending
    deadline = asyncio.get_running_loop().time() + 30
    while server.closed < 1:  # the server sees the client leave
        assert asyncio.get_running_loop().time() < deadline, "the connection was not closed"
        await asyncio.sleep(0.01)


async def test_no_answer_is_an_os_error(serve) -> None:  # type: ignore[no-untyped-def]
    server, client = await serve(lambda request: b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nshort")
    with pytest.raises(ConnectionResetError):  # the connection closed before the body ended
        await asyncio.wait_for(_post_then_drop(server, client), 30)
    server.script = lambda request: b"SMTP ready\r\n\r\n"
    with pytest.raises(ProtocolError):
        await client.post("/v1/completions", HEADERS, b"{}")
    assert issubclass(ProtocolError, OSError)  # the feeder sends a line again after any OSError


async def _post_then_drop(server: Server, client: Http1Client) -> None:
    sending = asyncio.create_task(client.post("/v1/completions", HEADERS, b"{}"))
    await server.got_request.wait()
    await asyncio.sleep(0)
    await server.drop_idle()
    await sending


async def test_a_refused_connection_is_an_os_error() -> None:
    server = Server(lambda request: ok())
    await server.start()
    port = server.port
    await server.stop()
    with pytest.raises(OSError):
        await Http1Client("127.0.0.1", port).post("/v1/completions", HEADERS, b"{}")


async def _closed(server: Server) -> None:
    deadline = asyncio.get_running_loop().time() + 30
    while server.closed < 1:  # the server sees the client leave
        assert asyncio.get_running_loop().time() < deadline, "the connection was not closed"
        await asyncio.sleep(0.01)


@pytest.mark.parametrize("framing", ["content-length", "chunked", "a chunk's size line that never ends",
                                     "up to the close"])
async def test_an_answer_over_its_bound_is_not_read_and_hangs_up(serve, framing: str) -> None:  # type: ignore[no-untyped-def]
    most = 1000
    answers = {
        # Its length says it all: nothing of the body is sent, and the client must not wait for it.
        "content-length": b"HTTP/1.1 200 OK\r\ncontent-length: 1000000000\r\n\r\n",
        # Two chunks pass the bound, and the answer never ends: the client must not wait for its end.
        "chunked": b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + b"258\r\n" + b"a" * 600 + b"\r\n"
                   + b"258\r\n" + b"b" * 600 + b"\r\n",
        "a chunk's size line that never ends": b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
                                                + b"0" * (most + MAX_HEAD_BYTES + 1),
        "up to the close": b"HTTP/1.1 200 OK\r\n\r\n" + b"c" * 2000,
    }
    server, client = await serve(lambda request: answers[framing])
    with pytest.raises(AnswerTooLarge) as refused:
        await asyncio.wait_for(client.post("/v1/completions", HEADERS, b"{}", most=most), 30)
    assert refused.value.most == most
    assert refused.value.length == (1_000_000_000 if framing == "content-length" else None)
    assert not isinstance(refused.value, OSError)  # the feeder sends a line again after an OSError: not this
    if framing != "up to the close":  # that one the server closes itself
        await _closed(server)
    server.script = lambda request: ok(b"x" * most)  # at the bound: read, on a new connection
    assert (await client.post("/v1/completions", HEADERS, b"{}", most=most)).body == b"x" * most
    assert server.connections == 2


@pytest.mark.parametrize("headers", [{"x-a": "one\r\ntwo: 2"}, {"x-a": "one\ntwo"}, {"x a": "b"}, {"x:a": "b"}])
def test_headers_that_would_break_the_framing_are_refused(headers: dict[str, str]) -> None:
    with pytest.raises(ValueError):
        header_block(headers)


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_answers_and_keep_alive_on_each_loop_the_sidecar_runs_on(loop: str) -> None:
    # uvloop's transports are not asyncio.Transport subclasses (an isinstance check once failed
    # every connection there, so no line of a batch was ever sent).
    if loop == "uvloop":
        pytest.importorskip("uvloop")

    async def two_posts() -> tuple[list[int], int, str]:
        server = Server(lambda request: ok())
        await server.start()
        client = Http1Client("127.0.0.1", server.port)
        try:
            answers = [await client.post("/v1/chat/completions", HEADERS, b"{}") for _ in range(2)]
        finally:
            await client.close()
            await server.stop()
        return [answer.status for answer in answers], server.connections, loop_name(asyncio.get_running_loop())

    statuses, connections, ran_on = run(two_posts(), loop_factory({EVENT_LOOP_ENV: loop}))
    assert (statuses, connections, ran_on) == ([200, 200], 1, loop)
