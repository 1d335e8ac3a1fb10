"""The admin page's building blocks: the admin token file, sessions, login backoff, docs rendering, live tok/s,
and the refusals seen through plain HTTP (no browser needed)."""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path
from urllib.parse import urlencode

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from envex.installer.admin import (
    AdminTokenError,
    build_admin_app,
    create_admin_token,
    prefix_from_launch,
    verify_admin_token,
)
from envex.installer.admin.auth import LoginThrottle, SessionStore, csrf_ok, token_path
from envex.installer.admin.docs import doc_image, doc_names, render_doc, render_markdown
from envex.installer.admin.views import LiveSampler


def test_admin_token_is_stored_hashed_and_private(tmp_path: Path) -> None:
    token = create_admin_token(tmp_path)
    path = token_path(tmp_path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600 and stat.S_IMODE(os.stat(path.parent).st_mode) == 0o700
    assert token not in path.read_text() and token.split("-")[-1] not in path.read_text()
    assert verify_admin_token(tmp_path, token)
    assert not verify_admin_token(tmp_path, token[:-1]) and not verify_admin_token(tmp_path, "")
    with pytest.raises(AdminTokenError, match="already has an admin token"):
        create_admin_token(tmp_path)
    new = create_admin_token(tmp_path, replace=True)
    assert new != token and verify_admin_token(tmp_path, new) and not verify_admin_token(tmp_path, token)


def test_missing_or_corrupt_token_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(AdminTokenError, match="no admin token; run envex admin"):
        verify_admin_token(tmp_path, "x")
    create_admin_token(tmp_path)
    token_path(tmp_path).write_text("{not json")
    with pytest.raises(AdminTokenError, match="--reset-token"):
        verify_admin_token(tmp_path, "x")


def test_sessions_expire_and_csrf_is_per_session() -> None:
    store = SessionStore(idle_s=0.2, max_s=10)
    a, b = store.create(), store.create()
    assert a.id != b.id and a.csrf != b.csrf
    assert store.get(a.id) is a and store.get("forged") is None and store.get(None) is None
    assert csrf_ok(a, a.csrf) and not csrf_ok(a, b.csrf) and not csrf_ok(a, "") and not csrf_ok(a, None)
    time.sleep(0.3)
    assert store.get(a.id) is None
    store.drop(b.id)
    assert store.get(b.id) is None


def test_login_throttle_backs_off_then_resets() -> None:
    throttle = LoginThrottle(free=2, cap_s=4)
    throttle.failed()
    assert throttle.wait_s() == 0
    throttle.failed()
    assert 1.5 < throttle.wait_s() <= 2
    throttle.failed()
    throttle.failed()
    assert 3.5 < throttle.wait_s() <= 4  # capped
    throttle.succeeded()
    assert throttle.wait_s() == 0


def test_offline_docs_render_and_images_are_served_by_exact_name() -> None:
    assert {"install", "bundles", "admin", "performance"} <= set(doc_names()) and "benchmarks" not in doc_names()
    index = (render_doc("index.md") or ("", ""))[1]
    assert '<a href="performance.md">performance.md</a>' in index and "benchmarks.md" not in index
    title, html = render_doc("admin.md") or ("", "")
    assert title == "The admin page" and '<img src="admin-overview.png"' in html
    assert render_doc("../pyproject.toml") is None and render_doc("nope") is None
    image = doc_image("admin-overview.png")
    assert image is not None and image[0].startswith(b"\x89PNG") and image[1] == "image/png"
    assert doc_image("../README.md") is None and doc_image("install.md") is None


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet=st.sampled_from(list("<>/\"'=&;: abcdefghijklmnopqrstuvwxyz[]()!`*#-|\n")), max_size=200))
def test_markdown_never_passes_raw_html_through(text: str) -> None:
    html = render_markdown(text + "\n<script>alert(1)</script>\n<img src=x onerror=alert(1)>")
    assert "<script" not in html and "<img src=x" not in html
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html


def test_live_sampler_rate_over_the_window() -> None:
    sampler = LiveSampler(window_s=10)
    assert sampler.sample(0, now=100.0) == 0.0
    assert sampler.sample(50, now=102.0) == pytest.approx(25.0)
    assert sampler.sample(150, now=104.0) == pytest.approx(37.5)
    assert sampler.sample(150, now=120.0) == 0.0  # samples older than the window are dropped: nothing moved since


def test_prefix_from_launch(tmp_path: Path) -> None:
    (tmp_path / "state.json").write_text("{}")
    assert prefix_from_launch(tmp_path / "current" / "launch.json") == tmp_path
    assert prefix_from_launch(tmp_path / "releases" / "0001-x" / "launch.json") == tmp_path
    assert prefix_from_launch(tmp_path / "elsewhere" / "a" / "b" / "launch.json") is None


def test_admin_app_needs_an_installed_prefix(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="nothing is installed there"):
        build_admin_app(tmp_path)


