"""Headless Chromium against a served admin page: the browser's flags, chat load to keep the page's live figures
moving, login, and the wait for those figures (tests/test_admin_browser.py; verify/lab/admin_screenshot.py takes the
docs' screenshot with them). Everything stays on 127.0.0.1.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@contextmanager
def chat_load(url: str, model: str, *, clients: int = 2, max_tokens: int = 16) -> Iterator[None]:
    """Keep `clients` chat requests in flight against `url` until the block ends."""
    stop = threading.Event()

    def loop() -> None:
        with httpx.Client(base_url=url, timeout=120) as client:
            while not stop.is_set():
                body = {
                    "model": model,
                    "messages": [{"role": "user", "content": "Tell me about the sea."}],
                    "max_tokens": max_tokens,
                    "temperature": 0.7,
                }
                client.post("/v1/chat/completions", json=body)

    threads = [threading.Thread(target=loop, daemon=True) for _ in range(clients)]
    for thread in threads:
        thread.start()
    try:
        yield
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=120)


def login(page: Any, url: str, token: str) -> None:
    page.goto(f"{url}/admin/login")
    page.fill("#token", token)
    page.click("button[type=submit]")
    page.wait_for_url(f"{url}/admin")


def wait_for_live(page: Any, timeout_s: float = 60.0) -> dict[str, float]:
    """Wait until the page's live figures (refreshed by its script) show tokens flowing; returns them."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        figures = {
            key: float(page.inner_text(f"[data-live={key}]"))
            for key in ("tokens_per_s", "queue_depth", "generation_tokens_total", "requests_total")
        }
        if figures["tokens_per_s"] > 0 and figures["requests_total"] > 0:
            return figures
        time.sleep(0.5)
    raise TimeoutError("the overview's live figures never showed tokens per second above zero")
