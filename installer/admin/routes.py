"""The admin page's routes, mounted at /admin: they check the session (and CSRF on every POST), then delegate.

Mounted by `admin_router(prefix)` on the serving app (build_app's extra_routers, which finds the engine on
`app.state.envex`) or on the model-less app of `envex admin`. Every response carries the security headers; no
page loads anything from outside this server.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jinja2
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, RedirectResponse, Response

from envex.installer.admin import actions, docs, views
from envex.installer.admin.auth import (
    AdminTokenError,
    LoginThrottle,
    Session,
    SessionStore,
    csrf_ok,
    verify_admin_token,
)
from envex.installer.admin.web import SecureRoute, read_form, same_origin, templates
from envex.installer.launch import recorded_probe
from envex.installer.probe import Probe, probe
from envex.installer.state import load_state

HERE = Path(__file__).parent
COOKIE = "envex_admin"
LOGIN_COOKIE = "envex_admin_login"  # double-submit token for the login form, before there is a session
STATIC = {"admin.css": "text/css; charset=utf-8", "admin.js": "text/javascript; charset=utf-8"}
NAV = (
    ("overview", ""),
    ("hardware", "/hardware"),
    ("bundles", "/bundles"),
    ("gates", "/gates"),
    ("benchmarks", "/benchmarks"),
    ("releases", "/releases"),
    ("docs", "/docs/"),
)


@dataclass
class AdminState:
    prefix: Path
    bundle_dirs: tuple[Path, ...] = ()
    probe_gpu: bool = True
    sessions: SessionStore = field(default_factory=SessionStore)
    throttle: LoginThrottle = field(default_factory=LoginThrottle)
    sampler: views.LiveSampler = field(default_factory=views.LiveSampler)
    started: float = field(default_factory=time.time)
    probe: Probe | None = None
    probed_at: str | None = None
    verifications: dict[str, actions.Verification] = field(default_factory=dict)  # by manifest sha256
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one action at a time from this page
    templates: jinja2.Environment = field(default_factory=templates)


def _engine_context(request: Request) -> Any:
    return getattr(request.app.state, "envex", None)  # a ServerContext when a model is served


def admin_router(prefix: Path, *, bundle_dirs: tuple[Path, ...] = (), probe_gpu: bool = True) -> APIRouter:
    """The /admin routes for the appliance installed in `prefix`.

    `bundle_dirs`: where the re-verify button looks for the installed bundles' files (the media's bundles/).
    `probe_gpu`: let the hardware page probe GPUs (False: CPU-only probe, as `envex-install --cpu`).
    """
    prefix = Path(prefix).absolute()
    # <prefix>/bundles: where the installer is to keep the verified bundle files (not yet; see admin.md)
    bundle_dirs = (*bundle_dirs, prefix / "bundles")
    st = AdminState(prefix=prefix, bundle_dirs=tuple(Path(d) for d in bundle_dirs), probe_gpu=probe_gpu)
    router = APIRouter(prefix="/admin", route_class=SecureRoute)

    def page(request: Request, template: str, session: Session | None, status: int = 200, **ctx: Any) -> Response:
        flash, session_flash = (list(session.flash), session.flash) if session else ([], None)
        if session_flash is not None:
            session_flash.clear()
        html = st.templates.get_template(template).render(
            nav=NAV, path=request.url.path, session=session, flash=flash, prefix=str(st.prefix), **ctx
        )
        return Response(html, status_code=status, media_type="text/html; charset=utf-8")

    def session_of(request: Request) -> Session | None:
        return st.sessions.get(request.cookies.get(COOKIE))

    def refuse(request: Request, status: int, message: str) -> Response:
        return page(request, "message.html", None, status=status, title="Refused", message=message)

    async def checked_post(request: Request) -> tuple[Session, dict[str, str]] | Response:
        """The session and form of a POST, or the refusal: no session, a cross-site origin, a bad CSRF token."""
        session = session_of(request)
        if session is None:
            return refuse(request, 403, "No valid admin session: log in at /admin/login first.")
        if not same_origin(request):
            return refuse(request, 403, "This form was posted from another site; use the admin page itself.")
        form = await read_form(request)
        if form is None or not csrf_ok(session, form.get("csrf")):
            return refuse(request, 403, "The form's CSRF token is not this session's; reload the page and retry.")
        return session, form

    def login_redirect() -> Response:
        return RedirectResponse("/admin/login", status_code=303)

    def back(to: str) -> Response:
        return RedirectResponse(f"/admin{to}", status_code=303)

    # ---- login ---------------------------------------------------------------------------------------------

    @router.get("/static/{name}")
    async def static(name: str) -> Response:
        if name not in STATIC:
            return Response("not found", status_code=404, media_type="text/plain")
        return Response((HERE / name).read_bytes(), media_type=STATIC[name])

    def login_page(request: Request, status: int = 200, error: str | None = None) -> Response:
        nonce = secrets.token_urlsafe(24)
        response = page(request, "login.html", None, status=status, title="Log in", login_csrf=nonce, error=error)
        response.set_cookie(
            LOGIN_COOKIE,
            nonce,
            httponly=True,
            samesite="strict",
            path="/admin",
            secure=request.url.scheme == "https",
            max_age=3600,
        )
        return response

    @router.get("/login")
    async def login_form(request: Request) -> Response:
        return login_page(request)

    @router.post("/login")
    async def login(request: Request) -> Response:
        wait = st.throttle.wait_s()
        if wait > 0:
            return login_page(request, 429, f"Too many failed logins: wait {wait:.0f} s before trying again.")
        form = await read_form(request)
        nonce = request.cookies.get(LOGIN_COOKIE)
        if (
            form is None
            or not same_origin(request)
            or not nonce
            or not secrets.compare_digest(nonce.encode(), form.get("csrf", "").encode())
        ):
            return login_page(request, 403, "The login form expired or came from elsewhere; try again.")
        try:
            ok = await asyncio.to_thread(verify_admin_token, st.prefix, form.get("token", "").strip())
        except AdminTokenError as exc:
            return login_page(request, 503, str(exc))
        if not ok:
            st.throttle.failed()
            return login_page(request, 401, "Wrong admin token.")
        st.throttle.succeeded()
        old = request.cookies.get(COOKIE)
        if old:
            st.sessions.drop(old)
        session = st.sessions.create()
        response = back("")
        response.set_cookie(
            COOKIE, session.id, httponly=True, samesite="strict", path="/admin", secure=request.url.scheme == "https"
        )
        response.delete_cookie(LOGIN_COOKIE, path="/admin")
        return response

    @router.post("/logout")
    async def logout(request: Request) -> Response:
        checked = await checked_post(request)
        if isinstance(checked, Response):
            return checked
        st.sessions.drop(checked[0].id)
        response = login_redirect()
        response.delete_cookie(COOKIE, path="/admin")
        return response

    # ---- pages ---------------------------------------------------------------------------------------------

    @router.get("")
    async def overview(request: Request) -> Response:
        if (session := session_of(request)) is None:
            return login_redirect()
        state = load_state(st.prefix)
        ctx = _engine_context(request)
        live = views.live_stats(ctx.async_engine, ctx.metrics, st.sampler) if ctx is not None else None
        return page(
            request,
            "overview.html",
            session,
            title="Overview",
            state=state,
            launch=views.active_launch(st.prefix, state),
            current=views.current_link(st.prefix),
            served=ctx.served_model_name if ctx is not None else None,
            live=live,
            uptime_s=time.time() - st.started,
            releases=views.release_rows(st.prefix, state),
        )

    @router.get("/live")
    async def live(request: Request) -> Response:
        if session_of(request) is None:
            return JSONResponse({"error": "no valid admin session"}, status_code=403)
        ctx = _engine_context(request)
        if ctx is None:
            return JSONResponse({"engine_running": False, "uptime_s": round(time.time() - st.started, 1)})
        return JSONResponse(views.live_stats(ctx.async_engine, ctx.metrics, st.sampler))

    @router.get("/hardware")
    async def hardware(request: Request) -> Response:
        if (session := session_of(request)) is None:
            return login_redirect()
        if st.probe is None:
            # The install's own probe of this machine, as launch.json recorded it; a live probe only without one
            # (or when asked for with the button).
            recorded = recorded_probe(st.prefix)
            if recorded is not None:
                st.probe, st.probed_at = recorded
            else:
                await run_probe()
        return page(request, "hardware.html", session, title="Hardware", probe=st.probe, probed_at=st.probed_at)

    async def run_probe() -> None:
        st.probe = await asyncio.to_thread(probe, st.prefix, want_gpu=st.probe_gpu)
        st.probed_at = "run by this page at " + time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())

    @router.post("/hardware/probe")
    async def reprobe(request: Request) -> Response:
        checked = await checked_post(request)
        if isinstance(checked, Response):
            return checked
        async with st.lock:
            await run_probe()
        checked[0].flash.append(("ok", "Hardware probed again."))
        return back("/hardware")

    @router.get("/bundles")
    async def bundles(request: Request) -> Response:
        if (session := session_of(request)) is None:
            return login_redirect()
        state = load_state(st.prefix)
        return page(
            request,
            "bundles.html",
            session,
            title="Bundles",
            state=state,
            checks=st.verifications,
            bundle_dirs=[str(d) for d in st.bundle_dirs],
        )

    @router.post("/bundles/reverify")
    async def reverify(request: Request) -> Response:
        checked = await checked_post(request)
        if isinstance(checked, Response):
            return checked
        session, form = checked
        state = load_state(st.prefix)
        ref = next((b for b in state.bundles if b.manifest_sha256 == form.get("bundle")), None)
        if ref is None:
            session.flash.append(("error", "No such installed bundle; reload the bundles page."))
            return back("/bundles")
        async with st.lock:
            result = await asyncio.to_thread(actions.reverify_bundle, st.prefix, ref, st.bundle_dirs)
        st.verifications[ref.manifest_sha256] = result
        kind = "ok" if result.ok else "error"
        session.flash.append(
            (kind, f"{ref.name} {ref.version}: {'verified' if result.ok else 'FAILED'}: {result.detail}")
        )
        return back("/bundles")

    @router.get("/gates")
    async def gates(request: Request) -> Response:
        if (session := session_of(request)) is None:
            return login_redirect()
        state = load_state(st.prefix)
        rows = [(r, views.gate_views(st.prefix, r)) for r in views.releases_newest_first(state) if r.checks]
        return page(request, "gates.html", session, title="Gates", state=state, rows=rows)

    @router.get("/benchmarks")
    async def benchmarks(request: Request) -> Response:
        if (session := session_of(request)) is None:
            return login_redirect()
        state = load_state(st.prefix)
        benches = [views.bench_view(st.prefix, r) for r in views.releases_newest_first(state) if r.checks]
        tables = {b.release.id: docs.render_markdown(b.table_md) for b in benches if b.table_md}
        return page(
            request, "benchmarks.html", session, title="Benchmarks", state=state, benches=benches, tables=tables
        )

    @router.get("/benchmarks/{release_id}/plot.png")
    async def bench_plot(release_id: str, request: Request) -> Response:
        if session_of(request) is None:
            return Response("no valid admin session", status_code=403, media_type="text/plain")
        state = load_state(st.prefix)
        if state.release(release_id) is None:  # only ids from state.json ever reach the file system
            return Response("no such release", status_code=404, media_type="text/plain")
        plot = views.bench_dir(st.prefix, release_id) / "bench.png"
        if not plot.is_file():
            return Response("no plot for this release", status_code=404, media_type="text/plain")
        return Response(plot.read_bytes(), media_type="image/png")

    @router.get("/releases")
    async def releases(request: Request) -> Response:
        if (session := session_of(request)) is None:
            return login_redirect()
        state = load_state(st.prefix)
        rows = views.release_rows(st.prefix, state)
        return page(
            request,
            "releases.html",
            session,
            title="Releases",
            state=state,
            rows=rows,
            target=next((r for r in rows if r.rollback_target), None),
            current=views.current_link(st.prefix),
        )

    @router.get("/releases/confirm")
    async def confirm(request: Request, action: str = "", release: str = "") -> Response:
        if (session := session_of(request)) is None:
            return login_redirect()
        state = load_state(st.prefix)
        rows = {r.release.id: r for r in views.release_rows(st.prefix, state)}
        if action == "rollback":
            target = next((r for r in rows.values() if r.rollback_target), None)
        elif action == "activate":
            target = rows.get(release)
        else:
            target = None
        if target is None or not target.activatable or target.active:
            session.flash.append(("error", "Nothing to confirm: that release cannot be activated now."))
            return back("/releases")
        return page(request, "confirm.html", session, title="Confirm", action=action, target=target, state=state)

    @router.post("/releases/{action}")
    async def change(action: str, request: Request) -> Response:
        checked = await checked_post(request)
        if isinstance(checked, Response):
            return checked
        session, form = checked
        if action not in ("rollback", "activate") or form.get("confirmed") != "yes":
            return refuse(request, 400, "Unknown or unconfirmed release action; use the releases page.")
        async with st.lock:
            try:
                result = await asyncio.to_thread(actions.change_release, st.prefix, action, form.get("release"))
            except actions.ActionError as exc:
                session.flash.append(("error", f"{action} refused: {exc}"))
            else:
                session.flash.append(("ok", f"{action}: {result.message}"))
        return back("/releases")

    @router.get("/docs/")
    async def docs_index(request: Request) -> Response:
        if (session := session_of(request)) is None:
            return login_redirect()
        return page(request, "docs.html", session, title="Docs", docs=docs.doc_titles(), body=None)

    @router.get("/docs/{name}")
    async def doc(name: str, request: Request) -> Response:
        if (session := session_of(request)) is None:
            return login_redirect()
        image = docs.doc_image(name)
        if image is not None:
            return Response(image[0], media_type=image[1])
        rendered = docs.render_doc(name)
        if rendered is None:
            return refuse(request, 404, f"No offline doc named {name!r}; see /admin/docs/.")
        return page(request, "docs.html", session, title=rendered[0], docs=docs.doc_titles(), body=rendered[1])

    return router
