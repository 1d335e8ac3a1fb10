"""The processes of a tensor-parallel engine: rank 0 is the engine itself (scheduler, sampler, server); ranks
1..W-1 are workers started here, one per GPU, that hold their shard and follow rank 0's steps.

Per step rank 0 sends one message over a gloo group on the host (`StepChannel`): an eager step's plan, or a decode
graph's batch, positions and block tables; then broadcasts the step's input ids from its device. A worker receives
the message while its GPU still runs the previous step, enqueues the same work (the same forward, or a replay of
the same CUDA graph) and waits for the next: nothing waits on a host between layers, and the workers' collectives
meet rank 0's inside the graphs.

    python -m envex.runtime.parallel.workers --rank R --world W --init tcp://127.0.0.1:P --config JSON
"""

from __future__ import annotations

import argparse
import atexit
import dataclasses
import json
import os
import socket
import subprocess
import sys
import threading
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from envex.runtime.parallel.comm import TPCommunicator
from envex.runtime.parallel.plan import EagerPlan
from envex.runtime.parallel.state import NO_MULTICAST_ENV, ParallelState

STOP, EAGER, GRAPH = 0, 1, 2
_HEAD = 1024  # int64 words of the first message: a decode step's whole message up to ~60 sequences x 16 blocks
# A server may idle for days between requests, the workers blocked on the channel meanwhile.
_IDLE_TIMEOUT = timedelta(days=3650)
_START_TIMEOUT = timedelta(minutes=10)  # loading a 70B shard from a slow disk


class StepChannel:
    """Rank 0's step messages to the other ranks: [op, length, ints...] in a fixed head, the rest (long prefill
    plans) in a second broadcast."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self._head = torch.zeros(_HEAD, dtype=torch.int64)

    def _send(self, op: int, data: list[int]) -> None:
        k = min(len(data), _HEAD - 2)
        self._head[0], self._head[1] = op, len(data)
        if k:
            self._head[2 : 2 + k] = torch.tensor(data[:k], dtype=torch.int64)
        dist.broadcast(self._head, src=0, group=self.group)
        if len(data) > k:
            dist.broadcast(torch.tensor(data[k:], dtype=torch.int64), src=0, group=self.group)

    def send_eager(self, data: list[int]) -> None:
        self._send(EAGER, data)

    def send_graph(self, data: list[int]) -> None:
        self._send(GRAPH, data)

    def send_stop(self) -> None:
        self._send(STOP, [])

    def recv(self) -> tuple[int, list[int]]:
        dist.broadcast(self._head, src=0, group=self.group)
        op, n = int(self._head[0]), int(self._head[1])
        k = min(n, _HEAD - 2)
        data = self._head[2 : 2 + k].tolist()
        if n > k:
            rest = torch.empty(n - k, dtype=torch.int64)
            dist.broadcast(rest, src=0, group=self.group)
            data += rest.tolist()
        return op, data


def init_rank(rank: int, world: int, init_method: str, device_type: str, *, ordered: bool = False) -> ParallelState:
    """Join the group (NCCL on CUDA, gloo on CPU) with multicast off, and build this rank's communicator (ordered:
    the deterministic mode's all-reduce, TPCommunicator)."""
    os.environ.update(NO_MULTICAST_ENV)  # before NCCL or symmetric memory reads them
    if device_type == "cuda":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
        dist.init_process_group("nccl", init_method=init_method, rank=rank, world_size=world,
                                timeout=_START_TIMEOUT, device_id=device)  # fmt: skip
    else:
        device = torch.device("cpu")
        # W processes share the host's cores: more threads than cores makes every BLAS call and collective wait.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world, timeout=_START_TIMEOUT)
    control = dist.new_group(backend="gloo", timeout=_IDLE_TIMEOUT)
    group = dist.group.WORLD
    assert group is not None
    comm = TPCommunicator(group, rank=rank, world_size=world, device=device, ordered=ordered)
    return ParallelState(rank=rank, world_size=world, device=device, comm=comm, channel=StepChannel(control))


