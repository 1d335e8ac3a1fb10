"""The GPU acceptance matrix's cells (verify/lab/gpu_matrix.py), run here on the CPU against a tiny dummy Llama: each
cell starts the real `envex serve` as a child process and drives it with the official openai client, as it does on
the device. A ready server is checked end to end; a flag the model cannot take is recorded as its one-line refusal,
not as a crash."""

from __future__ import annotations

import json
import socket

import pytest
import torch

from envex.verify.lab import gpu_matrix as M

TINY = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=64, intermediate_size=128,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=32000, rms_norm_eps=1e-5,
            rope_theta=10000.0, max_position_embeddings=2048, tie_word_embeddings=False, torch_dtype="float32",
            eos_token_id=2)  # fmt: skip
TINY_MODEL = M.Model("tiny", "tiny Llama (dummy)", TINY, 1024, ("tiny_b1", "tiny_c4"))


@pytest.fixture()
def cases(monkeypatch):
    # CPU-sized cases (batch, prompt, output, timed runs): the matrix's own run_case and checks, shorter prompts
    monkeypatch.setitem(M.CASES, "tiny_b1", (1, 96, 12, 2))
    monkeypatch.setitem(M.CASES, "tiny_c4", (4, 64, 8, 1))
    monkeypatch.setitem(M.CASES, "b1_1k", (1, 96, 12, 1))


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cell(tmp_path, mode: str):
    return M.run_cell(TINY_MODEL, mode, port=free_port(), out=tmp_path, models_dir=tmp_path / "models",
                      bandwidth=None, ready_timeout=300)  # fmt: skip


@pytest.mark.slow
def test_a_ready_cell_answers_every_api_reports_its_settings_and_stops_cleanly(tmp_path, cases) -> None:
    default = cell(tmp_path, "default")
    assert default["status"] == "ok", default
    assert default["flags"][:4] == ["--model", str(tmp_path / "models" / "tiny"), "--load-format", "dummy"]
    assert default["api"] == {"chat": True, "completion": True, "stream": True, "metrics": True,
                              "shutdown_clean": True}  # fmt: skip
    assert default["resolved"]["backend"] == "torch" and default["resolved"]["deterministic"] is False
    assert default["resolved"]["max_model_len"] == "1024"
    assert set(default["cases"]) == {"tiny_b1", "tiny_c4"}
    b1 = default["cases"]["tiny_b1"]
    assert b1["metric"] == "decode_tok_s" and len(b1["runs"]) == 2 and b1["excluded"] == 0 and b1["median"] > 0
    assert default["cases"]["tiny_c4"]["metric"] == "output_tok_s"
    assert default["invariance"] is None  # the default mode promises nothing
    det = cell(tmp_path, "det")
    assert det["status"] == "ok" and det["resolved"]["deterministic"] is True, det
    inv = det["invariance"]
    assert inv["promised"] and inv["identical"] and inv["differing_tokens"] == 0 and inv["compared_tokens"] == 128
    spec = cell(tmp_path, "spec4")
    assert spec["status"] == "ok" and spec["resolved"]["num_speculative_tokens"] == 4, spec
    assert list(spec["cases"]) == ["b1_1k"]  # the modes beside the default run batch 1 at 1K
    line = M.summary_line(spec)
    assert "spec4" in line and "ok" in line and "b1_1k" in line


@pytest.mark.slow
def test_a_flag_the_model_cannot_take_is_a_one_line_refusal(tmp_path, cases, monkeypatch) -> None:
    # a draft whose vocabulary differs: envex serve refuses it in one line before serving
    monkeypatch.setitem(M.DRAFTS, "tiny", {**TINY, "vocab_size": 31000})
    refused = cell(tmp_path, "draft")
    assert refused["status"] == "refused", refused
    assert refused["line"].startswith("error: draft_model: ") and "tokenizer" in refused["line"]
    assert refused["cases"] == {} and refused["api"] == {}
    assert "refused" in M.summary_line(refused)


def test_cli_refuses_unknown_models_and_modes_in_one_line(tmp_path, capsys) -> None:
    assert M.main(["--out", str(tmp_path), "--models", "llama8b,gpt-5", "--modes", "default,turbo",
                   "--no-bandwidth"]) == 2  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "gpt-5, turbo" in err[0] and "llama8b" in err[0]
    assert not (tmp_path / "matrix.json").exists()
    assert M.main(["--out", str(tmp_path), "--cells", "llama8b:default", "--cases", "b1_1k,b1_2k",
                   "--no-bandwidth"]) == 2  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "case b1_2k;" in err[0] and "b1_128k" in err[0]


