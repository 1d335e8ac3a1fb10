"""Qwen3-Next's multi-token-prediction module (models/qwen3_next.py Qwen3NextMTP, draft_model "mtp") on the tiny
checkpoint of tests/test_runtime_qwen3_next.py plus `mtp.*` tensors in the published naming: its logits and the
hidden state it chains on are HF transformers' MtpLayer over the same weights (a prompt's positions through its own
K/V cache, then one decode row reading that cache); its tensors load by their published names, and a checkpoint
without them, or missing one, is refused in one line; the model itself loads such a checkpoint as before; the
config's MTP layer count and the module's share of the KV budget. Through the engine (verify steps on the
recurrent state, tests/test_runtime_qwen3_next_spec.py): greedy output with MTP drafts is the plain output, with
every draft of an MTP layer built to predict the model accepted and some of a noisy one."""

from __future__ import annotations

import copy
import dataclasses
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextDecoderLayer, Qwen3NextRMSNorm

from envex.kernels.accuracy import rel_err
from envex.kernels.ops import AttentionMetadata
from envex.kernels.torch_ops import TorchOps
from envex.runtime.config import ConfigError, ModelConfig
from envex.runtime.engine import EngineConfig, LLMEngine
from envex.runtime.engine.spec import draft_kv_bytes
from envex.runtime.loader import load_model_info
from envex.runtime.models.qwen3_next import Qwen3NextForCausalLM, Qwen3NextMTP
from envex.tests.test_runtime_mtp import _blocks, _prefill, transformers_mtp
from envex.tests.test_runtime_qwen3_next import GREEDY, PROMPTS, PUBLISHED, TINY, _hf_greedy, save_tiny_checkpoint

H = TINY["hidden_size"]
FULL = 1  # a full-attention MoE layer of TINY: the MTP layer's kind (HF MtpLayer's layer_idx)
NORMS = ("pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight", "norm.weight")
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def mtp_checkpoint(tmp_path_factory):
    """(HF model, the HF decoder layer of the MTP module, its `mtp.*` tensors, a checkpoint with them, one
    without). The layer is a perturbed copy of layer FULL, saved by transformers (the published per-expert
    layout) and renamed mtp.layers.0.*; fc random; the three norms away from their default (x·(1 + w))."""
    tmp = tmp_path_factory.mktemp("qwen3_next_mtp")
    hf_model = save_tiny_checkpoint(tmp / "without")
    block_model = copy.deepcopy(hf_model)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in block_model.model.layers[FULL].parameters():
            p.add_(torch.randn(p.shape, generator=gen) * p.std())
    block_model.save_pretrained(tmp / "block", safe_serialization=True)
    layer = f"model.layers.{FULL}."
    mtp = {f"mtp.layers.0.{k.removeprefix(layer)}": v for k, v in load_file(str(tmp / "block" / "model.safetensors"))
           .items() if k.startswith(layer)}  # fmt: skip
    mtp |= {f"mtp.{n}": torch.randn(H, generator=gen) * 0.3 + 0.3 for n in NORMS}
    mtp["mtp.fc.weight"] = torch.randn(H, 2 * H, generator=gen) * (2 * H) ** -0.5 * 4
    shutil.copytree(tmp / "without", tmp / "with")
    save_file({k: v.contiguous() for k, v in mtp.items()}, str(tmp / "with" / "mtp.safetensors"))
    return hf_model, block_model.model.layers[FULL], mtp, tmp / "with", tmp / "without"


def _model_and_module(path) -> tuple[Qwen3NextForCausalLM, Qwen3NextMTP]:
    """The model and its MTP module loaded from the checkpoint at path, as LLMEngine and MtpDrafter load them."""
    loaded = load_model_info(str(path))
    model = Qwen3NextForCausalLM(loaded.config, dtype=torch.float32, device=CPU)
    with torch.no_grad():
        model.load_weights(loaded.iter_weights())
        module = model.multi_token_predictor()
        module.load_weights(loaded.iter_weights(module.weight_prefix), loaded.source.name)
    return model, module


