"""`envex admin`: the admin page for a prefix when no model is being served (registered by installer/commands.py)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer


def admin(
    prefix: Annotated[
        Path, typer.Option("--prefix", help="the appliance prefix (state.json, releases/, current)")
    ] = Path("/opt/envex"),
    host: Annotated[str, typer.Option(help="address to bind; loopback unless told otherwise")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=0, max=65535, help="port to listen on")] = 8080,
    bundles: Annotated[
        list[Path] | None, typer.Option("--bundles", help="where re-verify finds bundle files (the media's bundles/)")
    ] = None,
    reset_token: Annotated[bool, typer.Option(help="replace the admin token and print the new one once")] = False,
    gpu: Annotated[bool, typer.Option("--gpu/--cpu", help="--cpu: the hardware page skips the GPU probe")] = True,
    serve: Annotated[
        bool,
        typer.Option("--serve/--no-serve", help="--no-serve: only create (or with --reset-token replace) the token"),
    ] = True,
) -> None:
    """Serve the admin page (overview, hardware, bundles, gates, benchmarks, releases, docs) at /admin."""
    import uvicorn

    from envex.installer.admin.app import build_admin_app
    from envex.installer.admin.auth import AdminTokenError, create_admin_token, has_admin_token
    from envex.installer.prefix import PrefixError, check_prefix
    from envex.runtime.server.serve import ServeError, bind_socket

    try:
        # An installed prefix only: `--prefix /` must not get an admin/token.json.
        prefix = check_prefix(prefix, must_exist=True)
        app = build_admin_app(prefix, bundle_dirs=tuple(bundles or ()), probe_gpu=gpu)
        if reset_token or not has_admin_token(prefix):
            token = create_admin_token(prefix, replace=reset_token)
            typer.echo(f"admin token (shown once; only its hash is kept in {prefix}/admin/token.json):\n  {token}")
        elif not serve:
            typer.echo(f"{prefix} already has an admin token; --reset-token replaces it")
        if not serve:
            return
        sock = bind_socket(host, port)
    except (ValueError, AdminTokenError, ServeError, OSError, PrefixError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    shown = sock.getsockname()[1]
    typer.echo(f"Envex admin page for {prefix} on http://{host if ':' not in host else f'[{host}]'}:{shown}/admin")
    sys.stdout.flush()
    config = uvicorn.Config(app, host=host, port=shown, log_level="warning", timeout_graceful_shutdown=5)
    try:
        uvicorn.Server(config).run(sockets=[sock])
    except KeyboardInterrupt:
        pass
    finally:
        sock.close()


def main() -> None:
    """`python -m envex.installer.admin.cli` until the lead registers `envex admin`."""
    app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    app.command(name="admin")(admin)
    app(prog_name="envex admin")


if __name__ == "__main__":
    main()
