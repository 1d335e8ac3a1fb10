"""Take offline_docs/admin-overview.png: the overview page of a served model under load, in headless Chromium.

    python -m envex.tests.support.admin_screenshot [--out offline_docs/admin-overview.png]

It installs the admin test fixture (two releases, by the installer) into a temporary directory, serves the
embedded model with the admin page mounted exactly as `envex serve --launch` does (build_app's extra_routers),
keeps a few chat requests running over loopback, logs in and waits for the live figures before the shot.
Everything stays on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
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


def take(out: Path, work: Path) -> dict[str, float]:
    from playwright.sync_api import sync_playwright

    from envex.installer.admin import admin_router
    from envex.runtime.engine import AsyncEngine, EngineConfig, LLMEngine
    from envex.runtime.server.app import build_app
    from envex.tests.support.admin import build_admin_fixture
    from envex.tests.support.server import serve_in_thread

    fixture = build_admin_fixture(work, served_name="smollm2-135m-instruct")
    engine = LLMEngine(EngineConfig(device="cpu"))
    app = build_app(AsyncEngine(engine), extra_routers=[admin_router(fixture.prefix, probe_gpu=False)])
    with serve_in_thread(app) as url, chat_load(url, app.state.envex.served_model_name), sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1280, "height": 720})
        login(page, url, fixture.token)
        time.sleep(2.5)  # let the page's 2 s refresh take two samples under load
        figures = wait_for_live(page)
        out.parent.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(out), full_page=True)
        browser.close()
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m envex.tests.support.admin_screenshot", description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("offline_docs/admin-overview.png"))
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="envex-admin-shot-") as work:
        figures = take(args.out, Path(work))
    print(f"wrote {args.out} (live figures at the shot: {figures})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
