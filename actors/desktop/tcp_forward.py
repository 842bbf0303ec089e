"""A TCP port on the host that forwards to a desktop controller's Unix socket, so OSWorld's own host-side
clients (PythonController, SetupController: ``requests`` to ``http://IP:PORT``) reach our desktops unchanged.

Role: byte pipe only; it does not parse HTTP, so the controller's limits and answers apply as they are. Each
accepted TCP connection gets its own Unix-socket connection; the client's end of sending is passed on as a
half-close, and the controller closing its side closes the TCP connection. Listens on
127.0.0.1 by default: the controller runs commands as root inside the desktop, so never expose it to a network
you do not trust.

Usage::

    async with TcpForward("/tmp/arpo-desktops/<run>/<desktop>/controller.sock") as fwd:
        PythonController("127.0.0.1", fwd.port).get_screenshot()

or from a shell: ``python -m actors.desktop.tcp_forward SOCKET [--port 5000]`` (runs until interrupted).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import os

CHUNK = 65536


class TcpForward:
    """Forward ``host:port`` (TCP) to the Unix socket ``socket_path``.

    Args:
        socket_path: the controller's socket (it need not exist yet; a connection made while it is missing is
            closed at once).
        host: address to listen on (default loopback only).
        port: TCP port; 0 picks a free one (read :attr:`port` after :meth:`start`).
    Raises:
        OSError: from :meth:`start`, when the port cannot be bound.
    """

    def __init__(self, socket_path: str, host: str = "127.0.0.1", port: int = 0) -> None:
        self.socket_path = socket_path
        self.host = host
        self.port = port
        self._server: asyncio.base_events.Server | None = None
        self._pipes: set[asyncio.Task] = set()

    async def start(self) -> TcpForward:
        """Start listening; sets :attr:`port` to the bound port. Returns self."""
        self._server = await asyncio.start_server(self._serve, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    @property
    def url(self) -> str:
        """``http://host:port``, the base URL an HTTP client uses."""
        return f"http://{self.host}:{self.port}"

    async def close(self) -> None:
        """Stop listening and cut every open connection (idempotent)."""
        if self._server is not None:
            self._server.close()
            self._server = None
        for task in list(self._pipes):
            task.cancel()
        if self._pipes:
            await asyncio.gather(*self._pipes, return_exceptions=True)

    async def __aenter__(self) -> TcpForward:
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def _serve(self, tcp_reader: asyncio.StreamReader, tcp_writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._pipes.add(task)
        unix_writer = None
        try:
            try:
                unix_reader, unix_writer = await asyncio.open_unix_connection(self.socket_path)
            except OSError:
                return  # no controller there: the client sees the connection closed
            # client -> controller until the client is done (then half-close); controller -> client until the
            # controller closes, which ends the whole connection (the client then reconnects for its next request)
            upstream = asyncio.create_task(_pump(tcp_reader, unix_writer))
            try:
                await _pump(unix_reader, tcp_writer)
            finally:
                upstream.cancel()
                await asyncio.gather(upstream, return_exceptions=True)
        except OSError:
            pass
        finally:
            self._pipes.discard(task)
            for w in (tcp_writer, unix_writer):
                if w is not None:
                    w.close()
                    with contextlib.suppress(Exception):
                        await w.wait_closed()


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Copy until EOF, then half-close the other side (so a request's end reaches the controller)."""
    while chunk := await reader.read(CHUNK):
        writer.write(chunk)
        await writer.drain()
    if writer.can_write_eof():
        with contextlib.suppress(OSError):
            writer.write_eof()


async def _run(socket_path: str, host: str, port: int) -> None:
    async with TcpForward(socket_path, host, port) as fwd:
        print(f"forwarding {fwd.url} -> {socket_path} (Ctrl-C stops)", flush=True)
        await asyncio.Event().wait()


def main(argv: list[str] | None = None) -> int:
    """``python -m actors.desktop.tcp_forward SOCKET [--host H] [--port P]``: forward until interrupted."""
    p = argparse.ArgumentParser(prog="python -m actors.desktop.tcp_forward", description=__doc__.split("\n\n")[0])
    p.add_argument("socket", help="the desktop controller's Unix socket (controller.sock)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=5000, help="TCP port (OSWorld's controller port, 5000, by default)")
    args = p.parse_args(argv)
    if not os.path.exists(args.socket):
        print(f"error: no socket at {args.socket}")
        return 1
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_run(args.socket, args.host, args.port))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