def test_flags_are_what_a_user_types(tmp_path) -> None:
    llama = M.model_flags(M.MODELS["llama8b"], "draft", tmp_path)
    assert llama[:4] == ["--model", str(tmp_path / "llama8b"), "--load-format", "dummy"]
    assert llama[4:] == ["--max-model-len", "12288", "--draft-model", str(tmp_path / "llama8b-draft")]
    draft = json.loads((tmp_path / "llama8b-draft" / "config.json").read_text())
    target = json.loads((tmp_path / "llama8b" / "config.json").read_text())
    assert draft["vocab_size"] == target["vocab_size"] and draft["num_hidden_layers"] < target["num_hidden_layers"]
    assert (tmp_path / "llama8b-draft" / "tokenizer.json").read_bytes() == (
        tmp_path / "llama8b" / "tokenizer.json").read_bytes()
    assert M.model_flags(M.MODELS["embedded"], "draft", tmp_path) == ["--model", M.EMBEDDED, "--draft-model",
                                                                      M.EMBEDDED]  # fmt: skip
    assert M.model_flags(M.MODELS["gpt-oss-120b"], "det", tmp_path)[-3:] == ["--max-model-len", "131072",
                                                                             "--deterministic"]  # fmt: skip


def test_weights_modes_quantize_at_load_and_their_roofline_counts_packed_bytes(tmp_path) -> None:
    """fp8 / fp8-channel / int4 are `--weights <scheme>` as a user types it; a step's bytes count the projections
    at the scheme's bytes a weight (codes and scales, as kernels/quant.py stores them) and the rest in bf16."""
    from envex.kernels import quant
    from envex.verify.lab.kernel_bench.bench_server import projection_bytes, step_bytes

    for mode, scheme in (("fp8", "fp8_block"), ("fp8-channel", "fp8_channel"), ("int4", "int4_g128_asym")):
        assert M.model_flags(M.MODELS["llama8b"], mode, tmp_path)[-2:] == ["--weights", scheme]
    w = torch.randn(4096, 14336)  # Llama-3.1-8B's down projection
    for scheme, packed in (("fp8_block", quant.quantize_fp8(w, quant.FP8_BLOCK)),
                           ("fp8_channel", quant.quantize_fp8(w, quant.FP8_CHANNEL)),
                           ("int4_g128_asym", quant.quantize_int4(w, 128, symmetric=False))):  # fmt: skip
        assert packed.nbytes == projection_bytes(4096, 14336, scheme), scheme
    shape = M.MODELS["llama8b"].shape
    bf16, int4 = step_bytes(shape, 1024), step_bytes(shape, 1024, "int4_g128_asym")
    shapes = ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336))  # Llama-3.1-8B's qkv, o, gate_up, down
    assert bf16 - int4 == 32 * sum(projection_bytes(n, k) - projection_bytes(n, k, "int4_g128_asym") for n, k in shapes)


def test_kv_modes_run_the_long_context_cases_and_their_roofline_counts_the_packed_cache(tmp_path) -> None:
    """kv-fp8 / kv-int4 are `--kv-cache-dtype` as a user types it, timed in every case of the 128K-window Llama
    (1K to 128K at batch 1, 64 x 8K, each within the window); a step reads the cache at the packed bytes a token
    (kv_bytes_per_token: int4 a quarter of bf16 plus its scales and zeros)."""
    from envex.kernels.kv_quant_format import kv_bytes_per_token
    from envex.verify.lab.kernel_bench.bench_server import step_bytes

    long = M.MODELS["llama8b-128k"]
    assert M.model_flags(long, "kv-int4", tmp_path)[-4:] == ["--max-model-len", "131072", "--kv-cache-dtype", "int4"]
    assert M.cell_cases(long, "kv-int4") == M.cell_cases(long, "default") == ("b1_1k", "b1_32k", "b1_128k", "c64_8k")
    assert all(M.CASES[c][1] + M.CASES[c][2] <= 131072 for c in long.cases)
    assert M.cell_cases(long, "int4") == ("b1_1k", "c64_1k") and M.cell_cases(long, "spec4") == ("b1_1k",)
    # --cases keeps the cell's own cases it names, in the cell's order
    assert M.cell_cases(long, "kv-int4", ("b1_128k", "b1_1k", "b1_10k")) == ("b1_1k", "b1_128k")
    assert M.cell_cases(long, "spec4", ("b1_32k",)) == ()
    assert M.formats("kv-int4") == ("bf16", "int4") and M.formats("fp8") == ("fp8_block", "bf16")
    per_token = kv_bytes_per_token("int4", 8, 128)
    assert per_token == 2 * 8 * (64 + 2 * 2 * 2)  # K and V, 8 heads: 64 bytes of codes, 2 bf16 scales and zeros
    saved = step_bytes(long.shape, 131072) - step_bytes(long.shape, 131072, kv_cache_dtype="int4")
    assert saved == 32 * 131072 * (kv_bytes_per_token("bf16", 8, 128) - per_token)


