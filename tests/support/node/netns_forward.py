"""A TCP forwarder between two network namespaces: how the tests reach the node's API server, which listens only
inside the node's namespace, and how the node's pods reach a server the tests run on this machine's loopback.

Usage: python netns_forward.py NETNS_FILE HOST PORT [LISTEN_HOST]. It listens on LISTEN_HOST (default 127.0.0.1; a
free port, printed on the first line of stdout) in the namespace it starts in, then joins the namespace of NETNS_FILE
(e.g. /proc/PID/ns/net): sockets keep the namespace they were made in, so every connection it accepts is in the
namespace it started in and every connection it opens to HOST:PORT is in NETNS_FILE's. Started on this machine, it
lets the tests into the node; started inside the node's namespace (nsenter) with NETNS_FILE this machine's, it lets
the node's pods out to one port. It runs until killed.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import socket
import sys

CLONE_NEWNET = 0x40000000  # linux/sched.h


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except OSError:
        pass
    finally:
        writer.close()


async def _serve(listener: socket.socket, host: str, port: int) -> None:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection(host, port)
        except OSError:
            writer.close()
            return
        await asyncio.gather(_pipe(reader, upstream_writer), _pipe(upstream_reader, writer))

    server = await asyncio.start_server(handle, sock=listener)
    async with server:
        await server.serve_forever()


def main() -> None:
    netns_file, host, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
    listen_host = sys.argv[4] if len(sys.argv) > 4 else "127.0.0.1"
    listener = socket.create_server((listen_host, 0))
    with open(netns_file) as namespace:
        if ctypes.CDLL("libc.so.6", use_errno=True).setns(namespace.fileno(), CLONE_NEWNET) != 0:
            sys.exit(f"setns {netns_file}: {os.strerror(ctypes.get_errno())}")
    print(listener.getsockname()[1], flush=True)
    asyncio.run(_serve(listener, host, port))


if __name__ == "__main__":
    main()
