"""The one-shot all-reduce kernels (kernels/allreduce.py) under the interpreter: one process plays every rank, with
ordinary CPU tensors standing in for the peers' buffers and flag pads."""

import os

import pytest
import torch

from envex.kernels import allreduce
from envex.kernels import reference as ref
from envex.tests.support.kernels import assert_close, f64

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


class FakePeers:
    """What symmetric memory gives each rank: W buffers and W pads, and tables of their addresses."""

    def __init__(self, world: int, elems: int, dtype: torch.dtype) -> None:
        self.bufs = [torch.full((elems,), float("nan"), dtype=dtype, device=DEV) for _ in range(world)]
        self.pads = [torch.zeros(allreduce.PAD_INTS_PER_RANK, dtype=torch.int32, device=DEV) for _ in range(world)]
        self.buf_ptrs = torch.tensor([b.data_ptr() for b in self.bufs], dtype=torch.int64, device=DEV)
        self.pad_ptrs = torch.tensor([p.data_ptr() for p in self.pads], dtype=torch.int64, device=DEV)
        self.elems = elems

    def stage(self, parts: list[torch.Tensor], skip: int) -> None:
        """The peers' step 1 (their shares copied in), done for every rank but `skip`, the one the kernel plays."""
        for r, part in enumerate(parts):
            if r != skip:
                self.bufs[r][: part.numel()].copy_(part.reshape(-1))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("world,n", [(2, 1), (2, 1000), (3, 4097), (4, 70000), (8, 300)])
def test_one_shot_all_reduce_sums_every_rank(dtype: torch.dtype, world: int, n: int) -> None:
    parts = [torch.randn(n, device=DEV).to(dtype) for _ in range(world)]
    peers = FakePeers(world, n + 5, dtype)
    want = torch.stack(f64(*parts)).sum(0)
    outs = []
    for rank in range(world):
        peers.stage(parts, skip=rank)
        outs.append(allreduce.one_shot_all_reduce(parts[rank], peers.buf_ptrs, peers.pad_ptrs, rank,
                                                  buffer_elems=peers.elems, sync=False))  # fmt: skip
        assert torch.equal(peers.bufs[rank][:n], parts[rank]), "a rank's share must be in its own buffer"
    for out in outs:
        assert out.dtype == dtype and out.shape == (n,)
        assert_close("one_shot_all_reduce", out, want, dtype)
        assert torch.equal(out, outs[0]), "every rank must get the same bits (rank-order sum)"


