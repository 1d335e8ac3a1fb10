"""`envex serve`: load the engine, bind the socket, run uvicorn, and say how to reach the server once it listens."""

from __future__ import annotations

import json
import shlex
import signal
import socket
import sys
from collections.abc import Sequence
from typing import TextIO

import uvicorn
from fastapi import APIRouter

from envex.runtime.engine import EngineConfig, LLMEngine
from envex.runtime.server.app import build_app
from envex.runtime.server.async_engine import AsyncEngine


class ServeError(OSError):
    """The server could not start; the message says why and what to do."""


def bind_socket(host: str, port: int) -> socket.socket:
    """Bind before loading the model, so a busy port fails in a second, not after the weights are read."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ServeError(f"--host {host!r}: cannot be resolved ({exc.strerror}); give an IP address") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        raise ServeError(f"cannot listen on {host}:{port}: {exc.strerror}; pick another --port or stop the "
                         "process using it") from None
    sock.set_inheritable(True)
    return sock


def ready_message(host: str, port: int, model: str, api_key: str | None) -> str:
    """One line a person can act on: where the server is, and a curl command that works as pasted."""
    shown = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
    if ":" in shown:
        shown = f"[{shown}]"
    url = f"http://{shown}:{port}"
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 32})
    auth = ' -H "Authorization: Bearer $ENVEX_API_KEY"' if api_key else ""
    return (f"Envex is serving {model} on {url} (OpenAI API at {url}/v1). Try: curl {url}/v1/chat/completions"
            f" -H 'Content-Type: application/json'{auth} -d {shlex.quote(body)}")


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()  # signal handlers can be set only there


def _stop_requested(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # SIGTERM after uvicorn's graceful shutdown: stop as after Ctrl-C


class _Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, message: str, out: TextIO) -> None:
        super().__init__(config)
        self._message = message
        self._out = out

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started:  # the lifespan ran (engine thread up) and the socket accepts connections
            print(self._message, file=self._out, flush=True)


def serve(config: EngineConfig, *, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
          extra_routers: Sequence[APIRouter] = (), out: TextIO | None = None) -> None:
    """Build the engine from `config` and serve it until Ctrl-C (then return). Raises ServeError when it cannot
    start (bad port, port in use), before the model is loaded.

    With `api_key`, clients must send `Authorization: Bearer <key>`; the ready line refers to it as
    $ENVEX_API_KEY rather than printing the secret into logs. `extra_routers` are mounted as in build_app (the
    admin page for `envex serve --launch`).
    """
    if not 0 <= port <= 65535:
        raise ServeError(f"--port {port}: must be between 0 and 65535")
    sock = bind_socket(host, port)
    try:
        async_engine = AsyncEngine(LLMEngine(config))
        app = build_app(async_engine, api_key=api_key, served_model_name=config.served_name,
                        extra_routers=extra_routers)
        actual_port = sock.getsockname()[1]
        uv_config = uvicorn.Config(app, host=host, port=actual_port, log_level="info", timeout_graceful_shutdown=5)
        message = ready_message(host, actual_port, app.state.envex.served_model_name, api_key)
        # uvicorn shuts down gracefully on Ctrl-C and on SIGTERM (a service manager's stop), then raises the signal
        # again under the handler that was there before: SIGTERM's default would end the process with -15 after a
        # clean shutdown. Both are a normal stop, exit 0.
        previous = signal.getsignal(signal.SIGTERM) if _main_thread() else None
        if previous is not None:
            signal.signal(signal.SIGTERM, _stop_requested)
        try:
            _Server(uv_config, message, out or sys.stdout).run(sockets=[sock])
        except KeyboardInterrupt:  # uvicorn re-raises Ctrl-C after its graceful shutdown: that is a normal stop
            pass
        finally:
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)
    finally:
        sock.close()
