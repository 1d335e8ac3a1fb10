"""The local admin web page, mounted at /admin: overview, hardware, bundles, gates, benchmarks, releases, docs.

    app = build_app(async_engine, extra_routers=[admin_router(prefix)])   # envex serve --launch
    app = build_admin_app(prefix)                                          # envex admin, no model

Login is with the prefix's admin token (create_admin_token, shown once; only a scrypt hash is stored). Every
action goes through the functions the CLI uses (installer.activate, bundles.verify_bundle). See
offline_docs/admin.md.

The token functions import nothing heavy (the installer calls them); the web stack loads on first use of
admin_router, build_admin_app or prefix_from_launch.
"""

from __future__ import annotations

from typing import Any

from envex.installer.admin.auth import AdminTokenError, create_admin_token, has_admin_token, verify_admin_token

_LAZY = {
    "admin_router": "envex.installer.admin.routes",
    "build_admin_app": "envex.installer.admin.app",
    "prefix_from_launch": "envex.installer.admin.app",
    "admin_routers_for_launch": "envex.installer.admin.app",
}

__all__ = [
    "AdminTokenError",
    "admin_router",
    "admin_routers_for_launch",
    "build_admin_app",
    "create_admin_token",
    "has_admin_token",
    "prefix_from_launch",
    "verify_admin_token",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
