"""Multi-head latent attention on the paged latent cache (kernels/mla.py) and DeepSeek's routing: the float64
references (kernels/reference.py) against HF transformers' own DeepSeek-V2/V3 modules on tiny random float32
configs, and the Triton kernels (under the interpreter here) against the references."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from envex.kernels import mla
from envex.kernels import reference as ref
from envex.kernels.accuracy import TOLERANCE, rel_err
from envex.tests.support.kernels import assert_close

DEV = "cuda" if torch.cuda.is_available() else "cpu"
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "mscale": 0.707,
        "mscale_all_dim": 1.0, "rope_theta": 10000.0, "beta_fast": 32, "beta_slow": 1}  # fmt: skip
HF_SEQ, HF_PAGE = 9, 4  # two sequences of 9 tokens in 4-token blocks
# Float32 Triton against float64: the interpreter's dots are float32 ones; a GPU's are TF32 (kernels/accuracy.py).
F32_BAR = 1e-5 if DEV == "cpu" else TOLERANCE[torch.float32]


def _tables(batch: int, blocks_each: int, pool: int, seed: int) -> torch.Tensor:
    """[batch, blocks_each] distinct blocks drawn from a shuffled pool: no sequence's blocks are in order."""
    perm = torch.randperm(pool, generator=torch.Generator().manual_seed(seed))
    return perm[: batch * blocks_each].reshape(batch, blocks_each).to(torch.int32)


