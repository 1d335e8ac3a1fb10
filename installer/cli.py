"""`envex-install` and the installer's `envex` commands (status, activate, rollback, demo): thin typer wrappers.

Exit codes: 0 success; 1 the install (or rollback/activation) failed and the previous release stays active;
2 bad usage or input; 3 another installer holds the prefix's lock. Every failure is one line on stderr, usage
errors included (`run_app`), never a traceback.

Test hooks (read here only, documented in offline_docs/install.md): ENVEX_TEST_PAUSE_AT=<step> stops the
installer with SIGSTOP before that step; ENVEX_TEST_GATES_REPORT=<gates.json> replaces running the gates.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated, Literal, NoReturn

import typer

from envex.bundles.files import one_line
from envex.installer.fsutil import LockHeldError
from envex.installer.media import InstallError
from envex.installer.prefix import PrefixError, check_prefix, describe_os_error
from envex.installer.state import StateError, load_state

EXIT_FAILED, EXIT_USAGE, EXIT_LOCKED = 1, 2, 3
DEMO_PREFIX = Path("demo-prefix")

PrefixOpt = Annotated[Path, typer.Option("--prefix", help="the appliance prefix (state.json, releases/, current)")]
DeterministicInstallOpt = Annotated[bool, typer.Option(
    "--deterministic/--no-deterministic",
    help="serve with batch-invariant kernels (a prompt's tokens do not depend on the rest of the batch; slower: "
         "offline_docs/engine.md); the release's gates then require batch invariance. Refused for gpt-oss")]


KVCacheDtypeOpt = Annotated[str, typer.Option(
    "--kv-cache-dtype",
    help="the KV cache's format: bf16 (default), fp8 or int4 (packed: about 1.9x / 3.5x the tokens in the same "
         "memory); a packed one is gated against the model's bf16-KV self and refused outside its band "
         "(offline_docs/kv_cache.md)")]


WeightsOpt = Annotated[str | None, typer.Option(
    "--weights",
    help="a weights policy: the model's projections quantized at load and served packed, a scheme name "
         "(fp8_channel, int4_g128_sym, ...) or the policy's JSON; gated against the model's bf16 self and refused "
         "outside its band (offline_docs/quantization.md)", metavar="POLICY")]


ReferenceOpt = Annotated[str, typer.Option(
    "--reference",
    help="what the gates judge the release against: auto (HF transformers beside the engine where it fits in "
         "memory, else the model bundle's signed answers), local, or signed (offline_docs/gates.md)")]


def _fail(message: str, code: int = EXIT_FAILED) -> NoReturn:
    typer.echo(f"error: {one_line(message)}", err=True)
    raise typer.Exit(code)


def run_app(app: typer.Typer, prog_name: str, argv: list[str] | None = None) -> int:
    """Run a typer app so that every failure is one `error: ...` line on stderr; returns the exit code.

    Usage errors (an unknown option, `--port 99999`, a missing argument) are one line and exit 2, in place of
    typer's multi-line boxes; an OSError that escaped a command (a path too long, a read-only filesystem) is one
    line naming the file and exit 1; anything else is one line too, exit 1, with the traceback only when
    ENVEX_TRACEBACK=1 is set (for a bug report).
    """
    try:  # typer >= 0.20 carries its own copy of click; older ones use click itself
        from typer._click import exceptions as click_errors  # type: ignore[import-not-found,unused-ignore]
    except ImportError:  # pragma: no cover
        from click import exceptions as click_errors  # type: ignore[no-redef,unused-ignore]

    try:
        result = app(args=argv, prog_name=prog_name, standalone_mode=False)
    except click_errors.NoArgsIsHelpError as exc:  # a bare group or command: its help, as usual
        exc.show()
        return EXIT_USAGE
    except click_errors.UsageError as exc:
        hint = f" (see {exc.ctx.command_path} --help)" if exc.ctx is not None else ""
        typer.echo(f"error: {one_line(exc.format_message())}{hint}", err=True)
        return EXIT_USAGE
    except click_errors.ClickException as exc:
        typer.echo(f"error: {one_line(exc.format_message())}", err=True)
        return exc.exit_code
    except typer.Abort:  # end of input at a prompt
        typer.echo("error: aborted", err=True)
        return EXIT_FAILED
    except KeyboardInterrupt:
        typer.echo("error: interrupted", err=True)
        return 130
    except OSError as exc:
        typer.echo(f"error: {one_line(describe_os_error(exc))}", err=True)
        return EXIT_FAILED
    except Exception as exc:
        if os.environ.get("ENVEX_TRACEBACK") == "1":
            raise
        typer.echo(
            f"error: internal error: {type(exc).__name__}: {one_line(str(exc))} (a bug: please report it with the "
            "output of the same command under ENVEX_TRACEBACK=1)",
            err=True,
        )
        return EXIT_FAILED
    return result if isinstance(result, int) else 0


def _test_hooks() -> tuple[str | None, Path | None]:
    from envex.installer.ui import STEPS

    pause = os.environ.get("ENVEX_TEST_PAUSE_AT") or None
    if pause is not None and pause not in STEPS:
        _fail(f"ENVEX_TEST_PAUSE_AT={pause!r}: not one of {', '.join(STEPS)}", EXIT_USAGE)
    report = os.environ.get("ENVEX_TEST_GATES_REPORT") or None
    return pause, Path(report) if report else None


def run_install(
    *,
    media: Path,
    prefix: Path,
    trust_fingerprint: str | None,
    yes: bool,
    model: str | None = None,
    max_model_len: int | None = None,
    suite: str = "quick",
    bench: bool = True,
    gpu: bool = True,
    reinstall: bool = False,
    deterministic: bool = False,
    reference: str = "auto",
    kv_cache_dtype: str = "bf16",
    weights: str | None = None,
) -> int:
    """Run the install chain with its progress display; returns the exit code."""
    from envex.kernels.kv_quant_format import KV_CACHE_DTYPES

    if kv_cache_dtype not in KV_CACHE_DTYPES:  # checked first: a usage error touches nothing
        _fail(f"--kv-cache-dtype {kv_cache_dtype!r}: use {', '.join(KV_CACHE_DTYPES[:-1])} or {KV_CACHE_DTYPES[-1]}",
              EXIT_USAGE)
    if weights is not None:  # the policy's own one line: which key, what to write
        from envex.runtime.weight_policy import PolicyError, policy_from_setting

        try:
            policy_from_setting(weights)
        except PolicyError as exc:
            _fail(f"--weights: {exc}", EXIT_USAGE)
    from envex.installer.launch import set_offline_env
    from envex.installer.netguard import install_guard
    from envex.installer.pipeline import InstallOptions, install
    from envex.installer.ui import InstallUI

    set_offline_env()
    install_guard()  # this process never needs a non-loopback connection: refuse any
    pause, gates_report = _test_hooks()
    if suite not in ("quick", "full"):
        _fail(f"--suite {suite!r}: use quick or full", EXIT_USAGE)
    from envex.verify.references_file import REFERENCE_CHOICES

    if reference not in REFERENCE_CHOICES:
        _fail(f"--reference {reference!r}: use {', '.join(REFERENCE_CHOICES[:-1])} or {REFERENCE_CHOICES[-1]}",
              EXIT_USAGE)
    ui = InstallUI(pause_at=pause)

    def confirm(fingerprint: str) -> bool:
        if yes or not sys.stdin.isatty():
            return False
        ui.console.print(f"First install into {prefix}. The media's trust root has fingerprint:\n  {fingerprint}")
        return typer.confirm("Does it match the fingerprint published to you out of band?", default=False)

    options = InstallOptions(
        media=media,
        prefix=prefix,
        trust_fingerprint=trust_fingerprint,
        model=model,
        max_model_len=max_model_len,
        suite=suite,
        bench=bench,
        use_gpu=gpu,
        reinstall=reinstall,
        deterministic=deterministic,
        reference=reference,
        kv_cache_dtype=kv_cache_dtype,
        weights=weights,
        test_gates_report=gates_report,
    )
    try:
        outcome = install(options, ui, confirm)
    except LockHeldError as exc:
        _fail(str(exc), EXIT_LOCKED)
    except (StateError, PrefixError) as exc:
        _fail(str(exc), EXIT_USAGE)
    except OSError as exc:  # the lock or the prefix itself cannot be written (a read-only filesystem)
        _fail(describe_os_error(exc))
    if not outcome.ok:
        typer.echo(f"error: {one_line(outcome.message)}", err=True)
        return EXIT_FAILED
    return 0


def install_command(
    media: Annotated[Path, typer.Option("--media", help="the install media: bundles/, trust/root.json")],
    prefix: PrefixOpt,
    yes: Annotated[
        bool, typer.Option("--yes", "-y", help="never prompt (first install then needs --trust-fingerprint)")
    ] = False,
    trust_fingerprint: Annotated[
        str | None, typer.Option(help="the trust root fingerprint to pin on first install")
    ] = None,
    model: Annotated[str | None, typer.Option(help="install this model bundle (default: the newest)")] = None,
    max_model_len: Annotated[
        int | None, typer.Option(min=2, help="context to plan for (default: the model card's)")
    ] = None,
    suite: Annotated[str, typer.Option(help="gate suite: quick | full")] = "quick",
    bench: Annotated[bool, typer.Option("--bench/--no-bench", help="run the benchmark after the gates")] = True,
    gpu: Annotated[bool, typer.Option("--gpu/--cpu", help="--cpu: install for CPU even where a GPU is present")] = True,
    reinstall: Annotated[bool, typer.Option(help="install even when the active release has the same bundles")] = False,
    deterministic: DeterministicInstallOpt = False,
    reference: ReferenceOpt = "auto",
    kv_cache_dtype: KVCacheDtypeOpt = "bf16",
    weights: WeightsOpt = None,
) -> None:
    """Verify the media, probe this machine, install a new release, gate it, and activate it only if it passes."""
    raise typer.Exit(
        run_install(
            media=media,
            prefix=prefix,
            trust_fingerprint=trust_fingerprint,
            yes=yes,
            model=model,
            max_model_len=max_model_len,
            suite=suite,
            bench=bench,
            gpu=gpu,
            reinstall=reinstall,
            deterministic=deterministic,
            reference=reference,
            kv_cache_dtype=kv_cache_dtype,
            weights=weights,
        )
    )


def main(argv: list[str] | None = None) -> int:
    """Console script `envex-install`."""
    app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    app.command(name="envex-install")(install_command)
    return run_app(app, "envex-install", argv)


# ---- `envex` commands, registered by installer/commands.py ----------------------------------------------------


def status(prefix: PrefixOpt = Path("/opt/envex")) -> None:
    """Show the active release, every release with its gate verdict, the trust root and the high-water marks."""
    from envex.installer.activate import status_lines

    try:
        prefix = check_prefix(prefix, must_exist=True)
        state = load_state(prefix)
    except (StateError, PrefixError) as exc:
        _fail(str(exc), EXIT_USAGE)
    for line in status_lines(prefix, state):
        typer.echo(one_line(line))


def _locked_change(prefix: Path, change: Literal["activate", "rollback"], release: str | None = None) -> None:
    from envex.installer.activate import change_release

    try:
        state = change_release(prefix, change, release)
    except LockHeldError as exc:
        _fail(str(exc), EXIT_LOCKED)
    except PrefixError as exc:
        _fail(str(exc), EXIT_USAGE)
    except (InstallError, StateError) as exc:
        _fail(str(exc))
    except OSError as exc:  # the lock cannot be taken (a read-only filesystem)
        _fail(describe_os_error(exc))
    typer.echo(
        f"{state.active} is active ({prefix / 'current'}); restart the server to serve it "
        f"(systemctl restart envex, or envex serve --launch {prefix / 'current' / 'launch.json'})"
    )


def activate(
    release: Annotated[str, typer.Argument(help="a release id from envex status that passed its gates")],
    prefix: PrefixOpt = Path("/opt/envex"),
) -> None:
    """Make an installed release that passed its gates the active one."""
    _locked_change(prefix, "activate", release)


def rollback(prefix: PrefixOpt = Path("/opt/envex")) -> None:
    """Activate the release before the active one that passed its gates (bundle high-water marks stay)."""
    _locked_change(prefix, "rollback")


def demo(
    prefix: Annotated[Path, typer.Option(help="where to install the demo")] = DEMO_PREFIX,
    port: Annotated[int, typer.Option(min=1, max=65535, help="port to serve on (127.0.0.1)")] = 8000,
    serve: Annotated[bool, typer.Option("--serve/--no-serve", help="serve the activated release")] = True,
    bench: Annotated[bool, typer.Option("--bench/--no-bench")] = True,
    suite: Annotated[str, typer.Option(help="gate suite: quick | full")] = "quick",
    runtime_version: Annotated[str, typer.Option(help="version of the demo runtime bundle")] = "0.1.0",
    model_version: Annotated[str, typer.Option(help="version of the demo model bundle")] = "1.0.0",
    wheel: Annotated[Path | None, typer.Option(help="an envex wheel to ship (default: build from the source)")] = None,
    gpu: Annotated[bool, typer.Option("--gpu/--cpu")] = True,
    rebuild: Annotated[bool, typer.Option(help="rebuild the demo media (e.g. after changing the source)")] = False,
    device: Annotated[
        str, typer.Option(help="auto | cpu | cuda: on CUDA the media also gets a kernel bundle compiled here")
    ] = "auto",
    media_only: Annotated[
        bool, typer.Option("--media-only", help="build the signed media, print its trust fingerprint, stop there")
    ] = False,
    deterministic: DeterministicInstallOpt = False,
) -> None:
    """The embedded default end to end: demo keys and signed media, install, gates and benchmark, activate, serve."""
    import shutil

    from envex.installer.demo import build_demo_media, cuda_available

    if device not in ("auto", "cpu", "cuda"):
        _fail(f"--device {device!r}: use auto, cpu or cuda", EXIT_USAGE)
    gpu = gpu and device != "cpu"
    kernels = gpu and (device == "cuda" or cuda_available())
    if device == "cuda" and not cuda_available():
        _fail("--device cuda: torch sees no CUDA device here; use --device cpu", EXIT_USAGE)
    try:
        prefix = check_prefix(prefix, must_exist=False)
    except PrefixError as exc:
        _fail(str(exc), EXIT_USAGE)
    work = prefix / ".demo"
    media = work / "media"
    if rebuild:
        shutil.rmtree(media, ignore_errors=True)
    typer.echo(f"building signed demo media in {media} (demo key in {work / 'keys'})")
    try:
        built = build_demo_media(
            media,
            work / "keys",
            runtime_version=runtime_version,
            model_version=model_version,
            wheel=wheel,
            kernels=kernels,
        )
    except (InstallError, ValueError, OSError) as exc:
        _fail(f"demo media: {exc}")
    if media_only:
        kernels_line = f"; kernel bundle {built.kernels.name}" if built.kernels else ""
        typer.echo(f"media: {media}{kernels_line}\ntrust fingerprint: {built.fingerprint}")
        return
    code = run_install(
        media=media,
        prefix=prefix,
        trust_fingerprint=built.fingerprint,
        yes=True,
        suite=suite,
        bench=bench,
        gpu=gpu,
        deterministic=deterministic,
    )
    if code != 0:
        raise typer.Exit(code)
    if serve:
        envex = prefix / "current" / "venv" / "bin" / "envex"
        launch = prefix / "current" / "launch.json"
        typer.echo(f"serving {launch} on http://127.0.0.1:{port}/v1 (Ctrl-C to stop)")
        sys.stdout.flush()
        os.execv(envex, [str(envex), "serve", "--launch", str(launch), "--host", "127.0.0.1", "--port", str(port)])


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
