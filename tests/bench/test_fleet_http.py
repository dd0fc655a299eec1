"""bench._fleet_http's kept-alive connections: a connection the server closed while it sat idle is
reconnected once, and only then."""

from __future__ import annotations

import asyncio

import pytest

from bench._fleet_http import Connection

ANSWER = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
REQUEST = b"POST /x HTTP/1.1\r\nHost: t\r\nContent-Length: 0\r\n\r\n"


async def _serve(handler) -> tuple[asyncio.Server, int]:
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


def test_a_connection_the_server_closed_while_idle_is_opened_again_and_the_request_answered():
    async def main():
        accepted = []

        async def one_request_then_close(reader, writer):  # as an idle timeout would, after the answer
            accepted.append(writer)
            await reader.readuntil(b"\r\n\r\n")
            writer.write(ANSWER)
            await writer.drain()
            writer.close()

        server, port = await _serve(one_request_then_close)
        async with server:
            connection = Connection("127.0.0.1", port)
            first = await connection.exchange(REQUEST, 5)
            await asyncio.sleep(0.05)  # the server's close reaches us
            second = await connection.exchange(REQUEST, 5)
            connection.close()
        return first[0], second[0], len(accepted)

    first, second, connections = asyncio.run(main())
    assert (first, second) == (200, 200)
    assert connections == 2, "the second request went out on a new connection"


def test_a_new_connection_that_fails_is_the_server_s_answer_not_retried():
    async def main():
        accepted = []

        async def close_at_once(reader, writer):
            accepted.append(writer)
            await reader.readuntil(b"\r\n\r\n")
            writer.close()

        server, port = await _serve(close_at_once)
        async with server:
            connection = Connection("127.0.0.1", port)
            with pytest.raises(asyncio.IncompleteReadError):
                await connection.exchange(REQUEST, 5)
            connection.close()
        return len(accepted)

    assert asyncio.run(main()) == 1
