"""Which slice of each matrix a rank holds (Megatron-LM's tensor parallelism, Shoeybi et al. 2019), checked against
the model once.

Column-parallel: Q/K/V (by head) and gate/up (by intermediate row): each rank computes its heads and its part of
the MLP with no communication. Row-parallel: O and down take the matching input columns, so their outputs are
partial sums, reduced by the next layer's norm (an all-reduce fused with the residual add and RMSNorm where that
saves a pass; kernels/ops.py). The vocabulary is cut into W equal row ranges (the last padded with zero rows): the
embedding gives zeros outside a rank's range, so its output is a partial sum too, and the LM head's logits are
gathered. KV heads are split when there are at least W of them, else each rank keeps the one its query heads use.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from envex.runtime.config import GPT_OSS, ModelConfig

if TYPE_CHECKING:
    from envex.runtime.parallel.comm import TPCommunicator
    from envex.runtime.parallel.workers import StepChannel

# NVLink multicast (NVLS) stays off everywhere: NCCL's NVLS algorithms, symmetric memory's multicast objects and
# NVSHMEM's. Set in every rank's environment before torch.distributed starts (workers get it explicitly).
NO_MULTICAST_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def check_tensor_parallel(config: ModelConfig, world: int) -> None:
    """ValueError with one line when `config` cannot be split over `world` ranks."""
    if world == 1:
        return
    name = f"tensor_parallel: {world}"
    if config.architecture == GPT_OSS or config.moe is not None:
        raise ValueError(f"{name}: {config.architecture} is not supported under tensor parallelism yet; serve it "
                         "with --tensor-parallel 1")  # fmt: skip
    if config.num_attention_heads % world:
        raise ValueError(f"{name} does not divide the model's {config.num_attention_heads} attention heads; pick a "
                         "divisor of them")  # fmt: skip
    kv = config.num_key_value_heads
    if kv % world and world % kv:
        raise ValueError(f"{name} and the model's {kv} KV heads: one must divide the other; pick another degree")
    if config.intermediate_size % world:
        raise ValueError(f"{name} does not divide the MLP width {config.intermediate_size}; pick a divisor of it")


@dataclass(frozen=True)
class ParallelState:
    """This process's place in the tensor-parallel group. comm: what the model calls to reduce and gather (None
    where only shapes are wanted, e.g. to load one rank's shard); channel: rank 0's step metadata to the others."""

    rank: int = 0
    world_size: int = 1
    device: torch.device = torch.device("cpu")
    comm: TPCommunicator | None = None
    channel: StepChannel | None = None

    @property
    def is_driver(self) -> bool:
        """Rank 0: it schedules and samples; the others follow its steps."""
        return self.rank == 0

    def heads(self, c: ModelConfig) -> int:
        return c.num_attention_heads // self.world_size

    def kv_heads(self, c: ModelConfig) -> int:
        return max(1, c.num_key_value_heads // self.world_size)

    def kv_head_start(self, c: ModelConfig) -> int:
        """The first KV head this rank holds: its own share, or (fewer KV heads than ranks) the one that the GQA
        group of its query heads reads."""
        if c.num_key_value_heads >= self.world_size:
            return self.rank * self.kv_heads(c)
        return self.rank * c.num_key_value_heads // self.world_size

    def intermediate(self, c: ModelConfig) -> int:
        return c.intermediate_size // self.world_size

    def vocab_rows(self, c: ModelConfig) -> int:
        return -(-c.vocab_size // self.world_size)

    def vocab_start(self, c: ModelConfig) -> int:
        return self.rank * self.vocab_rows(c)

    def min_across(self, value: int) -> int:
        """The smallest of every rank's value (e.g. KV blocks: each GPU's free memory differs a little)."""
        if self.world_size == 1 or self.comm is None:
            return value
        return self.comm.min_int(value)
