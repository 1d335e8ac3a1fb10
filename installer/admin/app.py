"""The admin page's own app, for `envex admin` when no model is served, and finding a launch file's prefix."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from fastapi import APIRouter, FastAPI
from fastapi.responses import RedirectResponse

from envex.installer.admin.routes import admin_router
from envex.installer.state import STATE_FILE


def build_admin_app(prefix: Path, *, bundle_dirs: Sequence[Path] = (), probe_gpu: bool = True) -> FastAPI:
    """A FastAPI app serving only /admin for `prefix` (the overview then says no model is served here)."""
    if not (Path(prefix) / STATE_FILE).is_file():
        raise ValueError(f"--prefix {prefix}: no {STATE_FILE}; nothing is installed there (run envex-install first)")
    app = FastAPI(title="Envex admin", docs_url=None, redoc_url=None, openapi_url=None)
    app.include_router(admin_router(prefix, bundle_dirs=tuple(bundle_dirs), probe_gpu=probe_gpu))

    @app.get("/", include_in_schema=False)
    async def root() -> RedirectResponse:
        return RedirectResponse("/admin", status_code=303)

    return app


def prefix_from_launch(launch: Path) -> Path | None:
    """The prefix of an installed release's launch.json, or None for a launch file outside any prefix.

    `<prefix>/current/launch.json` (what the unit file serves) and `<prefix>/releases/<id>/launch.json` both work.
    """
    launch = Path(launch).absolute()
    for candidate in (launch.parent.parent, launch.parent.parent.parent):
        if (candidate / STATE_FILE).is_file():
            return candidate
    return None


def admin_routers_for_launch(launch: Path) -> list[APIRouter]:
    """What `envex serve --launch FILE` passes as build_app's extra_routers: /admin for the launch file's prefix
    (none for a launch file outside an installed prefix)."""
    prefix = prefix_from_launch(launch)
    return [] if prefix is None else [admin_router(prefix)]
