"""TritonOps: the `Ops` entry points (kernels/ops.py) on the Triton kernels, the CUDA fast path.

Each entry point picks its kernel from the rows it is given:
- one row (batch-1 decode): the GEMV kernel (gemv.py), which reads the weight once at full bandwidth and folds
  the residual add + RMSNorm, the SwiGLU and the bias into the same pass; chained with programmatic dependent
  launch on Hopper, so each kernel's weight stream starts under its predecessor's tail;
- more rows: cuBLAS (torch matmul) with the fused Triton norm and activation kernels around it. For 2-16 rows
  (the down projection: up to 64) with K >= 4096, O and down run as one strided-batched GEMM over two K halves
  into float32 partials, and the next norm's launch sums them (`norm.add_rms_norm_partials`): cuBLAS's own
  split-K would have spent a reduce launch there (verify/lab/journal-kernels.md, v19);
- attention: for a pure decode step, and a speculative verify step of up to decode_attention.MAX_QUERY_ROWS query
  rows (k + 1 tokens x the GQA group) per KV head (Llama-3.1-8B: k ≤ 15; gpt-oss: k ≤ 7), decode_attention_fused
  (q/k norm + rotary + KV write + attention, the split merge in a second launch); else rotary_and_store_kv and
  the varlen paged_attention kernel. Sinks and a sliding window are constexpr variants of both; a window layer
  picks its key splits from the window, not from the graph's max_model_len;
- a packed KV cache (int4, fp8; kv_quant.py): the packed write kernel and the packed paged attention, for every
  step;
- a packed low-bit weight (quant.py): the packed GEMV with the same prologues up to quant_gemv.GEMV_MAX_ROWS rows,
  past them the norm or SwiGLU kernel and the packed GEMM (quant_gemm.py) up to quant_gemm.GEMM_MAX_ROWS (decode
  batches, prefill chunks), and past that the weight dequantized for the call and cuBLAS;
- moe: the norm kernel, the router projection (GEMV at one row), then moe_mxfp4.fused_moe (routing and both
  expert projections, MXFP4 or FP8 dequantized in registers; gpt-oss's clamped SwiGLU with biases, or Qwen3-MoE's
  plain SwiGLU without, compiled as variants of the same kernels).
invariant_ops.py is the batch-invariant path on the same kernels (the deterministic mode).
The model file never sees these choices; the gates prove the result equals TorchOps.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F

from envex.kernels import (
    activation,
    attention,
    decode_attention,
    delta_rule,
    gemv,
    invariant_matmul,
    kv_quant,
    mla,
    moe_mxfp4,
    norm,
    quant_gemm,
    quant_gemv,
    reference,
    rotary,
)
from envex.kernels._common import check
from envex.kernels.ops import (
    AttentionLayer,
    AttentionMetadata,
    Communicator,
    LinearAttentionLayer,
    MLALayer,
    MoEWeights,
    split_qkv,
)
from envex.kernels.quant import PackedWeight

# Smallest K (input width) whose projection TritonOps splits into halves for the next norm to sum.
SPLIT_K_MIN = 4096


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])  # [..., H] -> [T, H] (copies only if the view is impossible)


def _is_partials(x: torch.Tensor) -> bool:
    return x.dim() == 3  # [S, T, N] float32 from _split_k_product; hidden rows are [T, H]


def _normed(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float
            ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(rms_norm(x + residual), x + residual) by the norm kernels; no residual: (rms_norm(x), x)."""
    if residual is None:
        return norm.rms_norm(x, norm_weight, eps), x
    return norm.add_rms_norm(x, residual, norm_weight, eps)


# torch.bmm(..., out_dtype=) (bf16 in, float32 out) exists from torch 2.8; without it no projection is split.
_BMM_TO_FLOAT32 = any("out_dtype" in str(s) for s in torch._C._jit_get_schemas_for_operator("aten::bmm"))


