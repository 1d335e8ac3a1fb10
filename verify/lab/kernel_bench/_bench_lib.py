"""Timing helpers, the read-bandwidth probe and the Llama-3.1-8B-shaped model that bench_h200.py uses."""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable
from types import SimpleNamespace

import torch
import triton
import triton.language as tl

LLAMA31_8B = dict(
    hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
    vocab_size=128256, rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=131072,
    rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192},
)  # fmt: skip


def decode_chain(models, shape: dict, *, layers: int, context: int = 1024, graph_len: int = 4096,
                 device: str = "cuda", dtype: str = "bfloat16", batch: int = 1,
                 **settings) -> SimpleNamespace:  # fmt: skip
    """A decode step of `batch` sequences as a served graph runs it: `layers` layers of `shape` (dummy weights, an
    engine with `settings`), then the final norm and LM head, every sequence at `context` cached keys (its own
    blocks), with the attention's split count and longest sequence of the `graph_len` decode graph of that batch.
    Returns step (step(i) launches one step and returns its logits [batch, V]), engine, caches, meta and ids."""
    from envex.kernels.ops import AttentionMetadata
    from envex.runtime.engine import EngineConfig, LLMEngine
    from envex.runtime.engine.accel.cuda_graphs import num_splits_for
    from envex.verify.lab.kernel_bench.bench_server import write_model_dir

    shape = dict(shape, num_hidden_layers=layers)
    if "layer_types" in shape:
        shape["layer_types"] = shape["layer_types"][:layers]
    path = models / f"{shape['model_type']}-{layers}l-dummy"
    write_model_dir(path, shape, weights=False)
    engine = LLMEngine(EngineConfig(model=str(path), load_format="dummy", device=device, dtype=dtype,
                                    max_model_len=graph_len, num_kv_blocks=512, max_num_seqs=max(8, batch),
                                    enable_prefix_caching=False, **settings))  # fmt: skip
    runner = engine.runner
    model, ops, dev, dt = runner.model, runner.ops, runner.device, runner.dtype
    c = model.config
    bs = runner.block_size
    blocks = -(-(context + 1) // bs)
    caches = [(torch.randn(batch * blocks, bs, c.num_key_value_heads, c.head_dim, device=dev, dtype=dt),
               torch.randn(batch * blocks, bs, c.num_key_value_heads, c.head_dim, device=dev, dtype=dt))
              for _ in range(layers)]  # fmt: skip
    seqs = torch.arange(batch, device=dev)
    meta = AttentionMetadata(
        positions=torch.full((batch,), context, device=dev), slot_mapping=seqs * blocks * bs + context,
        cu_seqlens_q=torch.arange(batch + 1, device=dev, dtype=torch.int32),
        block_tables=torch.arange(batch * blocks, device=dev, dtype=torch.int32).view(batch, blocks),
        cos=runner.cos, sin=runner.sin, max_q_len=1, max_seq_len=graph_len,
        num_splits=num_splits_for(batch, c.num_key_value_heads, graph_len, dev), q_per_seq=1)  # fmt: skip
    ids = torch.full((batch,), 7, device=dev)

    def step(_: int) -> torch.Tensor:
        hidden, residual = model.forward(ops, ids, caches, meta)
        return model.compute_logits(ops, hidden, residual)

    return SimpleNamespace(step=step, engine=engine, caches=caches, meta=meta, ids=ids)


def chain_timer(step: Callable[[int], object], width: int = 44) -> Callable[[str], float]:
    """timed(label): one step's graph time in µs (4 steps a graph, median of 9 replays), printed beside label."""

    def timed(label: str) -> float:
        us = graph_time_ms(step, n_inner=4, replays=9) * 1e3
        print(f"  chain {label:<{width}} {us:8.2f} us", flush=True)
        return us

    return timed


def sweep(timed: Callable[[str], float], label: str, values, target, key) -> list[tuple[object, float | None, str]]:
    """timed() with target's `key` (an item of a dict target, else an attribute: a module's tuning constant) set
    to each value in turn, and as it was afterwards, even on an error. Returns (value, µs, "") per value, or
    (value, None, error) for a value that does not compile or fit."""
    is_dict = isinstance(target, dict)
    had = key in target if is_dict else True
    saved = target.get(key) if is_dict else getattr(target, key)
    out: list[tuple[object, float | None, str]] = []
    try:
        for value in values:
            if is_dict:
                target[key] = value
            else:
                setattr(target, key, value)
            try:
                out.append((value, timed(f"{label} {value}"), ""))
            except Exception as exc:  # noqa: BLE001 - a value that does not compile or fit is a row, not the end
                out.append((value, None, str(exc)[:200]))
    finally:
        if not is_dict:
            setattr(target, key, saved)
        elif had:
            target[key] = saved
        else:
            target.pop(key, None)
    return out


@contextlib.contextmanager
def without(target, name: str, only: Callable[..., bool] | None = None):
    """Inside the block, target.name (a module's function or kernel, or an ops object's method) launches nothing:
    its first call for each argument shape runs it and keeps the result, later calls return that result. With
    `only(*args, **kwargs)`, the calls it refuses run as before. A chain timed inside the block, against the chain
    outside it, gives what the removed launches cost the step where they sit (their results are stale; the time
    is what is measured). A Triton kernel (`kernel[grid](...)`) becomes a launch that does nothing."""
    real = getattr(target, name)
    if isinstance(real, triton.runtime.jit.KernelInterface):
        replacement = _NoLaunch()
    else:
        kept: dict = {}

        def replacement(*args, **kwargs):
            if only is not None and not only(*args, **kwargs):
                return real(*args, **kwargs)
            key = tuple((tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else type(a).__name__
                        for a in (*args, *kwargs.values()))  # fmt: skip
            if key not in kept:
                kept[key] = real(*args, **kwargs)
            return kept[key]

    own = name in vars(target)  # a method of an ops object is its class's: the instance attribute goes again
    setattr(target, name, replacement)
    try:
        yield
    finally:
        if own:
            setattr(target, name, real)
        else:
            delattr(target, name)


class _NoLaunch:
    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def sync() -> None:
    torch.cuda.synchronize()


def graph_time_ms(fn: Callable[[int], object], n_inner: int, replays: int = 7) -> float:
    """Median time of one fn(i) call, from CUDA-graph replays of n_inner calls (launch gaps as in a graphed step)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(min(n_inner, 3)):
            fn(i)
    torch.cuda.current_stream().wait_stream(stream)
    sync()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(n_inner):
            fn(i)
    graph.replay()
    sync()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        sync()
        times.append(start.elapsed_time(end) / n_inner)
    del graph
    return statistics.median(times)


def wall_ms(fn: Callable[[], object], repeats: int = 3) -> float:
    """Median wall time of fn() with a device sync on both sides (for whole generations)."""
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


@triton.jit
def _read_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    base = pid * BLOCK * ITERS
    for i in range(ITERS):
        offs = base + i * BLOCK + tl.arange(0, BLOCK)
        acc += tl.load(x_ptr + offs, mask=offs < n, other=0.0, eviction_policy="evict_first").to(tl.float32)
    tl.store(out_ptr + pid, tl.sum(acc, axis=0))


def measure_bandwidth(gib: float = 4.0) -> dict[str, float]:
    """Device-memory bandwidths in TB/s: a read-only Triton sweep (best of a few shapes), torch sum, and copy."""
    n = int(gib * 2**30) // 2
    x = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    result: dict[str, float] = {}
    best = 0.0
    for block, iters, warps in ((4096, 8, 8), (8192, 4, 8), (2048, 16, 4), (8192, 8, 16)):
        grid = triton.cdiv(n, block * iters)
        out = torch.empty(grid, device="cuda", dtype=torch.float32)
        ms = graph_time_ms(lambda _i, o=out, b=block, it=iters, w=warps, g=grid: _read_kernel[(g,)](
            x, o, n, BLOCK=b, ITERS=it, num_warps=w), n_inner=5)  # fmt: skip
        best = max(best, 2 * n / ms / 1e9)
    result["read_triton_TBps"] = best
    result["read_torch_sum_TBps"] = 2 * n / graph_time_ms(lambda _i: x.sum(dtype=torch.float32), 5) / 1e9
    y = torch.empty_like(x)
    result["copy_rw_TBps"] = 4 * n / graph_time_ms(lambda _i: y.copy_(x), 5) / 1e9
    result["read_TBps"] = max(result["read_triton_TBps"], result["read_torch_sum_TBps"])
    return result


def build_hf_model(layers: int | None = None):
    """HF LlamaForCausalLM with the Llama-3.1-8B shape and random bf16 weights (HF's own init, on the GPU)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = dict(LLAMA31_8B)
    if layers is not None:
        cfg["num_hidden_layers"] = layers
    config = LlamaConfig(**cfg, tie_word_embeddings=False)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(prev)
    model.eval().requires_grad_(False)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def envex_weights(hf) -> SimpleNamespace:
    """The same weights under envex's Llama names, q/k/v and gate/up packed (norms, O, down, embed shared)."""
    layers = []
    for layer in hf.model.layers:
        a, m = layer.self_attn, layer.mlp
        layers.append(SimpleNamespace(
            input_layernorm_weight=layer.input_layernorm.weight,
            post_attention_layernorm_weight=layer.post_attention_layernorm.weight,
            qkv_proj_weight=torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]),
            o_proj_weight=a.o_proj.weight,
            gate_up_proj_weight=torch.cat([m.gate_proj.weight, m.up_proj.weight]),
            down_proj_weight=m.down_proj.weight,
        ))  # fmt: skip
    return SimpleNamespace(embed_tokens_weight=hf.model.embed_tokens.weight, layers=layers,
                           norm_weight=hf.model.norm.weight, lm_head_weight=hf.lm_head.weight)  # fmt: skip


def step_weight_bytes(w: SimpleNamespace) -> int:
    """Bytes one decode step must read from weights: every layer's matrices and norms, the final norm, the LM
    head, and one row of the embedding table."""
    total = w.norm_weight.nbytes + w.lm_head_weight.nbytes + w.embed_tokens_weight[0].nbytes
    for layer in w.layers:
        total += sum(t.nbytes for t in vars(layer).values())
    return total
