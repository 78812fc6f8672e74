"""The socket `servelab serve` listens on: accepted connections send small writes at once."""

import asyncio
import socket


def test_accepted_connections_have_nagle_off():
    """asyncio turns Nagle off (TCP_NODELAY) only on a socket created as IPPROTO_TCP. With it on, a
    response written in two pieces (headers, then body or a stream's first chunk) waits for the
    client's delayed ACK: about 40 ms on every keep-alive request."""
    from servelab.commands.serve import _bind

    async def main() -> int:
        listener = _bind("127.0.0.1", 0)
        accepted: asyncio.Future = asyncio.get_running_loop().create_future()

        def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            sock = writer.get_extra_info("socket")
            accepted.set_result(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        server = await asyncio.start_server(on_connect, sock=listener)
        _, writer = await asyncio.open_connection(*listener.getsockname()[:2])
        try:
            return await asyncio.wait_for(accepted, 10)
        finally:
            writer.close()
            server.close()
            await server.wait_closed()

    assert asyncio.run(main()) != 0