@pytest.mark.slow
def test_a_weights_cell_serves_packed_at_batch_1_and_64(tmp_path, cases, monkeypatch) -> None:
    monkeypatch.setitem(M.CASES, "c64_1k", (4, 64, 8, 1))
    int4 = cell(tmp_path, "int4")
    assert int4["status"] == "ok", int4
    assert int4["resolved"]["weights"] == "int4_g128_asym"
    assert list(int4["cases"]) == ["b1_1k", "c64_1k"]
    assert int4["cases"]["c64_1k"]["metric"] == "output_tok_s" and int4["cases"]["c64_1k"]["median"] > 0


def test_the_qwen3_next_cell_is_a_hybrid_model_the_runtime_reads_and_its_roofline_counts_its_bytes(tmp_path) -> None:
    """The Qwen3-Next cell's dummy folder is a config the runtime reads as the published model's layers at half
    depth (6 full-attention, 18 Gated DeltaNet layers); its batch-1 roofline bytes are the model's own parameters
    a decode step reads (every one but the experts it does not route to and all but one embedding row), plus the
    linear layers' float32 states and the full layers' K/V."""
    import torch

    from envex.runtime.config import ModelConfig
    from envex.runtime.models.qwen3_next import Qwen3NextForCausalLM
    from envex.verify.lab.kernel_bench.bench_server import step_bytes

    flags = M.model_flags(M.MODELS["qwen3-next"], "mtp", tmp_path)
    assert flags[2:] == ["--load-format", "dummy", "--max-model-len", "131072", "--draft-model", "mtp"]
    shape = json.loads((tmp_path / "qwen3-next" / "config.json").read_text())
    config = ModelConfig.from_hf(shape)
    assert config.hybrid is not None and len(config.hybrid.linear_layers) == 18 and config.mtp_layers == 1
    model = Qwen3NextForCausalLM(config, dtype=torch.bfloat16, device=torch.device("meta"))
    moe = config.moe
    assert moe is not None
    unrouted = config.num_hidden_layers * (moe.num_experts - moe.top_k) * 3 * config.hidden_size * moe.intermediate_size
    read = sum(p.numel() for p in model.parameters()) - unrouted - (config.vocab_size - 1) * config.hidden_size
    hy = config.hybrid
    state = len(hy.linear_layers) * hy.num_v_heads * hy.head_k_dim * hy.head_v_dim * 4
    kv = 6 * 2 * config.num_key_value_heads * config.head_dim * 2 * 1024
    assert step_bytes(M.MODELS["qwen3-next"].shape, 1024) == pytest.approx(2 * read + state + kv, rel=2e-4)


