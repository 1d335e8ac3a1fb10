"""Packed KV caches (int4 and fp8), their write kernel (rotary + Hadamard + quantize) and paged attention that reads
them packed, dequantizing in registers. Issue 43; offline_docs/kv_cache.md has the formats, bytes and errors.

Formats, per (token, KV head) row of D elements (reference.py's packed KV section is their float64 definition):

- int4: groups of G = 64 (or 32) elements, each with a bf16 scale s = (max - min)/15 and a bf16 zero z = min,
  codes clamp(floor((x - z)/s + 1/2), 0, 15). data uint8 [blocks, page, Hkv, D/2]: byte j holds element j in its
  low nibble and element j + D/2 in its high nibble ("split-half": the kernel gets the row's two halves as two
  [N, D/2] tiles with one mask each, and the q·k and p·v dots run per half). meta bf16 [blocks, page,
  Hkv, 2·D/G]: the D/G scales, then the D/G zeros. 4.5 bits an element at G = 64 (3.56x fewer bytes than bf16).
  A zero point with G = 64 beat symmetric codes with G = 32 at the same bytes on SmolLM2's real K/V (attention
  output error 15.4% vs 16.6%; verify/lab/kernel_bench/kv_quant_errors.py).
- fp8: e4m3fn with one bf16 scale per row (absmax/448, computed as the row is written: no calibration, and an
  outlier token cannot saturate its neighbours). data float8_e4m3fn [blocks, page, Hkv, D]; meta bf16 [..., 1].

Keys (and, with rotate_values, values) are multiplied by the normalised Sylvester Hadamard matrix H_D before they
are quantized: outlier channels are spread over the whole row, so a group's range, and the error, shrink (SmolLM2:
K error 13.0% -> 8.6%; QuaRot, Ashkboos et al. 2024; llama.cpp's rotated q4_0 KV). H is orthogonal
and symmetric, so the kernel rotates q the same way and (qH)·(kH) = q·k; a rotated V's output is un-rotated by H
once per program. H_D = [[H', H'], [H', -H']] / sqrt(D) with H' = H_{D/2} (±1, built in registers from the parity of
i & j), which matches the split-half layout: x·H_D = [(x_lo + x_hi)·H', (x_lo - x_hi)·H'] / sqrt(D), two [R, D/2] x
[D/2, D/2] dots (fp32, ieee: exact for the ±1 entries). D must be a power of two ≥ 32 (64 and 128 are served).

Attention's key loop (`_packed_attn_kernel`): tile i + 1's packed bytes and meta rows are loaded into registers
before tile i is dequantized and computed, its block ids one tile earlier (`_fetch_rows` / `_decode_rows`, the
quant_gemv `w_next` pattern); int4 codes become floats without I2F: the low nibble OR-ed into 2^23's mantissa, the
high nibble, left in place, into 2^19's, the power of two subtracted (exact), then u·s + z as before.

Floor (decode): memory, the packed K and V of every cached token read once: seq_len·bytes_per_token per sequence
per layer (Llama-8B: 1152 bytes a token against bf16's 4096). The formats and their layout constants live in
kv_quant_format.py (no Triton there, so the engine's config and the torch backend import them anywhere); they are
re-exported here.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from envex.kernels import reference
from envex.kernels._common import FLOAT_DTYPES, INTERPRETING, check, check_tensor, exact_dot, next_pow2
from envex.kernels.attention import LOG2E, _merge_splits_kernel, choose_num_splits, split_key_range
from envex.kernels.kv_quant_format import (
    DEFAULT_INT4_GROUP,
    INT4_GROUP_SIZES,
    KV_CACHE_DTYPES,
    KVCacheFormat,
    PackedKVCache,
    dequantize_blocks,
    kv_bytes_per_token,
)
from envex.kernels.ops import AttentionLayer, AttentionMetadata, split_qkv
from envex.kernels.quant_gemv import TWO_23, TWO_23_BITS

__all__ = ["DEFAULT_INT4_GROUP", "INT4_GROUP_SIZES", "KV_CACHE_DTYPES", "KVCacheFormat", "PackedKVCache",
           "dequantize_blocks", "kv_bytes_per_token", "packed_attention", "packed_paged_attention",
           "rotary_and_write_packed_kv"]

# (token, head) rows a write program holds: tl.dot's smallest M on the GPU; 64 under the interpreter, whose time
# goes by programs, not by their size (the same code, a quarter of the programs).
_WRITE_ROWS = 64 if INTERPRETING else 16


@triton.jit
def _hadamard_pm1(HALF: tl.constexpr):
    """The ±1 Sylvester matrix H_HALF [HALF, HALF] in fp32: (-1)^popcount(i & j), the parity by xor-folding."""
    i = tl.arange(0, HALF)[:, None]
    j = tl.arange(0, HALF)[None, :]
    p = i & j
    p = p ^ (p >> 8)
    p = p ^ (p >> 4)
    p = p ^ (p >> 2)
    p = p ^ (p >> 1)
    return tl.where((p & 1) == 0, 1.0, -1.0)


@triton.jit
def _rotate_halves(lo, hi, HALF: tl.constexpr):
    """[lo | hi] (fp32 [R, HALF] each) times the normalised H_{2·HALF} -> (lo', hi'); its own inverse."""
    h = _hadamard_pm1(HALF)
    a = tl.dot(lo, h, input_precision="ieee")
    b = tl.dot(hi, h, input_precision="ieee")
    inv = 1.0 / tl.sqrt(2.0 * HALF)
    return (a + b) * inv, (a - b) * inv


@triton.jit
def _fp8_e4m3_bits(y):
    """fp32 y with |y| ≤ 448 -> its e4m3fn byte, rounded to nearest even (as torch's cast). Integer arithmetic:
    Triton's interpreter rounds fp32 -> fp8 wrongly where rounding carries into the exponent (124.97 -> 64)."""
    a = tl.abs(y)
    ib = a.to(tl.int32, bitcast=True)
    rounded = ib + 0x7FFFF + ((ib >> 20) & 1)  # round the 23-bit mantissa to 3 bits, ties to even
    normal = (((rounded >> 23) - 120) << 3) | ((rounded >> 20) & 7)  # exponent rebiased 127 -> 7
    t = a * 512.0  # subnormals (and zero) are multiples of 2^-9
    r = tl.floor(t)
    f = t - r
    ri = r.to(tl.int32)
    up = (f > 0.5) | ((f == 0.5) & ((ri & 1) == 1))
    sub = ri + up.to(tl.int32)
    code = tl.where(a >= 0.015625, normal, sub)
    return (code | tl.where(y < 0, 128, 0)).to(tl.uint8)


@triton.jit
def _bf16(x):
    """fp32 x rounded to nearest-even bf16 (returned as bf16): the cast itself truncates under the interpreter."""
    ib = x.to(tl.int32, bitcast=True)
    ib = (ib + 0x7FFF + ((ib >> 16) & 1)) & -65536
    return ib.to(tl.float32, bitcast=True).to(tl.bfloat16)


@triton.jit
def _round_to(x, dtype: tl.constexpr):
    """fp32 x rounded to dtype, to nearest even on the GPU and under the interpreter alike."""
    if dtype == tl.bfloat16:
        return _bf16(x)
    return x.to(dtype)


@triton.jit
def _int4_codes(x, s, z):
    inv = tl.where(s > 0.0, 1.0 / tl.where(s > 0.0, s, 1.0), 0.0)
    return tl.minimum(tl.maximum(tl.floor((x - z) * inv + 0.5), 0.0), 15.0).to(tl.int32)


@triton.jit
def _encode_rows(lo, hi, ok, data_ptr, meta_ptr, drow, mrow, j, FP8: tl.constexpr, ROT: tl.constexpr,
                 HALF: tl.constexpr, G: tl.constexpr, BLOCK_R: tl.constexpr):  # fmt: skip
    """Quantize rows [lo | hi] (fp32 [R, HALF] each) and store them at data_ptr + drow, meta_ptr + mrow where ok."""
    if ROT:
        lo, hi = _rotate_halves(lo, hi, HALF)
    m2 = ok[:, None]
    if FP8:
        amax = tl.maximum(tl.max(tl.abs(lo), axis=1), tl.max(tl.abs(hi), axis=1))
        s = _bf16(amax / 448.0)
        sf = s.to(tl.float32)
        inv = tl.where(sf > 0.0, 1.0 / tl.where(sf > 0.0, sf, 1.0), 0.0)[:, None]
        lo_b = _fp8_e4m3_bits(tl.minimum(tl.maximum(lo * inv, -448.0), 448.0))
        hi_b = _fp8_e4m3_bits(tl.minimum(tl.maximum(hi * inv, -448.0), 448.0))
        tl.store(data_ptr + drow[:, None] + j[None, :], lo_b, mask=m2)
        tl.store(data_ptr + drow[:, None] + HALF + j[None, :], hi_b, mask=m2)
        tl.store(meta_ptr + mrow, s, mask=ok)
    else:
        NG: tl.constexpr = 2 * HALF // G  # groups of a row; scales at meta[0, NG), zeros at meta[NG, 2·NG)
        if G <= HALF:
            NH: tl.constexpr = HALF // G  # groups of a half
            lo3 = tl.reshape(lo, [BLOCK_R, NH, G])  # [R, groups, G]
            hi3 = tl.reshape(hi, [BLOCK_R, NH, G])
            s_lo = _bf16((tl.max(lo3, axis=2) - tl.min(lo3, axis=2)) / 15.0)
            s_hi = _bf16((tl.max(hi3, axis=2) - tl.min(hi3, axis=2)) / 15.0)
            z_lo = _bf16(tl.min(lo3, axis=2))
            z_hi = _bf16(tl.min(hi3, axis=2))
            c_lo = tl.reshape(_int4_codes(lo3, s_lo.to(tl.float32)[:, :, None], z_lo.to(tl.float32)[:, :, None]),
                              [BLOCK_R, HALF])  # fmt: skip
            c_hi = tl.reshape(_int4_codes(hi3, s_hi.to(tl.float32)[:, :, None], z_hi.to(tl.float32)[:, :, None]),
                              [BLOCK_R, HALF])  # fmt: skip
            g = tl.arange(0, NH)[None, :]
            gm = m2 & (g < NH)
            tl.store(meta_ptr + mrow[:, None] + g, s_lo, mask=gm)
            tl.store(meta_ptr + mrow[:, None] + NH + g, s_hi, mask=gm)
            tl.store(meta_ptr + mrow[:, None] + NG + g, z_lo, mask=gm)
            tl.store(meta_ptr + mrow[:, None] + NG + NH + g, z_hi, mask=gm)
        else:  # one group is the whole row (G == D)
            mx = tl.maximum(tl.max(lo, axis=1), tl.max(hi, axis=1))
            mn = tl.minimum(tl.min(lo, axis=1), tl.min(hi, axis=1))
            s = _bf16((mx - mn) / 15.0)
            z = _bf16(mn)
            c_lo = _int4_codes(lo, s.to(tl.float32)[:, None], z.to(tl.float32)[:, None])
            c_hi = _int4_codes(hi, s.to(tl.float32)[:, None], z.to(tl.float32)[:, None])
            tl.store(meta_ptr + mrow, s, mask=ok)
            tl.store(meta_ptr + mrow + 1, z, mask=ok)
        tl.store(data_ptr + drow[:, None] + j[None, :], (c_lo | (c_hi << 4)).to(tl.uint8), mask=m2)


@triton.jit
def _rope_rows(src, pos, cos_ptr, sin_ptr, stride_cos, m2, j, HALF: tl.constexpr):
    """Rows [lo | hi] at src [R, 1] rotated at pos [R] (HF rotate_half, fp32 math) -> (lo, hi) fp32, not rounded."""
    c = tl.load(cos_ptr + pos[:, None] * stride_cos + j[None, :], mask=m2, other=0.0)
    s = tl.load(sin_ptr + pos[:, None] * stride_cos + j[None, :], mask=m2, other=0.0)
    x1 = tl.load(src + j[None, :], mask=m2, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF + j[None, :], mask=m2, other=0.0).to(tl.float32)
    return x1 * c - x2 * s, x2 * c + x1 * s


@triton.jit
def _write_kv_rows(pid, k_ptr, v_ptr, pos_ptr, cos_ptr, sin_ptr, slot_ptr, kd_ptr, km_ptr, vd_ptr, vm_ptr, n_rows,
                   stride_kt, stride_kh, stride_vt, stride_vh, stride_cos, N_KV: tl.constexpr, HALF: tl.constexpr,
                   G: tl.constexpr, NG2: tl.constexpr, DATA_W: tl.constexpr, FP8: tl.constexpr, ROT_K: tl.constexpr,
                   ROT_V: tl.constexpr, BLOCK_R: tl.constexpr):  # fmt: skip
    j = tl.arange(0, HALF)
    r = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    t = (r // N_KV).to(tl.int64)
    h = r % N_KV
    slot = tl.load(slot_ptr + t, mask=r < n_rows, other=-1)
    ok = (r < n_rows) & (slot >= 0)  # a negative slot: a padding token, nothing to cache
    pos = tl.load(pos_ptr + t, mask=ok, other=0)
    m2 = ok[:, None]
    k_row = k_ptr + t[:, None] * stride_kt + h[:, None] * stride_kh
    lo, hi = _rope_rows(k_row, pos, cos_ptr, sin_ptr, stride_cos, m2, j, HALF)
    # rotary.py's rounding: the rotated k rounded to k's dtype (what a bf16 cache would hold), then quantized
    k_ty = k_ptr.dtype.element_ty
    lo = _round_to(lo, k_ty).to(tl.float32)
    hi = _round_to(hi, k_ty).to(tl.float32)
    slot_c = tl.maximum(slot, 0).to(tl.int64)
    drow = (slot_c * N_KV + h) * DATA_W  # contiguous [num_blocks·page, Hkv, width]: a slot is Hkv rows
    mrow = (slot_c * N_KV + h) * NG2
    _encode_rows(lo, hi, ok, kd_ptr, km_ptr, drow, mrow, j, FP8, ROT_K, HALF, G, BLOCK_R)
    v_row = v_ptr + t[:, None] * stride_vt + h[:, None] * stride_vh
    v_lo = tl.load(v_row + j[None, :], mask=m2, other=0.0).to(tl.float32)
    v_hi = tl.load(v_row + HALF + j[None, :], mask=m2, other=0.0).to(tl.float32)
    _encode_rows(v_lo, v_hi, ok, vd_ptr, vm_ptr, drow, mrow, j, FP8, ROT_V, HALF, G, BLOCK_R)


@triton.jit
def _rotate_q_rows(pid, q_ptr, pos_ptr, cos_ptr, sin_ptr, q_out_ptr, n_rows, stride_qt, stride_qh, stride_cos,
                   stride_qot, stride_qoh, N_Q: tl.constexpr, HALF: tl.constexpr, BLOCK_R: tl.constexpr):  # fmt: skip
    j = tl.arange(0, HALF)
    r = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    ok = r < n_rows
    t = (r // N_Q).to(tl.int64)
    h = r % N_Q
    pos = tl.load(pos_ptr + t, mask=ok, other=0)
    m2 = ok[:, None]
    lo, hi = _rope_rows(q_ptr + t[:, None] * stride_qt + h[:, None] * stride_qh, pos, cos_ptr, sin_ptr, stride_cos,
                        m2, j, HALF)  # fmt: skip
    o_row = q_out_ptr + t[:, None] * stride_qot + h[:, None] * stride_qoh
    out_ty = q_out_ptr.dtype.element_ty
    tl.store(o_row + j[None, :], _round_to(lo, out_ty), mask=m2)
    tl.store(o_row + HALF + j[None, :], _round_to(hi, out_ty), mask=m2)


@triton.jit
def _write_kernel(
    q_ptr, k_ptr, v_ptr, pos_ptr, cos_ptr, sin_ptr, slot_ptr, q_out_ptr, kd_ptr, km_ptr, vd_ptr, vm_ptr,
    n_kv_rows, n_q_rows,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_cos, stride_qot, stride_qoh,
    N_Q: tl.constexpr, N_KV: tl.constexpr, HALF: tl.constexpr, G: tl.constexpr, NG2: tl.constexpr,
    DATA_W: tl.constexpr, FP8: tl.constexpr, ROT_K: tl.constexpr, ROT_V: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    """Programs 0 .. cdiv(n_kv_rows, BLOCK_R)-1 own BLOCK_R (token, KV head) rows: rotary on k, then k and v encoded
    into their slot; the rest own (token, query head) rows: rotary on q into q_out (as rotary.py rounds it)."""
    pid = tl.program_id(0)
    n_kv_progs = tl.cdiv(n_kv_rows, BLOCK_R)
    if pid < n_kv_progs:
        _write_kv_rows(pid, k_ptr, v_ptr, pos_ptr, cos_ptr, sin_ptr, slot_ptr, kd_ptr, km_ptr, vd_ptr, vm_ptr,
                       n_kv_rows, stride_kt, stride_kh, stride_vt, stride_vh, stride_cos, N_KV, HALF, G, NG2, DATA_W,
                       FP8, ROT_K, ROT_V, BLOCK_R)  # fmt: skip
    else:
        _rotate_q_rows(pid - n_kv_progs, q_ptr, pos_ptr, cos_ptr, sin_ptr, q_out_ptr, n_q_rows, stride_qt, stride_qh,
                       stride_cos, stride_qot, stride_qoh, N_Q, HALF, BLOCK_R)  # fmt: skip


def rotary_and_write_packed_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                               cos: torch.Tensor, sin: torch.Tensor, slot_mapping: torch.Tensor,
                               cache: PackedKVCache) -> torch.Tensor:  # fmt: skip
    """rotary.rotary_and_store_kv for a packed cache, one launch: q [T, Hq, D] rotated -> q_rot (returned, q's dtype);
    k [T, Hkv, D] rotated (rounded to k's dtype), Hadamard-rotated if the format says so, quantized and written
    with v at slot_mapping (negative: skipped). cos/sin: [max_pos, D/2] float32."""
    from envex.kernels.rotary import check_token_inputs

    check_token_inputs(q, k, v, positions, cos, sin, slot_mapping)
    tokens, n_q, head_dim = q.shape
    n_kv = k.shape[1]
    check(head_dim == cache.head_dim and n_kv == cache.num_kv_heads,
          f"k: {n_kv} heads x {head_dim} do not match the cache's {cache.num_kv_heads} x {cache.head_dim}")  # fmt: skip
    check(cache.k_data.device == q.device, f"cache: on {cache.k_data.device}, q on {q.device}")
    q_rot = torch.empty((tokens, n_q, head_dim), dtype=q.dtype, device=q.device)
    if tokens == 0:
        return q_rot
    fmt = cache.fmt
    n_kv_rows, n_q_rows = tokens * n_kv, tokens * n_q
    grid = (triton.cdiv(n_kv_rows, _WRITE_ROWS) + triton.cdiv(n_q_rows, _WRITE_ROWS),)
    # fp8 rows are written as their bytes (_fp8_e4m3_bits); a uint8 view of int4 data is itself
    _write_kernel[grid](
        q, k, v, positions, cos, sin, slot_mapping, q_rot, cache.k_data.view(torch.uint8), cache.k_meta,
        cache.v_data.view(torch.uint8), cache.v_meta, n_kv_rows, n_q_rows,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0),
        q_rot.stride(0), q_rot.stride(1),
        N_Q=n_q, N_KV=n_kv, HALF=head_dim // 2, G=fmt.group_size, NG2=fmt.meta_width(head_dim),
        DATA_W=fmt.data_width(head_dim), FP8=fmt.dtype == "fp8", ROT_K=fmt.keys_rotated, ROT_V=fmt.values_rotated,
        BLOCK_R=_WRITE_ROWS, num_warps=4,
    )  # fmt: skip
    return q_rot


# 2^19 as fp32 bits: its mantissa's bit 4 weighs 1, so a high nibble left in place (b & 0xF0) OR-ed in is 2^19 + u
TWO_19_BITS = tl.constexpr(0x49000000)
TWO_19 = tl.constexpr(524288.0)


@triton.jit
def _block_ids(bt_row, kpos, hi, PAGE: tl.constexpr):
    """The cache blocks (int64) holding keys kpos [N]; block 0 at kpos ≥ hi, whose loads the callers mask."""
    return tl.load(bt_row + kpos // PAGE, mask=kpos < hi, other=0).to(tl.int64)


@triton.jit
def _fetch_rows(data_ptr, meta_ptr, blk, kpos, hi, kvh, j, stride_db, stride_ds, stride_dh, stride_mb, stride_ms,
                stride_mh, FP8: tl.constexpr, HALF: tl.constexpr, MW: tl.constexpr, PAGE: tl.constexpr):  # fmt: skip
    """The stored rows of keys kpos [N] (in blocks blk) of one KV head, as loaded: (data_lo, data_hi, meta); masked
    rows (kpos ≥ hi) read nothing and are 0. int4: data [N, HALF] bytes, both halves' nibbles (data_hi is data_lo);
    fp8: the two halves' [N, HALF] bytes. meta: the whole row, [N, MW] (fp8: [N, 2], the second column masked).
    The meta strides are in rows (units of MW entries), so the compiler sees each row start aligned to MW entries:
    vector loads (sm_90: 32- or 64-bit) instead of one 16-bit load an entry."""
    k_ok = kpos < hi
    m2 = k_ok[:, None]
    doff = blk * stride_db + (kpos % PAGE) * stride_ds + kvh * stride_dh
    moff = (blk * stride_mb + (kpos % PAGE) * stride_ms + kvh * stride_mh) * MW
    if FP8:
        col = tl.arange(0, 2)[None, :]
        meta = tl.load(meta_ptr + moff[:, None] + col, mask=m2 & (col < 1), other=0.0)
        lo = tl.load(data_ptr + doff[:, None] + j[None, :], mask=m2, other=0)  # masked lanes 0, not an fp8 NaN
        hi = tl.load(data_ptr + doff[:, None] + HALF + j[None, :], mask=m2, other=0)
    else:
        meta = tl.load(meta_ptr + moff[:, None] + tl.arange(0, MW)[None, :], mask=m2, other=0.0)
        lo = tl.load(data_ptr + doff[:, None] + j[None, :], mask=m2, other=0)
        hi = lo
    return lo, hi, meta


@triton.jit
def _decode_rows(raw, FP8: tl.constexpr, HALF: tl.constexpr, G: tl.constexpr, MW: tl.constexpr):
    """_fetch_rows' rows (data_lo, data_hi, meta) -> their two halves, fp32 [N, HALF] each (0 where masked)."""
    data_lo, data_hi, meta = raw
    if FP8:
        s, _ = tl.split(meta.to(tl.float32))
        lo = data_lo.to(tl.float8e4nv, bitcast=True).to(tl.float32) * s[:, None]
        hi = data_hi.to(tl.float8e4nv, bitcast=True).to(tl.float32) * s[:, None]
    else:
        lo, hi = _decode_int4(data_lo, meta.to(tl.float32), HALF, G, MW)
    return lo, hi


@triton.jit
def _decode_int4(data, meta, HALF: tl.constexpr, G: tl.constexpr, MW: tl.constexpr):
    """int4 rows: bytes [N, HALF] and their meta rows [N, MW] (fp32) -> the two halves, fp32 [N, HALF] each."""
    N: tl.constexpr = data.shape[0]
    if MW == 2:  # one group is the whole row (G = D): [s, z], shared by both halves
        s_lo, z_lo = tl.split(meta)
        s_lo, z_lo = s_lo[:, None], z_lo[:, None]
        s_hi, z_hi = s_lo, z_lo
    else:  # the row [s_lo (NH groups), s_hi, z_lo, z_hi] -> [N, NH] each, broadcast over each group's G elements
        NH: tl.constexpr = MW // 4
        sz = tl.permute(tl.reshape(meta, [N, 2, 2, NH]), (0, 3, 2, 1))  # [N, NH, half, scale|zero]
        s, z = tl.split(sz)
        s_lo, s_hi = tl.split(s)
        z_lo, z_hi = tl.split(z)
        s_lo, s_hi = _spread(s_lo, N, NH, G), _spread(s_hi, N, NH, G)
        z_lo, z_hi = _spread(z_lo, N, NH, G), _spread(z_hi, N, NH, G)
    # Each code becomes its float without an int-to-float conversion (quarter rate on Hopper, one an element):
    # OR-ed into the mantissa of 2^23 (low nibble) or, left in place, of 2^19 (high nibble), then the power of two
    # taken off again, both exact (quant_gemv._int4_codes); u·s + z then rounds as before.
    b = data.to(tl.int32)
    u_lo = ((b & 0x0F) | TWO_23_BITS).to(tl.float32, bitcast=True) - TWO_23
    u_hi = ((b & 0xF0) | TWO_19_BITS).to(tl.float32, bitcast=True) - TWO_19
    return u_lo * s_lo + z_lo, u_hi * s_hi + z_hi


@triton.jit
def _spread(x, N: tl.constexpr, NH: tl.constexpr, G: tl.constexpr):
    """[N, NH] per-group values -> [N, NH·G], each repeated over its group's G elements."""
    return tl.reshape(tl.broadcast_to(x[:, :, None], [N, NH, G]), [N, NH * G])


# stride_bt follows the step's longest block table: not specialised (as attention._attn_kernel's).
@triton.jit(do_not_specialize=["stride_bt"])
def _packed_attn_kernel(
    q_ptr, kd_ptr, km_ptr, vd_ptr, vm_ptr, out_ptr, part_o_ptr, part_lse_ptr,
    cu_q_ptr, seq_lens_ptr, block_tables_ptr, sinks_ptr, qk_scale,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_db, stride_ds, stride_dh, stride_mb, stride_ms, stride_mh, stride_bt,
    stride_ps, stride_pt, stride_ph, stride_ls, stride_lt,
    GROUP: tl.constexpr, HALF: tl.constexpr, G: tl.constexpr, MW: tl.constexpr, FP8: tl.constexpr,
    ROT_K: tl.constexpr, ROT_V: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr,
    NUM_SPLITS: tl.constexpr, UPCAST_DOT: tl.constexpr, HAS_SINKS: tl.constexpr, WINDOW: tl.constexpr,
):  # fmt: skip
    """attention._attn_kernel over the packed cache: one program per (tile of BLOCK_M (token, query head) rows of
    one KV head's GQA group, sequence, KV head x key split); K/V tiles dequantized in registers, q·k and p·v per
    half of D."""
    pid_m = tl.program_id(0)
    b = tl.program_id(1)
    kvh = tl.program_id(2) // NUM_SPLITS
    split = tl.program_id(2) % NUM_SPLITS
    q_start = tl.load(cu_q_ptr + b)
    q_len = tl.load(cu_q_ptr + b + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + b)
    if pid_m * BLOCK_M >= q_len * GROUP:
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    tok = rows // GROUP
    head = kvh * GROUP + rows % GROUP
    row_ok = tok < q_len
    q_pos = seq_len - q_len + tok
    j = tl.arange(0, HALF)
    lo, hi = split_key_range(pid_m, q_len, seq_len, split, GROUP, BLOCK_M, BLOCK_N, NUM_SPLITS, WINDOW)

    # Software-pipelined by hand, as quant_gemv's w_next: tile i + 1's K/V bytes and meta are requested before
    # tile i is computed, and its block ids one tile earlier still, so no step waits on a load chain (block table
    # -> meta); Triton's pipeliner left the meta loads (2-byte entries, below cp.async's 4) synchronous. Loads past
    # hi (the split's end; the last tile's prefetch) are masked off. Tile 0's are requested before q is loaded
    # and rotated: a decode split of one tile (1K context) waits on them while the Hadamard products run.
    kk = tl.arange(0, BLOCK_N)
    bt_row = block_tables_ptr + b * stride_bt
    blk = _block_ids(bt_row, lo + kk, hi, PAGE)
    k_next = _fetch_rows(kd_ptr, km_ptr, blk, lo + kk, hi, kvh, j, stride_db, stride_ds, stride_dh, stride_mb,
                         stride_ms, stride_mh, FP8, HALF, MW, PAGE)  # fmt: skip
    v_next = _fetch_rows(vd_ptr, vm_ptr, blk, lo + kk, hi, kvh, j, stride_db, stride_ds, stride_dh, stride_mb,
                         stride_ms, stride_mh, FP8, HALF, MW, PAGE)  # fmt: skip
    blk_next = _block_ids(bt_row, lo + BLOCK_N + kk, hi, PAGE)

    q_rows = (q_start + tok).to(tl.int64)
    q_ptrs = q_ptr + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + j[None, :]
    q_mask = row_ok[:, None]
    q_lo = tl.load(q_ptrs, mask=q_mask, other=0.0)
    q_hi = tl.load(q_ptrs + HALF, mask=q_mask, other=0.0)
    dot_ty = q_lo.dtype
    if UPCAST_DOT:  # the interpreter multiplies bf16 dot operands as raw bits (_common.INTERPRETING)
        dot_ty = tl.float32
    if ROT_K:  # q in the keys' rotated basis: (qH)·(kH) = q·k
        q_lo, q_hi = _rotate_halves(q_lo.to(tl.float32), q_hi.to(tl.float32), HALF)
    q_lo = q_lo.to(dot_ty)
    q_hi = q_hi.to(dot_ty)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    if HAS_SINKS:  # the sink joins split 0's softmax as one more logit (log2 domain, unscaled) with no value
        sink = tl.load(sinks_ptr + head, mask=row_ok, other=0.0).to(tl.float32) * 1.4426950408889634
        m_i = tl.where(split == 0, sink, m_i)
        l_i = tl.where(split == 0, 1.0, l_i)
    acc_lo = tl.zeros([BLOCK_M, HALF], dtype=tl.float32)
    acc_hi = tl.zeros([BLOCK_M, HALF], dtype=tl.float32)
    for start in range(lo, hi, BLOCK_N):
        kpos = start + kk
        k_ok = kpos < hi
        k_raw, v_raw = k_next, v_next
        ahead = kpos + BLOCK_N  # tile i + 1, requested before tile i is computed
        k_next = _fetch_rows(kd_ptr, km_ptr, blk_next, ahead, hi, kvh, j, stride_db, stride_ds, stride_dh, stride_mb,
                             stride_ms, stride_mh, FP8, HALF, MW, PAGE)  # fmt: skip
        v_next = _fetch_rows(vd_ptr, vm_ptr, blk_next, ahead, hi, kvh, j, stride_db, stride_ds, stride_dh, stride_mb,
                             stride_ms, stride_mh, FP8, HALF, MW, PAGE)  # fmt: skip
        blk_next = _block_ids(bt_row, ahead + BLOCK_N, hi, PAGE)
        k_lo, k_hi = _decode_rows(k_raw, FP8, HALF, G, MW)
        v_lo, v_hi = _decode_rows(v_raw, FP8, HALF, G, MW)
        s = exact_dot(q_lo, tl.trans(k_lo.to(dot_ty))) + exact_dot(q_hi, tl.trans(k_hi.to(dot_ty)))
        s = s * qk_scale  # [BLOCK_M, BLOCK_N], log2 domain
        visible = (kpos[None, :] <= q_pos[:, None]) & k_ok[None, :]
        if WINDOW > 0:
            visible = visible & (kpos[None, :] > q_pos[:, None] - WINDOW)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that sees no key yet keeps p = 0
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        p = p.to(dot_ty)
        acc_lo = acc_lo * alpha[:, None] + exact_dot(p, v_lo.to(dot_ty))
        acc_hi = acc_hi * alpha[:, None] + exact_dot(p, v_hi.to(dot_ty))
        m_i = m_new

    l_div = tl.where(l_i > 0.0, l_i, 1.0)
    o_lo = acc_lo / l_div[:, None]
    o_hi = acc_hi / l_div[:, None]
    if ROT_V:  # Σ p·(vH) = (Σ p·v)H: back to the model's basis (linear, so before the split merge)
        o_lo, o_hi = _rotate_halves(o_lo, o_hi, HALF)
    if NUM_SPLITS == 1:
        o_ptrs = out_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + j[None, :]
        tl.store(o_ptrs, o_lo.to(out_ptr.dtype.element_ty), mask=q_mask)
        tl.store(o_ptrs + HALF, o_hi.to(out_ptr.dtype.element_ty), mask=q_mask)
    else:
        p_ptrs = part_o_ptr + split * stride_ps + q_rows[:, None] * stride_pt + head[:, None] * stride_ph + j[None, :]
        tl.store(p_ptrs, o_lo, mask=q_mask)
        tl.store(p_ptrs + HALF, o_hi, mask=q_mask)
        lse = tl.where(l_i > 0.0, m_i + tl.log2(l_div), float("-inf"))
        tl.store(part_lse_ptr + split * stride_ls + q_rows * stride_lt + head, lse, mask=row_ok)


def packed_paged_attention(
    q: torch.Tensor,
    cache: PackedKVCache,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    *,
    max_q_len: int,
    max_seq_len: int,
    num_splits: int | None = None,
    block_m: int | None = None,
    block_n: int = 64,
    num_warps: int | None = None,
    num_stages: int | None = None,
    sinks: torch.Tensor | None = None,
    window: int | None = None,
    partials: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """attention.paged_attention over a packed cache: packed varlen queries q [T, Hq, D] (rotary applied, not the
    Hadamard rotation: the kernel applies it), sequence b's rows cu_seqlens_q[b]:cu_seqlens_q[b+1] at the last q_len
    of its seq_lens[b] cached (already written) tokens. Decode (q_len 1), speculative verify rows (q_len k + 1) and
    prefill over a packed prefix (any q_len; no split, no tile skipping the causal mask yet) run through the same
    kernel; split-K for short query chunks, merged by attention's merge kernel. sinks [Hq], window: as
    reference.paged_attention. partials: preallocated float32 split buffers ([S, T, Hq, D], [S, T, Hq]) for a CUDA
    graph, with num_splits fixed; else allocated here. -> [T, Hq, D] in q's dtype."""
    check_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES)
    tokens, n_q, head_dim = q.shape
    check(head_dim == cache.head_dim, f"q: head_dim {head_dim} != the cache's {cache.head_dim}")
    n_kv, page = cache.num_kv_heads, cache.block_size
    check(n_q % n_kv == 0, f"q: {n_q} query heads is not a multiple of {n_kv} KV heads")
    check(cache.k_data.device == q.device, f"cache: on {cache.k_data.device}, q on {q.device}")
    check_tensor("cu_seqlens_q", cu_seqlens_q, ndim=1, dtypes=(torch.int32, torch.int64), device=q.device)
    check_tensor("seq_lens", seq_lens, ndim=1, dtypes=(torch.int32, torch.int64), device=q.device)
    check_tensor("block_tables", block_tables, ndim=2, dtypes=(torch.int32, torch.int64), device=q.device)
    batch = seq_lens.shape[0]
    check(cu_seqlens_q.shape[0] == batch + 1, f"cu_seqlens_q: {cu_seqlens_q.shape[0]} entries for batch {batch}")
    check(block_tables.shape[0] == batch, f"block_tables: {block_tables.shape[0]} rows for batch {batch}")
    check(max_q_len >= 1 and max_seq_len >= max_q_len, f"max_q_len {max_q_len} / max_seq_len {max_seq_len} invalid")
    check(window is None or window >= 1, f"window: {window} must be a positive number of tokens or None")
    if sinks is not None:
        check_tensor("sinks", sinks, ndim=1, dtypes=FLOAT_DTYPES, device=q.device)
        check(sinks.shape[0] == n_q, f"sinks: {sinks.shape[0]} entries for {n_q} query heads")
    group = n_q // n_kv
    out = torch.empty_like(q)
    if tokens == 0 or batch == 0:
        return out
    if num_splits is None:
        keys = max_seq_len if window is None else min(max_seq_len, window + max_q_len)
        num_splits = choose_num_splits(batch, n_kv, keys, q.device) if max_q_len <= 4 else 1
    if block_m is None:
        block_m = max(16, min(64, next_pow2(max_q_len * group)))
    if num_splits > 1:
        if partials is None:
            partials = (torch.empty((num_splits, tokens, n_q, head_dim), dtype=torch.float32, device=q.device),
                        torch.empty((num_splits, tokens, n_q), dtype=torch.float32, device=q.device))  # fmt: skip
        part_o, part_lse = partials
        for name, t, shape in (("o", part_o, (num_splits, tokens, n_q, head_dim)),
                               ("lse", part_lse, (num_splits, tokens, n_q))):  # fmt: skip
            check(t.shape == shape and t.dtype == torch.float32 and t.stride(-1) == 1,
                  f"partials: {name} must be float32 {list(shape)} with a contiguous last dim")  # fmt: skip
    else:
        part_o = torch.empty((1, 1, 1, 1), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((1, 1, 1), dtype=torch.float32, device=q.device)
    fmt = cache.fmt
    mw = fmt.meta_width(head_dim)  # meta strides in rows of mw entries (the cache is contiguous: whole rows)
    grid = (triton.cdiv(max_q_len * group, block_m), batch, n_kv * num_splits)
    _packed_attn_kernel[grid](
        q, cache.k_data.view(torch.uint8), cache.k_meta, cache.v_data.view(torch.uint8), cache.v_meta, out, part_o,
        part_lse, cu_seqlens_q, seq_lens,
        block_tables, sinks if sinks is not None else q, float(scale) * LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        cache.k_data.stride(0), cache.k_data.stride(1), cache.k_data.stride(2),
        *(st // mw for st in cache.k_meta.stride()[:3]), block_tables.stride(0),
        part_o.stride(0), part_o.stride(1), part_o.stride(2), part_lse.stride(0), part_lse.stride(1),
        GROUP=group, HALF=head_dim // 2, G=fmt.group_size, MW=mw, FP8=fmt.dtype == "fp8",
        ROT_K=fmt.keys_rotated, ROT_V=fmt.values_rotated, BLOCK_M=block_m, BLOCK_N=block_n, PAGE=page,
        NUM_SPLITS=num_splits, UPCAST_DOT=INTERPRETING, HAS_SINKS=sinks is not None, WINDOW=window or 0,
        num_warps=num_warps or 4, num_stages=num_stages or 2,
    )  # fmt: skip
    if num_splits > 1:
        _merge_splits_kernel[(tokens, n_q)](
            part_o, part_lse, out,
            part_o.stride(0), part_o.stride(1), part_o.stride(2), part_lse.stride(0), part_lse.stride(1),
            out.stride(0), out.stride(1),
            NUM_SPLITS=num_splits, BLOCK_S=next_pow2(num_splits), HEAD_DIM=head_dim, BLOCK_D=head_dim,
            USE_PDL=False, num_warps=4,
        )  # fmt: skip
    return out


def packed_attention(qkv: torch.Tensor, cache: PackedKVCache, meta: AttentionMetadata,
                     layer: AttentionLayer) -> torch.Tensor:  # fmt: skip
    """`Ops.attention` over a packed cache: qkv [T, (Hq + 2·Hkv)·D] un-rotated -> [T, Hq·D]; this step's K/V written
    packed at meta.slot_mapping. Two launches (write, attention) plus the split merge. A window layer passes its
    own pool's metadata (meta.window) and cache, as the model files do for the bf16 cache. Qwen3's per-head q/k
    RMSNorm runs as torch ops before the write (not fused yet)."""
    tokens = qkv.shape[0]
    q, k, v = split_qkv(qkv, layer)
    if layer.q_norm is not None and layer.k_norm is not None:
        q = reference.rms_norm(q, layer.q_norm, layer.norm_eps)
        k = reference.rms_norm(k, layer.k_norm, layer.norm_eps)
    q_rot = rotary_and_write_packed_kv(q, k, v, meta.positions, meta.cos, meta.sin, meta.slot_mapping, cache)
    seq_lens = meta.seq_lens
    if seq_lens is None:  # decode or a uniform verify step: the last position of each sequence + 1
        q_len = meta.q_per_seq or 1
        seq_lens = (meta.positions.view(-1, q_len)[:, -1] + 1).to(torch.int32)
    # A window layer reads at most `window` keys: its split count comes from that, not the graph's max_seq_len.
    num_splits = meta.num_splits if layer.sliding_window is None else None
    out = packed_paged_attention(q_rot, cache, meta.cu_seqlens_q, seq_lens, meta.block_tables, layer.scale,
                                 max_q_len=meta.max_q_len, max_seq_len=meta.max_seq_len, num_splits=num_splits,
                                 sinks=layer.sinks, window=layer.sliding_window)  # fmt: skip
    return out.view(tokens, layer.q_size)
