"""DeepSeek-V3's MTP drafter on quantized releases (issue 44): a tiny random V3 written as an FP8 release (as
DeepSeek-V3/R1 ship: quant_method "fp8", block scales `weight_scale_inv`) whose MTP layer `model.layers.{N}.*` is
FP8 too (its decoder block's projections, experts and attention; eh_proj, enorm, hnorm, shared_head and the
embedding copy float, as the release stores them), and as an INT4 release (Kimi K2's compressed-tensors layout:
routed experts INT4). The MTP module keeps its experts as stored and its logits are HF transformers' MtpLayer over
the dequantized weights; greedy output with its drafts is the plain output; the config lists the MTP layer's index
among the quantized experts' layers only where the checkpoint quantizes it (one it leaves out drafts on its experts
dequantized); the model's own load drops the MTP layer's quantized tensors before gathering or dequantizing them."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from envex.runtime import packed_load
from envex.runtime.config import ModelConfig
from envex.runtime.engine import SamplingParams
from envex.runtime.models.deepseek import DeepseekMTP
from envex.tests.test_runtime_deepseek import PROMPTS, _hf_model
from envex.tests.test_runtime_moe_fp8 import _release as _fp8_release
from envex.tests.test_runtime_moe_int4 import KIMI_IGNORE, _ct_config
from envex.tests.test_runtime_moe_int4 import _release as _int4_release
from envex.tests.test_runtime_mtp import H, N, _engine, assert_transformers_mtp_layer, layers_adding_nothing

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
BLOCK = [16, 32]  # FP8 blocks: several to a matrix at these widths (the releases' 128 x 128 would be one)
PREFIX = f"model.layers.{N}."


def _with_block(hf_model, noise: float):
    """hf_model with one more layer, N: a copy of its MoE layer 1, perturbed by `noise` (relative): the MTP layer's
    decoder block, so a release of this model writes it quantized in the published naming."""
    config = copy.deepcopy(hf_model.config)
    config.num_hidden_layers = N + 1
    model = type(hf_model)(config).eval()
    model.load_state_dict(hf_model.state_dict(), strict=False)
    block = model.model.layers[N]
    block.load_state_dict(hf_model.model.layers[1].state_dict())
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in block.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * p.std() * noise)
    return model


def _mtp_release(hf_model, tmp: Path, kind: str, own: dict[str, torch.Tensor], noise: float = 1.0):
    """The release (kind "fp8" or "int4") of hf_model with an MTP layer: its block as _with_block makes it, quantized
    as the release quantizes a layer, and `own` (enorm, hnorm, eh_proj, shared_head.norm) with copies of the
    embedding and head, float. -> (its directory, HF's model with the block as layer N, dequantized)."""
    big = _with_block(hf_model, noise)
    path, hf = _fp8_release(big, tmp, BLOCK) if kind == "fp8" else _int4_release(big, tmp, "ct", 32)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": N, "num_nextn_predict_layers": 1}))
    own = {**own, "embed_tokens.weight": hf_model.model.embed_tokens.weight.detach(),
           "shared_head.head.weight": hf_model.lm_head.weight.detach()}  # fmt: skip
    save_file({PREFIX + k: v.contiguous() for k, v in own.items()}, str(path / "mtp.safetensors"))
    return path, hf


def _random_own(seed: int = 1) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    own = {k: torch.rand(H, generator=gen) + 0.5 for k in ("enorm.weight", "hnorm.weight", "shared_head.norm.weight")}
    return own | {"eh_proj.weight": torch.randn(H, 2 * H, generator=gen) * (2 * H) ** -0.5 * 4}


@pytest.fixture(scope="module")
def releases(tmp_path_factory):
    """kind -> (kind, own tensors, the release's directory, HF's dequantized model with the MTP block as layer N),
    each written once."""
    made: dict[str, tuple] = {}

    def release(kind: str) -> tuple:
        if kind not in made:
            own = _random_own()
            made[kind] = (kind, own, *_mtp_release(_hf_model("v3"), tmp_path_factory.mktemp(kind), kind, own))
        return made[kind]

    return release


@pytest.fixture(params=["fp8", "int4"])
def random_release(request, releases):
    return releases(request.param)


def test_quantized_mtp_logits_equal_transformers_mtp_layer(random_release) -> None:
    """The MTP module of a quantized release holds its experts as stored (FP8 codes and block scales, or INT4
    words) and its other projections dequantized; its logits and chained hidden state are HF's MtpLayer over the
    dequantized weights (the torch ops dequantize the chosen experts exactly)."""
    kind, own, path, hf = random_release
    engine = _engine(path, draft_model="mtp", num_speculative_tokens=1)
    module = engine.spec.drafter.module
    assert isinstance(module, DeepseekMTP)
    moe, experts = engine.model_config.moe, module.layer.experts
    assert (N in moe.fp8_layers, N in moe.int4_layers) == (kind == "fp8", kind == "int4")
    assert experts.fp8 if kind == "fp8" else experts.int4 and not moe.int4_shared  # Kimi K2: float shared expert
    assert module.layer.kv_b_proj.dtype == module.eh_proj.dtype == torch.float32
    assert_transformers_mtp_layer(module, hf, hf.model.layers[N], own, N)  # the block, dequantized


@pytest.fixture(scope="module")
def predicting_fp8(tmp_path_factory):
    """An FP8 release whose layers add nothing (o_proj and every down projection zero, FP8 zeros) and whose FP8
    MTP layer is its next-token predictor (tests/test_runtime_mtp.py's construction: eh_proj [I, 0], unit enorm,
    shared_head.norm the final norm's weight, which is not uniform)."""
    hf_model = layers_adding_nothing()
    own = {"enorm.weight": torch.ones(H), "hnorm.weight": torch.ones(H),
           "eh_proj.weight": torch.cat([torch.eye(H), torch.zeros(H, H)], dim=1),
           "shared_head.norm.weight": hf_model.model.norm.weight.detach().clone()}  # fmt: skip
    return _mtp_release(hf_model, tmp_path_factory.mktemp("predicting"), "fp8", own, noise=0.0)[0]


@pytest.mark.parametrize("k", [1, 3])
def test_greedy_output_with_fp8_mtp_drafts_is_the_plain_output(predicting_fp8, k: int) -> None:
    """Three prompts in a batch, to the context's end: the FP8 MTP layer's drafts are all accepted (k + 1 tokens a
    step but where the length capped it) and the tokens are the plain engine's."""
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (16, 16, 40 - len(PROMPTS[2]))]
    want = [c.token_ids for c in _engine(predicting_fp8, max_model_len=40).generate(PROMPTS, params)]
    spec = _engine(predicting_fp8, max_model_len=40, draft_model="mtp", num_speculative_tokens=k)
    assert spec.spec.drafter.module.layer.experts.fp8
    assert [c.token_ids for c in spec.generate(PROMPTS, params)] == want
    stats = spec.stats()
    assert stats.spec_draft_tokens_total >= 3 * 8 * k // (k + 1)
    assert stats.accepted_draft_tokens_total == stats.spec_draft_tokens_total and stats.spec_tokens_per_step > k