def _spread(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Values over a wide range of exponents (2^-20 .. 2^20; fp16 2^-10 .. 2^10, its range), both signs: where
    additions round most often."""
    g = torch.Generator().manual_seed(seed)
    span = 10 if dtype == torch.float16 else 20
    scale = torch.exp2(torch.randint(-span, span + 1, (n,), generator=g).float())
    return (torch.randn(n, generator=g) * scale).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("world", [2, 3, 4])
def test_the_deterministic_modes_sum_of_any_size_is_the_kernels(dtype: torch.dtype, world: int) -> None:
    """TPCommunicator(ordered=True) adds a message the one-shot kernel does not take in the kernel's order
    (reference.ordered_sum): the same bits, element for element, so a row's sum does not depend on the batch's size.
    With two ranks NCCL's and gloo's own sum is correctly rounded and gives those bits too (a two-term sum, and
    float32 has the 2p + 2 bits for bf16's and fp16's p); with more, another order would differ."""
    from envex.kernels.reference import ordered_sum

    n = 4099
    parts = [_spread(n, dtype, seed=world * 10 + r).to(DEV) for r in range(world)]
    # The interpreter rounds float32 to bf16 and fp16 toward zero, the GPU to nearest: there the kernel's float32
    # sum (the same additions on float32 copies) is rounded by torch.
    inputs = parts if DEV == "cuda" else [p.float() for p in parts]
    peers = FakePeers(world, n, inputs[0].dtype)
    peers.stage(inputs, skip=0)
    kernel = allreduce.one_shot_all_reduce(inputs[0], peers.buf_ptrs, peers.pad_ptrs, 0, buffer_elems=n, sync=False)
    kernel = kernel.to(dtype)
    assert torch.equal(ordered_sum(torch.stack(parts)), kernel)
    if world == 2:  # the exact sum (float64 holds it, or rounds it innocuously) rounded once: NCCL's bits
        exact = (parts[0].double() + parts[1].double()).to(dtype)
        assert torch.equal(exact, kernel), "a two-term sum must be correctly rounded in every path"
    elif dtype == torch.float32:  # (rounded to bf16 or fp16, an order's difference is rare: 4,099 may show none)
        reverse = ordered_sum(torch.stack(parts[::-1]))
        assert not torch.equal(reverse, kernel), "these values must be ones whose sum depends on the order"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("residual", [True, False])
@pytest.mark.parametrize("world,tokens,hidden", [(2, 1, 64), (2, 5, 96), (4, 3, 1000), (2, 70, 32)])
def test_fused_all_reduce_add_rms_norm(dtype: torch.dtype, residual: bool, world: int, tokens: int,
                                       hidden: int) -> None:  # fmt: skip
    parts = [torch.randn(tokens, hidden, device=DEV).to(dtype) for _ in range(world)]
    res = torch.randn(tokens, hidden, device=DEV).to(dtype) if residual else None
    w = torch.randn(hidden, device=DEV).to(dtype)
    peers = FakePeers(world, tokens * hidden, dtype)
    want_out, want_sum = ref.all_reduce_add_rms_norm(f64(*parts), *f64(res) if res is not None else [None],
                                                     *f64(w), 1e-5)  # fmt: skip
    for rank in range(world):
        peers.stage(parts, skip=rank)
        out, total = allreduce.one_shot_all_reduce_add_rms_norm(parts[rank], res, w, 1e-5, peers.buf_ptrs,
                                                                peers.pad_ptrs, rank, buffer_elems=peers.elems,
                                                                sync=False)  # fmt: skip
        assert_close("fused.out", out, want_out, dtype)
        assert_close("fused.sum", total, want_sum, dtype)


def flags(pad: torch.Tensor) -> torch.Tensor:
    """[barrier (in, out), program, sender] of one rank's pad."""
    return pad[: allreduce.FLAG_INTS].view(2, allreduce.MAX_PROGRAMS, allreduce.MAX_WORLD)


def test_barrier_posts_its_epoch_and_waits_for_the_peers() -> None:
    """Rank 1 of 3, twice, with its peers' flags already posted for each call (both barriers): each launch takes
    the next epoch per program, posts it into both peers' pads and returns once its own pad holds the peers' epoch
    (run alone without them it would spin: that is the protocol)."""
    world, n, rank = 3, 3000, 1
    parts = [torch.randn(n, device=DEV) for _ in range(world)]
    peers = FakePeers(world, n, torch.float32)
    peers.stage(parts, skip=rank)
    programs = 3  # tiles of 1024 elements
    for epoch in (1, 2):
        for q in (0, 2):
            flags(peers.pads[rank])[:, :programs, q] = epoch
        out = allreduce.one_shot_all_reduce(parts[rank], peers.buf_ptrs, peers.pad_ptrs, rank, buffer_elems=n)
        assert_close("synced all-reduce", out, torch.stack(f64(*parts)).sum(0), torch.float32)
        epochs = peers.pads[rank][allreduce.FLAG_INTS :]
        assert epochs[:programs].eq(epoch).all() and epochs[programs:].eq(0).all(), "one epoch per program and call"
        for q in (0, 2):
            posted = flags(peers.pads[q])
            assert posted[:, :programs, rank].eq(epoch).all(), "this rank's epoch in every peer's pad, both barriers"
            assert int(posted.abs().sum()) == 2 * programs * epoch, "only its own flags, for its own programs"


def test_rejects_bad_input() -> None:
    peers = FakePeers(2, 16, torch.float32)
    x = torch.randn(32, device=DEV)
    with pytest.raises(ValueError, match="peer buffer"):
        allreduce.one_shot_all_reduce(x, peers.buf_ptrs, peers.pad_ptrs, 0, buffer_elems=16)
    with pytest.raises(ValueError, match="rank: 2"):
        allreduce.one_shot_all_reduce(x[:8], peers.buf_ptrs, peers.pad_ptrs, 2, buffer_elems=16)
    with pytest.raises(ValueError, match="weight: length"):
        allreduce.one_shot_all_reduce_add_rms_norm(x[:16].view(2, 8), None, torch.randn(4, device=DEV), 1e-5,
                                                   peers.buf_ptrs, peers.pad_ptrs, 0, buffer_elems=16)  # fmt: skip


class TwinRanks:
    """A Communicator for two ranks holding the same partial sums: all_reduce is 2x. fused=False: no fused path
    (what the communicator answers above its peer buffer's size)."""

    world_size = 2

    def __init__(self, fused: bool) -> None:
        self.fused = fused
        self.calls: list[str] = []

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.append("all_reduce")
        return x * 2

    def all_reduce_add_rms_norm(self, x, residual, weight, eps):  # type: ignore[no-untyped-def]
        self.calls.append("fused")
        if not self.fused:
            return None
        return ref.all_reduce_add_rms_norm([x, x], residual, weight, eps)

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x, x], dim=1)