def test_the_qwen3_next_fp8_cell_builds_fp8_experts_and_its_roofline_counts_their_bytes(tmp_path) -> None:
    """The Qwen3-Next FP8 cell's dummy folder is the published model at all 48 layers with the FP8 release's
    quantization_config, which --load-format dummy builds with FP8 routed experts (the MTP layer's too) and FP8
    projections (HybridConfig.fp8_layers); its batch-1 roofline bytes are that model's own parameters as held (FP8
    codes and float32 scales, per block or, q/k/v, per row; the router, gates, norms and LM head bf16) a decode
    step reads, plus the states and the 12 full layers' K/V."""
    import torch

    from envex.runtime.config import ModelConfig
    from envex.runtime.models.qwen3_next import Qwen3NextForCausalLM
    from envex.verify.lab.kernel_bench.bench_server import qwen3_next_step_bytes, step_bytes

    cell = M.MODELS["qwen3-next-fp8"]
    assert cell.cases == ("b1_1k", "b1_128k", "c64_8k") and cell.max_model_len == 131072
    M.model_flags(cell, "default", tmp_path)
    config = ModelConfig.from_hf(json.loads((tmp_path / "qwen3-next-fp8" / "config.json").read_text()))
    moe, hy = config.moe, config.hybrid
    assert moe is not None and hy is not None and config.num_hidden_layers == 48
    assert moe.fp8_block == (128, 128) and moe.fp8_layers == tuple(range(49))  # the MTP layer's index 48 too
    assert hy.fp8_layers == tuple(range(49))
    model = Qwen3NextForCausalLM(config, dtype=torch.bfloat16, device=torch.device("meta"))
    held = {name: p.numel() * p.element_size() for name, p in model.named_parameters()}
    experts = sum(b for name, b in held.items() if name.rpartition(".")[2] in ("gate_up_proj", "gate_up_proj_scale",
                                                                              "down_proj", "down_proj_scale"))
    assert model.layers[0].gate_up_proj.dtype == torch.float8_e4m3fn and 77e9 < experts < 78e9
    unrouted = experts * (moe.num_experts - moe.top_k) // moe.num_experts
    read = sum(held.values()) - unrouted - (config.vocab_size - 1) * config.hidden_size * 2
    state = len(hy.linear_layers) * hy.num_v_heads * hy.head_k_dim * hy.head_v_dim * 4
    kv = 12 * 2 * config.num_key_value_heads * config.head_dim * 2 * 1024
    assert step_bytes(cell.shape, 1024) == pytest.approx(read + state + kv, rel=2e-4)
    # exactly: against the same shape in bf16, the routed experts read (codes and scales, 368,640 bytes of scales
    # a step: below the tolerance above) and the other FP8 projections as held (q/k/v's scales per row: 7 MB) in
    # place of their bf16 matrices
    routed_bf16 = config.num_hidden_layers * moe.top_k * 3 * config.hidden_size * moe.intermediate_size * 2
    own = {f"{n}{s}" for n in ("in_proj", "out_proj", "qkvg_proj", "o_proj", "shared_proj", "shared_down")
           for s in ("", "_scale")}  # the other projections' FP8 codes and scales (models/qwen3_next.py)
    packed = sum(b for name, b in held.items() if name.rpartition(".")[2] in own)
    codes = sum(p.numel() for name, p in model.named_parameters()
                if name.rpartition(".")[2] in own and p.dtype == torch.float8_e4m3fn)  # fmt: skip
    assert model.layers[3].qkvg_proj_weight.block == (1, 128) and model.layers[0].in_proj_weight.block == (128, 128)
    saved = qwen3_next_step_bytes(cell.shape, 1024) - step_bytes(cell.shape, 1024)
    assert saved == routed_bf16 - experts * moe.top_k // moe.num_experts + 2 * codes - packed


def _meta_model(shape: dict):
    """The runtime's config of a shape (ModelConfig.from_hf) and its model on the meta device, bf16 as served."""
    from envex.runtime.config import ModelConfig
    from envex.runtime.models import model_class

    config = ModelConfig.from_hf(shape)
    return config, model_class(config)(config, dtype=torch.bfloat16, device=torch.device("meta"))


def _same_parameters_as_hf(shape: dict, model) -> bool:
    """HF transformers' own model of the config (on the meta device) holds as many weights as the runtime's: its
    parameters and DeepSeek's e_score_correction_bias buffers against ours, FP8 block scales left out."""
    import transformers

    arch = shape["architectures"][0]
    hf_config = {"Qwen3MoeForCausalLM": transformers.Qwen3MoeConfig,
                 "DeepseekV3ForCausalLM": transformers.DeepseekV3Config}[arch]  # fmt: skip
    cfg = hf_config(**{k: v for k, v in shape.items() if k not in ("architectures", "model_type", "torch_dtype",
                                                                    "quantization_config")})  # fmt: skip
    with torch.device("meta"):
        hf = getattr(transformers, arch)(cfg)
    theirs = sum(p.numel() for p in hf.parameters()) + sum(
        b.numel() for name, b in hf.named_buffers() if name.endswith("e_score_correction_bias"))
    ours = sum(p.numel() for name, p in model.named_parameters() if not name.endswith("_proj_scale"))
    return theirs == ours


def _held(model) -> dict[str, int]:
    return {name: p.numel() * p.element_size() for name, p in model.named_parameters()}