def test_random_quantized_mtp_drafts_leave_the_output_unchanged(random_release) -> None:
    """An MTP layer that mostly misses: k = 3 drafts verified away, the tokens the plain engine's."""
    _, _, path, _ = random_release
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    want = [c.token_ids for c in _engine(path).generate(PROMPTS, params)]
    spec = _engine(path, draft_model="mtp", num_speculative_tokens=3)
    assert [c.token_ids for c in spec.generate(PROMPTS, params)] == want
    assert spec.stats().spec_draft_tokens_total > 0


def test_the_mtp_layer_is_among_the_quantized_expert_layers_where_the_checkpoint_quantizes_it(random_release) -> None:
    """Read from config.json alone (as the model's layers): N is listed where the config quantizes its experts,
    not with num_nextn_predict_layers 0 or its experts left float (modules_to_not_convert); a float checkpoint's
    config is as without an MTP layer; a config that would quantize the MTP layer's shared expert beside float
    ones in the model's layers (an ignore list of exact names written without it) leaves it float, not refused."""
    kind, _, path, _ = random_release
    cfg = json.loads((path / "config.json").read_text())
    field = "fp8_layers" if kind == "fp8" else "int4_layers"

    def layers(**changes) -> tuple[int, ...]:
        return getattr(ModelConfig.from_hf({**cfg, **changes}).moe, field)

    assert layers() == (1, N) and layers(num_nextn_predict_layers=0) == (1,)
    qc = cfg["quantization_config"]
    if kind == "fp8":
        skip = [*qc["modules_to_not_convert"], f"{PREFIX}mlp."]
        assert layers(quantization_config={**qc, "modules_to_not_convert": skip}) == (1,)
    else:
        assert layers(quantization_config=_named_shared_ignored()) == (1,)
    bf16 = {k: v for k, v in cfg.items() if k != "quantization_config"}
    moe = ModelConfig.from_hf(bf16).moe
    assert moe.fp8_layers == moe.int4_layers == () and moe == ModelConfig.from_hf({**bf16, "num_nextn_predict_layers":
                                                                                   0}).moe  # fmt: skip