def follow(runner: Any, state: ParallelState) -> None:
    """A worker's loop: run every step rank 0 sends until it says stop. runner: this rank's ModelRunner."""
    assert state.channel is not None
    with torch.inference_mode():
        while True:
            op, data = state.channel.recv()
            if op == STOP:
                return
            if op == EAGER:
                runner.run_plan(EagerPlan.unpack(data))
            elif op == GRAPH:
                runner.decode_graphs.follow(data)
            else:
                raise RuntimeError(f"tensor parallel: unknown step message {op}")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def worker_env(environ: Any, path: list[str]) -> dict[str, str]:
    """The workers' environment: they import what this process imports (its sys.path), NVLink multicast is off in
    them too, and `python -m` keeps their working directory off sys.path (PYTHONSAFEPATH), as in every child the
    installer starts: in a source checkout's root its kernels/ folder would shadow the PyPI package `kernels` that
    transformers >= 5.25 imports. Explicitly, not inherited: they must not depend on who set what here."""
    return {**environ, **NO_MULTICAST_ENV, "PYTHONSAFEPATH": "1", "PYTHONPATH": os.pathsep.join(p for p in path if p)}


class Workers:
    """Ranks 1..W-1 as child processes, and rank 0's place in the group (`state`). stop() ends them; a worker
    that dies while the engine runs ends this process too, as rank 0 would otherwise wait on it forever."""

    def __init__(self, config: Any, world: int) -> None:  # config: a resolved EngineConfig
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        env = worker_env(os.environ, sys.path)
        argv = [sys.executable, "-m", "envex.runtime.parallel.workers", "--world", str(world), "--init", init_method]
        argv += ["--config", json.dumps(dataclasses.asdict(config))]
        self.procs = [subprocess.Popen([*argv, "--rank", str(r)], env=env) for r in range(1, world)]
        self._stopping = False
        threading.Thread(target=self._watch, name="envex-tp-watch", daemon=True).start()
        ordered = config.kernels.capabilities.ordered_all_reduce  # the batch-invariant backend's rank-order sums
        try:
            self.state = init_rank(0, world, init_method, config.device, ordered=ordered)
        except BaseException:
            self._stopping = True
            for proc in self.procs:
                proc.kill()
            raise
        atexit.register(self.stop)

    def _watch(self) -> None:
        while not self._stopping:
            for rank, proc in enumerate(self.procs, start=1):
                code = proc.poll()
                if code is not None and not self._stopping:
                    print(f"error: tensor parallel worker rank {rank} exited with code {code}; stopping (its log is "
                          "above)", file=sys.stderr, flush=True)  # fmt: skip
                    os._exit(1)
            threading.Event().wait(0.5)

    def stop(self) -> None:
        if self._stopping:
            return
        self._stopping = True
        try:
            if self.state.channel is not None:
                self.state.channel.send_stop()
        except Exception:  # a worker already gone: nothing to tell
            pass
        # Every rank tears its communicators down at the same time (NCCL's may wait for the peers'); bounded, as a
        # dead peer must not keep this process from exiting.
        if dist.is_initialized():
            teardown = threading.Thread(target=dist.destroy_process_group, name="envex-tp-teardown", daemon=True)
            teardown.start()
            teardown.join(timeout=30)
        for proc in self.procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()


def _die_with_parent() -> None:
    """Linux: SIGTERM when rank 0 dies, so a killed server leaves no worker holding a GPU. (The signal follows the
    thread that started the worker: the engine is built on a thread that lives as long as it, the main one.)"""
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        try:
            ctypes.CDLL("libc.so.6").prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        except OSError:
            pass


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="a tensor-parallel worker (started by the engine, not by hand)")
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--init", required=True)
    ap.add_argument("--config", required=True)
    args = ap.parse_args(argv)
    _die_with_parent()
    from envex.runtime.engine.config import EngineConfig
    from envex.runtime.engine.model_runner import ModelRunner
    from envex.runtime.loader import load_model_info

    config = EngineConfig(**json.loads(args.config))
    ordered = config.kernels.capabilities.ordered_all_reduce
    state = init_rank(args.rank, args.world, args.init, config.device, ordered=ordered)
    runner = ModelRunner(config, load_model_info(config.model), parallel=state)
    follow(runner, state)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
