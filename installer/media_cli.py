"""`envex media build`: the thin typer command over installer/media_build.py."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from envex.bundles.files import one_line, show
from envex.installer.media_build import TORCH_VERSION, MediaRequest, PipSource, Target, build_media

media_app = typer.Typer(help="Make signed install media.", no_args_is_help=True, add_completion=False)

STEPS = ("reading the model's files", "loading the keys", "building the runtime wheelhouse", "bundling the runtime",
         "bundling the model", "signing")  # fmt: skip


@media_app.command("build")
def build(
    model: Annotated[Path, typer.Option("--model", help="The model: an HF directory or a .gguf file.")],
    out: Annotated[Path, typer.Option("--out", help="The media folder to write (must not exist, or --force).")],
    keys: Annotated[Path, typer.Option("--keys", help="Folder of keys (`envex bundle keygen`), perhaps root.json.")],
    name: Annotated[str | None, typer.Option("--name", help="Model bundle name (default: from the file name).")] = None,
    version: Annotated[str, typer.Option("--version", help="Model bundle version.")] = "1.0.0",
    runtime_version: Annotated[str, typer.Option("--runtime-version", help="Runtime bundle version.")] = "0.1.0",
    target_python: Annotated[str, typer.Option("--target-python", help="The appliance's Python.")] = "3.12",
    target_platform: Annotated[
        str, typer.Option("--target-platform", help="The appliance's wheel platform tag.")
    ] = "manylinux_2_28_x86_64",
    torch: Annotated[str, typer.Option("--torch", help="cu130 (PyPI's torch) or cpu (needs PyTorch's CPU index).")] = (
        "cu130"
    ),
    torch_version: Annotated[str, typer.Option("--torch-version", help="torch release to ship.")] = TORCH_VERSION,
    kernels: Annotated[
        list[Path] | None, typer.Option("--kernels", help="A kernels bundle to add and sign (repeatable).")
    ] = None,
    find_links: Annotated[
        list[Path] | None, typer.Option("--find-links", help="A local folder of wheels for pip (repeatable).")
    ] = None,
    no_index: Annotated[bool, typer.Option("--no-index", help="Resolve from --find-links only.")] = False,
    index_url: Annotated[str | None, typer.Option("--index-url", help="pip's index (default: pip's).")] = None,
    extra_index_url: Annotated[
        list[str] | None, typer.Option("--extra-index-url", help="Another index, e.g. PyTorch's CPU one.")
    ] = None,
    envex_wheel: Annotated[
        Path | None, typer.Option("--envex-wheel", help="An envex wheel (default: built from this source tree).")
    ] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace the media at --out.")] = False,
) -> None:
    """Build signed install media for a model: card, complete wheelhouse for the target, signatures, trust root."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from envex.bundles import VerificationError
    from envex.installer.media import InstallError

    console = Console(stderr=True)
    try:
        request = MediaRequest(
            model=model, out=out, keys=keys, name=name, version=version, runtime_version=runtime_version,
            target=Target(python=target_python, platform=target_platform, torch=torch,  # type: ignore[arg-type]
                          torch_version=torch_version),
            source=PipSource(find_links=tuple(find_links or ()), no_index=no_index, index_url=index_url,
                             extra_index_urls=tuple(extra_index_url or ())),
            kernels=tuple(kernels or ()), envex_wheel=envex_wheel, force=force,
        )  # fmt: skip
        with Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(),
                      console=console, transient=True, disable=not console.is_terminal) as progress:  # fmt: skip
            task = progress.add_task(STEPS[0], total=len(STEPS))

            def step(what: str) -> None:
                if what in STEPS:
                    progress.update(task, description=what, completed=STEPS.index(what))
                else:  # a line of pip's while the wheelhouse resolves
                    progress.update(task, description=f"{STEPS[2]}: {one_line(what)[:70]}")

            built = build_media(request, step)
    except (InstallError, VerificationError, OSError, ValueError) as exc:
        typer.echo(f"error: {one_line(str(exc))}", err=True)
        raise typer.Exit(2) from None
    if built.root_written_to_keys:
        typer.echo(f"note: made a trust root of the keys in {show(keys)} and kept it there as root.json", err=True)
    typer.echo(f"wrote {show(built.media)}: {len(built.bundles)} signed bundles, {built.wheels} wheels")
    for bundle in built.bundles:
        typer.echo(f"  {bundle.name}")
    typer.echo(f"trust root fingerprint: {built.fingerprint}")
    typer.echo("give the operator this fingerprint out of band; they confirm it with --trust-fingerprint")
