"""Helpers the kernel launchers share: one-line argument checks and interpreter detection; and Triton's key for its
C modules pinned so that it does not depend on the `file` tool (pin_platform_key)."""

from __future__ import annotations

import functools
import os
import platform
import struct
import sys

import torch
import triton
import triton.language as tl
import triton.runtime.build

# Triton's CPU interpreter (TRITON_INTERPRET=1, how CI runs these kernels) multiplies bf16 `tl.dot` operands as
# raw uint16 bit patterns (triton 3.9 interpreter.create_dot), so kernels that use tl.dot upcast their operands
# to fp32 when this is set. Triton itself reads this variable at import time; we read it once, here, for the
# same decision, and pass it down as a constexpr so the GPU code is unchanged.
INTERPRETING: bool = os.environ.get("TRITON_INTERPRET", "0") == "1"

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def pin_platform_key() -> None:
    """Triton keys its C modules (the driver's cuda_utils, each kernel's launcher) by triton.runtime.build's
    platform_key(), which ends with platform.architecture(): that asks the `file` tool about the Python binary and,
    where `file` is missing, answers ('64bit', '') instead of ('64bit', 'ELF'). A host without it (a minimal
    appliance, or a PATH cut down to keep compilers out) then looks every C module of a kernel bundle up under other
    keys, misses them all and needs a C compiler after all (H100, 2026-12-07: a fresh engine with PATH holding only
    python missed cuda_utils). Pinned to what `file` answers on Linux, computed without it: the same keys as before
    wherever `file` is installed."""
    if not sys.platform.startswith("linux") or not hasattr(triton.runtime.build, "platform_key"):
        return
    key = ",".join([platform.machine(), platform.system(), f"{struct.calcsize('P') * 8}bit", "ELF"])
    triton.runtime.build.platform_key = functools.cache(lambda: key)


pin_platform_key()  # before any launch: the driver's module is keyed at the first

_L2_LINE = tl.constexpr("{ .reg .pred p; setp.ne.s32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.b32 $0, 0; }")


