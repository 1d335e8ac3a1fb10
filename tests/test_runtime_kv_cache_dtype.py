"""kv_cache_dtype end to end (issue 43): the packed KV cache (int4, fp8) allocated by the model runner, counted by
bytes, written and read through Ops.attention on the torch and Triton backends, served by the engine, shown on
/metrics, chosen on the CLI and in launch.json, and refused where the path cannot take it."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from envex.kernels.accuracy import rel_err
from envex.kernels.kv_quant_format import KVCacheFormat, format_for, kv_bytes_per_token
from envex.kernels.ops import AttentionMetadata
from envex.kernels.torch_ops import TorchOps
from envex.kernels.triton_ops import TritonOps
from envex.runtime.config import ModelConfig
from envex.runtime.engine import EngineConfig, LLMEngine, SamplingParams
from envex.runtime.engine.accel.cuda_graphs import DecodeGraphs
from envex.runtime.models import dummy_weights
from envex.runtime.models.llama import LlamaForCausalLM, rope_cos_sin
from envex.tests.support.kernels import eager_step

PAGE, MAX_LEN, VOCAB, BLOCKS = 8, 64, 40, 12
BASE = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "tie_word_embeddings": False, "head_dim": 32}  # fmt: skip
ARCHS = {  # head_dim 32: the packed formats' smallest (a power of two >= 32); qwen3 adds the q/k norm
    "llama": {"architectures": ["LlamaForCausalLM"], "model_type": "llama"},
    "qwen3": {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"},
}


class _Runner(SimpleNamespace):
    """What DecodeGraphs needs of a ModelRunner."""

    def forward_logits(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        hidden, residual = self.model(self.ops, input_ids, self.kv_caches, meta)
        return self.model.compute_logits(self.ops, hidden, residual)


def _model(arch: str) -> LlamaForCausalLM:
    model = LlamaForCausalLM(ModelConfig.from_hf({**BASE, **ARCHS[arch]}), dtype=torch.float32, device="cpu")
    dummy_weights(model, seed=1)
    return model


def _runner(model: LlamaForCausalLM, ops, fmt: KVCacheFormat | None) -> _Runner:
    c = model.config
    cos, sin = rope_cos_sin(c, MAX_LEN, torch.device("cpu"))
    if fmt is None:
        caches = [(torch.zeros(BLOCKS, PAGE, c.num_key_value_heads, c.head_dim),
                   torch.zeros(BLOCKS, PAGE, c.num_key_value_heads, c.head_dim))
                  for _ in range(c.num_hidden_layers)]  # fmt: skip
    else:  # as ModelRunner._layer_cache: the packed cache and None, unpacked by the model into Ops.attention
        caches = [(fmt.allocate(BLOCKS, PAGE, c.num_key_value_heads, c.head_dim, "cpu"), None)
                  for _ in range(c.num_hidden_layers)]  # fmt: skip
    return _Runner(model=model, ops=ops, kv_caches=caches, cos=cos, sin=sin, device=torch.device("cpu"),
                   block_size=PAGE, max_model_len=MAX_LEN, model_config=c)  # fmt: skip


def _step(runner: _Runner, ids: list[list[int]], starts: list[int], tables: list[list[int]],
          q_per_seq: int | None = None) -> torch.Tensor:  # fmt: skip
    """One eager step: the logits of every token (prefill chunks, verify rows and decode alike)."""
    tokens, meta, _ = eager_step(ids, starts, tables, runner.cos, runner.sin, PAGE, torch.device("cpu"))
    if q_per_seq is not None:
        meta = replace(meta, q_per_seq=q_per_seq)
    with torch.inference_mode():
        hidden, residual = runner.model(runner.ops, tokens, runner.kv_caches, meta)
        hidden = runner.ops.materialize(hidden, residual.dtype)
        return runner.model.compute_logits(runner.ops, hidden, residual)


@pytest.mark.parametrize("kv, arch", [("fp8", "llama"), ("int4", "qwen3")])
def test_packed_cache_forward_on_triton_ops_equals_torch_ops(kv: str, arch: str) -> None:
    """The model file over a packed cache: TritonOps (the packed write kernel and packed paged attention, under
    the interpreter) against TorchOps (the float64 reference write, the blocks dequantized, the plain attention)
    on a chunked prefill over a packed prefix, a uniform 3-token verify-shaped step, eager decode and the decode
    graphs' step. Both also stay within the format's band of the same model over an unquantized cache."""
    model = _model(arch)
    fmt = format_for(kv, model.config.head_dim)  # int4 at head_dim 32: one group a row
    assert fmt is not None
    ref, fast, plain = _runner(model, TorchOps(), fmt), _runner(model, TritonOps(), fmt), _runner(model, TorchOps(),
                                                                                                  None)  # fmt: skip
    tables = [[3, 7, 10], [1, 5, 2]]
    steps = (
        ("prefill chunk", [[4, 11, 29, 3, 8], [1, 2, 3, 5, 8, 13, 21, 34, 7]], [0, 0], None),
        ("chunk over a packed prefix", [[9, 17, 6], [11, 18, 29, 30, 6]], [5, 9], None),
        ("verify rows", [[12, 19, 5], [22, 4, 16]], [8, 14], 3),
        ("decode", [[30], [6]], [11, 17], None),
    )
    # the logits of a 2-layer random model against the unquantized cache: measured fp8 3.9-4.7%, int4 15-19%
    band = 0.06 if kv == "fp8" else 0.25
    for name, ids, starts, q_per_seq in steps:
        want, got = _step(ref, ids, starts, tables, q_per_seq), _step(fast, ids, starts, tables, q_per_seq)
        # 5e-3: where the write kernel's fp32 rotary and the reference's float64 one round a key to a different
        # side of a quantization step (fp8 llama, measured 2.2e-3); equal bytes give ~5e-7
        assert rel_err(got, want) < 5e-3, f"{kv} {arch} {name}: {rel_err(got, want):.2e}"
        exact = _step(plain, ids, starts, tables, q_per_seq)
        assert rel_err(want, exact) < band, f"{kv} {arch} {name} vs unquantized: {rel_err(want, exact):.2e}"
    for (packed, _), (packed_ref, _) in zip(fast.kv_caches, ref.kv_caches, strict=True):
        same = (packed.k_data.view(torch.uint8) == packed_ref.k_data.view(torch.uint8)).float().mean()
        assert same > 0.99, f"{kv} {arch}: the write kernel's K bytes differ from the reference's ({same:.3f})"
    graphs = DecodeGraphs(fast, max_batch=2, capture=False)  # the graph's forward, run eagerly on the CPU
    want = _step(ref, [[12], [19]], [12, 18], tables)
    got = graphs.run([12, 19], [12, 18], tables)
    assert rel_err(got, want) < 2e-3, f"{kv} {arch} graph decode: {rel_err(got, want):.2e}"


def test_gpt_oss_full_layers_packed_with_sinks_beside_a_plain_window_layer() -> None:
    """gpt-oss as the engine serves it with a packed cache: the full-attention layer (sinks) packed, the window
    layer's K/V plain (its own small pool, runtime/engine/caches/window_kv.py); TritonOps against TorchOps."""
    from envex.runtime.models.gpt_oss import GptOssForCausalLM

    hf = {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", **BASE, "intermediate_size": 32,
          "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 4, "attention_bias": True,
          "layer_types": ["sliding_attention", "full_attention"]}  # fmt: skip
    config = ModelConfig.from_hf(hf)
    model = GptOssForCausalLM(config, dtype=torch.float32, device=torch.device("cpu"))
    dummy_weights(model, seed=1)
    g = torch.Generator().manual_seed(2)  # not the global generator: its state depends on the tests run before
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("sinks"):  # far from 0, so a dropped sink shows
                p.normal_(0.0, 0.5, generator=g)
    fmt = format_for("int4", config.head_dim)
    assert fmt is not None and config.layer_windows == (4, None)
    ref, fast = _runner(model, TorchOps(), fmt), _runner(model, TritonOps(), fmt)
    plain = _runner(model, TorchOps(), None)
    for runner in (ref, fast):  # layer 0, the window layer: plain, as the engine's window pool
        runner.kv_caches[0] = _runner(model, TorchOps(), None).kv_caches[0]
    tables = [[3, 7, 10], [1, 5, 2]]
    for ids, starts in (([[4, 11, 29, 3, 8], [1, 2, 3, 5, 8, 13, 21, 34, 7]], [0, 0]), ([[30], [6]], [5, 9])):
        want, got = _step(ref, ids, starts, tables), _step(fast, ids, starts, tables)
        assert rel_err(got, want) < 5e-3, f"gpt-oss int4: {rel_err(got, want):.2e}"
        # against the unquantized cache: measured 5.3% (prefill) and 7.1% (decode) with these sinks (4.8% / 6.9%
        # before they were seeded; a CI run whose earlier tests left the global generator elsewhere measured 31%)
        assert rel_err(want, _step(plain, ids, starts, tables)) < 0.15