def _slots(tables: torch.Tensor, positions: list[list[int]], page: int) -> torch.Tensor:
    return torch.tensor([int(tables[b, p // page]) * page + p % page for b, ps in enumerate(positions) for p in ps])


def _randomize(module: torch.nn.Module, seed: int) -> None:
    """Every parameter random (HF leaves expert stacks uninitialised and norms at one), scaled to keep logits O(1)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            scale = 1.0 if "norm" in name else p.shape[-1] ** -0.5
            p.copy_(torch.randn(p.shape, generator=g) * scale + (1.0 if "norm" in name else 0.0))


def _hf_attention(version: int, q_lora_rank: int | None, rope_parameters: dict | None, interleave: bool):
    """(HF attention module, its rotary module, config): 4 heads, rank 32, rope 8, nope 16, v 12, float32;
    interleave: V3's rope_interleave (V2 always interleaves)."""
    kw = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=q_lora_rank,
              kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
              max_position_embeddings=64)  # fmt: skip
    if rope_parameters is not None:
        kw["rope_parameters"] = rope_parameters
    if version == 3:
        from transformers.models.deepseek_v3 import modeling_deepseek_v3 as m
        from transformers.models.deepseek_v3.configuration_deepseek_v3 import DeepseekV3Config

        cfg = DeepseekV3Config(**kw, rope_interleave=interleave)
        attn, rotary = m.DeepseekV3Attention(cfg, 0), m.DeepseekV3RotaryEmbedding(cfg)
    else:
        from transformers.models.deepseek_v2 import modeling_deepseek_v2 as m
        from transformers.models.deepseek_v2.configuration_deepseek_v2 import DeepseekV2Config

        cfg = DeepseekV2Config(**kw)
        attn, rotary = m.DeepseekV2Attention(cfg, 0), m.DeepseekV2RotaryEmbedding(cfg)
    cfg._attn_implementation = "eager"
    _randomize(attn, seed=1 + version)
    return attn.eval(), rotary, cfg


def _rope_tables(version: int, rotary, x: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Our cos/sin tables [n, rope/2] float32 from HF's rotary module (YaRN's attention_factor included)."""
    pos = torch.arange(n)[None]
    if version == 3:
        cos, sin = rotary(x, pos)  # [1, n, rope] = cat(freqs, freqs)
        half = cos.shape[-1] // 2
        return cos[0, :, :half].float().contiguous(), sin[0, :, :half].float().contiguous()
    freqs_cis = rotary(x, pos)[0]  # [n, rope/2] complex
    return freqs_cis.real.float().contiguous(), freqs_cis.imag.float().contiguous()


def _hf_forward(version: int, attn, rotary, x: torch.Tensor) -> torch.Tensor:
    s = x.shape[1]
    pos = torch.arange(s)[None]
    mask = torch.full((s, s), torch.finfo(x.dtype).min).triu(1)[None, None]  # additive causal
    emb = rotary(x, pos)
    with torch.no_grad():
        return attn(x, position_embeddings=emb, attention_mask=mask)[0]


def _projections(attn, x: torch.Tensor, cfg) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's own q and kv_a projections -> (q [T, H, nope + rope], kv_a [T, rank + rope]), tokens flattened."""
    flat = x.reshape(-1, x.shape[-1])
    if cfg.q_lora_rank is None:
        q = attn.q_proj(flat)
    else:
        q = attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(flat)))
    return q.view(flat.shape[0], cfg.num_attention_heads, -1), attn.kv_a_proj_with_mqa(flat)


@pytest.mark.parametrize(("version", "q_lora_rank", "rope", "interleave"),
                         [(3, 24, None, True), (3, None, None, True), (3, 24, YARN, True), (3, None, None, False),
                          (2, None, None, True), (2, 24, YARN, True)])  # fmt: skip
def test_absorbed_attention_on_the_latent_cache_equals_hf(version: int, q_lora_rank: int | None, rope: dict | None,
                                                          interleave: bool) -> None:  # fmt: skip
    """HF DeepseekV3Attention (with a q LoRA: V3/Kimi K2; without: Moonlight/V2-Lite) and DeepseekV2Attention, two
    sequences through their own weights and a causal mask, against: the latent rows written into shuffled paged
    blocks, the query absorbed through W_UK, absorbed attention over the cache, W_UV and o_proj (float64
    reference); the expanded prefill path; and the Triton store + decode kernels for each sequence's last token.
    YaRN (factor 4, mscale 0.707, mscale_all_dim 1) scales both the softmax and HF's cos/sin tables."""
    attn, rotary, cfg = _hf_attention(version, q_lora_rank, rope, interleave)
    x = torch.randn(2, HF_SEQ, cfg.hidden_size, generator=torch.Generator().manual_seed(7))
    want = _hf_forward(version, attn, rotary, x).reshape(2 * HF_SEQ, -1)  # [T, hidden]

    rank, nope, rope_dim = cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
    heads, interleaved = cfg.num_attention_heads, version == 2 or interleave
    cos, sin = _rope_tables(version, rotary, x, 32)
    scale = mla.mla_softmax_scale(nope + rope_dim, cfg.rope_parameters)
    assert scale == pytest.approx(attn.scaling, rel=1e-12)
    tables = _tables(2, 3, 8, seed=3)
    positions = [list(range(HF_SEQ))] * 2
    slots, pos = _slots(tables, positions, HF_PAGE), torch.tensor(positions[0] * 2)
    with torch.no_grad():
        q, kv_a = _projections(attn, x, cfg)
        w_uk, w_uv = mla.split_kv_b_proj(attn.kv_b_proj.weight, num_heads=heads, qk_nope_head_dim=nope,
                                         v_head_dim=cfg.v_head_dim)  # fmt: skip
        q64, kv64, uk64, uv64 = q.double(), kv_a.double(), w_uk.double(), w_uv.double()
        cache = torch.zeros(8, HF_PAGE, rank + rope_dim, dtype=torch.float64)
        ref.mla_store_latent(kv64, attn.kv_a_layernorm.weight.double(), attn.kv_a_layernorm.variance_epsilon, pos,
                             cos.double(), sin.double(), slots, cache, interleaved=interleaved)  # fmt: skip
        q_pe = ref.deepseek_rope(q64[..., nope:], pos, cos.double(), sin.double(), interleaved=interleaved)
        q_abs = mla.absorb_query(q64[..., :nope], uk64)
        cu = torch.tensor([0, HF_SEQ, 2 * HF_SEQ])
        seq_lens = torch.tensor([HF_SEQ, HF_SEQ])
        o_lat = ref.mla_paged_attention(q_abs, q_pe, cache, cu, seq_lens, tables, scale)
        got = F.linear(mla.expand_output(o_lat, uv64), attn.o_proj.weight.double())
        err = rel_err(got, want)
        assert err < 1e-5, f"absorbed reference vs HF: relative error {err:.3g}"

        expanded = mla.mla_prefill_attention(q64[..., :nope], q_pe, cache, tables, uk64, uv64, scale,
                                             q_lens=[HF_SEQ] * 2, seq_lens=[HF_SEQ] * 2)  # fmt: skip
        err = rel_err(F.linear(expanded.reshape(2 * HF_SEQ, -1), attn.o_proj.weight.double()), want)
        assert err < 1e-5, f"expanded prefill vs HF: relative error {err:.3g}"

        # Triton, float32: the first 8 tokens of each sequence written by the reference, the last by the kernel
        last = torch.tensor([HF_SEQ - 1, 2 * HF_SEQ - 1])
        cache32 = cache.float()
        cache32.view(-1, rank + rope_dim)[slots[last]] = 0.0
        cache32 = cache32.to(DEV)
        norm = attn.kv_a_layernorm
        kv_d, w_d, pos_d, cos_d, sin_d, slot_d, q_d, uk_d = (
            t.to(DEV) for t in (kv_a[last], norm.weight, pos[last], cos, sin, slots[last], q[last], w_uk))
        q_pe32 = mla.mla_store_latent(kv_d, w_d, norm.variance_epsilon, pos_d, cos_d, sin_d, slot_d, cache32,
                                      interleaved=interleaved, q=q_d, qk_nope_head_dim=nope)  # fmt: skip
        o32 = mla.mla_decode_attention(mla.absorb_query(q_d[..., :nope], uk_d), q_pe32, cache32, tables.to(DEV),
                                       seq_lens.to(DEV, torch.int32), scale, max_seq_len=HF_SEQ, num_splits=2,
                                       block_n=16)  # fmt: skip
        err = rel_err(attn.o_proj(mla.expand_output(o32.cpu(), w_uv)), want[last])
        assert err < F32_BAR, f"Triton store + decode vs HF: relative error {err:.3g}"


def _router_config(version: int, **kw):
    common = dict(hidden_size=32, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
                  routed_scaling_factor=2.5, moe_intermediate_size=8, intermediate_size=16,
                  n_shared_experts=1)  # fmt: skip
    common.update(kw)
    if version == 3:
        from transformers.models.deepseek_v3.configuration_deepseek_v3 import DeepseekV3Config

        return DeepseekV3Config(**common)
    from transformers.models.deepseek_v2.configuration_deepseek_v2 import DeepseekV2Config

    return DeepseekV2Config(**common)


def _same_choice(ids: torch.Tensor, weights: torch.Tensor, hf_ids: torch.Tensor, hf_weights: torch.Tensor) -> None:
    """The same experts per token with the same weights, in any order (HF's top-k is unsorted)."""
    ours, order = ids.sort(dim=-1)
    theirs, hf_order = hf_ids.sort(dim=-1)
    assert torch.equal(ours, theirs.to(ours.dtype)), "a token chose other experts than HF's router"
    err = rel_err(weights.gather(1, order), hf_weights.gather(1, hf_order))
    assert err < 1e-6, f"routing weights vs HF: relative error {err:.3g}"


@pytest.mark.parametrize(("norm", "n_group", "topk_group"), [(True, 4, 2), (False, 4, 2), (True, 1, 1)])
def test_v3_routing_equals_hf_router_and_moe(norm: bool, n_group: int, topk_group: int) -> None:
    """DeepseekV3TopkRouter's choice and weights (sigmoid, correction bias for the choice only, grouped top-k,
    normalised or not, routed scaling), and DeepseekV3MoE's output with those weights on its experts plus the
    shared one (Kimi K2 and Moonlight route with n_group 1)."""
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as m

    cfg = _router_config(3, norm_topk_prob=norm, n_group=n_group, topk_group=topk_group)
    moe = m.DeepseekV3MoE(cfg).eval()
    _randomize(moe, seed=11)
    g = torch.Generator().manual_seed(12)
    with torch.no_grad():
        moe.gate.e_score_correction_bias.copy_(torch.randn(16, generator=g) * 0.3)
        x = torch.randn(64, cfg.hidden_size, generator=g)
        _, hf_w, hf_ids = moe.gate(x)
        want = moe(x)
    logits = F.linear(x.double(), moe.gate.weight.double())
    weights, ids = ref.deepseek_v3_routing(logits, moe.gate.e_score_correction_bias.double(), top_k=4,
                                           n_group=n_group, topk_group=topk_group, norm_topk_prob=norm,
                                           routed_scaling_factor=2.5)  # fmt: skip
    _same_choice(ids, weights, hf_ids, hf_w)
    ex = moe.experts
    gu, dn = ex.gate_up_proj.double(), ex.down_proj.double()
    x64 = x.double()
    out = torch.zeros_like(x64)
    for k in range(4):
        gate, up = torch.einsum("th,tih->ti", x64, gu[ids[:, k]]).chunk(2, dim=-1)
        out += weights[:, k, None] * torch.einsum("ti,thi->th", F.silu(gate) * up, dn[ids[:, k]])
    se = moe.shared_experts
    shared = F.linear(F.silu(F.linear(x64, se.gate_proj.weight.double())) * F.linear(x64, se.up_proj.weight.double()),
                      se.down_proj.weight.double())  # fmt: skip
    err = rel_err(out + shared, want)
    assert err < 1e-5, f"DeepseekV3MoE with the reference routing: relative error {err:.3g}"


@pytest.mark.parametrize("method", ["greedy", "group_limited_greedy"])
def test_v2_routing_equals_hf_router(method: str) -> None:
    """DeepseekV2TopkRouter: softmax scores, plain or group-limited greedy top-k, times routed_scaling_factor."""
    from transformers.models.deepseek_v2 import modeling_deepseek_v2 as m

    router = m.DeepseekV2TopkRouter(_router_config(2, topk_method=method)).eval()
    _randomize(router, seed=21)
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(22))
    with torch.no_grad():
        _, hf_w, hf_ids = router(x)
    weights, ids = ref.deepseek_v2_routing(F.linear(x.double(), router.weight.double()), top_k=4, topk_method=method,
                                           n_group=4, topk_group=2, routed_scaling_factor=2.5)  # fmt: skip
    _same_choice(ids, weights, hf_ids, hf_w)
    if method == "group_limited_greedy":  # the group limit changes some choice on these inputs: it is exercised
        greedy, _ = ref.deepseek_v2_routing(F.linear(x.double(), router.weight.double()), top_k=4,
                                            topk_method="greedy", n_group=4, topk_group=2, routed_scaling_factor=2.5)
        assert not torch.equal(greedy, weights)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("interleaved", [True, False])
