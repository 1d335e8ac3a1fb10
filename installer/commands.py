"""The `envex` command: thin typer commands that parse options and delegate to the packages.

Heavy imports (torch, the engine, the server) happen inside the commands, so `envex --help` and the bundle
commands stay fast and work where torch is absent.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, TypedDict, Unpack

import typer

from envex.bundles.cli import KERNELS_FROM_MODEL, MODEL_CARD_CHECK, bundle_app, verify_app
from envex.bundles.files import one_line
from envex.installer.admin.cli import admin
from envex.installer.cli import activate, demo, rollback, run_app, status
from envex.installer.media_cli import media_app
from envex.runtime.loader import EMBEDDED_MODEL
from envex.verify.cli import bench, gates_app

if TYPE_CHECKING:
    from envex.runtime.engine.config import EngineConfig


def _stage_kernels(model: str, dest: Path, min_driver: str | None) -> dict[str, object]:
    """`envex bundle build --kind kernels --model M`: the engine's warm-up on this GPU (bundles cannot run it)."""
    from envex.installer.kernel_bundle import stage_kernels

    return stage_kernels(model, dest, min_driver=min_driver)


def _check_model_card(src: Path) -> None:
    """`envex bundle build --kind model`: the source's envex-model.json checked (cards.check_model_source; bundles
    cannot read the installer's card); CardError, a ValueError, in one line when it is refused."""
    from envex.installer.cards import check_model_source

    check_model_source(src)


app = typer.Typer(
    name="envex",
    help="Envex: an air-gappable inference runtime with an OpenAI-compatible API.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"obj": {KERNELS_FROM_MODEL: _stage_kernels, MODEL_CARD_CHECK: _check_model_card}},
)
app.add_typer(bundle_app, name="bundle")
app.add_typer(verify_app, name="verify")
app.add_typer(gates_app, name="gates")
app.add_typer(media_app, name="media")

ModelOpt = Annotated[str, typer.Option("--model", "-m", help=f"HF model dir, .gguf file, or {EMBEDDED_MODEL!r}")]
DeviceOpt = Annotated[str, typer.Option(help="auto | cpu | cuda")]
DtypeOpt = Annotated[str, typer.Option(help="auto | float32 | bfloat16 | float16")]
BackendOpt = Annotated[str, typer.Option(help="auto | torch | triton")]
DeterministicOpt = Annotated[bool | None, typer.Option(
    "--deterministic/--no-deterministic", show_default=False,
    help="batch-invariant kernels: a prompt's tokens do not depend on the rest of the batch (default: off, as "
         "on every model measured it costs more than the bar for a default: offline_docs/engine.md; refused for "
         "gpt-oss and with --backend torch on cuda)")]


def fail(message: str, code: int = 2) -> typer.Exit:
    """Print one line for people on stderr and return the Exit to raise."""
    typer.echo(f"error: {one_line(message)}", err=True)
    return typer.Exit(code)


class EngineOptions(TypedDict, total=False):
    """The engine settings a command takes from its options: EngineConfig's fields of the same names and types
    (each default is EngineConfig's), so a setting can be followed from the option to the kernel."""

    model: str
    device: str
    dtype: str
    backend: str
    max_model_len: int | None
    deterministic: bool | None
    tensor_parallel: int
    draft_model: str | None
    num_speculative_tokens: int
    load_format: str
    kv_cache_dtype: str
    weights: str | None


def engine_config(**options: Unpack[EngineOptions]) -> EngineConfig:
    """The EngineConfig of a command's options, or the command's one-line error (exit 2)."""
    from envex.runtime.engine.config import EngineConfig  # torch: only when a command runs the engine

    try:
        return EngineConfig(**options)
    except ValueError as exc:
        raise fail(str(exc)) from None