def _expert_stacks(held: dict[str, int]) -> int:
    """Bytes of every layer's expert stacks as held (codes and FP8 block scales; DeepSeek's shared experts too)."""
    return sum(b for name, b in held.items() if name.rpartition(".")[2] in ("gate_up_proj", "gate_up_proj_scale",
                                                                             "down_proj", "down_proj_scale"))


def test_the_qwen3_30b_a3b_cell_is_the_published_config_and_its_roofline_counts_its_bytes(tmp_path) -> None:
    """The Qwen3-30B-A3B cell's dummy folder is the published config, which the runtime reads (128 experts, top-8,
    normalized, every layer sparse); its batch-1 roofline bytes are that model's own parameters a decode step reads
    (all but the 120 experts a layer it does not route to and all but one embedding row), plus 48 layers' K/V."""
    from envex.verify.lab.kernel_bench.bench_server import step_bytes

    cell = M.MODELS["qwen3-30b-a3b"]
    assert cell.cases == ("b1_1k", "b1_10k", "c64_1k") and "(dummy bf16)" in cell.label
    assert M.model_flags(cell, "default", tmp_path)[2:] == ["--load-format", "dummy", "--max-model-len", "12288"]
    assert all(M.CASES[c][1] + M.CASES[c][2] <= cell.max_model_len for c in cell.cases)
    shape = json.loads((tmp_path / "qwen3-30b-a3b" / "config.json").read_text())
    config, model = _meta_model(shape)
    assert _same_parameters_as_hf(shape, model)
    moe = config.moe
    assert config.architecture == "Qwen3MoeForCausalLM" and config.qk_norm and config.num_hidden_layers == 48
    assert moe is not None and (moe.num_experts, moe.top_k, moe.intermediate_size) == (128, 8, 768)
    assert moe.norm_topk_prob and moe.dense_layers == () and not moe.fp8_layers
    held = _held(model)
    assert 30.4e9 < sum(held.values()) / 2 < 30.6e9  # 30.5B parameters
    unrouted = _expert_stacks(held) * (moe.num_experts - moe.top_k) // moe.num_experts
    read = sum(held.values()) - unrouted - (config.vocab_size - 1) * config.hidden_size * 2
    kv = 48 * 2 * config.num_key_value_heads * config.head_dim * 2 * 1152
    assert step_bytes(cell.shape, 1152) == read + kv
    assert 4.15e12 / step_bytes(cell.shape, 1152) / 2 == pytest.approx(335, abs=1)  # issue 44: "about 340"


def test_the_moonlight_cell_is_an_mla_model_in_its_8k_window_and_its_roofline_counts_the_latent_cache(
        tmp_path) -> None:  # fmt: skip
    """Moonlight-16B-A3B's published config (DeepSeek-V3 architecture: MLA without a q LoRA, one dense layer, 64
    routed experts top-6 plus 2 shared, sigmoid routing with its bias) is read by the runtime; its window is 8K, so
    the cell serves 8192 tokens and its cases fit in it (no 10K or 32K case). Its roofline bytes are the model's
    parameters a step reads (the 58 experts a layer it does not route to left out; the float32 router and bias
    counted at 4 bytes) plus the latent cache, whose bytes a token are the runtime's own."""
    from envex.runtime.engine.config import model_window
    from envex.verify.lab.kernel_bench.bench_server import step_bytes

    cell = M.MODELS["moonlight"]
    assert cell.cases == ("b1_1k", "b1_7k", "c64_1k") and "(dummy bf16)" in cell.label
    M.model_flags(cell, "default", tmp_path)
    shape = json.loads((tmp_path / "moonlight" / "config.json").read_text())
    config, model = _meta_model(shape)
    assert _same_parameters_as_hf(shape, model)
    moe, mla = config.moe, config.mla
    assert model_window(config) == cell.max_model_len == 8192
    assert all(M.CASES[c][1] + M.CASES[c][2] <= 8192 for c in cell.cases) and M.CASES["b1_10k"][1] > 8192
    assert mla is not None and mla.q_lora_rank is None and (mla.kv_lora_rank, mla.qk_rope_head_dim) == (512, 64)
    assert moe is not None and (moe.num_experts, moe.top_k, moe.shared_experts, moe.dense_layers) == (64, 6, 2, (0,))
    assert moe.scoring == "sigmoid" and moe.routed_scaling_factor == 2.446 and config.mtp_layers == 0
    assert model.layers[1].router_weight.dtype == torch.float32
    held = _held(model)
    assert 15.8e9 < sum(held.values()) / 2 < 16.1e9  # "16B"
    stack = moe.num_experts + moe.shared_experts
    unrouted = _expert_stacks(held) * (moe.num_experts - moe.top_k) // stack
    read = sum(held.values()) - unrouted - (config.vocab_size - 1) * config.hidden_size * 2
    per_token = model.kv_cache_bytes_per_block(16, torch.bfloat16) // 16
    assert per_token == 27 * (512 + 64) * 2  # the latent row, no V: 31 KB a token over 27 layers
    assert step_bytes(cell.shape, 1152) == read + per_token * 1152
    assert step_bytes(cell.shape, 7808) / step_bytes(cell.shape, 1152) < 1.04  # the cache stays small at 7K
    with pytest.raises(ValueError, match="kv_cache_dtype 'int4' has no roofline for DeepseekV3ForCausalLM"):
        step_bytes(cell.shape, 1152, kv_cache_dtype="int4")  # the latent cache is the model dtype's