def test_mtp_logits_and_state_equal_transformers_mtp_layer(mtp_checkpoint) -> None:
    """Qwen3NextMTP over a prompt's positions = HF's MtpLayer (fc over [pre_fc_norm_embedding(embed(t_{i+1}));
    pre_fc_norm_hidden(h_i)], the full-attention MoE layer, mtp.norm) then the model's head, at HF's positions i+1
    (ours sit at i: rotary attention sees the same offsets; meta carries the engine's full-width rotary tables,
    which the module must swap for the model's partial ones); the state it chains on is MtpLayer's output. Then
    the last row again as a decode step reading the first rows' K/V from the module's cache."""
    hf_model, hf_block, mtp, path, _ = mtp_checkpoint
    model, module = _model_and_module(path)
    assert module.embed_tokens_weight.data_ptr() == model.embed_tokens_weight.data_ptr()  # the model's, not copied
    assert module.head_weight.data_ptr() == model.lm_head_weight.data_ptr()
    prompt = PROMPTS[2]
    t = len(prompt)
    tokens = torch.tensor(prompt)  # t_{i+1}, i = 0..t-1
    hidden = torch.randn(t, H, generator=torch.Generator().manual_seed(2)) * 3  # h_i
    weights = [mtp[f"mtp.{n}.weight"] for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "fc", "norm")]
    out, want = transformers_mtp(hf_model, (Qwen3NextDecoderLayer, Qwen3NextRMSNorm, FULL), hf_block, *weights,
                                 tokens, hidden)  # fmt: skip
    ops = TorchOps()
    cache, fresh = (module.make_kv_cache(_blocks(t), 4, torch.float32, CPU) for _ in range(2))
    meta = _prefill(module.config, t)
    step = AttentionMetadata(
        positions=torch.tensor([t - 1]), slot_mapping=torch.tensor([t - 1]),
        cu_seqlens_q=torch.tensor([0, 1], dtype=torch.int32), block_tables=meta.block_tables, cos=meta.cos,
        sin=meta.sin, max_q_len=1, max_seq_len=t, seq_lens=torch.tensor([t], dtype=torch.int32),
    )  # fmt: skip
    with torch.inference_mode():
        got, chained = module.compute_logits(ops, *module(ops, tokens, hidden, cache, meta))
        module(ops, tokens[:-1], hidden[:-1], fresh, _prefill(module.config, t - 1))
        last, last_chained = module.compute_logits(ops, *module(ops, tokens[-1:], hidden[-1:], fresh, step))
    assert rel_err(got, want) < 1e-5
    assert rel_err(chained, out) < 1e-5
    assert rel_err(last, want[-1:]) < 1e-5 and rel_err(last_chained, out[-1:]) < 1e-5
    assert torch.allclose(fresh[0], cache[0], atol=1e-5) and torch.allclose(fresh[1], cache[1], atol=1e-5)


