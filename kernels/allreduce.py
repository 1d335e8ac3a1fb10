"""One-shot all-reduce over peer memory (tensor parallelism's small messages), alone or fused with the residual add
and RMSNorm that follow it in a Llama layer.

Every rank owns one buffer that all ranks can address (torch symmetric memory: the peers' buffers are mapped into
each GPU's address space over NVLink; no multicast object is ever made) and a pad of int32 flags. A launch:

1. each program copies its share of this rank's input into this rank's buffer, and takes its next epoch (a
   per-program call counter kept in its own pad: the same on every rank, as every rank makes the same calls);
2. barrier in: it writes the epoch into its flag in every peer's pad (a release store: nothing to wait for) and
   waits until every peer's matching flag in its own pad holds the epoch (acquire): the peers' shares are written;
3. it reads the same share from every rank's buffer, always in rank order 0..W-1, and sums in fp32: every rank
   gets the same bits (the replicated residual stream stays identical across ranks);
4. barrier out, on a second set of flags: no peer may overwrite its buffer (the next all-reduce's step 1) before
   every rank has read it. The next launch starts only when every program of this one has passed it, so this
   holds whatever the next launch's partition into programs.

Flags are compared for equality with the epoch, which wraps: nothing is reset between launches, a CUDA graph can
replay them, and no peer can get two epochs ahead (it would first need our barrier-out flag). Program p on rank r
pairs with program p on every peer only, so the launch is limited to programs that are resident at once
(MAX_PROGRAMS); each loops over its tiles. The pattern is the one-shot all-reduce of vLLM's custom_all_reduce.cuh
(flags holding a counter, blockwise barriers) and PyTorch's symmetric-memory one_shot_all_reduce, in Triton.

Pointer tables are int64 device tensors of addresses, [W] each: buf_ptrs (the ranks' buffers) and pad_ptrs (their
pads, each int32: [2, MAX_PROGRAMS, MAX_WORLD] flags (barrier, program, sender), then [MAX_PROGRAMS] epochs).
Under TRITON_INTERPRET=1 ordinary CPU tensors stand in for the peers (tests/test_kernels_allreduce.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from envex.kernels._common import FLOAT_DTYPES, check, check_tensor, next_pow2, pdl_launch

MAX_WORLD = 8
# Programs of one launch that can all be resident on an H100/H200 (132 SMs) beside whatever else runs: a program
# spins until its peers' matching programs arrive, so every program must be running, never queued.
MAX_PROGRAMS = 64
FLAG_INTS = 2 * MAX_PROGRAMS * MAX_WORLD
PAD_INTS_PER_RANK = FLAG_INTS + MAX_PROGRAMS  # the flags, then each program's epoch
_PROGRAMS: tl.constexpr = tl.constexpr(MAX_PROGRAMS)
_WORLD: tl.constexpr = tl.constexpr(MAX_WORLD)


@triton.jit
def _next_epoch(pad_ptrs, pid, rank):
    """This program's call count, kept in its own pad (the previous launch has ended: no other program touches
    it). One atomic increment, made by one thread and its result shared by all: a load and a store by every
    thread let a warp that reached here late read the count a faster warp had already stored, hold the next
    epoch, and wait forever for a flag no peer would post (the TP=2 hangs of verify/lab/journal-kernels.md, "The TP=2
    hang")."""
    counter = tl.load(pad_ptrs + rank).to(tl.pointer_type(tl.int32)) + 2 * _PROGRAMS * _WORLD + pid
    return tl.atomic_add(counter, 1, sem="relaxed", scope="gpu") + 1


@triton.jit
def _barrier(pad_ptrs, which, pid, rank, epoch, WORLD: tl.constexpr):
    """Post this program's epoch to every peer, then wait for every peer's (see above)."""
    tl.debug_barrier()  # every thread's stores before the (one-thread) release
    slot = (which * _PROGRAMS + pid) * _WORLD  # [2, MAX_PROGRAMS, MAX_WORLD] flags per rank
    for q in tl.static_range(WORLD):
        if q != rank:
            peer = tl.load(pad_ptrs + q).to(tl.pointer_type(tl.int32))
            tl.atomic_xchg(peer + slot + rank, epoch, sem="release", scope="sys")  # result unused: no round trip
    own = tl.load(pad_ptrs + rank).to(tl.pointer_type(tl.int32))
    for q in tl.static_range(WORLD):
        if q != rank:
            seen = tl.atomic_add(own + slot + q, 0, sem="acquire", scope="sys")
            while seen != epoch:
                seen = tl.atomic_add(own + slot + q, 0, sem="acquire", scope="sys")
    tl.debug_barrier()  # the acquire before any thread's loads


@triton.jit
def _all_reduce_kernel(inp_ptr, out_ptr, buf_ptrs, pad_ptrs, n, rank,
                       tiles, WORLD: tl.constexpr, SYNC: tl.constexpr, BLOCK: tl.constexpr,
                       USE_PDL: tl.constexpr):  # fmt: skip
    if USE_PDL:  # the next kernel (a GEMV) may start streaming its weight now; our input is the previous kernel's
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    dtype = inp_ptr.dtype.element_ty
    # The buffers are allocations of their own (16-byte aligned at least): said so, the loads are 16-byte vectors.
    own = tl.multiple_of(tl.load(buf_ptrs + rank).to(tl.pointer_type(dtype)), 16)
    for t in range(tiles):  # tiles pid, pid + programs, ...
        offs = (pid + t * programs).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(own + offs, tl.load(inp_ptr + offs, mask=mask), mask=mask)
    epoch = 0
    if SYNC:
        epoch = _next_epoch(pad_ptrs, pid, rank)
        _barrier(pad_ptrs, 0, pid, rank, epoch, WORLD)
    for t in range(tiles):
        offs = (pid + t * programs).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for q in tl.static_range(WORLD):  # rank order: the same sum on every rank
            buf = tl.multiple_of(tl.load(buf_ptrs + q).to(tl.pointer_type(dtype)), 16)
            acc += tl.load(buf + offs, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
        tl.store(out_ptr + offs, acc.to(dtype), mask=mask)
    if SYNC:
        _barrier(pad_ptrs, 1, pid, rank, epoch, WORLD)


@triton.jit
def _all_reduce_add_rms_norm_kernel(
    inp_ptr, res_ptr, w_ptr, out_ptr, sum_ptr, buf_ptrs, pad_ptrs, rows, H, eps, rank, rows_per_program,
    WORLD: tl.constexpr, SYNC: tl.constexpr, HAS_RESIDUAL: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    dtype = inp_ptr.dtype.element_ty
    cols = tl.arange(0, BLOCK_H)
    cmask = cols < H
    own = tl.multiple_of(tl.load(buf_ptrs + rank).to(tl.pointer_type(dtype)), 16)
    for i in range(rows_per_program):  # rows pid, pid + programs, ... (x, residual, outputs contiguous [T, H])
        row = (pid + i * programs).to(tl.int64)
        mask = cols < tl.where(row < rows, H, 0)  # a row past the last: nothing
        tl.store(own + row * H + cols, tl.load(inp_ptr + row * H + cols, mask=mask), mask=mask)
    epoch = 0
    if SYNC:
        epoch = _next_epoch(pad_ptrs, pid, rank)
        _barrier(pad_ptrs, 0, pid, rank, epoch, WORLD)
    for i in range(rows_per_program):
        row = (pid + i * programs).to(tl.int64)
        mask = cols < tl.where(row < rows, H, 0)  # a row past the last: nothing
        acc = tl.zeros([BLOCK_H], dtype=tl.float32)
        for q in tl.static_range(WORLD):
            buf = tl.multiple_of(tl.load(buf_ptrs + q).to(tl.pointer_type(dtype)), 16)
            acc += tl.load(buf + row * H + cols, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
        x = acc.to(dtype)  # what an all-reduce returns, rounded as NCCL's output is
        if HAS_RESIDUAL:  # then add_rms_norm exactly as kernels/norm.py: the sum rounded before the norm
            r = tl.load(res_ptr + row * H + cols, mask=mask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(dtype)
        tl.store(sum_ptr + row * H + cols, x, mask=mask)
        xf = x.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / H + eps)
        normed = (xf * rstd).to(dtype).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * H + cols, (normed * w).to(dtype), mask=mask)
    if SYNC:
        _barrier(pad_ptrs, 1, pid, rank, epoch, WORLD)


def _check_tables(buf_ptrs: torch.Tensor, pad_ptrs: torch.Tensor, rank: int, device: torch.device) -> int:
    world = buf_ptrs.shape[0]
    check(buf_ptrs.dtype == torch.int64 and pad_ptrs.dtype == torch.int64, "buf_ptrs, pad_ptrs: int64 addresses")
    check(buf_ptrs.device == device and pad_ptrs.device == device, "buf_ptrs, pad_ptrs: on the input's device")
    check(pad_ptrs.shape == buf_ptrs.shape, f"pad_ptrs: {tuple(pad_ptrs.shape)} != buf_ptrs {tuple(buf_ptrs.shape)}")
    check(2 <= world <= MAX_WORLD, f"buf_ptrs: {world} ranks; the one-shot all-reduce takes 2..{MAX_WORLD}")
    check(0 <= rank < world, f"rank: {rank} is not in 0..{world - 1}")
    return world


def one_shot_all_reduce(
    x: torch.Tensor,
    buf_ptrs: torch.Tensor,
    pad_ptrs: torch.Tensor,
    rank: int,
    *,
    buffer_elems: int,
    sync: bool = True,
    out: torch.Tensor | None = None,
    pdl: bool = False,
) -> torch.Tensor:
    """The sum over ranks of x (contiguous, any shape), as every rank's copy of it. buffer_elems: the capacity of
    each rank's buffer in x's dtype. sync=False skips the barriers (tests, where one process plays every rank).
    pdl: launch with programmatic dependent launch (Hopper): the kernel waits for its predecessor before reading x,
    and lets its successor start at once. The engine does not set it: at 70B TP=2 it measured no faster
    (verify/lab/journal-kernels.md, "The TP=2 hang", where it also ran without hanging once the epoch count was one
    atomic)."""
    world = _check_tables(buf_ptrs, pad_ptrs, rank, x.device)
    check(x.dtype in FLOAT_DTYPES, f"x: dtype {x.dtype} not supported")
    check(x.is_contiguous(), "x: must be contiguous")
    n = x.numel()
    check(n <= buffer_elems, f"x: {n} elements > the peer buffer's {buffer_elems}; use NCCL for this size")
    out = torch.empty_like(x) if out is None else out
    block = 1024 if n <= 64 * 1024 else 4096
    tiles = triton.cdiv(n, block)
    programs = min(tiles, MAX_PROGRAMS)
    _all_reduce_kernel[(programs,)](x, out, buf_ptrs, pad_ptrs, n, rank, triton.cdiv(tiles, programs),
                                    WORLD=world, SYNC=sync, BLOCK=block, USE_PDL=pdl, num_warps=4,
                                    **pdl_launch(pdl))  # fmt: skip
    return out


def one_shot_all_reduce_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, buf_ptrs: torch.Tensor,
    pad_ptrs: torch.Tensor, rank: int, *, buffer_elems: int, sync: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(rms_norm(all_reduce(x) + residual), all_reduce(x) + residual) in one launch; residual None: no add.
    x, residual [T, H] contiguous."""
    world = _check_tables(buf_ptrs, pad_ptrs, rank, x.device)
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    check(x.is_contiguous(), "x: must be contiguous")
    rows, hidden = x.shape
    check_tensor("weight", weight, ndim=1, dtypes=(x.dtype,), device=x.device)
    check(weight.shape[0] == hidden, f"weight: length {weight.shape[0]} != hidden size {hidden} of x")
    if residual is not None:
        check_tensor("residual", residual, ndim=2, dtypes=(x.dtype,), device=x.device)
        check(residual.shape == x.shape and residual.is_contiguous(),
              f"residual: shape {tuple(residual.shape)} must equal x's {tuple(x.shape)}, contiguous")  # fmt: skip
    check(x.numel() <= buffer_elems, f"x: {x.numel()} elements > the peer buffer's {buffer_elems}; use NCCL")
    check(hidden <= 16384, f"x: hidden size {hidden} > 16384 is not supported by the fused kernel")
    out, total = torch.empty_like(x), torch.empty_like(x)
    programs = min(rows, MAX_PROGRAMS)
    _all_reduce_add_rms_norm_kernel[(programs,)](
        x, residual if residual is not None else x, weight, out, total, buf_ptrs, pad_ptrs, rows, hidden, eps, rank,
        triton.cdiv(rows, programs), WORLD=world, SYNC=sync, HAS_RESIDUAL=residual is not None,
        BLOCK_H=next_pow2(hidden), num_warps=8 if hidden >= 4096 else 4,
    )  # fmt: skip
    return out, total