def _split_k_product(x: torch.Tensor, weight: torch.Tensor, splits: int) -> torch.Tensor:
    """x [T, K] @ weight[N, K].T as float32 partials [splits, T, N], partial s over K slice s: one strided-batched
    cuBLAS GEMM over views of x and the weight (no copy), float32 out (bf16 products accumulated in float32)."""
    k = x.shape[1]
    xs = x.unflatten(1, (splits, k // splits)).transpose(0, 1)  # [S, T, K/S]
    ws = weight.unflatten(1, (splits, k // splits)).permute(1, 2, 0)  # [S, K/S, N]
    if x.is_cuda:
        return torch.bmm(xs, ws, out_dtype=torch.float32)
    return torch.bmm(xs.float(), ws.float())  # the CPU has no bf16 -> float32 bmm; the same sums in float32


class TritonOps:
    name = "triton"
    deterministic: ClassVar[bool] = False

    def __init__(self, *, pdl: bool = False, split_k: bool = True) -> None:
        # pdl: launch the one-row kernels with programmatic dependent launch (Hopper and later). Every kernel so
        # launched waits on its predecessor before reading activations, so mixing with plain launches is safe.
        # split_k: O and down may return float32 split partials for the next norm to sum (module docstring; in
        # the invariant backend the invariant matmul's own pieces, which the norm adds in the reduce's order).
        self.pdl = pdl
        self.split_k = split_k

    @staticmethod
    def _gemv(x: torch.Tensor) -> bool:
        # Above one row, cuBLAS beats re-reading the weight per row; a multi-row tensor-core GEMV (one weight
        # pass for 2-16 rows) lost to cuBLAS at every Llama-3.1-8B projection but O (verify/lab/journal-kernels.md,
        # v11).
        return x.shape[0] == 1

    def norm_linear(self, x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                    weight: torch.Tensor, bias: torch.Tensor | None = None, comm: Communicator | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        if isinstance(weight, PackedWeight):
            return self._packed_norm_linear(x, residual, norm_weight, eps, weight, bias, comm)
        if _is_partials(x):
            if comm is None and residual is not None:  # the split-K reduce, the add and the norm in one launch
                normed, residual = norm.add_rms_norm_partials(x, residual, norm_weight, eps, pdl=self._row_pdl(x[0]))
                return self._project(normed, weight, bias), residual
            x = self.materialize(x, weight.dtype if residual is None else residual.dtype)
        if comm is not None:
            # One row: reduce alone, the GEMV folds the add and the norm into its weight pass anyway. More rows:
            # the reduce, the add and the norm in one pass over the peers' rows where the size allows.
            fused = comm.all_reduce_add_rms_norm(x, residual, norm_weight, eps) if self._fuse_reduce(x) else None
            if fused is not None:
                normed, residual = fused
                return self._project(normed, weight, bias), residual
            x = comm.all_reduce(x)  # not PDL-launched (Communicator.all_reduce); the GEMV after it is
        return self._norm_linear(x, residual, norm_weight, eps, weight, bias)

    def _fuse_reduce(self, x: torch.Tensor) -> bool:
        """Whether norm_linear takes the fused all-reduce + add + norm pass for these rows."""
        return not self._gemv(x)

    def _norm_linear(self, x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                     weight: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """norm_linear on reduced, materialized rows."""
        if self._gemv(x):
            prologue = gemv.PROLOGUE_RMS if residual is None else gemv.PROLOGUE_ADD_RMS
            y, total = gemv.gemv(x, weight, prologue=prologue, b=residual, norm_weight=norm_weight, eps=eps,
                                 bias=bias, pdl=self.pdl)  # fmt: skip
            return y, (x if total is None else total)
        normed, residual = _normed(x, residual, norm_weight, eps)
        return F.linear(normed, weight, bias), residual

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        check(x.dim() == 2, f"x: expected [T, K] rows, got shape {tuple(x.shape)}")
        if isinstance(weight, PackedWeight):  # the packed GEMV up to its rows, else the packed GEMM
            return quant_gemm.quant_linear(x, weight, bias)
        splits = self._splits(x, weight, bias)
        return _split_k_product(x, weight, splits) if splits > 1 else self._project(x, weight, bias)

    def _project(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x @ weight.T (+ bias) as [T, N] rows."""
        if self._gemv(x):
            return gemv.gemv(x, weight, bias=bias, pdl=self.pdl)[0]
        return F.linear(x, weight, bias)

    def act_linear(self, gate_up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        check(gate_up.dim() == 2, f"gate_up: expected [T, 2I] rows, got shape {tuple(gate_up.shape)}")
        # SwiGLU as a launch of its own, each element once, then the projection: not in a GEMV's prologue, where
        # every program computed all I of them after its wait, on the chain's critical path
        # (verify/lab/journal-kernels.md, "SwiGLU out of the down projection's prologue"). PDL-chained at one row.
        act = activation.silu_and_mul(gate_up, pdl=self._row_pdl(gate_up))
        if isinstance(weight, PackedWeight) and act.shape[0] <= quant_gemv.GEMV_MAX_ROWS:
            return quant_gemv.quant_gemv(act, weight, pdl=self._row_pdl(act))[0]
        return self.linear(act, weight)

    def _splits(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> int:
        """K slices for a default-mode projection whose output goes to the next norm (H200, Llama-3.1-8B shape,
        verify/lab/journal-kernels.md v19: two halves gain 1.8-2.2 us on O and down at 2-16 rows and on down at 64; O at
        64 rows loses 0.5). A bias would need adding before the norm's sum: such projections stay whole."""
        rows, k = x.shape
        # k % 16: each half's rows start 16-byte aligned, as cuBLAS wants
        if not (self.split_k and _BMM_TO_FLOAT32) or bias is not None or rows < 2 or k < SPLIT_K_MIN or k % 16:
            return 1
        return 2 if rows <= 16 or (rows <= 64 and k >= 2 * weight.shape[0]) else 1

    def materialize(self, hidden: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        # the pieces added as the norm kernel adds them (in the invariant backend: the reduce kernel's bits)
        return invariant_matmul.sum_pieces(hidden, dtype) if _is_partials(hidden) else hidden

    def attention(self, qkv: torch.Tensor, k_cache: torch.Tensor | kv_quant.PackedKVCache,
                  v_cache: torch.Tensor | None, meta: AttentionMetadata, layer: AttentionLayer
                  ) -> torch.Tensor:  # fmt: skip
        if isinstance(k_cache, kv_quant.PackedKVCache):
            # The packed write (rotary + Hadamard + quantize) and the packed paged attention, for decode, verify
            # rows and prefill chunks alike (kv_quant.packed_attention: two launches and the split merge).
            return kv_quant.packed_attention(qkv, k_cache, meta, layer)
        assert v_cache is not None, "a plain cache comes as a (k, v) pair"
        tokens = qkv.shape[0]
        window = layer.sliding_window
        # A window layer reads at most `window` keys: its split count comes from that, not from the (graph's)
        # max_seq_len; it depends only on the batch, so a captured graph stays valid.
        num_splits = meta.num_splits if window is None else None
        q_len = 1 if meta.is_decode else meta.q_per_seq
        if q_len is not None and q_len > 1:
            check(q_len == meta.max_q_len, f"meta: q_per_seq {q_len} != max_q_len {meta.max_q_len}")
        group = layer.num_heads // layer.num_kv_heads
        if meta.is_decode or (q_len is not None and q_len * group <= decode_attention.MAX_QUERY_ROWS):
            # Decode, and a verify step's k + 1 tokens a sequence: rotary, the K/V write and attention in one
            # launch (the split merge in a second), where the general path takes three (verify/lab/journal-kernels.md,
            # v16).
            pdl = self.pdl and tokens == 1
            return decode_attention.decode_attention_fused(
                qkv, meta.positions, meta.slot_mapping, meta.cos, meta.sin, k_cache, v_cache, meta.block_tables,
                layer.scale, num_heads=layer.num_heads, num_kv_heads=layer.num_kv_heads,
                max_seq_len=meta.max_seq_len, num_splits=num_splits, merge_in_kernel=False,
                q_norm=layer.q_norm, k_norm=layer.k_norm, norm_eps=layer.norm_eps, pdl=pdl,
                sinks=layer.sinks, window=window, q_len=q_len,
            ).view(tokens, layer.q_size)  # fmt: skip
        q, k, v = split_qkv(qkv, layer)
        if layer.q_norm is not None and layer.k_norm is not None:
            q = norm.rms_norm(_rows(q), layer.q_norm, layer.norm_eps).view(q.shape)
            k = norm.rms_norm(_rows(k), layer.k_norm, layer.norm_eps).view(k.shape)
        q, _ = rotary.rotary_and_store_kv(q, k, v, meta.positions, meta.cos, meta.sin, k_cache, v_cache,
                                          meta.slot_mapping)  # fmt: skip
        assert meta.seq_lens is not None, "a step with prefill chunks carries seq_lens"
        out = attention.paged_attention(q, k_cache, v_cache, meta.cu_seqlens_q, meta.seq_lens, meta.block_tables,
                                        layer.scale, max_q_len=meta.max_q_len, max_seq_len=meta.max_seq_len,
                                        num_splits=num_splits, sinks=layer.sinks, window=window)  # fmt: skip
        return out.view(tokens, layer.q_size)

    def moe(self, x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
            router_weight: torch.Tensor, router_bias: torch.Tensor | None, experts: MoEWeights, top_k: int
            ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        if experts.scoring != "softmax":
            return self._deepseek_moe(x, residual, norm_weight, eps, router_weight, router_bias, experts, top_k)
        x = self.materialize(x, router_weight.dtype if residual is None else residual.dtype)
        planes = None
        pdl = self.pdl and x.shape[0] == 1  # the batch-1 chain, as the GEMV path launches it
        gemv_path = moe_mxfp4.takes_gemv_path(x.shape[0], x.shape[1], experts.intermediate_size)
        if gemv_path and x.shape[1] <= moe_mxfp4.NORM_ROUTER_MAX_HIDDEN:
            # the add, the norm (with the GEMVs' input planes) and the router in one launch
            h, residual, planes, logits = moe_mxfp4.norm_router(x, residual, norm_weight, eps, router_weight,
                                                                router_bias, pdl=pdl)  # fmt: skip
        elif gemv_path:  # a row wider than one program holds: the norm with its planes, then the router
            h, residual, planes = norm.norm_planes(x, residual, norm_weight, eps, pdl=pdl)
            logits = self._project(h, router_weight, router_bias)
        else:
            if residual is None:
                h, residual = norm.rms_norm(x, norm_weight, eps), x
            else:
                h, residual = norm.add_rms_norm(x, residual, norm_weight, eps)
            logits = self._project(h, router_weight, router_bias)  # [T, E]
        out = moe_mxfp4.fused_moe(h, logits, top_k, gate_up=experts.gate_up_matrix(),
                                  gate_up_bias=experts.gate_up_bias, down=experts.down_matrix(),
                                  down_bias=experts.down_bias, alpha=experts.alpha, limit=experts.limit,
                                  activation=experts.activation, renormalize=experts.renormalize,
                                  x_planes=planes, pdl=pdl)  # fmt: skip
        return out, residual

    def _deepseek_moe(self, x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                      router_weight: torch.Tensor, router_bias: torch.Tensor | None, experts: MoEWeights, top_k: int
                      ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """DeepSeek's routing in torch (MoEWeights.deepseek_route: sigmoid or softmax scores, groups, the correction
        bias, the scaling factor, the shared experts as always-chosen experts), then the existing expert kernels: the
        chosen experts are handed to fused_moe as logits log(w), every other expert far below, whose top-k softmax
        is w / Σw, and the output is multiplied back by Σw. No kernel change; the routing is not fused (yet)."""
        x = self.materialize(x, norm_weight.dtype if residual is None else residual.dtype)
        if residual is None:
            h, residual = norm.rms_norm(x, norm_weight, eps), x
        else:
            h, residual = norm.add_rms_norm(x, residual, norm_weight, eps)
        weights, ids = experts.deepseek_route(F.linear(h.to(router_weight.dtype), router_weight, router_bias), top_k)
        weights = weights.float()
        stack = experts.gate_up if experts.gate_up is not None else experts.gate_up_blocks
        assert stack is not None
        chosen = torch.full((h.shape[0], stack.shape[0]), -1e30, dtype=torch.float32, device=h.device)
        chosen.scatter_(1, ids, weights.clamp_min(1e-30).log())  # [T, E + shared]
        out = moe_mxfp4.fused_moe(h, chosen, ids.shape[1], gate_up=experts.gate_up_matrix(),
                                  gate_up_bias=experts.gate_up_bias, down=experts.down_matrix(),
                                  down_bias=experts.down_bias, alpha=experts.alpha, limit=experts.limit,
                                  activation=experts.activation, renormalize=True)  # fmt: skip
        return (out.float() * weights.sum(-1, keepdim=True)).to(out.dtype), residual

    def linear_attention(self, mixed: torch.Tensor, state_pool: torch.Tensor, conv_pool: torch.Tensor,
                         meta: AttentionMetadata, layer: LinearAttentionLayer) -> torch.Tensor:  # fmt: skip
        """kernels/delta_rule.py: the decode kernels for a step of one token a sequence, else the chunked prefill."""
        return delta_rule.gated_delta_net(mixed, state_pool, conv_pool, meta, layer)

    def mla_attention(self, q: torch.Tensor, kv_a: torch.Tensor, latent_cache: torch.Tensor,
                      meta: AttentionMetadata, layer: MLALayer) -> torch.Tensor:  # fmt: skip
        """Decode and verify steps absorbed over the latent cache (mla_decode_attention, split-K); prefill chunks
        expanded (mla_prefill_attention, torch, host lengths: not for CUDA graphs)."""
        tokens = q.shape[0]
        q = q.view(tokens, layer.num_heads, layer.q_head_dim)  # [T, H, nope + rope]
        q_pe = mla.mla_store_latent(kv_a, layer.kv_norm, layer.norm_eps, meta.positions, meta.cos, meta.sin,
                                    meta.slot_mapping, latent_cache, interleaved=layer.interleaved, q=q,
                                    qk_nope_head_dim=layer.qk_nope_head_dim)  # fmt: skip
        assert q_pe is not None
        q_nope = q[..., : layer.qk_nope_head_dim]
        q_len = 1 if meta.is_decode else meta.q_per_seq
        if q_len is not None:
            seq_lens = meta.seq_lens if meta.seq_lens is not None else (meta.positions + 1).to(torch.int32)
            o = mla.mla_decode_attention(mla.absorb_query(q_nope, layer.w_uk), q_pe, latent_cache, meta.block_tables,
                                         seq_lens, layer.scale, max_seq_len=meta.max_seq_len, q_len=q_len,
                                         num_splits=meta.num_splits)  # fmt: skip
            return mla.expand_output(o, layer.w_uv)
        assert meta.seq_lens is not None, "a step with prefill chunks carries seq_lens"
        q_lens, seq_lens_host = reference.host_lengths(meta.cu_seqlens_q, meta.seq_lens, meta.q_lens_host,
                                                       meta.seq_lens_host)  # fmt: skip
        out = mla.mla_prefill_attention(q_nope, q_pe, latent_cache, meta.block_tables, layer.w_uk, layer.w_uv,
                                        layer.scale, q_lens=q_lens, seq_lens=seq_lens_host)  # fmt: skip
        return out.reshape(tokens, -1)  # [T, H v]

    def _packed_norm_linear(self, x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                            eps: float, weight: PackedWeight, bias: torch.Tensor | None, comm: Communicator | None
                            ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """norm_linear on a low-bit weight (kernels/quant.py): up to quant_gemv.GEMV_MAX_ROWS rows the packed GEMV
        with the add + RMSNorm in its prologue (as the bf16 GEMV folds them), else the norm kernel, then
        quant_gemm.quant_linear (the packed GEMM, or a dequantized weight past GEMM_MAX_ROWS)."""
        if _is_partials(x):  # a bf16 O or down before it left split-K partials
            x = self.materialize(x, norm_weight.dtype if residual is None else residual.dtype)
        if comm is not None:
            x = comm.all_reduce(x)
        if x.shape[0] <= quant_gemv.GEMV_MAX_ROWS:
            prologue = gemv.PROLOGUE_RMS if residual is None else gemv.PROLOGUE_ADD_RMS
            y, total = quant_gemv.quant_gemv(x, weight, prologue=prologue, b=residual, norm_weight=norm_weight,
                                             eps=eps, bias=bias, pdl=self._row_pdl(x))  # fmt: skip
            return y, (x if total is None else total)
        normed, residual = _normed(x, residual, norm_weight, eps)
        return quant_gemm.quant_linear(normed, weight, bias), residual

    def _row_pdl(self, x: torch.Tensor) -> bool:
        return self.pdl and x.shape[0] == 1  # the batch-1 chain (PDL only there), as the GEMV path launches it