def test_weights_load_by_their_published_names_or_are_refused_in_one_line(mtp_checkpoint) -> None:
    """Every `mtp.*` tensor is read into the module and writes every parameter; a checkpoint missing one, or
    storing none, or one more, is refused in one line."""
    _, _, mtp, path, without = mtp_checkpoint
    model, module = _model_and_module(path)
    assert {f"mtp.layers.0.{n}" for n in ("mlp.experts.7.up_proj.weight", "mlp.shared_expert_gate.weight",
                                          "self_attn.q_norm.weight", "mlp.shared_expert.down_proj.weight")} <= set(mtp)
    fresh = model.multi_token_predictor()
    with torch.no_grad():
        for p in fresh.parameters():
            p.fill_(float("nan"))
        fresh.load_weights(mtp.items(), "tiny")
    for (name, p), (_, want) in zip(fresh.named_parameters(), module.named_parameters(), strict=True):
        assert torch.equal(p, want), name  # every parameter written (no NaN left), as from the checkpoint's files
    gone = "mtp.layers.0.mlp.experts.3.down_proj.weight"
    with pytest.raises(ValueError, match=r"^weights: 1 tensors of the multi-token-prediction module missing, e\.g\. "
                                         rf"\['{gone}'\]; the checkpoint is incomplete$"):  # fmt: skip
        fresh.load_weights(((k, v) for k, v in mtp.items() if k != gone), "tiny")
    with pytest.raises(ValueError, match=r"^weights: unexpected tensor 'mtp.layers.0.mlp.gate_proj.weight' in the "):
        fresh.load_weights([*mtp.items(), ("mtp.layers.0.mlp.gate_proj.weight", torch.zeros(96, H))], "tiny")
    loaded = load_model_info(str(without))
    with pytest.raises(ValueError) as err:
        model.multi_token_predictor().load_weights(loaded.iter_weights(Qwen3NextMTP.weight_prefix), "tiny-qwen3-next")
    assert str(err.value) == ("draft_model: 'mtp' needs the multi-token-prediction module's weights (mtp.*), which "
                              "tiny-qwen3-next does not store; serve it without --draft-model mtp")


def test_the_model_loads_a_checkpoint_with_mtp_tensors_as_before(mtp_checkpoint) -> None:
    """The model's loader skips `mtp.*`: the same parameters as from the checkpoint without them, and the engine
    serving it gives HF's greedy tokens."""
    hf_model, _, _, path, without = mtp_checkpoint
    with_mtp, _ = _model_and_module(path)
    plain = Qwen3NextForCausalLM(with_mtp.config, dtype=torch.float32, device=CPU)
    plain.load_weights(load_model_info(str(without)).iter_weights())
    for (name, p), (_, want) in zip(with_mtp.named_parameters(), plain.named_parameters(), strict=True):
        assert torch.equal(p, want), name
    engine = LLMEngine(EngineConfig(model=str(path), device="cpu", block_size=4, kv_cache_memory_gb=0.02))
    assert engine.generate([PROMPTS[0]], GREEDY)[0].token_ids == _hf_greedy(hf_model, PROMPTS[0])


def test_mtp_layers_from_the_config_and_what_the_engine_refuses(mtp_checkpoint, tmp_path) -> None:
    """The published config has no num_nextn_predict_layers: one MTP layer (vLLM's default; the tensors decide).
    With 0 the engine refuses draft_model "mtp" in one line."""
    assert ModelConfig.from_hf(PUBLISHED).mtp_layers == 1
    assert ModelConfig.from_hf({**PUBLISHED, "num_nextn_predict_layers": 0}).mtp_layers == 0
    assert ModelConfig.from_hf({**PUBLISHED, "num_nextn_predict_layers": 2}).mtp_layers == 2
    with pytest.raises(ConfigError, match="num_nextn_predict_layers must be an integer ≥ 0, got -1"):
        ModelConfig.from_hf({**PUBLISHED, "num_nextn_predict_layers": -1})
    _, _, _, path, _ = mtp_checkpoint
    shutil.copytree(path, tmp_path / "none")
    config = json.loads((path / "config.json").read_text())
    (tmp_path / "none" / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 0}))
    with pytest.raises(ValueError, match=r"^draft_model: 'mtp' needs a multi-token-prediction module, as "
                                         r"DeepSeek-V3/R1 and Qwen3-Next ship .* \(Qwen3NextForCausalLM\) has none"):
        LLMEngine(EngineConfig(model=str(tmp_path / "none"), device="cpu", draft_model="mtp"))