# ---- the engine on the embedded model (SmolLM2-135M: 30 layers, 3 KV heads of 64, float32 on the CPU) -----------

GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def packed_engines() -> dict[str, LLMEngine]:
    return {kv: LLMEngine(EngineConfig(device="cpu", kv_cache_dtype=kv, max_model_len=512, kv_cache_memory_gb=0.25))
            for kv in ("fp8", "int4")}  # fmt: skip


def _agreeing(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def test_packed_kv_engine_generates_as_its_bf16_self(embedded_engine: LLMEngine,
                                                     packed_engines: dict[str, LLMEngine]) -> None:  # fmt: skip
    tok = embedded_engine.tokenizer
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    want = embedded_engine.generate([prompt], GREEDY)[0]
    fp8 = packed_engines["fp8"].generate([prompt], GREEDY)[0]
    int4 = packed_engines["int4"].generate([prompt], GREEDY)[0]
    # Measured on this CPU (2026-12-06), each request alone, 32 greedy tokens: fp8 agrees with the bf16-KV run on
    # all 32; int4 on the first 7, "The capital of France is Paris." (then " It's a city" for "\nsystem"). Other
    # prompts, same run: "A list of prime numbers: 2, 3, 5," fp8 21, int4 1; "The capital of France is" fp8 5,
    # int4 27; "Fact number 3 about the ocean:" fp8 2, int4 2 (near-ties in the bf16 run's own choices).
    assert want.text.startswith("The capital of France is Paris.")
    assert _agreeing(fp8.token_ids, want.token_ids) == 32
    assert _agreeing(int4.token_ids, want.token_ids) >= 7 and int4.text.startswith("The capital of France is Paris.")
    # The prefix cache over packed blocks: the same prompt again reuses them and answers the same.
    engine = packed_engines["int4"]
    hits = engine.stats().prefix_cache_hit_tokens_total
    again = engine.generate([prompt], GREEDY)[0]
    assert engine.stats().prefix_cache_hit_tokens_total > hits
    assert again.token_ids == int4.token_ids
    assert engine.stats().kv_blocks_used == 0


def test_blocks_are_counted_by_bytes(embedded_engine: LLMEngine, packed_engines: dict[str, LLMEngine]) -> None:
    """A GiB of KV memory holds as many more blocks as the format has fewer bytes a token (the packed engines have
    a quarter of the bf16 engine's GiB)."""
    plain = embedded_engine.runner
    per_token = {"bf16": 2 * 3 * 64 * 4}  # K and V, 3 heads of 64, float32 (the CPU's activation dtype)
    for kv, engine in packed_engines.items():
        per_token[kv] = kv_bytes_per_token(kv, 3, 64)
        assert engine.runner.kv_bytes_per_token == per_token[kv]
        assert engine.runner.num_blocks == 2**28 // (30 * 16 * per_token[kv])
    assert plain.num_blocks == 2**30 // (30 * 16 * per_token["bf16"])
    assert per_token == {"bf16": 1536, "fp8": 396, "int4": 216}
    assert 4 * packed_engines["int4"].runner.num_blocks / plain.num_blocks == pytest.approx(1536 / 216, rel=1e-3)
    # Against a bf16 activation dtype (the GPU's) the ratios are the issue's: int4 3.56x, fp8 1.94x (head_dim 64).
    assert kv_bytes_per_token("bf16", 3, 64) / kv_bytes_per_token("int4", 3, 64) == pytest.approx(3.56, abs=0.01)
    assert kv_bytes_per_token("bf16", 3, 64) / kv_bytes_per_token("fp8", 3, 64) == pytest.approx(1.94, abs=0.01)


def test_metrics_and_admin_page_show_kv_capacity_in_tokens(packed_engines: dict[str, LLMEngine]) -> None:
    from fastapi.testclient import TestClient

    from envex.runtime.server.app import build_app
    from envex.runtime.server.async_engine import AsyncEngine

    engine = packed_engines["int4"]
    text = TestClient(build_app(AsyncEngine(engine))).get("/metrics").text
    tokens = engine.runner.num_blocks * 16
    assert f'\nenvex_kv_cache_capacity_tokens{{kv_cache_dtype="int4"}} {tokens}\n' in text
    # the admin page's overview card (installer/admin/overview.html) reads the same figure
    from envex.installer.admin.views import LiveSampler, live_stats
    from envex.runtime.server.metrics import Metrics

    live = live_stats(AsyncEngine(engine), Metrics(), LiveSampler())
    assert (live["kv_capacity_tokens"], live["kv_cache_dtype"]) == (tokens, "int4")


# ---- choosing it, and what is refused -----------------------------------------------------------------------


def test_bad_kv_cache_dtype_is_one_line() -> None:
    with pytest.raises(ValueError, match=r"^kv_cache_dtype: 'int8' is not one of bf16, fp8, int4$"):
        EngineConfig(kv_cache_dtype="int8")


@pytest.mark.parametrize("kwargs, architecture, message", [
    ({"deterministic": True}, "LlamaForCausalLM", "no batch-invariant attention kernel yet"),
    ({}, "DeepseekV3ForCausalLM", "keeps a cache layout of its own"),
])  # fmt: skip
def test_unsupported_combinations_are_refused_at_resolution(kwargs, architecture, message) -> None:
    config = EngineConfig(device="cpu", kv_cache_dtype="int4", **kwargs)
    with pytest.raises(ValueError, match=message):
        config.resolved(window=4096, cuda_available=False, architecture=architecture)
    plain = replace(config, kv_cache_dtype="bf16")
    if architecture == "DeepseekV3ForCausalLM":  # the same settings with bf16 KV resolve
        assert plain.resolved(window=4096, cuda_available=False, architecture=architecture).kv_cache_dtype == "bf16"


def test_tensor_parallel_is_refused() -> None:
    from envex.runtime.engine.config import check_kv_cache_dtype

    refusal = check_kv_cache_dtype("fp8", deterministic=False, architecture="LlamaForCausalLM", tensor_parallel=True)
    assert refusal is not None and refusal.startswith("kv_cache_dtype: fp8") and "--tensor-parallel 1" in refusal
    assert check_kv_cache_dtype("bf16", deterministic=True, architecture=None, tensor_parallel=True) is None


def test_serve_cli_validates_kv_cache_dtype(capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    from envex.installer.commands import main

    assert main(["serve", "--kv-cache-dtype", "int8", "--port", "1"]) != 0
    err = capsys.readouterr().err.strip()
    assert err == "error: kv_cache_dtype: 'int8' is not one of bf16, fp8, int4", err
    assert main(["serve", "--launch", str(tmp_path / "launch.json"), "--kv-cache-dtype", "int4"]) != 0
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "--kv-cache-dtype: a release serves the KV cache its gates passed with" in err


def _launch_file(tmp_path, kv_cache_dtype: str):
    """An installed release's launch.json (gates passed) whose engine settings name kv_cache_dtype."""
    import json

    ref = {"name": "m", "kind": "model", "version": "1.0.0", "manifest_sha256": "a" * 64}
    (tmp_path / "model").mkdir(exist_ok=True)
    (tmp_path / "model" / "m.gguf").write_bytes(b"x")
    launch = {
        "release": "0001-m-1.0.0", "created": "2026-01-01T00:00:00Z", "mode": "cpu",
        "model": {"path": "model/m.gguf", "served_name": "m", "format": "gguf", "architecture": "LlamaForCausalLM",
                  "quantization": "Q4_1", "sha256": "b" * 64, "bundle": ref},
        "engine": {"device": "cpu", "dtype": "float32", "max_model_len": 512, "kv_cache_dtype": kv_cache_dtype},
        "numeric_policy": "weights Q4_1 computed in float32", "kv_cache": {"dtype": "float32", "block_size": 16},
        "kernels": None,
        "runtime": {"envex_version": "0.1.0", "python": "3.11", "torch": None, "triton": None, "venv": "venv",
                    "bundle": {**ref, "name": "envex-runtime", "kind": "runtime"}},
        "gates": {"verdict": "pass", "suite": "quick", "gates": {"g": "pass"}, "report": "r", "finished_at": "x"},
    }  # fmt: skip
    path = tmp_path / "launch.json"
    path.write_text(json.dumps(launch))
    return path


def test_launch_json_chooses_kv_cache_dtype(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    from envex.installer.commands import main
    from envex.installer.launch import load_launch

    assert load_launch(_launch_file(tmp_path, "int4")).kv_cache_dtype == "int4"
    # a bad value in launch.json: `envex serve --launch` says so in one line, before loading anything
    assert main(["serve", "--launch", str(_launch_file(tmp_path, "int8"))]) != 0
    err = capsys.readouterr().err.strip()
    assert err == "error: kv_cache_dtype: 'int8' is not one of bf16, fp8, int4", err
    # what the installer records: every EngineConfig field, so engine.kv_cache_dtype (bf16 unless chosen)
    from envex.installer.launch import LaunchManifest

    with pytest.raises(ValueError, match="engine.kv_cache_format"):
        LaunchManifest.model_validate_json(_launch_file(tmp_path, "fp8").read_text().replace(
            '"kv_cache_dtype"', '"kv_cache_format"'))  # fmt: skip


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kv", ["fp8", "int4"])
def test_packed_kv_serves_on_cuda_with_graphs(kv: str) -> None:
    """On the GPU: bf16 activations, the Triton backend, decode replaying CUDA graphs that captured the packed
    write and attention, against the same engine without graphs; both answer the France question."""
    config = EngineConfig(device="cuda", kv_cache_dtype=kv, max_model_len=2048)
    graphs = LLMEngine(config)
    assert graphs.runner.decode_graphs is not None and graphs.runner.kv_format is not None
    prompt = graphs.tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    with_graphs = graphs.generate([prompt], GREEDY)[0]
    del graphs
    eager = LLMEngine(replace(config, use_cuda_graphs=False)).generate([prompt], GREEDY)[0]
    assert "Paris" in with_graphs.text and "Paris" in eager.text, (with_graphs.text, eager.text)
    assert _agreeing(with_graphs.token_ids, eager.token_ids) >= 7
