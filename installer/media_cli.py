"""`envex media build`: the thin typer command over installer/media_build.py."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from envex.bundles.files import one_line, show
from envex.installer.cards import TORCH_VERSION

# installer/media_build.py is imported by the commands that run it: it computes reference answers, so it brings torch
# and the engine (~2 s), which every other `envex` command would otherwise pay at start.

media_app = typer.Typer(help="Make signed install media.", no_args_is_help=True, add_completion=False)

STEPS = ("reading the model's files", "loading the keys", "computing the reference answers",
         "building the runtime wheelhouse", "bundling the runtime", "bundling the model", "signing")  # fmt: skip


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
    no_references: Annotated[
        bool, typer.Option("--no-references", help="Leave the gates' reference answers out of the model bundle.")
    ] = False,
    reference_from: Annotated[
        Path | None, typer.Option("--reference-from", help="Reference answers computed elsewhere (`envex media "
                                  "references`), for these same files.")  # fmt: skip
    ] = None,
    reference_suite: Annotated[
        list[str] | None, typer.Option("--reference-suite", help="Gate suite to answer: quick (default), full.")
    ] = None,
    reference_device: Annotated[
        str, typer.Option("--reference-device", help="Where HF transformers computes them: cpu or cuda.")
    ] = "cpu",
) -> None:
    """Build signed install media for a model: card, complete wheelhouse for the target, signatures, trust root."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from envex.bundles import VerificationError
    from envex.installer.media import InstallError
    from envex.installer.media_build import MediaRequest, PipSource, Target, build_media

    console = Console(stderr=True)
    try:
        request = MediaRequest(
            model=model, out=out, keys=keys, name=name, version=version, runtime_version=runtime_version,
            target=Target(python=target_python, platform=target_platform, torch=torch,  # type: ignore[arg-type]
                          torch_version=torch_version),
            source=PipSource(find_links=tuple(find_links or ()), no_index=no_index, index_url=index_url,
                             extra_index_urls=tuple(extra_index_url or ())),
            kernels=tuple(kernels or ()), envex_wheel=envex_wheel, force=force, references=not no_references,
            reference_from=reference_from, reference_suites=tuple(reference_suite or ("quick",)),
            reference_device=reference_device,
        )  # fmt: skip
        with Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(),
                      console=console, transient=True, disable=not console.is_terminal) as progress:  # fmt: skip
            task = progress.add_task(STEPS[0], total=len(STEPS))
            current = [STEPS[0]]

            def step(what: str) -> None:
                if what in STEPS:
                    current[0] = what
                    progress.update(task, description=what, completed=STEPS.index(what))
                else:  # a line of pip's while the wheelhouse resolves, or the gate the reference answers
                    progress.update(task, description=f"{current[0]}: {one_line(what)[:70]}")

            built = build_media(request, step)
    except (InstallError, VerificationError, OSError, ValueError) as exc:
        typer.echo(f"error: {one_line(str(exc))}", err=True)
        raise typer.Exit(2) from None
    if built.root_written_to_keys:
        typer.echo(f"note: made a trust root of the keys in {show(keys)} and kept it there as root.json", err=True)
    answers = "without reference answers" if not built.references else f"reference answers for {built.references}"
    typer.echo(f"wrote {show(built.media)}: {len(built.bundles)} signed bundles, {built.wheels} wheels, {answers}")
    for bundle in built.bundles:
        typer.echo(f"  {bundle.name}")
    typer.echo(f"trust root fingerprint: {built.fingerprint}")
    typer.echo("give the operator this fingerprint out of band; they confirm it with --trust-fingerprint")


@media_app.command("references")
def references(
    model: Annotated[Path, typer.Option("--model", help="The model: an HF directory or a .gguf file.")],
    out: Annotated[Path, typer.Option("--out", help="The references file to write (RUN.json).")],
    suite: Annotated[list[str] | None, typer.Option("--suite", help="Gate suite: quick (default), full.")] = None,
    device: Annotated[str, typer.Option("--device", help="Where HF transformers runs: cpu or cuda.")] = "cpu",
    max_model_len: Annotated[
        int | None, typer.Option("--max-model-len", min=2, help="The window the appliance gates at (default: the "
                                 "card's).")  # fmt: skip
    ] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace --out.")] = False,
) -> None:
    """Compute the gates' reference answers for a model on a machine where HF transformers runs it in float32, for
    `envex media build --reference-from` on the build host."""
    from envex.bundles import VerificationError
    from envex.installer.media import InstallError
    from envex.installer.media_build import compute_references
    from envex.installer.model_card import card_for_model
    from envex.verify.references_file import references_bytes

    try:
        if out.exists() and not force:
            raise InstallError(f"--out {show(out)}: exists; give --force to replace it, or another --out")
        card = card_for_model(model, "references")
        window = min(max_model_len or card.defaults.max_model_len, card.max_position_embeddings)
        refs = compute_references(model, tuple(suite or ("quick",)), device, window,
                                  lambda what: typer.echo(what, err=True))  # fmt: skip
        tmp = out.with_name(f".{out.name}.tmp")
        tmp.write_bytes(references_bytes(refs))
        tmp.replace(out)
    except (InstallError, VerificationError, OSError, ValueError) as exc:
        typer.echo(f"error: {one_line(str(exc))}", err=True)
        raise typer.Exit(2) from None
    typer.echo(f"wrote {show(out)}: {len(refs.greedy)} greedy answers and {len(refs.logits)} texts' top logprobs for "
               f"the {'/'.join(refs.suites)} suite at max_model_len {refs.max_model_len} ({refs.reference_policy}); "
               "give it to `envex media build --reference-from`")