def test_the_mtp_cache_takes_one_layer_of_k_v(mtp_checkpoint) -> None:
    """draft_kv_bytes for "mtp" on Qwen3-Next: one layer's K and V in the model dtype (not the model's layers),
    the module's own count; and the published model's module."""
    _, _, _, path, _ = mtp_checkpoint
    config = EngineConfig(model=str(path), dtype="float32", block_size=4, draft_model="mtp")
    one_layer = 2 * 4 * TINY["num_key_value_heads"] * TINY["head_dim"] * 4
    assert draft_kv_bytes(config, load_model_info(str(path))) == one_layer
    model, module = _model_and_module(path)
    assert module.kv_cache_bytes_per_block(4, torch.float32) == one_layer
    assert [tuple(c.shape) for c in module.make_kv_cache(3, 4, torch.float32, CPU)] == [(3, 4, 2, 32)] * 2
    published = Qwen3NextForCausalLM(ModelConfig.from_hf(PUBLISHED), dtype=torch.bfloat16, device=torch.device("meta"))
    big = published.multi_token_predictor()
    assert big.kv_cache_bytes_per_block(16, torch.bfloat16) == 2 * 16 * 2 * 256 * 2
    assert tuple(big.fc.shape) == (2, 2048, 2048) and tuple(big.layer.gate_up_proj.shape) == (512, 1024, 2048)


def _predicting_checkpoint(path, noise: float):
    """A model whose layers add nothing (every o_proj, out_proj and down projection zero: the logits at i depend on
    t_i alone) and an MTP layer that is then its next-token predictor: fc = [I + noise·R, 0], a decoder layer that
    adds nothing, unit pre-fc norms and mtp.norm = the model's final norm, so MTP(t_{i+1}) = the model's logits at
    i+1 (noise 0), or a perturbed embedding of t_{i+1} that now and then predicts another token (noise > 0)."""
    hf_model = save_tiny_checkpoint(path)
    with torch.no_grad():
        for name, p in hf_model.named_parameters():
            if any(part in name for part in ("o_proj", "out_proj", "down_proj")):
                p.zero_()
    hf_model.save_pretrained(path, safe_serialization=True)
    layer = f"model.layers.{FULL}."
    saved = load_file(str(path / "model.safetensors"))
    mtp = {f"mtp.layers.0.{k.removeprefix(layer)}": v for k, v in saved.items() if k.startswith(layer)}
    gen = torch.Generator().manual_seed(7)
    fc = torch.eye(H) + noise * torch.randn(H, H, generator=gen) * H**-0.5
    mtp |= {"mtp.fc.weight": torch.cat([fc, torch.zeros(H, H)], dim=1), "mtp.norm.weight": saved["model.norm.weight"],
            "mtp.pre_fc_norm_embedding.weight": torch.zeros(H), "mtp.pre_fc_norm_hidden.weight": torch.zeros(H)}
    save_file({k: v.contiguous() for k, v in mtp.items()}, str(path / "mtp.safetensors"))
    return path


@pytest.mark.parametrize(("k", "overlap"), [(1, False), (3, True)])
def test_greedy_output_with_mtp_drafts_on_qwen3_next_is_the_plain_output(tmp_path, k: int, overlap: bool) -> None:
    params = dataclasses.replace(GREEDY, max_tokens=16)
    for noise, all_accepted in ((0.0, True), (1.5, False)):
        path = _predicting_checkpoint(tmp_path / f"noise-{noise}", noise)
        want = [c.token_ids for c in _engine(path).generate(PROMPTS, params)]  # the mtp.* tensors skipped
        spec = _engine(path, draft_model="mtp", num_speculative_tokens=k, async_scheduling=overlap)
        assert [c.token_ids for c in spec.generate(PROMPTS, params)] == want, noise
        stats = spec.stats()
        assert stats.speculative_drafter == "mtp" and stats.spec_draft_tokens_total > 0
        accepted, drafted = stats.accepted_draft_tokens_total, stats.spec_draft_tokens_total
        assert accepted == drafted if all_accepted else 0 < accepted < drafted, (noise, accepted, drafted)


def _engine(path, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(path), device="cpu", block_size=4, kv_cache_memory_gb=0.02, **kw))
