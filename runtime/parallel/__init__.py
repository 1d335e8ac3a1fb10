"""Tensor parallelism: one process per GPU, Megatron-style shards (state.py), the all-reduce the model calls
(comm.py), and the workers that follow rank 0's steps (workers.py)."""

from envex.runtime.parallel.state import NO_MULTICAST_ENV, ParallelState, check_tensor_parallel

__all__ = ["NO_MULTICAST_ENV", "ParallelState", "check_tensor_parallel"]
