"""TritonOps: the engine's fused operations on the Triton kernels, method for method like TorchOps.

envex.runtime.engine.torch_ops.TorchOps is the reference; the gates prove the two agree. Projections stay with
torch (cuBLAS) except at one row (batch-1 decode), where `linear` and the fused prologue variants use the GEMV
kernel, which reads the weight once and folds the norm or the activation into the same pass.
"""

from __future__ import annotations

import torch

from envex.kernels import activation, attention, gemv, norm, rotary


class TritonOps:
    name = "triton"

    def __init__(self, *, gemv_max_rows: int = 1) -> None:
        # Above this many rows, cuBLAS matmul beats re-reading the weight per row in the GEMV kernel.
        self.gemv_max_rows = gemv_max_rows

    @staticmethod
    def _rows(x: torch.Tensor) -> torch.Tensor:
        return x.reshape(-1, x.shape[-1])  # [..., H] -> [T, H] (copies only if the view is impossible)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return norm.rms_norm(self._rows(x), weight, eps).view(x.shape)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        normed, total = norm.add_rms_norm(self._rows(x), self._rows(residual), weight, eps)
        return normed.view(x.shape), total.view(x.shape)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        out = activation.silu_and_mul(self._rows(x))
        return out.view(*x.shape[:-1], out.shape[-1])

    def rotary_and_store_kv(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                            cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        return rotary.rotary_and_store_kv(q, k, v, positions, cos, sin, k_cache, v_cache, slot_mapping)

    def attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta) -> torch.Tensor:
        """meta: envex.runtime.engine.attention.AttentionMetadata (only its paged fields are read)."""
        return attention.paged_attention(
            q, k_cache, v_cache, meta.cu_seqlens_q, meta.seq_lens, meta.block_tables, meta.scale,
            max_q_len=meta.max_q_len, max_seq_len=meta.max_seq_len,
        )  # fmt: skip

    # ---- projections (beyond TorchOps: a model may call these, or torch.nn.functional.linear) -------------

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        rows = self._rows(x)
        if bias is not None or rows.shape[0] > self.gemv_max_rows or not x.is_cuda:
            return torch.nn.functional.linear(x, weight, bias)
        y, _ = gemv.gemv(rows, weight)
        return y.view(*x.shape[:-1], weight.shape[0])

    def add_rms_norm_linear(self, x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                            weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """(linear(rms_norm(x + residual)), x + residual) in one pass over the weight when x has one row."""
        if x.shape[0] > self.gemv_max_rows or not x.is_cuda:
            normed, total = self.add_rms_norm(x, residual, norm_weight, eps)
            return torch.nn.functional.linear(normed, weight), total
        y, total = gemv.gemv(x, weight, prologue=gemv.PROLOGUE_ADD_RMS, b=residual, norm_weight=norm_weight, eps=eps)
        assert total is not None
        return y, total

    def silu_and_mul_linear(self, gate_up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """linear(silu_and_mul(gate_up)) in one pass over the weight when gate_up has one row."""
        if gate_up.shape[0] > self.gemv_max_rows or not gate_up.is_cuda:
            return torch.nn.functional.linear(self.silu_and_mul(gate_up), weight)
        y, _ = gemv.gemv(gate_up, weight, prologue=gemv.PROLOGUE_SILU_MUL)
        return y