@pytest.mark.parametrize("tokens,fused,residual", [(1, True, True), (1, True, False), (3, True, True),
                                                    (3, False, True), (4, True, False)])  # fmt: skip
def test_norm_linear_reduces_partial_sums_on_both_backends(tokens: int, fused: bool, residual: bool) -> None:
    """TritonOps and TorchOps give the same (linear(rms_norm(reduce(x) + residual)), reduce(x) + residual); one row
    reduces alone (the GEMV folds the norm), more rows take the fused path where the communicator has one."""
    from envex.kernels.torch_ops import TorchOps
    from envex.kernels.triton_ops import TritonOps

    x = torch.randn(tokens, 64, device=DEV)
    res = torch.randn(tokens, 64, device=DEV) if residual else None
    nw, w = torch.randn(64, device=DEV), torch.randn(48, 64, device=DEV) / 8
    fast_comm, ref_comm = TwinRanks(fused), TwinRanks(fused)
    y, total = TritonOps().norm_linear(x, res, nw, 1e-5, w, comm=fast_comm)
    y_ref, total_ref = TorchOps().norm_linear(x, res, nw, 1e-5, w, comm=ref_comm)
    want_y, want_total = ref.all_reduce_add_rms_norm([x.double(), x.double()], None if res is None else res.double(),
                                                     nw.double(), 1e-5)  # fmt: skip
    assert_close("norm_linear total", total, want_total, torch.float32)
    assert_close("norm_linear y", y, want_y @ w.double().T, torch.float32)
    assert_close("torch ops y", y_ref, want_y @ w.double().T, torch.float32)
    assert torch.equal(total_ref, x * 2 + (res if res is not None else 0))
    assert fast_comm.calls == (["all_reduce"] if tokens == 1 else ["fused"] if fused else ["fused", "all_reduce"])


@pytest.mark.parametrize("tokens", [1, 3, 70])
def test_the_deterministic_mode_reduces_then_norms_at_every_size(tokens: int) -> None:
    """Under tensor parallelism the batch-invariant Triton backend never takes the fused all-reduce + norm (its own
    norm arithmetic, and only for the sizes that fit the peer buffer): it all-reduces, then runs the mode's norm and
    projection, so a row's bits are the same whatever the batch, equal to the same rows with the reduction done
    beforehand."""
    from envex.kernels.invariant_ops import InvariantTritonOps

    x = torch.randn(70, 64, device=DEV)
    res = torch.randn(70, 64, device=DEV)
    nw, w = torch.randn(64, device=DEV), torch.randn(48, 64, device=DEV) / 8
    ops, comm = InvariantTritonOps(split_k=False), TwinRanks(fused=True)
    y, total = ops.norm_linear(x[:tokens], res[:tokens], nw, 1e-5, w, comm=comm)
    assert comm.calls == ["all_reduce"]
    y_all, total_all = ops.norm_linear(x * 2, res, nw, 1e-5, w)  # the reduced rows, all 70 in one batch
    assert torch.equal(total, total_all[:tokens]) and torch.equal(y, y_all[:tokens])


