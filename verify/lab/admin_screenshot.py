"""Take offline_docs/admin-overview.png: the overview page of a served model under load, in headless Chromium.

    python -m envex.verify.lab.admin_screenshot [--out offline_docs/admin-overview.png]

It installs the admin test fixture (two releases, by the installer) into a temporary directory, serves the
embedded model with the admin page mounted exactly as `envex serve --launch` does (build_app's extra_routers),
keeps a few chat requests running over loopback, logs in and waits for the live figures before the shot
(tests/support/browser.py, which tests/test_admin_browser.py uses too). Everything stays on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from envex.tests.support.browser import CHROMIUM, CHROMIUM_ARGS, chat_load, login, wait_for_live


def take(out: Path, work: Path) -> dict[str, float]:
    from playwright.sync_api import sync_playwright

    from envex.installer.admin import admin_router
    from envex.runtime.engine import EngineConfig, LLMEngine
    from envex.runtime.server.app import build_app
    from envex.runtime.server.async_engine import AsyncEngine
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
    parser = argparse.ArgumentParser(prog="python -m envex.verify.lab.admin_screenshot", description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("offline_docs/admin-overview.png"))
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="envex-admin-shot-") as work:
        figures = take(args.out, Path(work))
    print(f"wrote {args.out} (live figures at the shot: {figures})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
