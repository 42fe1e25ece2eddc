"""A loopback server that answers one request with raw bytes, whatever they are (an answer cut short, one that is not
HTTP), then closes the connection."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator


@contextlib.contextmanager
def answering_once(answer: bytes) -> Iterator[str]:
    """The server's URL while it runs: it reads one request, writes `answer` and closes."""
    listener = socket.create_server(("127.0.0.1", 0))

    def answer_once() -> None:
        connection, _ = listener.accept()
        with connection:
            connection.recv(4096)
            connection.sendall(answer)

    server = threading.Thread(target=answer_once, daemon=True)
    server.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        server.join(timeout=5)
        listener.close()
