"""Fused rotary embedding (HF rotate_half convention) + paged KV-cache write, one program per token.

Floor: memory. Reads q, k, v once and writes q_rot, k_rot and the cache slots of k_rot and v once:
T·(2·Hq + 4·Hkv)·D elements plus T·D fp32 of cos/sin. All heads of a token share one cos/sin load.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from envex.kernels._common import FLOAT_DTYPES, check, check_tensor, next_pow2, pdl_launch


@triton.jit
def _rotate_heads(src_ptr, dst_ptr, cache_ptr, stride_src_h, stride_dst_h, n_heads, c, s, n_cache_heads,
                  HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):  # fmt: skip
    """Rotate all heads of one token ([n_heads, D] at src) into dst, and the first n_cache_heads into cache."""
    heads = tl.arange(0, BLOCK_H)[:, None]
    cols = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (heads < n_heads) & (cols < HALF)
    x1 = tl.load(src_ptr + heads * stride_src_h + cols, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src_ptr + heads * stride_src_h + HALF + cols, mask=mask, other=0.0).to(tl.float32)
    out_ty = dst_ptr.dtype.element_ty
    lo = (x1 * c - x2 * s).to(out_ty)
    hi = (x2 * c + x1 * s).to(out_ty)
    tl.store(dst_ptr + heads * stride_dst_h + cols, lo, mask=mask)
    tl.store(dst_ptr + heads * stride_dst_h + HALF + cols, hi, mask=mask)
    cache_mask = (heads < n_cache_heads) & (cols < HALF)
    cache_ty = cache_ptr.dtype.element_ty
    tl.store(cache_ptr + heads * (2 * HALF) + cols, lo.to(cache_ty), mask=cache_mask)
    tl.store(cache_ptr + heads * (2 * HALF) + HALF + cols, hi.to(cache_ty), mask=cache_mask)


@triton.jit
def _rotary_store_kernel(
    q_ptr, k_ptr, v_ptr, pos_ptr, cos_ptr, sin_ptr, q_out_ptr, k_out_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    n_q_heads, n_kv_heads,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_cos,
    stride_qot, stride_qoh, stride_kot, stride_koh,
    HEAD_DIM: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HKV: tl.constexpr, BLOCK_HALF: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    if USE_PDL:  # q, k, v, positions and slots all come from earlier kernels of the step
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    t = tl.program_id(0).to(tl.int64)
    HALF: tl.constexpr = HEAD_DIM // 2
    pos = tl.load(pos_ptr + t)
    hcols = tl.arange(0, BLOCK_HALF)[None, :]
    c = tl.load(cos_ptr + pos * stride_cos + hcols, mask=hcols < HALF, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + pos * stride_cos + hcols, mask=hcols < HALF, other=0.0).to(tl.float32)
    slot = tl.load(slot_ptr + t)
    n_cache_heads = tl.where(slot >= 0, n_kv_heads, 0)  # negative slot: a padding token, nothing to cache
    # The cache is contiguous [num_blocks*block_size, Hkv, D], so a slot is a row of Hkv*D elements.
    row = tl.maximum(slot, 0).to(tl.int64) * n_kv_heads * HEAD_DIM
    _rotate_heads(q_ptr + t * stride_qt, q_out_ptr + t * stride_qot, q_out_ptr, stride_qh, stride_qoh, n_q_heads,
                  c, s, 0, HALF, BLOCK_HQ, BLOCK_HALF)  # fmt: skip
    _rotate_heads(k_ptr + t * stride_kt, k_out_ptr + t * stride_kot, k_cache_ptr + row, stride_kh, stride_koh,
                  n_kv_heads, c, s, n_cache_heads, HALF, BLOCK_HKV, BLOCK_HALF)  # fmt: skip
    heads = tl.arange(0, BLOCK_HKV)[:, None]
    cols = tl.arange(0, 2 * BLOCK_HALF)[None, :]
    mask = (heads < n_cache_heads) & (cols < HEAD_DIM)
    v = tl.load(v_ptr + t * stride_vt + heads * stride_vh + cols, mask=mask, other=0.0)
    tl.store(v_cache_ptr + row + heads * HEAD_DIM + cols, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def check_token_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                       sin: torch.Tensor, slot_mapping: torch.Tensor) -> None:  # fmt: skip
    """The checks on a step's rows that every launcher of this rotary makes (here and inside
    invariant_attention.decode_attention_rotary): q [T, Hq, D], k and v [T, Hkv, D] of q's dtype, D even, one
    position and one slot a token, cos/sin [max_pos, D/2] float32 sharing one row stride."""
    check_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES)
    check_tensor("k", k, ndim=3, dtypes=(q.dtype,), device=q.device)
    check_tensor("v", v, ndim=3, dtypes=(q.dtype,), device=q.device)
    num_tokens, _, head_dim = q.shape
    check(head_dim % 2 == 0, f"q: head_dim {head_dim} must be even for rotate_half rotary")
    check(k.shape == (num_tokens, k.shape[1], head_dim), f"k: shape {tuple(k.shape)} does not match q {tuple(q.shape)}")
    check(v.shape == k.shape, f"v: shape {tuple(v.shape)} != k shape {tuple(k.shape)}")
    for name, x in (("positions", positions), ("slot_mapping", slot_mapping)):
        check_tensor(name, x, ndim=1, dtypes=(torch.int64, torch.int32), device=q.device)
        check(x.shape[0] == num_tokens, f"{name}: {x.shape[0]} entries for {num_tokens} tokens")
    for name, t in (("cos", cos), ("sin", sin)):
        check_tensor(name, t, ndim=2, dtypes=(torch.float32,), device=q.device)
        check(t.shape[1] == head_dim // 2, f"{name}: last dim {t.shape[1]} != head_dim/2 = {head_dim // 2}")
    check(cos.stride(0) == sin.stride(0), "cos/sin: must share one row stride; pass .contiguous() for both")


def rotary_and_store_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    pdl: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T,Hq,D] and k [T,Hkv,D]; write k_rot and v to the paged caches at slot_mapping.

    cos/sin: [max_pos, D/2] float32. Caches: contiguous [num_blocks, block_size, Hkv, D]. A negative slot skips
    the cache write for that token. Returns new tensors (q_rot, k_rot); q, k and v are not modified.
    """
    check_token_inputs(q, k, v, positions, cos, sin, slot_mapping)
    num_tokens, n_q, head_dim = q.shape
    n_kv = k.shape[1]
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        check_tensor(name, c, ndim=4, device=q.device)
        check(c.is_contiguous(), f"{name}: must be contiguous [num_blocks, block_size, Hkv, D]")
        check(c.shape[2:] == (n_kv, head_dim), f"{name}: trailing dims {tuple(c.shape[2:])} != ({n_kv}, {head_dim})")

    q_rot = torch.empty((num_tokens, n_q, head_dim), dtype=q.dtype, device=q.device)
    k_rot = torch.empty((num_tokens, n_kv, head_dim), dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return q_rot, k_rot
    _rotary_store_kernel[(num_tokens,)](
        q, k, v, positions, cos, sin, q_rot, k_rot, k_cache, v_cache, slot_mapping,
        n_q, n_kv, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0),
        q_rot.stride(0), q_rot.stride(1), k_rot.stride(0), k_rot.stride(1),
        HEAD_DIM=head_dim, BLOCK_HQ=next_pow2(n_q), BLOCK_HKV=next_pow2(n_kv), BLOCK_HALF=next_pow2(head_dim // 2),
        USE_PDL=pdl, num_warps=4, **pdl_launch(pdl),
    )  # fmt: skip
    return q_rot, k_rot
