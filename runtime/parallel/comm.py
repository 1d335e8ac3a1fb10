"""The collectives a tensor-parallel model calls (kernels.ops.Communicator), over one torch.distributed group.

All-reduce: messages up to CUSTOM_MAX_BYTES take the one-shot kernel over peer memory (kernels/allreduce.py): each
rank's buffer is torch symmetric memory, mapped into every GPU over NVLink by CUDA IPC, without multicast
(NO_MULTICAST_ENV). Larger messages, CPU ranks (gloo), and hosts where the peer buffers cannot be made use NCCL /
gloo. Both are captured by the decode CUDA graphs like any other kernel. Logits are gathered with NCCL.

The deterministic mode (`ordered`) needs every all-reduce to give an element the same bits whatever the message's
size, i.e. whatever the batch. The one-shot kernel adds the ranks' values in rank order in float32 and rounds once.
With two ranks every path gives those bits: a sum of two values is correctly rounded by NCCL and gloo, and so is
float32's sum of two bf16 or fp16 values rounded again (float32 has at least 2p + 2 bits for their p: double
rounding is then innocuous). With more ranks NCCL's and gloo's order follows the chunking, which follows the
size, so messages the one-shot does not take are added here in the kernel's order (each rank its 1/W of the
elements, exchanged all-to-all, then gathered: a ring all-reduce's traffic).
"""

from __future__ import annotations

import logging
import warnings

import torch
import torch.distributed as dist

from envex.kernels.reference import ordered_sum

log = logging.getLogger(__name__)

# One-shot reads every peer's copy, W x the bytes, so it wins while latency dominates; 1 MiB covers a decode step's
# hidden rows up to batch 64 at H = 8192 (bench_tp.py measures the crossover with NCCL).
CUSTOM_MAX_BYTES = 1 << 20


class _PeerBuffers:
    """This rank's symmetric buffer (data, then the flag pads) and the address tables of every rank's."""

    def __init__(self, group: dist.ProcessGroup, device: torch.device, data_bytes: int) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        from envex.kernels import allreduce

        pad_bytes = allreduce.PAD_INTS_PER_RANK * 4
        if hasattr(symm_mem, "set_backend"):
            try:
                symm_mem.set_backend("CUDA")  # CUDA IPC handles; not NVSHMEM
            except Exception:  # already set by this process, or a build with one backend
                pass
        name = group.group_name
        with warnings.catch_warnings():  # needed before torch 2.8 or so, deprecated (a no-op) after
            warnings.simplefilter("ignore")
            if hasattr(symm_mem, "enable_symm_mem_for_group"):
                symm_mem.enable_symm_mem_for_group(name)
        self.storage = symm_mem.empty(data_bytes + pad_bytes, dtype=torch.uint8, device=device)
        self.storage[data_bytes:].zero_()
        self.handle = symm_mem.rendezvous(self.storage, name)
        ptrs = [int(p) for p in self.handle.buffer_ptrs]
        # Each rank's tensor starts at the same offset into its allocation (the allocations are symmetric).
        offset = self.storage.data_ptr() - ptrs[group.rank()]
        self.buf_ptrs = torch.tensor([p + offset for p in ptrs], dtype=torch.int64, device=device)
        self.pad_ptrs = self.buf_ptrs + data_bytes
        self.data_bytes = data_bytes
        torch.cuda.synchronize(device)
        dist.barrier(group=group)  # every pad zeroed before anyone signals


class TPCommunicator:
    def __init__(self, group: dist.ProcessGroup, *, rank: int, world_size: int, device: torch.device,
                 custom_max_bytes: int = CUSTOM_MAX_BYTES, ordered: bool = False) -> None:  # fmt: skip
        """custom_max_bytes: the largest all-reduce the one-shot kernel takes (0: NCCL / gloo for everything).
        ordered: every all-reduce adds the ranks in rank order in float32 and rounds once, whatever its size (the
        deterministic mode; module docstring)."""
        self.group, self.rank, self.world_size, self.device = group, rank, world_size, device
        self.ordered = ordered
        self.peers: _PeerBuffers | None = None
        self.custom_note = "off"
        if device.type == "cuda" and custom_max_bytes > 0:
            try:
                self.peers = _PeerBuffers(group, device, custom_max_bytes)
                self.custom_note = f"one-shot over peer memory up to {custom_max_bytes >> 10} KiB, NCCL above"
            except Exception as exc:  # no P2P between these GPUs, or symmetric memory unavailable in this build
                self.custom_note = f"NCCL only (peer buffers unavailable: {type(exc).__name__}: {exc})"
                log.warning("tensor parallel: %s", self.custom_note)

    def _fits(self, x: torch.Tensor) -> bool:
        return self.peers is not None and x.is_contiguous() and x.numel() * x.element_size() <= self.peers.data_bytes

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self._fits(x):
            from envex.kernels import allreduce

            assert self.peers is not None
            return allreduce.one_shot_all_reduce(x, self.peers.buf_ptrs, self.peers.pad_ptrs, self.rank,
                                                 buffer_elems=self.peers.data_bytes // x.element_size())
        if self.ordered and self.world_size > 2:
            return self._ordered_sum(x)
        out = x.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(out, group=self.group)
        return out

    def _ordered_sum(self, x: torch.Tensor) -> torch.Tensor:
        """ordered_sum over the ranks' x with a ring all-reduce's traffic: each rank receives every rank's copy of
        its 1/W of the elements (all-to-all), adds them in rank order, and the slices are gathered."""
        w, n = self.world_size, x.numel()
        m = -(-n // w)
        send = torch.zeros(w * m, dtype=x.dtype, device=x.device)  # the padding's sums are dropped
        send[:n] = x.reshape(-1)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)  # row q of recv: rank q's copy of this rank's slice
        mine = ordered_sum(recv.view(w, m))
        return self.all_gather(mine.view(1, m)).view(-1)[:n].view(x.shape)  # [1, W·m]: the slices in rank order

    def all_reduce_add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                                eps: float) -> tuple[torch.Tensor, torch.Tensor] | None:  # fmt: skip
        if not self._fits(x) or x.dim() != 2 or (residual is not None and not residual.is_contiguous()):
            return None
        from envex.kernels import allreduce

        assert self.peers is not None
        return allreduce.one_shot_all_reduce_add_rms_norm(
            x, residual, weight, eps, self.peers.buf_ptrs, self.peers.pad_ptrs, self.rank,
            buffer_elems=self.peers.data_bytes // x.element_size(),
        )  # fmt: skip

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        n, d = x.shape
        out = torch.empty((self.world_size, n, d), dtype=x.dtype, device=x.device)
        if x.is_cuda:
            dist.all_gather_into_tensor(out, x, group=self.group)
        else:
            dist.all_gather(list(out.unbind(0)), x, group=self.group)
        return out.permute(1, 0, 2).reshape(n, self.world_size * d)  # [N, W, D] -> [N, W * D]

    def broadcast(self, x: torch.Tensor) -> None:
        """Rank 0's x into every rank's x, in place (a step's input ids: they may exist on rank 0's device only)."""
        dist.broadcast(x, src=0, group=self.group)

    def min_int(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())