def test_envex_admin_command_prints_the_token_once_and_serves_on_loopback(tmp_path: Path) -> None:
    import re
    import subprocess
    import sys

    import httpx

    from envex.installer.state import State, save_state

    save_state(tmp_path, State())
    cmd = [sys.executable, "-m", "envex.installer.admin.cli", "--prefix", str(tmp_path), "--port", "0", "--cpu"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        header, token_line, ready = (proc.stdout.readline() for _ in range(3))
        assert "shown once" in header and verify_admin_token(tmp_path, token_line.strip())
        url = re.search(r"(http://127\.0\.0\.1:\d+)/admin", ready)
        assert url is not None, ready
        with httpx.Client(base_url=url.group(1)) as client:
            assert client.get("/admin").status_code == 303  # to the login page
            page = client.get("/admin/login")
            csrf = re.search(r'name="csrf" value="([^"]+)"', page.text)
            assert csrf is not None
            ok = client.post("/admin/login", data={"csrf": csrf.group(1), "token": token_line.strip()})
            assert ok.status_code == 303 and ok.headers["location"] == "/admin"
            assert "nothing installed yet" in client.get("/admin").text
            # the benchmarks page points at the project's reference figures, which the docs render
            assert 'href="/admin/docs/performance.md"' in client.get("/admin/benchmarks").text
            performance = client.get("/admin/docs/performance.md")
            assert performance.status_code == 200 and "<h1>Performance</h1>" in performance.text
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    # a second start keeps the token (it was shown once) and prints only where it listens
    second = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert second.stdout is not None
        assert second.stdout.readline().startswith("Envex admin page for")
        assert verify_admin_token(tmp_path, token_line.strip())
    finally:
        second.terminate()
        second.wait(timeout=30)
    # --no-serve --reset-token: a new token, printed once, and nothing served
    reset = subprocess.run([*cmd, "--no-serve", "--reset-token"], capture_output=True, text=True, timeout=60)
    assert reset.returncode == 0, reset.stderr
    new_token = reset.stdout.splitlines()[1].strip()
    assert verify_admin_token(tmp_path, new_token) and not verify_admin_token(tmp_path, token_line.strip())


def test_admin_routers_for_launch(tmp_path: Path) -> None:
    from envex.installer.admin import admin_routers_for_launch

    assert admin_routers_for_launch(tmp_path / "current" / "launch.json") == []
    (tmp_path / "state.json").write_text("{}")
    (router,) = admin_routers_for_launch(tmp_path / "current" / "launch.json")
    assert router.prefix == "/admin" and any(getattr(r, "path", "") == "/admin/login" for r in router.routes)


@pytest.fixture(scope="module")
def bare_server(tmp_path_factory):
    """The admin app over a prefix with an empty state.json and a token, on a real uvicorn on loopback."""
    from envex.installer.state import State, save_state
    from envex.tests.support.server import serve_in_thread

    prefix = tmp_path_factory.mktemp("bare")
    save_state(prefix, State())
    token = create_admin_token(prefix)
    with serve_in_thread(build_admin_app(prefix, probe_gpu=False)) as url:
        yield url, prefix, token


@settings(max_examples=60, deadline=None)
@given(
    path=st.sampled_from(["/admin/login", "/admin/logout", "/admin/releases/rollback", "/admin/releases/activate",
                          "/admin/bundles/reverify", "/admin/hardware/probe", "/admin/releases/x"]),
    body=st.one_of(st.binary(max_size=300), st.text(max_size=300).map(str.encode),
                   st.dictionaries(st.sampled_from(["csrf", "token", "confirmed", "release", "bundle", "x"]),
                                   st.text(max_size=40), max_size=6).map(lambda d: urlencode(d).encode())),
    content_type=st.sampled_from(["application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
                                  "application/json", "text/plain", ""]),
)
def test_fuzzed_posts_are_refused_cleanly_and_change_nothing(bare_server, path, body, content_type) -> None:
    import httpx

    url, prefix, _ = bare_server
    before = (prefix / "state.json").read_bytes()
    response = httpx.post(url + path, content=body, headers={"content-type": content_type} if content_type else {})
    assert response.status_code in (400, 401, 403, 404, 405, 429), response.text[:300]
    assert response.headers["x-frame-options"] == "DENY" or response.status_code in (404, 405)
    assert (prefix / "state.json").read_bytes() == before


def test_pages_without_a_session_redirect_to_login(bare_server) -> None:
    import httpx

    url, _, _ = bare_server
    for path in ("/admin", "/admin/hardware", "/admin/bundles", "/admin/gates", "/admin/benchmarks",
                 "/admin/releases", "/admin/releases/confirm?action=rollback", "/admin/docs/", "/admin/docs/admin.md"):
        response = httpx.get(url + path, follow_redirects=False)
        assert response.status_code == 303 and response.headers["location"] == "/admin/login", path
        assert "default-src 'self'" in response.headers["content-security-policy"]
    assert httpx.get(url + "/admin/live").status_code == 403
    assert httpx.get(url + "/admin/benchmarks/x/plot.png").status_code == 403
    assert httpx.get(url + "/admin/static/admin.css").status_code == 200
    assert httpx.get(url + "/admin/static/../auth.py").status_code == 404