def test_store_latent_kernel_matches_reference(dtype: torch.dtype, interleaved: bool) -> None:
    """Norm, rotary and paged write of the latent rows, and the queries' rope part; a padding slot writes nothing
    and rows of other slots keep their contents. Rank 40 and 3 heads: masked tails."""
    rank, rope, heads, nope, page, tokens = 40, 16, 3, 8, 4, 7
    g = torch.Generator().manual_seed(31)
    kv_a = torch.randn(tokens, rank + rope, generator=g).to(dtype)
    w = (torch.rand(rank, generator=g) + 0.5).to(dtype)
    q = torch.randn(tokens, heads, nope + rope, generator=g).to(dtype)
    pos = torch.tensor([0, 5, 17, 3, 30, 9, 11])
    slots = torch.tensor([5, 22, -1, 0, 13, 7, 18])
    ang = torch.arange(32)[:, None] * (10000.0 ** (-torch.arange(rope // 2) / (rope // 2)))[None]
    cos, sin = ang.cos().float(), ang.sin().float()
    cache = torch.full((6, page, rank + rope), 7.0, dtype=dtype)
    want = cache.double().clone()
    ref.mla_store_latent(kv_a.double(), w.double(), 1e-6, pos, cos.double(), sin.double(), slots, want,
                         interleaved=interleaved)  # fmt: skip
    got_cache = cache.to(DEV)
    q_pe = mla.mla_store_latent(kv_a.to(DEV), w.to(DEV), 1e-6, pos.to(DEV), cos.to(DEV), sin.to(DEV), slots.to(DEV),
                                got_cache, interleaved=interleaved, q=q.to(DEV), qk_nope_head_dim=nope)  # fmt: skip
    assert_close("latent rows", got_cache, want, dtype)
    assert torch.equal(got_cache.cpu().view(-1, rank + rope)[[1, 2, 23]].float(), torch.full((3, rank + rope), 7.0))
    want_q = ref.deepseek_rope(q.double()[..., nope:], pos, cos.double(), sin.double(), interleaved=interleaved)
    assert_close("q_pe", q_pe, want_q, dtype)


def _decode_case(heads: int, rank: int, rope: int, seq_lens: list[int], page: int, dtype: torch.dtype, seed: int,
                 q_len: int = 1):  # fmt: skip
    """Random absorbed queries (q_len tokens a sequence) and a random latent cache behind shuffled block tables (one
    spare block per sequence, past its length) -> device tensors and their float64 reference output."""
    g = torch.Generator().manual_seed(seed)
    batch = len(seq_lens)
    width = max(-(-n // page) for n in seq_lens) + 1
    tables = _tables(batch, width, batch * width + 3, seed)
    cache = torch.randn(batch * width + 3, page, rank + rope, generator=g).to(dtype)
    q_abs = (torch.randn(batch * q_len, heads, rank, generator=g) * 0.3).to(dtype)
    q_pe = torch.randn(batch * q_len, heads, rope, generator=g).to(dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    scale = (128 + rope) ** -0.5
    cu = torch.arange(0, batch * q_len + 1, q_len)
    want = ref.mla_paged_attention(q_abs.double(), q_pe.double(), cache.double(), cu, lens, tables, scale)
    dev = [t.to(DEV) for t in (q_abs, q_pe, cache, tables, lens)]
    return dev, scale, want


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "num_splits"), [(5, 1), (5, 4), (20, 3)])
def test_decode_kernel_matches_reference(dtype: torch.dtype, heads: int, num_splits: int) -> None:
    """Varlen batch (1, 37 and 70 keys) over shuffled 8-token blocks, one split or several (some empty: the
    1-key sequence), heads in one partial block of 16 or two; rank 40 and rope 16 leave masked columns."""
    (q_abs, q_pe, cache, tables, lens), scale, want = _decode_case(heads, 40, 16, [1, 37, 70], 8, dtype, seed=41)
    got = mla.mla_decode_attention(q_abs, q_pe, cache, tables, lens, scale, max_seq_len=70, num_splits=num_splits,
                                   block_n=16)  # fmt: skip
    assert_close(f"MLA decode, {heads} heads, {num_splits} splits", got, want, dtype)


@pytest.mark.parametrize(("heads", "num_splits"), [(5, 1), (20, 3)])
def test_verify_step_rows_see_their_own_prefix(heads: int, num_splits: int) -> None:
    """A speculative verify step: 3 new tokens a sequence at consecutive positions, each row causal over the cache
    (rows of one token packed with the next token's in a 16-row tile at 5 heads; 4 tiles at 20)."""
    (q_abs, q_pe, cache, tables, lens), scale, want = _decode_case(heads, 40, 16, [3, 40], 8, torch.float32,
                                                                   seed=47, q_len=3)  # fmt: skip
    got = mla.mla_decode_attention(q_abs, q_pe, cache, tables, lens, scale, max_seq_len=40, q_len=3,
                                   num_splits=num_splits, block_n=16)  # fmt: skip
    assert_close(f"MLA verify, {heads} heads, {num_splits} splits", got, want, torch.float32)


def test_decode_kernel_splits_agree_and_take_strided_queries() -> None:
    """The absorbed query as absorb_query returns it (a strided view, [T, H, rank] of an [H, T, rank] GEMM output):
    the same answer with and without split-K, within float32 rounding."""
    (q_abs, q_pe, cache, tables, lens), scale, want = _decode_case(4, 32, 16, [50, 9], 16, torch.float32, seed=43)
    strided = q_abs.transpose(0, 1).contiguous().transpose(0, 1)
    assert not strided.is_contiguous()
    one = mla.mla_decode_attention(strided, q_pe, cache, tables, lens, scale, max_seq_len=50, num_splits=1)
    four = mla.mla_decode_attention(strided, q_pe, cache, tables, lens, scale, max_seq_len=50, num_splits=4,
                                    block_n=16)  # fmt: skip
    assert rel_err(one, four) < F32_BAR
    assert_close("MLA decode, strided q", four, want, torch.float32)


def test_decode_with_a_fixed_split_count_is_batch_invariant() -> None:
    """A sequence's output depends on its own length and num_splits only: the same bits alone and in a batch, as a
    CUDA graph's fixed num_splits needs (not yet the deterministic mode's contract: offline_docs/mla.md)."""
    (q_abs, q_pe, cache, tables, lens), scale, _ = _decode_case(4, 32, 16, [45, 20, 7], 8, torch.bfloat16, seed=45)
    batch = mla.mla_decode_attention(q_abs, q_pe, cache, tables, lens, scale, max_seq_len=45, num_splits=4,
                                     block_n=16)  # fmt: skip
    alone = mla.mla_decode_attention(q_abs[1:2], q_pe[1:2], cache, tables[1:2], lens[1:2], scale, max_seq_len=20,
                                     num_splits=4, block_n=16)  # fmt: skip
    assert torch.equal(batch[1:2], alone)


def test_prefill_path_matches_absorbed_reference_with_a_cached_prefix() -> None:
    """mla_prefill_attention (expanded) over a chunk after a cached prefix and a whole prompt, against the absorbed
    reference with the same W_UK / W_UV: the absorption is exact."""
    heads, rank, rope, nope, v, page = 3, 24, 8, 16, 12, 4
    g = torch.Generator().manual_seed(51)
    q_lens, seq_lens = [3, 6], [10, 6]
    tables = _tables(2, 3, 7, seed=52)
    cache = torch.randn(7, page, rank + rope, generator=g, dtype=torch.float64)
    q_nope = torch.randn(9, heads, nope, generator=g, dtype=torch.float64)
    q_pe = torch.randn(9, heads, rope, generator=g, dtype=torch.float64)
    w_uk = torch.randn(heads, nope, rank, generator=g, dtype=torch.float64) * rank**-0.5
    w_uv = torch.randn(heads, v, rank, generator=g, dtype=torch.float64) * rank**-0.5
    scale = (nope + rope) ** -0.5
    got = mla.mla_prefill_attention(q_nope, q_pe, cache, tables, w_uk, w_uv, scale, q_lens=q_lens, seq_lens=seq_lens)
    o_lat = ref.mla_paged_attention(mla.absorb_query(q_nope, w_uk), q_pe, cache, torch.tensor([0, 3, 9]),
                                    torch.tensor(seq_lens), tables, scale)  # fmt: skip
    assert rel_err(got.reshape(9, -1), mla.expand_output(o_lat, w_uv)) < 1e-12


def test_softmax_scale_and_bad_inputs() -> None:
    """DeepSeek-V3's published rope scaling (yarn, factor 40, mscale_all_dim 1) and the older rope_scaling key; the
    launchers name the input that is wrong."""
    v3 = {"type": "yarn", "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096}
    m = 0.1 * 1.0 * torch.log(torch.tensor(40.0, dtype=torch.float64)).item() + 1.0
    assert mla.mla_softmax_scale(192, v3) == pytest.approx(192**-0.5 * m * m, rel=1e-12)
    assert mla.mla_softmax_scale(192, None) == 192**-0.5
    assert mla.mla_softmax_scale(192, {"rope_type": "yarn", "factor": 40, "mscale_all_dim": 0}) == 192**-0.5
    (q_abs, q_pe, cache, tables, lens), scale, _ = _decode_case(4, 32, 16, [5], 8, torch.float32, seed=61)
    with pytest.raises(ValueError, match="latent_cache: row width"):
        mla.mla_decode_attention(q_abs, q_pe[..., :8], cache, tables, lens, scale, max_seq_len=5)
    with pytest.raises(ValueError, match="kv_a: width"):
        mla.mla_store_latent(torch.zeros(1, 33, device=DEV), torch.ones(32, device=DEV), 1e-6, lens.long(),
                             torch.zeros(8, 8, device=DEV), torch.zeros(8, 8, device=DEV), lens.long(), cache)
    with pytest.raises(ValueError, match="weight: 20 rows"):
        mla.split_kv_b_proj(torch.zeros(20, 8), num_heads=2, qk_nope_head_dim=6, v_head_dim=6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("heads", [16, 64, 128])
def test_decode_at_kimi_k2_width_on_gpu(heads: int) -> None:
    """Kimi K2 / DeepSeek-V3 widths (rank 512, rope 64; 128 heads unsharded, 64 and 16 for tensor parallelism),
    bf16, 64-token blocks, a varlen batch up to 32K keys, the chosen split count and one split, against float64."""
    seq_lens = [1, 1000, 4097, 32768]
    (q_abs, q_pe, cache, tables, lens), scale, want = _decode_case(heads, 512, 64, seq_lens, 64, torch.bfloat16, 71)
    for splits in (None, 1):
        got = mla.mla_decode_attention(q_abs, q_pe, cache, tables, lens, scale, max_seq_len=32768,
                                       num_splits=splits)  # fmt: skip
        assert_close(f"MLA decode {heads} heads, splits {splits}", got, want, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_store_latent_at_kimi_k2_width_on_gpu() -> None:
    """kv_a [T, 576] into a 64-token-block cache with 128 heads' queries, bf16, against float64."""
    rank, rope, heads, nope, page, tokens = 512, 64, 128, 128, 64, 300
    g = torch.Generator().manual_seed(81)
    kv_a = torch.randn(tokens, rank + rope, generator=g).bfloat16()
    w = (torch.rand(rank, generator=g) + 0.5).bfloat16()
    q = torch.randn(tokens, heads, nope + rope, generator=g).bfloat16()
    pos = torch.randint(0, 4096, (tokens,), generator=g)
    slots = torch.randperm(20 * page, generator=g)[:tokens]
    ang = torch.arange(4096)[:, None] * (10000.0 ** (-torch.arange(rope // 2) / (rope // 2)))[None]
    cos, sin = ang.cos().float(), ang.sin().float()
    want = torch.zeros(20, page, rank + rope, dtype=torch.float64)
    ref.mla_store_latent(kv_a.double(), w.double(), 1e-6, pos, cos.double(), sin.double(), slots, want,
                         interleaved=True)  # fmt: skip
    cache = torch.zeros(20, page, rank + rope, dtype=torch.bfloat16, device="cuda")
    q_pe = mla.mla_store_latent(kv_a.cuda(), w.cuda(), 1e-6, pos.cuda(), cos.cuda(), sin.cuda(), slots.cuda(), cache,
                                q=q.cuda(), qk_nope_head_dim=nope)  # fmt: skip
    assert_close("latent rows", cache, want, torch.bfloat16)
    want_q = ref.deepseek_rope(q.double()[..., nope:], pos, cos.double(), sin.double(), interleaved=True)
    assert_close("q_pe", q_pe, want_q, torch.bfloat16)


_AOT = r"""
import json, re, subprocess, tempfile
from pathlib import Path
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from envex.kernels import mla

ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas-blackwell"  # the one that reads
args = {name: "*bf16" for name in ("qn_ptr", "qp_ptr", "cache_ptr", "out_ptr")}  # Triton 3.9's PTX version
args.update(block_tables_ptr="*i32", seq_lens_ptr="*i32", part_o_ptr="*fp32", part_lse_ptr="*fp32", qk_scale="fp32")
args.update({s: "i32" for s in ("stride_qnt", "stride_qnh", "stride_qpt", "stride_qph", "stride_cb", "stride_cs",
                                "stride_bt", "stride_ot", "stride_oh", "stride_ps", "stride_pt", "stride_ph",
                                "stride_ls", "stride_lt")})
consts = dict(NUM_HEADS=128, RANK=512, ROPE=64, BLOCK_H=mla.BLOCK_H, BLOCK_R=512, BLOCK_P=64,
              BLOCK_N=mla.DECODE_BLOCK_N, PAGE=64, NUM_SPLITS=8, UPCAST_DOT=False, Q_LEN=1)
k = triton.compile(ASTSource(fn=mla._decode_kernel, signature={**args, **{c: "constexpr" for c in consts}},
                             constexprs=consts), target=GPUTarget("cuda", 90, 32),
                   options={"num_warps": mla.DECODE_WARPS, "num_stages": 2})
out = {"mma": sorted(set(re.findall(r"mma\.sync\.aligned\.(m\d+n\d+k\d+)", k.asm["ptx"])))}
if ptxas.is_file():
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "k.ptx").write_text(k.asm["ptx"])
        info = subprocess.run([str(ptxas), "-arch=sm_90a", "-v", str(Path(tmp) / "k.ptx"), "-o", str(Path(tmp) / "k")],
                              capture_output=True, text=True).stderr
    out["spills"] = [int(n) for n in re.findall(r"(\d+) bytes spill stores", info)]
print(json.dumps(out))
"""


def test_decode_kernel_compiles_for_hopper_at_v3_width_without_spills() -> None:
    """The device code the interpreter never runs: at rank 512, rope 64 and the launcher's tile and warps, the
    decode kernel compiles for sm_90 to bf16 tensor-core MMAs with no register spills (ptxas -v)."""
    from envex.tests.support.kernels import compile_for_hopper

    got = compile_for_hopper(_AOT)
    assert got["mma"] == ["m16n8k16"], got
    if "spills" in got:
        assert got["spills"] == [0], got