def test_the_models_load_drops_the_mtp_layers_quantized_tensors_unread(random_release, monkeypatch) -> None:
    """Every quantized layer the stream reads (load_packed, then dequantized unless kept as stored) is recorded: a
    plain engine reads none of the MTP layer's; a drafting one reads the model's same layers, then the MTP layer's
    attention projections (its experts are taken as stored, or converted expert by expert for INT4)."""
    kind, _, path, _ = random_release
    read: list[str] = []
    real = packed_load.load_packed

    def spy(scheme, tensors, *, module: str):
        read.append(module)
        return real(scheme, tensors, module=module)

    monkeypatch.setattr(packed_load, "load_packed", spy)
    _engine(path)
    plain = list(read)
    assert plain and not any(m.startswith(PREFIX) for m in plain)
    read.clear()
    _engine(path, draft_model="mtp", num_speculative_tokens=1)
    assert read[: len(plain)] == plain
    mtp = set(read[len(plain) :])
    if kind == "fp8":
        attn = ("q_a_proj", "q_b_proj", "kv_b_proj", "o_proj")  # the release's *_proj.weight (not kv_a_..._mqa)
        assert mtp == {f"{PREFIX}self_attn.{p}" for p in attn}
    else:  # Kimi K2: attention float; the routed experts converted into the INT4 stacks
        assert mtp == {f"{PREFIX}mlp.experts.{e}.{p}_proj" for e in range(8) for p in ("gate", "up", "down")}


def _named_shared_ignored() -> dict:
    """Kimi K2's INT4 config with the shared experts ignored by their exact names in the model's layers only (as a
    quantizer that never saw the MTP layer would list them): the MTP layer's shared experts would be INT4 beside
    float ones."""
    shared = [f"model.layers.{i}.mlp.shared_experts.{p}_proj" for i in range(N) for p in ("gate", "up", "down")]
    return {**_ct_config(32), "ignore": [p for p in KIMI_IGNORE if "shared_experts" not in p] + shared}


def test_an_mtp_layer_left_out_of_the_int4_layers_drafts_on_its_experts_dequantized(releases, tmp_path) -> None:
    """The INT4 release under _named_shared_ignored's config: the model serves as without an MTP layer, and the
    MTP module, whose experts the config leaves out of int4_layers, takes the stored INT4 experts dequantized into
    its float stacks: still transformers' MtpLayer on the dequantized weights."""
    _, own, path, hf = releases("int4")
    for f in path.iterdir():
        if f.name != "config.json":
            (tmp_path / f.name).symlink_to(f)
    config = json.loads((path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "quantization_config": _named_shared_ignored()}))
    engine = _engine(tmp_path, draft_model="mtp", num_speculative_tokens=1)
    moe, module = engine.model_config.moe, engine.spec.drafter.module
    assert moe.int4_layers == (1,) and not moe.int4_shared
    assert not module.layer.experts.int4 and module.layer.gate_up_proj.dtype == torch.float32
    assert_transformers_mtp_layer(module, hf, hf.model.layers[N], own, N)  # the block, dequantized
