"""The local admin web page, mounted at /admin: overview, hardware, bundles, gates, benchmarks, releases, docs.

    app = build_app(async_engine, extra_routers=[admin_router(prefix)])   # envex serve --launch
    app = build_admin_app(prefix)                                          # envex admin, no model

Login is with the prefix's admin token (create_admin_token, shown once; only a scrypt hash is stored). Every
action goes through the functions the CLI uses (installer.activate, bundles.verify_bundle). See
offline_docs/admin.md.
"""

from __future__ import annotations

from envex.runtime.server.admin.app import build_admin_app, prefix_from_launch
from envex.runtime.server.admin.auth import AdminTokenError, create_admin_token, has_admin_token, verify_admin_token
from envex.runtime.server.admin.routes import admin_router

__all__ = [
    "AdminTokenError",
    "admin_router",
    "build_admin_app",
    "create_admin_token",
    "has_admin_token",
    "prefix_from_launch",
    "verify_admin_token",
]
