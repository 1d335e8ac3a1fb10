"""Run an app on a real uvicorn server in a background thread, on 127.0.0.1 and a port the OS picks (for tests)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn
from fastapi import FastAPI

from envex.runtime.server.serve import bind_socket


@contextmanager
def serve_in_thread(app: FastAPI, *, host: str = "127.0.0.1", startup_timeout: float = 60.0) -> Iterator[str]:
    """Yield the server's base URL (http://127.0.0.1:PORT) once it accepts connections; stop it on exit."""
    sock = bind_socket(host, 0)
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning",
                                           timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="uvicorn-test", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + startup_timeout
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the test server on {host}:{port} did not start within {startup_timeout} s")
            time.sleep(0.02)
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()