def test_the_kimi_k2_width_cell_builds_fp8_experts_at_the_depth_that_loads_on_one_h200(tmp_path) -> None:
    """Kimi K2's width (hidden 7168, 384 experts top-8 plus a shared one, MLA with a q LoRA, yarn) with its FP8
    quantization_config: the runtime reads it and --load-format dummy builds FP8 routed and shared experts, every
    other projection bf16. Its roofline bytes are those parameters as held (codes and float32 block scales) a step
    reads, plus the latent cache. The depth is the largest that serves on one H200 (139 GiB): the weights, a 4 GiB
    reserve (CUDA context, allocator) and c32_2k's cache within the engine's default gpu_memory_utilization (0.85);
    loading adds dummy_weights' fill of one expert matrix at a time (float32 normals, then their FP8 copy: 5 bytes
    an element; it drew whole 385-expert stacks, 53 GiB, before, which held the cell to 5 layers)."""
    from envex.kernels import quant
    from envex.verify.lab.kernel_bench.bench_server import KIMI_K2_WIDTH_LAYERS, SHAPES, step_bytes

    cell = M.MODELS["kimi-k2-width"]
    depth = KIMI_K2_WIDTH_LAYERS
    assert cell.cases == ("b1_1k", "c32_2k") and f"(dummy FP8 experts, {depth} of 61 layers)" in cell.label
    M.model_flags(cell, "default", tmp_path)
    shape = json.loads((tmp_path / "kimi-k2-width" / "config.json").read_text())
    config, model = _meta_model(shape)
    assert _same_parameters_as_hf(shape, model)
    moe, mla = config.moe, config.mla
    assert mla is not None and (mla.q_lora_rank, mla.kv_lora_rank) == (1536, 512) and config.rope_yarn is not None
    assert moe is not None and (moe.num_experts, moe.top_k, moe.shared_experts, moe.intermediate_size) == (384, 8, 1,
                                                                                                           2048)
    assert moe.fp8_block == (128, 128) and moe.fp8_layers == tuple(range(1, depth)) and moe.dense_layers == (0,)
    assert model.layers[1].gate_up_proj.dtype == quant.FP8_DTYPE and model.layers[1].kv_b_proj.dtype == torch.bfloat16
    held = _held(model)
    stack = moe.num_experts + moe.shared_experts
    unrouted = _expert_stacks(held) * (moe.num_experts - moe.top_k) // stack
    read = sum(held.values()) - unrouted - (config.vocab_size - 1) * config.hidden_size * 2
    per_token = model.kv_cache_bytes_per_block(16, torch.bfloat16) // 16
    assert per_token == depth * (512 + 64) * 2
    assert step_bytes(cell.shape, 2176) == read + per_token * 2176

    gib, h200 = 2**30, 139 * 2**30
    fill = 5 * max(p[0].numel() for p in model.parameters() if p.dtype == quant.FP8_DTYPE)  # an expert at a time

    def weights(layers: int) -> int:
        return sum(_held(_meta_model({**SHAPES["kimi-k2-width"], "num_hidden_layers": layers})[1]).values())

    assert weights(depth) == sum(held.values()) and fill < gib / 4
    cache = depth * per_token * 32 * (2048 + 256)  # c32_2k's sequences, all resident
    assert weights(depth) + fill + 4 * gib <= h200 and weights(depth) + cache + 4 * gib <= 0.85 * h200
    assert weights(depth + 1) + 4 * gib > 0.85 * h200  # one more layer leaves no room for the cache
