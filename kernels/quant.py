"""Low-bit linear weights as checkpoints ship them, in one internal form per scheme, in pure torch (no Triton here).

A linear layer's float weight is W [N, K] (N outputs, K inputs). `PackedWeight` holds it packed, in one of:

  fp8_block    data float8_e4m3fn [N, K]; scale float32 [ceil(N/bn), ceil(K/bk)], one per bn x bk block (128 x 128
               in every published checkpoint): W[n, k] = data[n, k] * scale[n // bn, k // bk]. The DeepSeek-V3 /
               Kimi K2 / Qwen3-FP8 layout, whose scale tensor is named `weight_scale_inv` although it multiplies.
               A model's matrix gathered from a checkpoint's rows across blocks holds block (1, bk): one scale row
               a row, the blocks' scales repeated (put_rows).
  fp8_channel  data float8_e4m3fn [N, K]; scale float32 [N]: W[n, k] = data[n, k] * scale[n]
               (compressed-tensors float-quantized, strategy "channel": `weight_scale` [N, 1]).
  fp8_tensor   data float8_e4m3fn [N, K]; scale float32 [1]: W = data * scale (strategy "tensor").
  int4_group   data int32 [N, ceil(K/8)]: input k of row n is the 4-bit unsigned u in bits 4j..4j+3 of word
               data[n, k // 8], j = k % 8 (the lowest nibble holds the lowest k); scale [N, ceil(K/G)] (the
               checkpoint's float dtype); zero uint8 [N, ceil(K/G)] or None for symmetric (zero 8):
               W[n, k] = (u - zero[n, k // G]) * scale[n, k // G]. G (`group`) is a multiple of 8, so no word
               straddles two groups; per-channel INT4 is G = K rounded up to a multiple of 8.

The published INT4 packings differ and are converted once, at load, by the from_* functions below (their docstrings
give each packing's bit order as its format defines it); the kernels (kernels/quant_gemv.py) read only the
internal form. Every conversion is exact: integers are moved, never rounded, and scales only widen (fp8 scales to
float32). An INT4 zero point is kept as uint8 rather than packed because GPTQ's v1 checkpoints store zero - 1,
whose zero 0 reads back as 16.

Quantizers (bf16 -> each scheme) are for "quantize at install" and for tests: they pick the scale from each
block's or group's largest magnitude, so the largest element is represented with the most precision a code has.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

FP8_BLOCK, FP8_CHANNEL, FP8_TENSOR, INT4_GROUP = "fp8_block", "fp8_channel", "fp8_tensor", "int4_group"
SCHEMES = (FP8_BLOCK, FP8_CHANNEL, FP8_TENSOR, INT4_GROUP)
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn magnitude
PACK = 8  # 4-bit values per int32 word
SYMMETRIC_ZERO = 8  # the zero point of a symmetric INT4 code: u in 0..15 stands for u - 8 in -8..7
INT4_SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# AutoAWQ's GEMM packing puts output column 8c + AWQ_ORDER[i] into nibble i of word c (awq/modules/linear/gemm.py,
# WQLinear_GEMM.from_linear: order_map); so column 8c + j sits in nibble AWQ_NIBBLE[j], its inverse.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
AWQ_NIBBLE = (0, 4, 1, 5, 2, 6, 3, 7)


def _fail(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(message)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True, kw_only=True, eq=False)
class PackedWeight:
    """One linear layer's weight in a low-bit scheme (module docstring); validated here, so an inconsistent one
    cannot exist. shape is the float weight's (N, K); group is INT4's inputs per scale (0 for FP8); block is
    fp8_block's (rows, cols) per scale ((0, 0) otherwise)."""

    scheme: str
    shape: tuple[int, int]
    data: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None = None
    group: int = 0
    block: tuple[int, int] = (0, 0)

    def __post_init__(self) -> None:
        _fail(self.scheme in SCHEMES, f"packed weight: scheme {self.scheme!r} unknown; use one of {SCHEMES}")
        n, k = self.shape
        _fail(n > 0 and k > 0, f"packed weight: shape {self.shape} must be two positive sizes")
        devices = {t.device for t in (self.data, self.scale, self.zero) if t is not None}
        _fail(len(devices) == 1, f"packed weight: data, scale and zero on several devices {sorted(map(str, devices))}")
        if self.scheme == INT4_GROUP:
            g = self.group
            _fail(g > 0 and g % PACK == 0, f"int4 weight: group {g} must be a positive multiple of {PACK}")
            want = (n, _cdiv(k, g))
            _fail(self.data.dtype == torch.int32 and tuple(self.data.shape) == (n, _cdiv(k, PACK)),
                  f"int4 weight: data must be int32 [{n}, {_cdiv(k, PACK)}], got {self.data.dtype} "
                  f"{tuple(self.data.shape)}")  # fmt: skip
            _fail(self.scale.dtype in INT4_SCALE_DTYPES and tuple(self.scale.shape) == want,
                  f"int4 weight: scale must be float [{want[0]}, {want[1]}], got {self.scale.dtype} "
                  f"{tuple(self.scale.shape)}")  # fmt: skip
            _fail(self.zero is None or (self.zero.dtype == torch.uint8 and tuple(self.zero.shape) == want),
                  f"int4 weight: zero must be None or uint8 [{want[0]}, {want[1]}]")  # fmt: skip
            _fail(self.block == (0, 0), "int4 weight: block is for fp8_block only")
            return
        _fail(self.data.dtype == FP8_DTYPE and tuple(self.data.shape) == (n, k),
              f"{self.scheme} weight: data must be float8_e4m3fn [{n}, {k}], got {self.data.dtype} "
              f"{tuple(self.data.shape)}")  # fmt: skip
        _fail(self.zero is None and self.group == 0, f"{self.scheme} weight: FP8 is symmetric, with no zero or group")
        if self.scheme == FP8_BLOCK:
            bn, bk = self.block
            _fail(bn > 0 and bk > 0, f"fp8_block weight: block {self.block} must be two positive sizes")
            want = (_cdiv(n, bn), _cdiv(k, bk))
        else:
            _fail(self.block == (0, 0), f"{self.scheme} weight: block is for fp8_block only")
            want = (n,) if self.scheme == FP8_CHANNEL else (1,)
        _fail(self.scale.dtype == torch.float32 and tuple(self.scale.shape) == want,
              f"{self.scheme} weight: scale must be float32 {list(want)}, got {self.scale.dtype} "
              f"{list(self.scale.shape)}")  # fmt: skip

    @property
    def nbytes(self) -> int:
        """Bytes a kernel reads for the whole matrix (data, scales and zeros)."""
        return sum(t.numel() * t.element_size() for t in (self.data, self.scale, self.zero) if t is not None)

    def to(self, device: torch.device | str) -> PackedWeight:
        zero = None if self.zero is None else self.zero.to(device)
        return dataclasses.replace(self, data=self.data.to(device), scale=self.scale.to(device), zero=zero)


