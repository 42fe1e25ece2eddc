"""A TCP forwarder from this machine's loopback into a network namespace: how the tests reach the node's API server,
which listens only inside the node's namespace.

Usage: python netns_forward.py NETNS_FILE HOST PORT. It listens on 127.0.0.1 (a free port, printed on the first line
of stdout) in the namespace it starts in, then joins the namespace of NETNS_FILE (e.g. /proc/PID/ns/net): sockets
keep the namespace they were made in, so every accepted connection is from this machine and every connection it opens
to HOST:PORT is inside the node's namespace. It runs until killed.
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
    listener = socket.create_server(("127.0.0.1", 0))
    with open(netns_file) as namespace:
        if ctypes.CDLL("libc.so.6", use_errno=True).setns(namespace.fileno(), CLONE_NEWNET) != 0:
            sys.exit(f"setns {netns_file}: {os.strerror(ctypes.get_errno())}")
    print(listener.getsockname()[1], flush=True)
    asyncio.run(_serve(listener, host, port))


if __name__ == "__main__":
    main()