@app.command()
def serve(
    model: ModelOpt = EMBEDDED_MODEL,
    launch: Annotated[Path | None, typer.Option(help="start from an installed release's launch.json")] = None,
    host: Annotated[str, typer.Option(help="address to bind; loopback unless told otherwise")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=1, max=65535)] = 8000,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "auto",
    backend: BackendOpt = "auto",
    max_model_len: Annotated[int | None, typer.Option(help="context window to serve (default: the model's)")] = None,
    api_key: Annotated[str | None, typer.Option(envvar="ENVEX_API_KEY", help="require this Bearer key")] = None,
    draft_model: Annotated[str | None, typer.Option(
        "--draft-model", help="speculative decoding: a smaller model of the same tokenizer drafts tokens; mtp: the "
                         "model's own multi-token-prediction layer (DeepSeek-V3/R1, Qwen3-Next)")] = None,
    speculative_tokens: Annotated[int, typer.Option(
        "--speculative-tokens", min=0, max=16,
        help="speculative decoding: the most drafts verified per step (0: off; n-gram lookup without a draft model)",
    )] = 0,
    kv_cache_dtype: Annotated[str, typer.Option(
        "--kv-cache-dtype", help="KV cache: bf16 (as computed), fp8 or int4 (packed: about 2x and 3.5x the tokens "
                                 "in the same memory; offline_docs/kv_cache.md)")] = "bf16",
    deterministic: DeterministicOpt = None,
    tensor_parallel: Annotated[int, typer.Option(
        "--tensor-parallel", min=1, help="split the model over this many GPUs of this host (one process each)")] = 1,
    load_format: Annotated[str, typer.Option(
        "--load-format", help="auto: the weights in the model's files; dummy: random weights of the right shapes "
                              "made from config.json alone (benchmarks: speed does not depend on the values, answers "
                              "do)")] = "auto",
    weights: Annotated[str | None, typer.Option(
        "--weights", help="quantize the model's projections at load and serve them packed: a scheme (fp8_channel, "
                          "fp8_block, int4_g128_sym, ...) or a JSON policy (offline_docs/quantization.md)")] = None,
) -> None:
    """Serve the OpenAI-compatible API (and the admin page) on HOST:PORT."""
    extra_routers: list = []
    if launch is not None and deterministic is not None:
        raise fail("--deterministic/--no-deterministic: a release serves the settings its gates passed with "
                   "(launch.json's `deterministic`); drop the flag or install again")
    if launch is not None and tensor_parallel != 1:
        raise fail("--tensor-parallel: a release serves the degree its plan chose and its gates passed with "
                   "(launch.json's engine.tensor_parallel); drop the flag or install again")
    if launch is not None and (draft_model is not None or speculative_tokens):
        raise fail("--draft-model/--speculative-tokens: a release serves the settings of its launch.json "
                   "(engine.draft_model, engine.num_speculative_tokens); drop the flags or install with them")
    if launch is not None and kv_cache_dtype != "bf16":
        raise fail("--kv-cache-dtype: a release serves the KV cache its gates passed with (launch.json's "
                   "engine.kv_cache_dtype); drop the flag or install again")
    if launch is not None and weights is not None:
        raise fail("--weights: a release serves the weights policy its gates passed with (launch.json's "
                   "engine.weights); drop the flag or install again")
    if launch is not None and load_format != "auto":
        raise fail("--load-format: a release serves the weights its gates passed with; drop the flag")
    if launch is not None:
        from envex.installer.launch import LaunchError, load_launch

        try:
            config = load_launch(launch)
        except (LaunchError, ValueError) as exc:  # ValueError: an engine setting's value (EngineConfig)
            raise fail(str(exc)) from None
        from envex.installer.admin import admin_routers_for_launch  # (after the launch file: it brings torch)

        extra_routers = admin_routers_for_launch(launch)  # /admin for the release's prefix
    else:
        config = engine_config(model=model, device=device, dtype=dtype, backend=backend, max_model_len=max_model_len,
                               deterministic=deterministic, tensor_parallel=tensor_parallel,
                               draft_model=draft_model, num_speculative_tokens=speculative_tokens,
                               load_format=load_format, kv_cache_dtype=kv_cache_dtype, weights=weights)
    from envex.runtime.server.serve import serve as run_server  # after the checks: a refusal needs no web stack

    try:
        run_server(config, host=host, port=port, api_key=api_key, extra_routers=extra_routers)
    except (ValueError, OSError) as exc:
        raise fail(str(exc), 1) from None


@app.command()
def generate(
    prompt: Annotated[str, typer.Argument(help="the prompt (a user message when --chat)")],
    model: ModelOpt = EMBEDDED_MODEL,
    max_tokens: Annotated[int, typer.Option(min=1)] = 128,
    temperature: Annotated[float, typer.Option(min=0.0, max=2.0)] = 0.0,
    chat: Annotated[bool, typer.Option(help="wrap the prompt in the model's chat template")] = True,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "auto",
    backend: BackendOpt = "auto",
    deterministic: DeterministicOpt = None,
) -> None:
    """Generate from one prompt, streaming tokens to the terminal."""
    from envex.runtime.server.generate_cli import run_generate

    config = engine_config(model=model, device=device, dtype=dtype, backend=backend, deterministic=deterministic)
    try:
        code = run_generate(config, prompt, max_tokens=max_tokens, temperature=temperature, chat=chat)
    except ValueError as exc:
        raise fail(str(exc)) from None
    raise typer.Exit(code)


# The installer's commands, registered after serve and generate so --help lists those first.
for _name, _command in (("bench", bench), ("status", status), ("activate", activate), ("rollback", rollback),
                        ("demo", demo), ("admin", admin)):
    app.command(_name)(_command)


def main(argv: list[str] | None = None) -> int:
    """Console script `envex`: every failure one line on stderr (installer.cli.run_app)."""
    return run_app(app, "envex", argv)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
