"""Low-bit weights served packed (issue 42): a tiny random Llama written as each published quantized layout
(compressed-tensors FP8 per channel, DeepSeek/Qwen3-style block FP8, AutoAWQ and AutoGPTQ INT4, compressed-tensors
pack-quantized INT4), loaded by the engine with each projection a PackedWeight, gives the logits and greedy tokens
of the same model written in float32 with the weights dequantized; the Triton ops (interpreter) equal the torch
ops on the same packed model; a weights policy quantizes a float model at load; what cannot run is one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import save_file
from tokenizers import Tokenizer, models

from envex.kernels import quant, quant_gemv
from envex.kernels.accuracy import rel_err
from envex.kernels.backends import backend
from envex.kernels.torch_ops import TorchOps
from envex.kernels.triton_ops import TritonOps
from envex.runtime.config import ConfigError
from envex.runtime.engine import EngineConfig, LLMEngine, SamplingParams
from envex.runtime.loader import load_model_info
from envex.runtime.models.llama import LlamaForCausalLM, rope_cos_sin
from envex.runtime.packed_load import load_model_weights
from envex.tests.support.kernels import eager_step
from envex.tests.support.quant_packing import awq_pack, ct_pack, gptq_pack_weight, gptq_pack_zeros

VOCAB, GROUP = 128, 32
TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False, rms_norm_eps=1e-5)
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 9, 17, 33, 2], [100, 3, 3, 41, 77, 8, 12, 90, 1, 64, 27]]


ARCHS = {  # qwen3: q/k norms (held by the attention layer: the meta build must keep them); qwen2: q/k/v biases
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, {"head_dim": 16}),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {}),
}


def _hf_state(arch: str = "llama") -> tuple[dict, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    config_cls, model_cls, extra = ARCHS[arch]
    config = config_cls(**TINY, **extra)
    model = model_cls(config).eval()
    with torch.no_grad():  # decisive logits: greedy argmax is not a coin flip between near-ties
        for p in model.parameters():
            p.mul_(4.0) if p.dim() > 1 else None
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    return {**config.to_dict(), "architectures": [model_cls.__name__]}, state


def _write(path: Path, config: dict, tensors: dict[str, torch.Tensor]) -> Path:
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(path / "model.safetensors"))
    chars = {chr(c): c - 31 for c in range(32, 127)}  # a character-level tokenizer: BPE without merges
    Tokenizer(models.BPE({"<unk>": 0, **chars}, [], unk_token="<unk>")).save(str(path / "tokenizer.json"))
    return path


def _fp8_ct(w: torch.Tensor) -> tuple[quant.PackedWeight, dict[str, torch.Tensor]]:
    pw = quant.quantize_fp8(w, quant.FP8_CHANNEL)
    return pw, {"weight": pw.data, "weight_scale": pw.scale[:, None].clone()}


def _fp8_block(w: torch.Tensor) -> tuple[quant.PackedWeight, dict[str, torch.Tensor]]:
    pw = quant.quantize_fp8(w, quant.FP8_BLOCK, block=(32, 32))
    return pw, {"weight": pw.data, "weight_scale_inv": pw.scale}


def _awq(w: torch.Tensor) -> tuple[quant.PackedWeight, dict[str, torch.Tensor]]:
    pw = quant.quantize_int4(w, GROUP, symmetric=False, scale_dtype=torch.float16)
    assert pw.zero is not None
    u = quant.unpack_int4(pw.data, w.shape[1])  # [N, K]
    return pw, {"qweight": awq_pack(u.t()), "qzeros": awq_pack(pw.zero.t()), "scales": pw.scale.t().contiguous()}


def _gptq(w: torch.Tensor) -> tuple[quant.PackedWeight, dict[str, torch.Tensor]]:
    pw = quant.quantize_int4(w, GROUP, symmetric=True, scale_dtype=torch.float16)
    n, k = w.shape
    u = quant.unpack_int4(pw.data, k)
    zeros = torch.full((k // GROUP, n), quant.SYMMETRIC_ZERO)
    return pw, {"qweight": gptq_pack_weight(u.t()), "qzeros": gptq_pack_zeros(zeros, v1=True),
                "scales": pw.scale.t().contiguous(), "g_idx": (torch.arange(k) // GROUP).to(torch.int32)}


def _ct_pack(w: torch.Tensor) -> tuple[quant.PackedWeight, dict[str, torch.Tensor]]:
    pw = quant.quantize_int4(w, GROUP, symmetric=True, scale_dtype=torch.bfloat16)
    q = quant.unpack_int4(pw.data, w.shape[1]).to(torch.int64) - quant.SYMMETRIC_ZERO
    return pw, {"weight_packed": ct_pack(q), "weight_scale": pw.scale,
                "weight_shape": torch.tensor(list(w.shape), dtype=torch.int64)}


_CT_FP8 = {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
           "ignore": ["lm_head"], "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None,
           "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False}}}}
_CT_INT4 = {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "ignore": ["lm_head"], "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                "num_bits": 4, "type": "int", "strategy": "group", "group_size": GROUP, "symmetric": True}}}}
LAYOUTS = {  # name -> (writer, quantization_config, the scheme it is served as)
    "ct-fp8-channel": (_fp8_ct, _CT_FP8, quant.FP8_CHANNEL),
    "fp8-block": (_fp8_block, {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                               "weight_block_size": [32, 32]}, quant.FP8_BLOCK),
    "awq": (_awq, {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True, "version": "gemm"},
            quant.INT4_GROUP),
    "gptq": (_gptq, {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "sym": True, "desc_act": False,
                     "checkpoint_format": "gptq"}, quant.INT4_GROUP),
    "ct-pack-int4": (_ct_pack, _CT_INT4, quant.INT4_GROUP),
}


def _checkpoints(tmp: Path, layout: str, arch: str = "llama") -> tuple[Path, Path]:
    """(the quantized checkpoint, the same model in float32 with each projection dequantized)."""
    writer, qconfig, _ = LAYOUTS[layout]
    config, state = _hf_state(arch)
    packed, dequantized = {}, dict(state)
    for name, w in state.items():
        module = name.removesuffix(".weight")
        if module.rpartition(".")[2] in LINEARS and name.endswith(".weight"):
            pw, stored = writer(w)
            packed.update({f"{module}.{k}": v for k, v in stored.items()})
            dequantized[name] = quant.dequantize(pw, torch.float32)
        else:
            packed[name] = w
    return (_write(tmp / layout, {**config, "quantization_config": qconfig}, packed),
            _write(tmp / f"{layout}-float", config, dequantized))


def _engine(path: Path, **kw: object) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(path), device="cpu", kv_cache_memory_gb=0.02, max_model_len=64, **kw))


@pytest.mark.parametrize("layout, arch", [*((name, "llama") for name in sorted(LAYOUTS)), ("fp8-block", "qwen3"),
                                          ("awq", "qwen2")])  # fmt: skip
def test_quantized_checkpoint_serves_packed_as_its_dequantized_self(tmp_path: Path, layout: str, arch: str) -> None:
    """Torch backend, float32: packed (dequantized per call to the activation dtype) against the float model of
    the same dequantized values: the same products, so logits agree to float32 rounding (BLAS order: < 1e-5)
    and greedy tokens are equal."""
    qpath, fpath = _checkpoints(tmp_path, layout, arch)
    packed, ref = _engine(qpath), _engine(fpath)
    assert packed.model_config.architecture == ARCHS[arch][1].__name__
    want_scheme = LAYOUTS[layout][2]
    assert len(packed.runner.packed) == 2 * 4 and set(packed.runner.packed.values()) == {want_scheme}
    assert isinstance(packed.runner.model.layers[0].qkv_proj_weight, quant.PackedWeight)
    assert not isinstance(packed.runner.model.lm_head_weight, quant.PackedWeight)  # the configs leave it float
    # built on the meta device: no float copy of a packed projection was ever allocated, every other one was
    params = dict(packed.runner.model.named_parameters())
    assert "layers.0.qkv_proj_weight" not in params and not any(p.is_meta for p in params.values())
    ids = PROMPTS[1]
    got, want = packed.full_logits(ids), ref.full_logits(ids)
    assert rel_err(got, want) < 1e-5, f"{layout}: {rel_err(got, want):.2e}"
    assert ([o.token_ids for o in packed.generate(PROMPTS, GREEDY)]
            == [o.token_ids for o in ref.generate(PROMPTS, GREEDY)])  # fmt: skip


def _logits(model: LlamaForCausalLM, ops: object) -> list[torch.Tensor]:
    """A 13-row prefill of two sequences (past the GEMV's 8 rows: the norm kernel, then dequantize + matmul), a
    2-row and a 1-row decode step (the packed GEMV with the add + RMSNorm in its prologue, or after the SwiGLU
    launch)."""
    c = model.config
    cos, sin = rope_cos_sin(c, 64, torch.device("cpu"))
    caches = [(torch.zeros(8, 8, c.num_key_value_heads, c.head_dim), torch.zeros(8, 8, c.num_key_value_heads,
               c.head_dim)) for _ in range(c.num_hidden_layers)]  # fmt: skip
    steps = (([[4, 11, 29, 3, 8, 50, 61, 7, 9, 10], [1, 2, 3]], [0, 0], [[0, 1], [2, 3]]),
             ([[12], [6]], [10, 3], [[0, 1], [2, 3]]), ([[30]], [11], [[0, 1]]))  # fmt: skip
    out = []
    for ids, starts, tables in steps:
        tokens, meta, _ = eager_step(ids, starts, tables, cos, sin, 8, torch.device("cpu"))
        with torch.inference_mode():
            hidden, residual = model(ops, tokens, caches, meta)
            out.append(model.compute_logits(ops, ops.materialize(hidden, residual.dtype), residual))
    return out


def test_triton_ops_on_packed_weights_equal_torch_ops(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """TritonOps (interpreter) against TorchOps on one packed model with every kernel variant: layer 0 block
    FP8 (the policy's 128 x 128 blocks), layer 1 INT4 with zero points in groups of 32, the LM head FP8 per channel
    (the final norm in its GEMV's prologue); float32 sums in another order: < 1e-4."""
    info = load_model_info(str(_write(tmp_path / "float", *_hf_state())))
    model = LlamaForCausalLM(info.config, dtype=torch.float32, device=torch.device("cpu"))
    policy = {"default": f"int4_g{GROUP}_asym", "lm_head": "fp8_channel", "overrides": {"layers.0": "fp8_block"}}
    packed = load_model_weights(model, info, load_format="auto", seed=0, weights=json.dumps(policy),
                                backend=backend("triton"), device=torch.device("cpu"))  # fmt: skip
    assert set(packed.values()) == {quant.FP8_BLOCK, quant.INT4_GROUP, quant.FP8_CHANNEL}
    rows: list[int] = []  # the packed GEMV's calls, by rows and prologue
    gemv = quant_gemv.quant_gemv
    monkeypatch.setattr(quant_gemv, "quant_gemv", lambda a, w, **kw: (rows.append((a.shape[0], kw.get("prologue", 0))),
                                                                       gemv(a, w, **kw))[1])  # fmt: skip
    for i, (want, got) in enumerate(zip(_logits(model, TorchOps()), _logits(model, TritonOps()), strict=True)):
        assert rel_err(got, want) < 1e-4, f"step {i}: {rel_err(got, want):.2e}"
    # decode steps only, with every prologue: none (O, and down after the SwiGLU launch), add + RMS (QKV, gate-up,
    # the LM head), RMS (the first layer's QKV)
    assert sorted(set(rows)) == [(r, p) for r in (1, 2) for p in range(3)], sorted(set(rows))


def test_weights_policy_quantizes_a_float_model_at_load(tmp_path: Path) -> None:
    """EngineConfig.weights (launch.json engine.weights, envex serve --weights): the float checkpoint's
    projections quantized at load, per layer where the policy says, equal the checkpoint quantized the same way
    offline; the LM head stays float unless named."""
    config, state = _hf_state()
    for name in list(state):
        module = name.removesuffix(".weight")
        if module.rpartition(".")[2] in LINEARS and name.endswith(".weight"):
            scheme = quant.quantize_fp8(state[name], quant.FP8_CHANNEL) if ".layers.0." in name else \
                quant.quantize_int4(state[name], GROUP, symmetric=True)
            state[name] = quant.dequantize(scheme, torch.float32)
    want_path = _write(tmp_path / "offline", config, state)
    policy = json.dumps({"default": f"int4_g{GROUP}_sym", "overrides": {"layers.0": "fp8_channel"}})
    engine = _engine(_write(tmp_path / "float", *_hf_state()), weights=policy)
    assert json.loads(engine.config.weights or "") == {"default": f"int4_g{GROUP}_sym", "lm_head": "bf16",
                                                       "overrides": {"layers.0": "fp8_channel"}}  # canonical text
    assert set(engine.runner.packed.values()) == {quant.FP8_CHANNEL, quant.INT4_GROUP}
    ref = _engine(want_path)
    ids = PROMPTS[1]
    assert rel_err(engine.full_logits(ids), ref.full_logits(ids)) < 1e-5
    assert ([o.token_ids for o in engine.generate(PROMPTS, GREEDY)]
            == [o.token_ids for o in ref.generate(PROMPTS, GREEDY)])  # fmt: skip


def test_unsupported_or_impossible_is_one_line(tmp_path: Path) -> None:
    config, state = _hf_state()
    bnb = _write(tmp_path / "bnb", {**config, "quantization_config": {"quant_method": "bitsandbytes"}}, state)
    with pytest.raises(ConfigError, match=r"quant_method 'bitsandbytes' is not supported; supported: fp8, "):
        _engine(bnb)
    qpath, _ = _checkpoints(tmp_path, "ct-fp8-channel")
    with pytest.raises(ValueError, match="already quantized .*drop|without --weights"):
        _engine(qpath, weights="int4_g32_sym")
    with pytest.raises(ValueError, match="weights policy default: 'int3' is not a scheme"):
        EngineConfig(weights="int3")
    with pytest.raises(ValueError, match="batch-invariant torch backend cannot read packed"):
        EngineConfig(device="cpu", weights="fp8_channel", deterministic=True).resolved(
            window=128, cuda_available=False, architecture="LlamaForCausalLM")
    with pytest.raises(ValueError, match="Llama family only so far, not GptOssForCausalLM"):
        EngineConfig(device="cpu", weights="fp8_channel").resolved(window=128, cuda_available=False,
                                                                  architecture="GptOssForCausalLM")
    with pytest.raises(ConfigError, match="cannot read packed low-bit weights"):
        info = load_model_info(str(qpath))
        model = LlamaForCausalLM(info.config, dtype=torch.float32, device=torch.device("cpu"))
        load_model_weights(model, info, load_format="auto", seed=0, weights=None,
                           backend=backend("torch", deterministic=True), device=torch.device("cpu"))


def test_weights_policy_on_the_embedded_model(embedded_engine: LLMEngine) -> None:
    """The embedded SmolLM2-135M (a GGUF, dequantized at load) with a per-layer `weights` policy: the projections
    of the two layers it names packed, the rest and the (tied) LM head float; its logits stay close to its float
    self's (one-layer policies are inside their bands on this model, offline_docs/quantization.md)."""
    policy = '{"default": "bf16", "overrides": {"layers.3": "fp8_channel", "layers.20": "int4_g64_sym"}}'
    engine = LLMEngine(EngineConfig(device="cpu", weights=policy, max_model_len=64, kv_cache_memory_gb=0.02))
    assert sorted(engine.runner.packed.values()) == [quant.FP8_CHANNEL] * 4 + [quant.INT4_GROUP] * 4
    assert isinstance(engine.runner.model.layers[20].down_proj_weight, quant.PackedWeight)
    ids = engine.encode_prompt("The capital of France is Paris. The capital of Italy is Rome. The capital of")
    got, want = engine.full_logits(ids), embedded_engine.full_logits(ids)
    kld = torch.nn.functional.kl_div(got.log_softmax(-1), want.log_softmax(-1), log_target=True,
                                     reduction="none").sum(-1)  # fmt: skip
    top1 = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
    # measured: mean KLD 0.015, top-1 15 of 17 positions (two near-ties flip)
    assert kld.mean().item() < 0.03 and top1 >= 0.8, (kld.mean().item(), top1)


# ---- choosing a policy: launch.json, the CLI, the install's gate ------------------------------------------------


def test_launch_json_and_cli_carry_the_policy(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from envex.installer.commands import main
    from envex.installer.launch import load_launch
    from envex.tests.test_runtime_kv_cache_dtype import _launch_file

    path = _launch_file(tmp_path, "bf16")
    data = json.loads(path.read_text())
    policy = {"default": "int4_g128_sym", "overrides": {"down_proj": "bf16"}}
    path.write_text(json.dumps({**data, "engine": {**data["engine"], "weights": json.dumps(policy)}}))
    assert json.loads(load_launch(path).weights or "") == {**policy, "lm_head": "bf16"}
    path.write_text(json.dumps({**data, "engine": {**data["engine"], "weights": "int3"}}))
    for argv in (["serve", "--launch", str(path)], ["serve", "--weights", "int3", "--port", "1"]):
        assert main(argv) != 0
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: weights policy default: 'int3' is not a scheme; use bf16") and "\n" not in err
    assert main(["serve", "--launch", str(_launch_file(tmp_path, "bf16")), "--weights", "fp8_channel"]) != 0
    assert "--weights: a release serves the weights policy its gates passed with" in capsys.readouterr().err


def test_install_gate_holds_the_policy_to_its_band(tmp_path: Path) -> None:
    """installer.gate_runner's verify.weight_quality_band on the release's model: bf16 (the sanity policy) passes
    with KLD 0; whole-model INT4 on this tiny random model is refused with the figures."""
    from envex.installer.gate_runner import weights_gate

    path = _write(tmp_path / "float", *_hf_state())
    ok = weights_gate(EngineConfig(model=str(path), weights="bf16"))
    assert ok["verdict"] == "pass" and ok["result"]["mean_kld"] == 0.0, ok
    bad = weights_gate(EngineConfig(model=str(path), weights=f"int4_g{GROUP}_sym"))
    assert bad["verdict"] == "fail", bad
    assert bad["reason"].startswith('weights policy {"default":"int4_g32_sym","lm_head":"bf16"} refused: outside the '
                                    "int4 band: mean KLD "), bad["reason"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("layout", ["ct-fp8-channel", "fp8-block", "awq"])
def test_packed_checkpoint_serves_on_cuda_with_graphs(tmp_path: Path, layout: str) -> None:
    """On the GPU, bf16: the Triton backend (the packed GEMV at decode, replayed from CUDA graphs) against the torch
    backend (dequantize + matmul) on the same packed checkpoint: logits within bf16 rounding, greedy tokens equal."""
    qpath, _ = _checkpoints(tmp_path, layout)
    kw = dict(device="cuda", dtype="bfloat16", max_model_len=64, num_kv_blocks=64)  # a tiny model's pool
    fast = LLMEngine(EngineConfig(model=str(qpath), backend="triton", **kw))  # type: ignore[arg-type]
    ref = LLMEngine(EngineConfig(model=str(qpath), backend="torch", **kw))  # type: ignore[arg-type]
    assert fast.runner.decode_graphs is not None and set(fast.runner.packed.values()) == {LAYOUTS[layout][2]}
    ids = PROMPTS[1]
    assert rel_err(fast.full_logits(ids), ref.full_logits(ids)) < 2e-2
    assert ([o.token_ids for o in fast.generate(PROMPTS, GREEDY)]
            == [o.token_ids for o in ref.generate(PROMPTS, GREEDY)])  # fmt: skip


@pytest.mark.parametrize("layout", ["fp8-block", "ct-fp8-channel", "awq", "ct-pack-int4"])
def test_model_card_counts_a_quantized_checkpoint_as_the_engine_holds_it(tmp_path: Path, layout: str) -> None:
    """The install plan's weight bytes (ModelCard.weights_bytes: packed tensors as stored, the rest in the serving
    dtype) are what the loaded engine holds, within the scales' and zero points' widening (a few %). For FP8 that is
    well under the count a plan used before (every stored element in the serving dtype); for INT4, whose words
    hold 8 weights an element, that count was under what the engine holds."""
    from envex.installer.model_card import card_for_model

    qpath, _ = _checkpoints(tmp_path, layout)
    card = card_for_model(qpath, "tiny")
    model = _engine(qpath, dtype="float32").runner.model
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    for module in model.modules():
        for pw in [v for v in vars(module).values() if isinstance(v, quant.PackedWeight)]:
            held += sum(t.numel() * t.element_size() for t in (pw.data, pw.scale, pw.zero) if t is not None)
    assert card.packed_parameters > 0 and card.packed_bytes > 0
    assert card.weights_bytes(4) == pytest.approx(held, rel=0.05), (card.weights_bytes(4), held)
    if "fp8" in layout:
        assert card.weights_bytes(4) < 0.8 * card.parameters * 4


def test_model_card_of_a_float_checkpoint_counts_every_parameter_in_the_serving_dtype(tmp_path: Path) -> None:
    from envex.installer.model_card import card_for_model

    _, fpath = _checkpoints(tmp_path, "fp8-block")
    card = card_for_model(fpath, "tiny")
    assert (card.packed_parameters, card.packed_bytes) == (0, 0)
    assert card.weights_bytes(2) == card.parameters * 2