@triton.jit
def prefetch_l2(ptrs, on):
    """Ask L2 for the 128-byte line at each pointer of ptrs where on (int32, same shape) is not 0: fire and forget,
    nothing waits on it or holds it in a register. PTX only: the interpreter has no cache, so callers skip it there."""
    tl.inline_asm_elementwise(_L2_LINE, "=r,l,r", [ptrs, on], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def round_as(x, dtype: tl.constexpr):
    """fp32 x rounded to `dtype` (round to nearest, ties to even) and back to fp32, for kernels that round where HF
    rounds. For bf16 with integer operations: a conversion instruction (F2F) runs at a quarter of the ALU rate on
    Hopper, and two a SwiGLU element made the 14,336-wide down projection's prologue 1.8% of a Llama-8B step (H100,
    2026-12-06, the journal); the bit trick is the same rounding for every finite value, and also the interpreter's
    (its fp32 -> bf16 cast truncates)."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    else:
        return x.to(dtype).to(tl.float32)


# The deterministic mode's short launches between two projections (the norm adding O's or down's pieces, the
# SwiGLU pass, the reduce, the attention merge) let the next launch start only after their own wait has returned:
# the projection after them, which asks L2 for its first weight columns before it waits
# (invariant_matmul.WARM_K), is then resident only once the projection before has finished and HBM is idle. A
# schedule, never a bit; read at launch time (verify/lab/journal-kernels.md, "The short launches trigger after their
# wait").
LATE_TRIGGER = True


@triton.jit
def pdl_enter(USE_PDL: tl.constexpr, LATE: tl.constexpr):
    """A programmatic dependent launch's entry: let the next launch start, then wait for the previous one, so the
    next launch's programs are resident (and waiting) before this one ends. LATE: wait first, then let the next
    launch start, so none of its programs runs before the previous launch has finished."""
    if USE_PDL:
        if LATE:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        else:
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()


def check(cond: bool, message: str) -> None:
    """Raise one ValueError naming the input and what to do, the launchers' only error."""
    if not cond:
        raise ValueError(message)


def check_tensor(
    name: str,
    t: torch.Tensor,
    *,
    ndim: int,
    dtypes: tuple[torch.dtype, ...] | None = None,
    last_contiguous: bool = True,
    device: torch.device | None = None,
) -> None:
    """Check rank, dtype, unit stride of the last dim and device of one kernel argument."""
    check(isinstance(t, torch.Tensor), f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    check(t.dim() == ndim, f"{name}: expected {ndim} dims, got shape {tuple(t.shape)}")
    if dtypes is not None:
        check(t.dtype in dtypes, f"{name}: dtype {t.dtype} not supported; use one of {[str(d) for d in dtypes]}")
    if last_contiguous and t.numel() > 0:
        check(t.stride(-1) == 1, f"{name}: last dim must have stride 1 (got strides {t.stride()}); pass .contiguous()")
    if device is not None:
        check(t.device == device, f"{name}: on {t.device}, expected {device} like the other inputs")


def check_paged_attention_inputs(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
                                 ) -> tuple[int, int, int, int, int]:  # fmt: skip
    """The checks every paged-attention launcher makes on packed queries q [T, Hq, D] and caches [num_blocks,
    block_size, Hkv, D] -> (T, Hq, D, block_size, Hkv)."""
    check_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES)
    num_tokens, n_q, head_dim = q.shape
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        check_tensor(name, c, ndim=4, dtypes=(q.dtype,), device=q.device)
        check(c.shape[3] == head_dim, f"{name}: head_dim {c.shape[3]} != q head_dim {head_dim}")
    check(k_cache.shape == v_cache.shape and k_cache.stride() == v_cache.stride(),
          "v_cache: must have k_cache's shape and strides")  # fmt: skip
    page, n_kv = k_cache.shape[1], k_cache.shape[2]
    check(page >= 1 and page & (page - 1) == 0, f"k_cache: block_size {page} must be a power of two")
    check(n_q % n_kv == 0, f"q: {n_q} query heads is not a multiple of {n_kv} KV heads")
    return num_tokens, n_q, head_dim, page, n_kv


def pdl_launch(pdl: bool) -> dict[str, bool]:
    """Launch options for programmatic dependent launch; empty when off (the interpreter knows no such option)."""
    return {"launch_pdl": True} if pdl else {}


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def pow2_floor(n: int) -> int:
    """The largest power of two ≤ n (n ≥ 1)."""
    return 1 << (int(n).bit_length() - 1)


def padded_rows(n: int) -> int:
    """n rounded up to a multiple of 16, for the row count of a per-step scratch buffer: Triton specialises an
    integer argument on divisibility by 16 (and on == 1), so a stride that is a multiple of a step's row count
    would make each step shape its own compiled variant; a padded one is always in the same class."""
    return -(-int(n) // 16) * 16


_COUNTERS: dict[tuple[str, torch.device], torch.Tensor] = {}
_RETIRED: list[torch.Tensor] = []  # outgrown counters that graphs captured earlier may still address


def arrival_counters(owner: str, device: torch.device, n: int, *, least: int = 4096) -> torch.Tensor:
    """At least n zeroed int32 arrival counters for the kernels of `owner` (the last program of a group to arrive
    does the group's ordered sum and resets its counter, so every launch leaves them zero and a CUDA graph replay
    finds them so). Made outside any graph capture (`least` of them the first time); a larger need takes a new
    buffer and keeps the old one, which graphs captured earlier may still use. One buffer per owner and device: an
    owner's launches must not overlap on two streams of one device."""
    have = _COUNTERS.get((owner, device))
    if have is None or have.numel() < n:
        check(device.type != "cuda" or not torch.cuda.is_current_stream_capturing(),
              f"{owner}: run it once before capturing a CUDA graph (it allocates its arrival counters)")  # fmt: skip
        if have is not None:
            _RETIRED.append(have)
        have = torch.zeros(max(n, least), dtype=torch.int32, device=device)
        _COUNTERS[(owner, device)] = have
    return have


@triton.jit
def load_kv_tile(k_cache_ptr, v_cache_ptr, block_tables_ptr, b, kvh, kpos, k_ok, d, d_ok, stride_kb, stride_ks,
                 stride_kh, stride_bt, PAGE: tl.constexpr):  # fmt: skip
    """The keys and values at positions kpos [N] of sequence b's KV head kvh, gathered token by token through its
    block table from the paged cache [blocks, PAGE, Hkv, D] -> k, v [N, D] (0 where not k_ok or not d_ok). The one
    paged-KV tile load of the attention kernels (attention.py, invariant_attention.py)."""
    blk = tl.load(block_tables_ptr + b * stride_bt + kpos // PAGE, mask=k_ok, other=0).to(tl.int64)
    kv_off = blk * stride_kb + (kpos % PAGE) * stride_ks + kvh * stride_kh  # [N]
    kv_mask = k_ok[:, None] & d_ok[None, :]
    k = tl.load(k_cache_ptr + kv_off[:, None] + d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(v_cache_ptr + kv_off[:, None] + d[None, :], mask=kv_mask, other=0.0)
    return k, v


@triton.jit
def exact_dot(a, b):
    """a @ b (float32 accumulation); float32 operands at float32 precision. Triton's default for them is TF32 (10
    mantissa bits), which sets a float32 model's tiles of several rows (verify steps, prefill: dots) ~1e-3 apart
    from its decode step's GEMVs (elementwise float32) and flips near-ties between the two; bf16 and fp16 operands
    are exact either way, so no bf16 or fp16 kernel changes."""
    if a.dtype == tl.float32:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)
