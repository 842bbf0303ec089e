"""TcpForward: a real TCP port on 127.0.0.1 piping to a real Unix-socket server (no desktop needed)."""
from __future__ import annotations

import asyncio
import hashlib

import pytest

from actors.desktop.tcp_forward import TcpForward


async def _digest_server(path: str):
    """A Unix-socket server that reads to EOF, then answers the SHA-256 of what it got and closes."""
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        data = await reader.read()
        writer.write(hashlib.sha256(data).hexdigest().encode() + b" " + str(len(data)).encode())
        await writer.drain()
        writer.close()
    return await asyncio.start_unix_server(serve, path)


async def test_bytes_cross_both_ways_and_a_half_close_reaches_the_controller(tmp_path):
    sock = str(tmp_path / "c.sock")
    server = await _digest_server(sock)
    try:
        async with TcpForward(sock) as fwd:
            assert fwd.port > 0 and fwd.url == f"http://127.0.0.1:{fwd.port}"
            payload = bytes(range(256)) * 8192  # 2 MiB
            reader, writer = await asyncio.open_connection("127.0.0.1", fwd.port)
            writer.write(payload)
            await writer.drain()
            writer.write_eof()
            async with asyncio.timeout(10):
                answer = await reader.read()  # to EOF: the server closing closes our connection
            assert answer == hashlib.sha256(payload).hexdigest().encode() + b" " + str(len(payload)).encode()
            writer.close()
    finally:
        server.close()


async def test_a_missing_socket_closes_the_connection(tmp_path):
    async with TcpForward(str(tmp_path / "none.sock")) as fwd:
        reader, writer = await asyncio.open_connection("127.0.0.1", fwd.port)
        async with asyncio.timeout(10):
            assert await reader.read() == b""
        writer.close()


async def test_close_cuts_open_connections_and_frees_the_port(tmp_path):
    sock = str(tmp_path / "c.sock")
    server = await _digest_server(sock)
    try:
        fwd = await TcpForward(sock).start()
        reader, writer = await asyncio.open_connection("127.0.0.1", fwd.port)
        writer.write(b"partial request, never finished")
        await writer.drain()
        await fwd.close()
        async with asyncio.timeout(10):  # cut (EOF or reset), not left hanging
            try:
                assert await reader.read() == b""
            except ConnectionResetError:
                pass
        writer.close()
        with pytest.raises(OSError):
            await asyncio.open_connection("127.0.0.1", fwd.port)
    finally:
        server.close()