@dataclass(frozen=True, kw_only=True, eq=False)
class FP8BlockStack:
    """A mixture-of-experts layer's E matrices in fp8_block, stacked as kernels/ops.py MoEWeights holds them: data
    float8_e4m3fn [E, N, K] and float32 scales, one per bn x bk block of each expert's matrix as the checkpoint
    stores it (`weight_scale_inv`). Plain (down): scale [E, ceil(N/bn), ceil(K/bk)], row n's scales at row n // bn.
    paired (gate_up): the rows interleave two matrices of I = N/2 rows each (gate j at row 2j, up j at 2j + 1),
    each blocked on its own, and the scale rows interleave alike: [E, 2·ceil(I/bn), ceil(K/bk)], the gate's block
    row b at 2b and the up's at 2b + 1, so row r's scales sit at row 2·(r // 2 // bn) + r % 2 (with I a multiple
    of bn, as in every release, that is the plain [E, ceil(N/bn), ...] shape). Validated here: an inconsistent
    stack cannot exist."""

    data: torch.Tensor
    scale: torch.Tensor
    block: tuple[int, int] = (128, 128)
    paired: bool = False

    def __post_init__(self) -> None:
        what = "fp8 gate_up experts" if self.paired else "fp8 experts"
        _fail(self.data.dtype == FP8_DTYPE and self.data.dim() == 3,
              f"{what}: data must be float8_e4m3fn [E, N, K], got {self.data.dtype} {list(self.data.shape)}")
        bn, bk = self.block
        _fail(bn > 0 and bk >= 16 and bk & (bk - 1) == 0,
              f"{what}: block {list(self.block)} must be [rows > 0, a power of two >= 16 columns]")  # fmt: skip
        e, n, k = self.data.shape
        _fail(not self.paired or n % 2 == 0, f"{what}: {n} rows cannot interleave gate and up rows")
        want = [e, self.scale_rows(n), _cdiv(k, bk)]
        _fail(self.scale.dtype == torch.float32 and list(self.scale.shape) == want,
              f"{what}: scale must be float32 {want} for data {list(self.data.shape)} and block {list(self.block)}, "
              f"got {self.scale.dtype} {list(self.scale.shape)}")  # fmt: skip
        _fail(self.scale.device == self.data.device, f"{what}: data and scale on different devices")

    def scale_rows(self, n: int) -> int:
        """Scale rows of an expert of n rows."""
        bn = self.block[0]
        return 2 * _cdiv(n // 2, bn) if self.paired else _cdiv(n, bn)

    @property
    def shape(self) -> tuple[int, int, int]:
        e, n, k = self.data.shape
        return e, n, k

    def expert(self, e: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Expert e's float matrix [N, K] in dtype (data · scale per block; exact in float64, one rounding in
        float32, as `dequantize`)."""
        _, n, k = self.shape
        bn, bk = self.block
        work = torch.float64 if dtype == torch.float64 else torch.float32
        r = torch.arange(n, device=self.data.device)
        rows = 2 * (r // 2 // bn) + r % 2 if self.paired else r // bn
        cols = torch.arange(k, device=self.data.device) // bk
        return (self.data[e].to(work) * self.scale[e].to(work)[rows][:, cols]).to(dtype)


@dataclass(frozen=True, kw_only=True, eq=False)
class Int4GroupStack:
    """A mixture-of-experts layer's E matrices in int4_group, stacked as kernels/ops.py MoEWeights holds them: data
    int32 [E, N, K/8] (each expert's rows in the internal layout: input 8c + j in nibble j of word c), scale
    [E, N, ceil(K/G)] in the checkpoint's float dtype, zero uint8 of the scale's shape or None (symmetric, zero
    8): W_e[n, k] = (u - zero[e, n, k // G]) · scale[e, n, k // G]. K is a multiple of 8 (8 · the words a row) and
    G a power of two >= 16 (the grouped kernels' tiles lie in one group). Scales are per row, so gate_up's
    interleaved gate/up rows need nothing more. Validated here: an inconsistent stack cannot exist."""

    data: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None = None
    group: int = 128

    def __post_init__(self) -> None:
        g = self.group
        _fail(self.data.dtype == torch.int32 and self.data.dim() == 3 and g >= 16 and g & (g - 1) == 0
              and self.scale.dtype in INT4_SCALE_DTYPES and list(self.scale.shape) == self.scale_shape
              and (self.zero is None or self.zero.dtype == torch.uint8 and list(self.zero.shape) == self.scale_shape)
              and len({t.device for t in (self.data, self.scale, self.zero) if t is not None}) == 1,
              f"int4 experts: need data int32 [E, N, K/8], scale float16/bfloat16/float32 and zero uint8 or None "
              f"[E, N, ceil(K/G)] on one device, G a power of two >= 16; got data {self.data.dtype} "
              f"{list(self.data.shape)}, scale {self.scale.dtype} {list(self.scale.shape)}, zero "
              f"{None if self.zero is None else (self.zero.dtype, list(self.zero.shape))}, group {g}")  # fmt: skip

    @property
    def shape(self) -> tuple[int, int, int]:
        """(E, N, K) of the float stack."""
        e, n, w = self.data.shape
        return e, n, w * PACK

    @property
    def scale_shape(self) -> list[int]:
        e, n, k = self.shape if self.data.dim() == 3 else (0, 0, 0)
        return [e, n, _cdiv(k, self.group)]

    def expert(self, e: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Expert e's float matrix [N, K] in dtype (exact in float32 and float64, as `dequantize`)."""
        _, n, k = self.shape
        zero = None if self.zero is None else self.zero[e]
        w = PackedWeight(scheme=INT4_GROUP, shape=(n, k), data=self.data[e], scale=self.scale[e], zero=zero,
                         group=self.group)  # fmt: skip
        return dequantize(w, dtype)


def stack_int4(weights: list[PackedWeight]) -> Int4GroupStack:
    """E int4_group weights of one shape and group (each expert's matrix as a from_* converter made it) -> the
    stack; zeros kept if any expert has them (the symmetric ones get zero 8)."""
    _fail(len(weights) > 0 and all(w.scheme == INT4_GROUP for w in weights), "stack_int4: give int4_group weights")
    first = weights[0]
    _fail(all(w.shape == first.shape and w.group == first.group for w in weights),
          f"stack_int4: experts differ in shape or group ({sorted({(w.shape, w.group) for w in weights})})")
    zero = None
    if any(w.zero is not None for w in weights):
        zero = torch.stack([torch.full_like(w.scale, SYMMETRIC_ZERO, dtype=torch.uint8) if w.zero is None else w.zero
                            for w in weights])  # fmt: skip
    return Int4GroupStack(data=torch.stack([w.data for w in weights]), scale=torch.stack([w.scale for w in weights]),
                          zero=zero, group=first.group)  # fmt: skip


# ---- the internal INT4 packing ------------------------------------------------------------------------------------


def pack_int4(u: torch.Tensor) -> torch.Tensor:
    """u [R, C] integers in 0..15 -> int32 [R, ceil(C/8)], value c of a row in bits 4(c % 8).. of word c // 8
    (the internal layout; padding nibbles are 0)."""
    r, c = u.shape
    padded = torch.zeros(r, _cdiv(c, PACK) * PACK, dtype=torch.int64, device=u.device)
    padded[:, :c] = u.to(torch.int64) & 0xF
    shifts = torch.arange(PACK, device=u.device, dtype=torch.int64) * 4
    words = (padded.view(r, -1, PACK) << shifts).sum(-1)  # [R, C/8] in 0..2^32-1
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # the same 32 bits as int32


def unpack_int4(words: torch.Tensor, cols: int) -> torch.Tensor:
    """pack_int4's inverse: int32 [R, W] -> uint8 [R, cols] in 0..15 (the first cols of the 8·W values)."""
    shifts = torch.arange(PACK, device=words.device, dtype=torch.int32) * 4
    nibbles = (words.to(torch.int32)[..., None] >> shifts) & 0xF  # [R, W, 8]; & 0xF undoes >>'s sign fill
    return nibbles.flatten(-2)[:, :cols].to(torch.uint8)


def _int4_weight(u_nk: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, group: int) -> PackedWeight:
    """The internal INT4 weight from unsigned codes u [N, K], scale and zero [N, ceil(K/G)] (zero in 0..16 or None);
    a zero that is 8 everywhere is the symmetric case and is dropped."""
    n, k = u_nk.shape
    if zero is not None and bool((zero == SYMMETRIC_ZERO).all()):
        zero = None
    z = None if zero is None else zero.to(torch.uint8).contiguous()
    return PackedWeight(scheme=INT4_GROUP, shape=(n, k), data=pack_int4(u_nk).contiguous(),
                        scale=scale.contiguous(), zero=z, group=group)  # fmt: skip


def _group_of(group_size: int | None, k: int) -> int:
    """A checkpoint's group size (None or -1: one group per row, "channel") as the internal group."""
    g = k if group_size in (None, -1) else int(group_size)
    return _cdiv(g, PACK) * PACK


# ---- loading each published layout ------------------------------------------------------------------------------


def fp8_block(weight: torch.Tensor, weight_scale_inv: torch.Tensor,
              block: tuple[int, int] = (128, 128)) -> PackedWeight:  # fmt: skip
    """DeepSeek-V3 / Qwen3-FP8 (`quant_method: fp8`, `weight_block_size`): weight float8_e4m3fn [N, K] and
    weight_scale_inv float32 [ceil(N/bn), ceil(K/bk)] (or float8_e8m0fnu where scale_fmt is "ue8m0": powers of
    two, widened to float32 exactly), W = weight · weight_scale_inv per block. The codes are kept as they are."""
    n, k = weight.shape
    return PackedWeight(scheme=FP8_BLOCK, shape=(n, k), data=weight.contiguous(),
                        scale=weight_scale_inv.to(torch.float32).contiguous(),
                        block=(int(block[0]), int(block[1])))  # fmt: skip


def fp8_channel(weight: torch.Tensor, weight_scale: torch.Tensor) -> PackedWeight:
    """compressed-tensors float-quantized, strategy "channel": weight float8_e4m3fn [N, K], weight_scale [N, 1] in the
    model's float dtype (or float32); the scale is widened to float32 (exact)."""
    n, k = weight.shape
    _fail(weight_scale.numel() == n, f"fp8 channel weight_scale: {tuple(weight_scale.shape)} must hold {n} scales")
    return PackedWeight(scheme=FP8_CHANNEL, shape=(n, k), data=weight.contiguous(),
                        scale=weight_scale.reshape(n).to(torch.float32).contiguous())  # fmt: skip


def fp8_tensor(weight: torch.Tensor, weight_scale: torch.Tensor) -> PackedWeight:
    """compressed-tensors float-quantized, strategy "tensor" (and `quant_method: fp8` without a block size):
    one scale for the whole matrix, weight_scale of one element ([], [1] or [1, 1])."""
    n, k = weight.shape
    _fail(weight_scale.numel() == 1, f"fp8 tensor weight_scale: {tuple(weight_scale.shape)} must hold one scale")
    return PackedWeight(scheme=FP8_TENSOR, shape=(n, k), data=weight.contiguous(),
                        scale=weight_scale.reshape(1).to(torch.float32).contiguous())  # fmt: skip


def from_pack_quantized(weight_packed: torch.Tensor, weight_scale: torch.Tensor,
                        weight_shape: torch.Tensor | tuple[int, int], group_size: int | None,
                        weight_zero_point: torch.Tensor | None = None) -> PackedWeight:  # fmt: skip
    """compressed-tensors pack-quantized, 4 bits (compressors/quantized_compressors/pack_quantized.py,
    pack_to_int32): each signed code q in -8..7 is stored as q + 8, eight per int32 along K, code 8c + j in bits
    4j..4j+3 of weight_packed[n, c] (K padded with zeros to a multiple of 8); weight_shape holds (N, K);
    weight_scale [N, ceil(K/G)]. An asymmetric weight_zero_point (signed, -8..7) is packed the same way but along
    the OUTPUT dim (packed_dim=0): [ceil(N/8), ceil(K/G)], zero of row 8r + j in bits 4j.. of word [r, g].
    W = (q - zero) · scale. The packing is already the internal one, so weight_packed is kept as it is."""
    n, k = (int(v) for v in (weight_shape.tolist() if isinstance(weight_shape, torch.Tensor) else weight_shape))
    g = _group_of(group_size, k)
    _fail(weight_packed.dtype == torch.int32 and tuple(weight_packed.shape) == (n, _cdiv(k, PACK)),
          f"weight_packed: must be int32 [{n}, {_cdiv(k, PACK)}] for weight_shape ({n}, {k}), got "
          f"{weight_packed.dtype} {tuple(weight_packed.shape)}")  # fmt: skip
    scale = weight_scale.reshape(n, -1)
    zero = None
    if weight_zero_point is not None:
        groups = scale.shape[1]
        _fail(weight_zero_point.dtype == torch.int32 and tuple(weight_zero_point.shape) == (_cdiv(n, PACK), groups),
              f"weight_zero_point: must be int32 [{_cdiv(n, PACK)}, {groups}] (packed along the output dim), got "
              f"{weight_zero_point.dtype} {tuple(weight_zero_point.shape)}")  # fmt: skip
        zero = unpack_int4(weight_zero_point.t(), n).t()  # [N, groups], stored q + 8 like the weight: internal as is
    return PackedWeight(scheme=INT4_GROUP, shape=(n, k), data=weight_packed.contiguous(), scale=scale.contiguous(),
                        zero=None if zero is None else zero.contiguous(), group=g)  # fmt: skip


def from_naive_int4(weight: torch.Tensor, weight_scale: torch.Tensor, group_size: int | None,
                    weight_zero_point: torch.Tensor | None = None) -> PackedWeight:  # fmt: skip
    """compressed-tensors naive-quantized, 4-bit int: weight int8 [N, K] holding the signed codes -8..7 unpacked,
    weight_scale and weight_zero_point (int8, signed) [N, ceil(K/G)]; W = (q - zero) · scale."""
    n, k = weight.shape
    _fail(weight.dtype == torch.int8, f"weight: naive-quantized int4 must be int8 codes, got {weight.dtype}")
    scale = weight_scale.reshape(n, -1)
    zero = None if weight_zero_point is None else weight_zero_point.reshape(n, -1).to(torch.int16) + SYMMETRIC_ZERO
    return _int4_weight(weight.to(torch.int16) + SYMMETRIC_ZERO, scale, zero, _group_of(group_size, k))


def from_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int | None) -> PackedWeight:
    """AutoAWQ's GEMM layout (`quant_method: awq`, version "gemm"; awq/modules/linear/gemm.py): packed along the
    OUTPUT dim, transposed: qweight int32 [K, N/8], the unsigned code of W[8c + AWQ_ORDER[i], k] in bits 4i..4i+3
    of qweight[k, c] (order 0 2 4 6 1 3 5 7: nibble i holds column AWQ_ORDER[i]); qzeros int32 [K/G, N/8] packed
    the same way; scales float16 [K/G, N]. W[n, k] = (u - zero) · scale, codes and zeros in 0..15."""
    k, nw = qweight.shape
    n = nw * PACK
    _fail(qweight.dtype == torch.int32 and qzeros.dtype == torch.int32, "awq: qweight and qzeros must be int32")
    _fail(scales.dim() == 2 and scales.shape[1] == n, f"awq scales: {tuple(scales.shape)} must be [K/G, {n}]")
    groups = scales.shape[0]
    _fail(tuple(qzeros.shape) == (groups, nw), f"awq qzeros: {tuple(qzeros.shape)} must be [{groups}, {nw}]")
    order = torch.tensor(AWQ_NIBBLE, device=qweight.device)

    def columns(packed: torch.Tensor) -> torch.Tensor:  # [R, N/8] -> [R, N] codes in column order
        nib = unpack_int4(packed, packed.shape[1] * PACK).view(packed.shape[0], -1, PACK)
        return nib[:, :, order].flatten(1)

    u = columns(qweight).t()  # [N, K]
    g = _group_of(group_size, k)
    _fail(groups == _cdiv(k, g), f"awq: {groups} scale rows, expected {_cdiv(k, g)} for K = {k}, group {g}")
    return _int4_weight(u, scales.t(), columns(qzeros).t(), g)


def from_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int | None,
              g_idx: torch.Tensor | None = None, *, zero_plus_one: bool = True) -> PackedWeight:  # fmt: skip
    """AutoGPTQ / GPTQModel (`quant_method: gptq`): qweight int32 [K/8, N] packed along the INPUT dim, W[n, 8r + j]'s
    unsigned code in bits 4j..4j+3 of qweight[r, n]; qzeros int32 [K/G, N/8] packed along the output dim, the zero
    of column 8c + j in bits 4j.. of qzeros[g, c]; scales float16 [K/G, N]; g_idx int32 [K], input k's group.
    checkpoint_format "gptq" (v1, zero_plus_one) stores zero - 1, so the zero is the nibble + 1 (a symmetric
    layer's qzeros are all 0x77777777: zero 8); "gptq_v2" stores the zero itself. W = (u - zero) · scale.
    Act-order checkpoints whose g_idx is not k // G are refused (the kernels read groups in input order)."""
    kw, n = qweight.shape
    k = kw * PACK
    _fail(qweight.dtype == torch.int32 and qzeros.dtype == torch.int32, "gptq: qweight and qzeros must be int32")
    _fail(scales.dim() == 2 and scales.shape[1] == n, f"gptq scales: {tuple(scales.shape)} must be [K/G, {n}]")
    groups = scales.shape[0]
    _fail(tuple(qzeros.shape) == (groups, _cdiv(n, PACK)),
          f"gptq qzeros: {tuple(qzeros.shape)} must be [{groups}, {_cdiv(n, PACK)}]")  # fmt: skip
    g = _group_of(group_size, k)
    _fail(groups == _cdiv(k, g), f"gptq: {groups} scale rows, expected {_cdiv(k, g)} for K = {k}, group {g}")
    if g_idx is not None:
        trivial = torch.arange(k, device=g_idx.device) // g
        _fail(g_idx.numel() == k and bool((g_idx.reshape(-1).to(trivial.dtype) == trivial).all()),
              "gptq g_idx: act-order (desc_act) groups are not supported; use a checkpoint quantized with "
              "desc_act false or static_groups true")  # fmt: skip
    u = unpack_int4(qweight.t(), k)  # [N, K]: word [r, n] -> row n, inputs 8r..8r+7
    zero = unpack_int4(qzeros, n).t().to(torch.int16) + (1 if zero_plus_one else 0)  # [N, groups] in 0..16
    return _int4_weight(u, scales.t(), zero, g)


def concat_outputs(parts: list[PackedWeight]) -> PackedWeight:
    """The weights of several projections over the same input stacked along N, as the model files fuse Q, K, V
    (and gate, up) into one projection; exact: dequantize(result) is the parts' dequantized rows stacked. INT4
    parts need one group size and scale dtype (a symmetric part gets zero 8 beside an asymmetric one); FP8 parts
    with different per-matrix scales become per-row scales; fp8_block parts need one block shape, and every part
    but the last a whole number of block rows (a block's rows cannot straddle two parts)."""
    _fail(len(parts) > 0, "concat_outputs: no weights given")
    first = parts[0]
    k = first.shape[1]
    _fail(all(p.shape[1] == k for p in parts), f"concat_outputs: input sizes {[p.shape[1] for p in parts]} differ")
    n = sum(p.shape[0] for p in parts)
    if first.scheme == INT4_GROUP:
        _fail(all(p.scheme == INT4_GROUP and p.group == first.group and p.scale.dtype == first.scale.dtype
                  for p in parts), "concat_outputs: INT4 parts need one group size and scale dtype")  # fmt: skip
        zero = None
        if any(p.zero is not None for p in parts):
            eights = [torch.full_like(p.scale, SYMMETRIC_ZERO, dtype=torch.uint8) for p in parts]
            zero = torch.cat([p.zero if p.zero is not None else e for p, e in zip(parts, eights, strict=True)])
        return PackedWeight(scheme=INT4_GROUP, shape=(n, k), data=torch.cat([p.data for p in parts]),
                            scale=torch.cat([p.scale for p in parts]), zero=zero, group=first.group)  # fmt: skip
    _fail(all(p.scheme != INT4_GROUP for p in parts), "concat_outputs: FP8 and INT4 parts cannot share a projection")
    data = torch.cat([p.data for p in parts])
    if any(p.scheme == FP8_BLOCK for p in parts):
        bn = first.block[0]
        _fail(all(p.scheme == FP8_BLOCK and p.block == first.block for p in parts),
              "concat_outputs: block-scaled FP8 parts need one block shape and no other FP8 scheme")  # fmt: skip
        _fail(all(p.shape[0] % bn == 0 for p in parts[:-1]),
              f"concat_outputs: row counts {[p.shape[0] for p in parts]} are not whole {bn}-row blocks")  # fmt: skip
        return PackedWeight(scheme=FP8_BLOCK, shape=(n, k), data=data, scale=torch.cat([p.scale for p in parts]),
                            block=first.block)  # fmt: skip
    if all(p.scheme == FP8_TENSOR for p in parts) and all(torch.equal(p.scale, first.scale) for p in parts):
        return PackedWeight(scheme=FP8_TENSOR, shape=(n, k), data=data, scale=first.scale.clone())
    rows = [p.scale if p.scheme == FP8_CHANNEL else p.scale.expand(p.shape[0]) for p in parts]
    return PackedWeight(scheme=FP8_CHANNEL, shape=(n, k), data=data, scale=torch.cat(rows).contiguous())


def keeps_blocks(rows: torch.Tensor, bn: int) -> bool:
    """Whether writing a matrix's rows at `rows` of another (its row j at rows[j]) moves each of its bn-row blocks
    whole onto one bn-row block, at the same offsets (a last, partial block too): then its fp8_block scales can move
    with the blocks (put_rows); else the target holds one scale row per row."""
    j = torch.arange(rows.numel(), device=rows.device)
    start = j - j % bn  # each row's block's first row
    return bool((rows % bn == j % bn).all() and (rows // bn == rows[start] // bn).all())


def put_rows(target: PackedWeight, rows: torch.Tensor, part: PackedWeight) -> None:
    """Write an fp8_block weight's rows into a larger fp8_block weight in place, target row rows[j] = part row j,
    exactly as dequantize sees them: a model gathers and reorders a checkpoint's rows into its fused matrices so,
    never dequantizing them. A target in the part's blocks takes each block's scales with it (the rows must move
    whole blocks: keeps_blocks); a target with one scale row per row (block (1, bk)) takes each row's block scales,
    repeated (4 bytes a row per bk inputs), as a row permutation across blocks needs."""
    (bn, bk), (n, k) = part.block, part.shape
    _fail(target.scheme == FP8_BLOCK and part.scheme == FP8_BLOCK and rows.shape == (n,) and target.shape[1] == k
          and target.block in ((bn, bk), (1, bk)) and bool(((rows >= 0) & (rows < target.shape[0])).all()),
          f"put_rows: fp8_block rows {part.shape} in block {part.block} into {target.scheme} {target.shape} in block "
          f"{target.block}: give one target row (< {target.shape[0]}) a row, the same inputs and block columns, and a "
          f"target in blocks of {bn} or 1 rows")  # fmt: skip
    rows = rows.to(target.data.device)
    target.data.view(torch.uint8)[rows] = part.data.view(torch.uint8)  # the codes' bytes (no FP8 index_copy on CPU)
    if target.block[0] == 1:
        target.scale[rows] = part.scale.repeat_interleave(bn, 0)[:n]
        return
    _fail(keeps_blocks(rows, bn), f"put_rows: the rows move parts of {bn}-row blocks, whose scales a target in "
                                  f"blocks of {bn} rows cannot hold; give a target in block (1, {bk})")  # fmt: skip
    target.scale[rows[::bn] // bn] = part.scale


# ---- reference: dequantize and multiply ----------------------------------------------------------------------------


def dequantize(w: PackedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The float weight [N, K] in dtype. Exact in float64; in float32, INT4 is exact ((u - zero) · scale needs at
    most 16 significant bits) and FP8 rounds once (the product of an e4m3 value and a float32 scale)."""
    n, k = w.shape
    work = torch.float64 if dtype == torch.float64 else torch.float32
    if w.scheme == INT4_GROUP:
        u = unpack_int4(w.data, k).to(work)
        zero = torch.full_like(w.scale, SYMMETRIC_ZERO, dtype=work) if w.zero is None else w.zero.to(work)
        cols = torch.arange(k, device=w.data.device) // w.group
        return ((u - zero[:, cols]) * w.scale.to(work)[:, cols]).to(dtype)
    data = w.data.to(work)
    if w.scheme == FP8_BLOCK:
        bn, bk = w.block
        rows = torch.arange(n, device=data.device) // bn
        cols = torch.arange(k, device=data.device) // bk
        return (data * w.scale.to(work)[rows][:, cols]).to(dtype)
    scale = w.scale.to(work)[:, None] if w.scheme == FP8_CHANNEL else w.scale.to(work)
    return (data * scale).to(dtype)


def quant_linear_reference(x: torch.Tensor, w: PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y [M, N] = x [M, K] @ dequantize(w)^T (+ bias), in x's dtype: the definition the kernels are checked
    against (with float64 x) and the dequantize-then-matmul path for batches past the GEMV's rows."""
    return torch.nn.functional.linear(x, dequantize(w, x.dtype), None if bias is None else bias.to(x.dtype))


# ---- quantizers ------------------------------------------------------------------------------------------------


def quantize_fp8(w: torch.Tensor, scheme: str = FP8_BLOCK, block: tuple[int, int] = (128, 128)) -> PackedWeight:
    """W [N, K] -> FP8 e4m3 in scheme (fp8_block, fp8_channel or fp8_tensor), scale = amax / 448 per block, row
    or matrix in float32, so each one's largest magnitude maps to 448; codes round to nearest even. A W that is
    already e4m3 codes times such scales comes back bit for bit."""
    _fail(w.dim() == 2, f"quantize_fp8: weight must be 2-D, got shape {tuple(w.shape)}")
    n, k = w.shape
    wf = w.detach().to(torch.float32)
    if scheme == FP8_BLOCK:
        bn, bk = block
        padded = torch.zeros(_cdiv(n, bn) * bn, _cdiv(k, bk) * bk, dtype=torch.float32, device=w.device)
        padded[:n, :k] = wf.abs()
        amax = padded.view(_cdiv(n, bn), bn, _cdiv(k, bk), bk).amax(dim=(1, 3))  # [N/bn, K/bk]
        scale = amax.clamp_min(torch.finfo(torch.float32).tiny) / FP8_MAX
        per = scale[torch.arange(n, device=w.device) // bn][:, torch.arange(k, device=w.device) // bk]
    elif scheme == FP8_CHANNEL:
        scale = wf.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny) / FP8_MAX  # [N]
        per = scale[:, None]
    elif scheme == FP8_TENSOR:
        scale = (wf.abs().amax().clamp_min(torch.finfo(torch.float32).tiny) / FP8_MAX).reshape(1)
        per = scale
    else:
        raise ValueError(f"quantize_fp8: scheme {scheme!r} is not FP8; use fp8_block, fp8_channel or fp8_tensor")
    data = (wf / per).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return PackedWeight(scheme=scheme, shape=(n, k), data=data, scale=scale.contiguous(),
                        block=(int(block[0]), int(block[1])) if scheme == FP8_BLOCK else (0, 0))  # fmt: skip


def quantize_fp8_stack(w: torch.Tensor, block: tuple[int, int] = (128, 128), *, paired: bool = False
                       ) -> FP8BlockStack:  # fmt: skip
    """A float expert stack [E, N, K] -> FP8BlockStack, each expert's matrix by quantize_fp8 (fp8_block); paired
    (gate_up, rows interleaved gate/up): the gate rows and the up rows each on their own, as a checkpoint stores
    them."""
    _fail(w.dim() == 3, f"quantize_fp8_stack: weights must be [E, N, K], got shape {tuple(w.shape)}")
    e, n, k = w.shape
    parts = 2 if paired else 1
    _fail(n % parts == 0, f"quantize_fp8_stack: {n} rows cannot interleave gate and up rows")
    data = torch.empty(w.shape, dtype=FP8_DTYPE, device=w.device)
    scale = torch.empty(e, parts * _cdiv(n // parts, block[0]), _cdiv(k, block[1]), device=w.device)
    for i in range(e):
        for p in range(parts):
            q = quantize_fp8(w[i, p::parts], FP8_BLOCK, block)
            data[i, p::parts], scale[i, p::parts] = q.data, q.scale
    return FP8BlockStack(data=data, scale=scale, block=block, paired=paired)


def _scale_at_least(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Positive float32 scales x in dtype, rounded up where the cast rounded down (one step of the 16-bit
    pattern), so no code needs more than its range: the quantizers' error bound holds with the stored scale."""
    y = x.to(dtype)
    if dtype == torch.float32:
        return y
    low = (y.to(torch.float32) < x).to(torch.int16)
    return (y.view(torch.int16) + low).view(dtype)


def quantize_int4(w: torch.Tensor, group: int = 128, *, symmetric: bool = True,
                  scale_dtype: torch.dtype = torch.bfloat16) -> PackedWeight:  # fmt: skip
    """W [N, K] -> int4_group with `group` inputs per scale (a multiple of 8). Symmetric: scale = amax / 7.5 and
    codes q = round(w / scale) clamped to -8..7, zero 8 (GPTQ's and compressed-tensors' choice: the 16 codes span
    [-amax, amax], the positive end clips by half a step). Asymmetric: the group's range [min(w, 0), max(w, 0)]
    over 15 steps, zero = round(-min / scale) in 0..15 (GPTQ's and AWQ's). Codes are rounded with the scale as
    stored in scale_dtype (rounded up where the cast would round down), so |dequantize - W| <= scale / 2."""
    _fail(w.dim() == 2, f"quantize_int4: weight must be 2-D, got shape {tuple(w.shape)}")
    _fail(group > 0 and group % PACK == 0, f"quantize_int4: group {group} must be a positive multiple of {PACK}")
    n, k = w.shape
    groups = _cdiv(k, group)
    padded = torch.zeros(n, groups * group, dtype=torch.float32, device=w.device)
    padded[:, :k] = w.detach().to(torch.float32)
    g = padded.view(n, groups, group)  # [N, G, group]; padding zeros never widen a range that contains 0
    tiny = torch.finfo(torch.float32).tiny
    if symmetric:
        scale = _scale_at_least(g.abs().amax(-1).clamp_min(tiny) / 7.5, scale_dtype)
        zero = torch.full((n, groups), SYMMETRIC_ZERO, dtype=torch.float32, device=w.device)
    else:
        lo, hi = g.amin(-1).clamp(max=0.0), g.amax(-1).clamp(min=0.0)
        scale = _scale_at_least((hi - lo).clamp_min(tiny) / 15.0, scale_dtype)
        zero = torch.round(-lo / scale.to(torch.float32)).clamp(0, 15)
    s = scale.to(torch.float32)[..., None]
    u = (torch.round(g / s) + zero[..., None]).clamp(0, 15).view(n, -1)[:, :k]
    return _int4_weight(u.to(torch.uint8), scale, None if symmetric else zero.to(torch.uint8), group)


def quantize_int4_stack(w: torch.Tensor, group: int = 128, *, symmetric: bool = True,
                        scale_dtype: torch.dtype = torch.bfloat16) -> Int4GroupStack:  # fmt: skip
    """A float expert stack [E, N, K] -> Int4GroupStack, each expert's matrix by quantize_int4."""
    _fail(w.dim() == 3, f"quantize_int4_stack: weights must be [E, N, K], got shape {tuple(w.shape)}")
    return stack_int4([quantize_int4(m, group, symmetric=symmetric, scale_dtype=scale_dtype) for m in w])
