"""The published low-bit packings, written here from each format's own definition and independently of
kernels/quant.py (numpy uint32 words and per-nibble loops, as the formats' reference packers write them), so the
tests check envex's readers against the layout, not against themselves.

Each packer takes integer codes in the format's own convention and returns what a checkpoint stores:
  compressed-tensors pack_to_int32 (pack-quantized): signed q in -8..7 stored as q + 8; along dim 1 by default,
    element 8c + i in bits 4i of word c; zero points along dim 0 (packed_dim=0).
  AutoAWQ WQLinear_GEMM.from_linear: intweight [K, N]; word c of row k holds column 8c + order_map[i] in bits 4i,
    order_map = [0, 2, 4, 6, 1, 3, 5, 7]; qzeros [K/G, N/8] the same.
  AutoGPTQ QuantLinear.pack: intweight [K, N]; qweight[r] |= intweight[8r + j] << 4j (along K); qzeros [K/G, N/8]
    along N, sequential, storing zero - 1 in the v1 format.
"""

from __future__ import annotations

import numpy as np
import torch

AWQ_ORDER_MAP = [0, 2, 4, 6, 1, 3, 5, 7]


def _words(acc: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(acc.astype(np.uint32).view(np.int32).copy())


def ct_pack(q: torch.Tensor, packed_dim: int = 1) -> torch.Tensor:
    """compressed-tensors pack_to_int32(q, 4, packed_dim): q int [R, C] in -8..7 -> int32."""
    u = (q.numpy().astype(np.int64) + 8).astype(np.uint32)
    if packed_dim == 0:
        u = u.T
    rows, cols = u.shape
    pad = (-cols) % 8
    u = np.pad(u, ((0, 0), (0, pad)))
    acc = np.zeros((rows, (cols + pad) // 8), dtype=np.uint32)
    for i in range(8):
        acc |= u[:, i::8] << np.uint32(4 * i)
    out = _words(acc)
    return out.t().contiguous() if packed_dim == 0 else out


def awq_pack(int_kn: torch.Tensor) -> torch.Tensor:
    """AutoAWQ's GEMM packing of unsigned codes intweight [K, N] (or zeros [K/G, N]) -> int32 [K, N/8]."""
    iw = int_kn.numpy().astype(np.uint32)
    acc = np.zeros((iw.shape[0], iw.shape[1] // 8), dtype=np.uint32)
    for col in range(iw.shape[1] // 8):
        for i in range(8):
            acc[:, col] |= iw[:, col * 8 + AWQ_ORDER_MAP[i]] << np.uint32(i * 4)
    return _words(acc)


def gptq_pack_weight(int_kn: torch.Tensor) -> torch.Tensor:
    """AutoGPTQ's qweight: unsigned codes intweight [K, N] -> int32 [K/8, N], packed along K."""
    iw = int_kn.numpy().astype(np.uint32)
    acc = np.zeros((iw.shape[0] // 8, iw.shape[1]), dtype=np.uint32)
    i, row = 0, 0
    while row < acc.shape[0]:
        for j in range(i, i + 8):
            acc[row] |= iw[j] << np.uint32(4 * (j - i))
        i += 8
        row += 1
    return _words(acc)


def gptq_pack_zeros(zeros_gn: torch.Tensor, v1: bool = True) -> torch.Tensor:
    """AutoGPTQ's qzeros: zero points [K/G, N] (v1: stored minus one) -> int32 [K/G, N/8], packed along N."""
    z = zeros_gn.numpy().astype(np.int64) - (1 if v1 else 0)
    assert (z >= 0).all(), "v1 stores zero - 1: a zero of 0 would wrap (the format's known flaw)"
    z = z.astype(np.uint32)
    acc = np.zeros((z.shape[0], z.shape[1] // 8), dtype=np.uint32)
    i, col = 0, 0
    while col < acc.shape[1]:
        for j in range(i, i + 8):
            acc[:, col] |= z[:, j] << np.uint32(4 * (j - i))
        i += 8
        col += 1
    return _words(acc)


def int4_reference(q_minus_z: torch.Tensor, scale_ng: torch.Tensor, group: int) -> torch.Tensor:
    """W [N, K] in float64 from (code - zero) [N, K] and scales [N, K/G]: the formats' shared definition."""
    k = q_minus_z.shape[1]
    return q_minus_z.double() * scale_ng.double().repeat_interleave(group, dim=1)[:, :k]
