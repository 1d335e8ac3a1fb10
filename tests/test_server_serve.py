"""serve() as `envex serve` runs it, in a subprocess: the ready line's curl command works as pasted, a full queue is a
429 and the server recovers, a busy port fails before the model loads, and Ctrl-C stops it cleanly."""

from __future__ import annotations

import asyncio
import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from envex.runtime.engine import EngineConfig
from envex.runtime.server.serve import ServeError, ready_message, serve

MODEL = "smollm2-135m-instruct"
# One running sequence and one waiting: the third concurrent request must be refused.
SMALL = "EngineConfig(device='cpu', max_num_seqs=1, max_queue=1, max_model_len=512, kv_cache_memory_gb=0.05)"


@dataclass
class Served:
    ready_line: str
    url: str
    proc: subprocess.Popen[str]
    log: Path


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    code = ("from envex.runtime.engine import EngineConfig\nfrom envex.runtime.server.serve import serve\n"
            f"serve({SMALL}, host='127.0.0.1', port=0)\n")
    log = tmp_path_factory.mktemp("serve") / "stderr.log"
    with open(log, "w") as err:
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=err, text=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()  # type: ignore[union-attr]
    try:
        line = lines.get(timeout=240)
    except queue.Empty:
        proc.kill()
        pytest.fail(f"serve() printed no ready line within 240 s; stderr: {Path(log).read_text()[-2000:]}")
    match = re.search(r"on (http://127\.0\.0\.1:\d+) ", line)
    assert match, line
    yield Served(line.strip(), match.group(1), proc, log)
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)


def in_flight(url: str) -> int:
    text = httpx.get(f"{url}/metrics").text
    return int(re.search(r"^envex_requests_in_flight (\d+)$", text, re.M).group(1))  # type: ignore[union-attr]


@pytest.mark.slow
def test_ready_line_curl_command_works_as_pasted(served: Served) -> None:
    assert served.ready_line.startswith(f"Envex is serving {MODEL} on {served.url}")
    command = served.ready_line.split("Try: ", 1)[1]
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed")
    result = subprocess.run(["bash", "-c", command + " --silent --show-error --max-time 120"], capture_output=True,
                            text=True, timeout=150)
    assert result.returncode == 0, result.stderr
    assert '"role":"assistant"' in result.stdout.replace(" ", "")


@pytest.mark.slow
def test_full_queue_is_429_then_the_server_recovers(served: Served) -> None:
    url = served.url
    hold = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 400, "temperature": 0,
            "ignore_eos": True, "stream": True}

    async def run() -> httpx.Response:
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:

            async def stream_until_cancelled() -> None:
                async with client.stream("POST", "/v1/completions", json=hold) as response:
                    assert response.status_code == 200
                    async for _ in response.aiter_lines():
                        pass

            holders = []
            for expected in (1, 2):  # one running, one waiting
                holders.append(asyncio.create_task(stream_until_cancelled()))
                deadline = time.monotonic() + 60
                while await asyncio.to_thread(in_flight, url) < expected:
                    assert time.monotonic() < deadline, "the holding request was never admitted"
                    await asyncio.sleep(0.05)
            try:
                refused = await client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2})
                # The waiting request's client leaves before it ever ran: it must leave the queue at once.
                holders[1].cancel()
                deadline = time.monotonic() + 30
                while await asyncio.to_thread(in_flight, url) != 1:
                    assert time.monotonic() < deadline, "the queued request was not aborted on disconnect"
                    await asyncio.sleep(0.05)
                assert not holders[0].done()
                return refused
            finally:
                for task in holders:
                    task.cancel()
                await asyncio.gather(*holders, return_exceptions=True)

    refused = asyncio.run(run())
    assert refused.status_code == 429, refused.text
    error = refused.json()["error"]
    assert error["code"] == "rate_limit_exceeded" and "retry" in error["message"]
    assert refused.headers["retry-after"] == "1"
    deadline = time.monotonic() + 30
    while in_flight(url) != 0:
        assert time.monotonic() < deadline, "the cancelled requests were never aborted"
        time.sleep(0.05)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "What is the capital "
                                           "of France?"}], temperature=0, max_tokens=16)
    assert reply.choices[0].message.content == "The capital of France is Paris."
    with pytest.raises(openai.BadRequestError, match="512"):
        client.completions.create(model=MODEL, prompt="word " * 600, max_tokens=4)


@pytest.mark.slow
def test_ctrl_c_stops_the_server_cleanly(served: Served) -> None:
    served.proc.send_signal(signal.SIGINT)
    assert served.proc.wait(timeout=60) == 0
    log = served.log.read_text()
    assert "Application shutdown complete" in log and "Traceback" not in log, log[-2000:]
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{served.url}/health")


def test_a_busy_port_fails_before_the_model_loads() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        started = time.monotonic()
        with pytest.raises(ServeError, match=f"127.0.0.1:{port}.*--port"):
            serve(EngineConfig(model="/no/such/model.gguf"), port=port)  # the model is never looked at
        assert time.monotonic() - started < 5
    with pytest.raises(ServeError, match="--port 70000"):
        serve(EngineConfig(model="/no/such/model.gguf"), port=70000)


def test_ready_message_is_a_valid_shell_command_without_the_secret() -> None:
    line = ready_message("0.0.0.0", 8123, MODEL, api_key="s3cret")
    assert "http://127.0.0.1:8123/v1/chat/completions" in line
    assert "s3cret" not in line and "$ENVEX_API_KEY" in line
    assert "[::1]:8000" in ready_message("::", 8000, MODEL, api_key=None)