def test_the_one_row_all_reduce_is_never_pdl_launched(monkeypatch: pytest.MonkeyPatch) -> None:
    """On Hopper the batch-1 GEMVs chain with PDL; the one-shot all-reduce between them must not (two H200s, TP=2,
    32 and 80 layers: both GPUs spun in it until it was launched plainly; verify/lab/journal-kernels.md). The GEMV is
    replaced by its reference here: the interpreter has no PDL, and what is checked is the communicator's call."""
    from envex.kernels import gemv
    from envex.kernels.triton_ops import TritonOps

    seen: list[bool] = []

    def gemv_ref(a, weight, *, prologue=0, b=None, norm_weight=None, eps=1e-6, bias=None, config=None, pdl=False):  # type: ignore[no-untyped-def]
        seen.append(pdl)
        total = a + b if b is not None else a
        return ref.rms_norm(total, norm_weight, eps) @ weight.T, (total if b is not None else None)

    monkeypatch.setattr(gemv, "gemv", gemv_ref)
    comm = TwinRanks(fused=True)
    x, res = torch.randn(1, 64, device=DEV), torch.randn(1, 64, device=DEV)
    TritonOps(pdl=True).norm_linear(x, res, torch.randn(64, device=DEV), 1e-5, torch.randn(48, 64, device=DEV),
                                    comm=comm)  # fmt: skip
    assert comm.calls == ["all_reduce"] and seen == [True]  # the reduce plain, the GEMV after it still PDL


COMPILE_FOR_HOPPER = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from envex.kernels import allreduce as A

aligned = {(i,): [["tt.divisibility", 16]] for i in range(5)}
sig = {"inp_ptr": "*bf16", "out_ptr": "*bf16", "buf_ptrs": "*i64", "pad_ptrs": "*i64", "n": "i32", "rank": "i32",
       "tiles": "i32", "WORLD": "constexpr", "SYNC": "constexpr", "BLOCK": "constexpr", "USE_PDL": "constexpr"}
src = ASTSource(A._all_reduce_kernel, sig, constexprs={"WORLD": 2, "SYNC": True, "BLOCK": 1024, "USE_PDL": True},
                attrs=aligned)
ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]
sig = {"inp_ptr": "*bf16", "res_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "sum_ptr": "*bf16",
       "buf_ptrs": "*i64", "pad_ptrs": "*i64", "rows": "i32", "H": "i32", "eps": "fp32", "rank": "i32",
       "rows_per_program": "i32", "WORLD": "constexpr", "SYNC": "constexpr", "HAS_RESIDUAL": "constexpr",
       "BLOCK_H": "constexpr"}
src = ASTSource(A._all_reduce_add_rms_norm_kernel, sig,
                constexprs={"WORLD": 4, "SYNC": True, "HAS_RESIDUAL": True, "BLOCK_H": 8192})
fused = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8}).asm["ptx"]
print(ptx + fused)
"""


def test_kernels_compile_for_hopper_with_the_intended_instructions() -> None:
    """The device code (not what the interpreter runs): both kernels compile for sm_90 with Triton's own ptxas,
    no GPU needed, and the PTX holds the protocol: release exchanges into the peers' pads, acquire loads of our
    own, 16-byte L1-bypassing loads of the peers' data, the programmatic-dependent-launch wait."""
    import subprocess
    import sys
    from pathlib import Path

    import triton

    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").is_file():
        pytest.skip("this Triton has no bundled ptxas")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", COMPILE_FOR_HOPPER], env=env, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    ptx = done.stdout
    for needle in ("atom.global.sys.release.exch.b32", "ld.global.sys.acquire.b32", "ld.global.cg.v4",
                   "griddepcontrol.wait", "griddepcontrol.launch_dependents"):  # fmt: skip
        assert needle in ptx, needle
    # The epoch count is one atomic increment, never a load and a store that warps could interleave.
    assert "atom.global.gpu.relaxed.add" in ptx or "atom.global.gpu.add" in ptx, "no atomic epoch increment"
