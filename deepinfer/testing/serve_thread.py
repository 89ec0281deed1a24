"""An ASGI app served by uvicorn from a background thread on a free loopback port (test servers)."""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass

import uvicorn


@dataclass(frozen=True)
class ThreadedServer:
    server: uvicorn.Server
    thread: threading.Thread
    url: str
    sock: socket.socket

    def stop(self, timeout: float = 30.0) -> None:
        """Ask uvicorn to exit, wait for its thread (it must end), close the socket."""
        self.server.should_exit = True
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the server thread did not end"
        self.sock.close()


def serve_in_thread(app, what: str, timeout: float = 60.0) -> ThreadedServer:
    """Start serving ``app``; returns once it accepts connections. The kernel picks a free port and uvicorn
    serves that very socket (no race for the port)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    srv = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not srv.started:
        assert thread.is_alive() and time.monotonic() < deadline, f"{what} did not start"
        time.sleep(0.02)
    return ThreadedServer(srv, thread, f"http://127.0.0.1:{sock.getsockname()[1]}", sock)
