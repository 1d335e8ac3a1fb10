"""End-to-end sections of bench_h200.py: batch-1 decode, HF baselines, batch sweep, on 8B-shaped weights."""

from __future__ import annotations

import math

import torch

from envex.kernels.accuracy import rel_err
from envex.kernels.fused_decode import DecodeShape, DecodeState, FusedDecoder, prefill, splits_for
from envex.verify.kernel_bench import _bench_lib as B

DEV = torch.device("cuda")
BF16 = torch.bfloat16
MATMUL_TFLOPS = 790.0
HQ, HKV, D, PAGE = 32, 8, 128, 16
KV_BYTES_PER_TOKEN = 32 * 2 * HKV * D * 2


class Engine8B:
    """The 8B-shaped weights (shared with the HF model), rope tables and one paged KV cache for every section."""

    def __init__(self, hf, num_blocks: int, gemv_configs: dict, attn_best: dict | None = None) -> None:
        self.hf = hf
        self.w = B.envex_weights(hf)
        inv = hf.model.rotary_emb.inv_freq.float().to(DEV)  # HF's llama3-scaled frequencies, used as they are
        freqs = torch.arange(131072, device=DEV).float()[:, None] * inv[None, :]
        self.cos, self.sin = freqs.cos(), freqs.sin()
        self.shape = DecodeShape(num_heads=HQ, num_kv_heads=HKV, head_dim=D, hidden_size=4096, eps=1e-5)
        self.caches = [(torch.zeros(num_blocks, PAGE, HKV, D, device=DEV, dtype=BF16),
                        torch.zeros(num_blocks, PAGE, HKV, D, device=DEV, dtype=BF16)) for _ in range(32)]  # fmt: skip
        self.gemv_configs = gemv_configs
        self.attn_best = attn_best or {}
        self.prefill_attn: dict = {}
        self.weight_bytes = B.step_weight_bytes(self.w)

    def attn_options(self, batch: int, max_len: int) -> tuple[dict, dict]:
        """(paged_attention kwargs, split-choice kwargs) from the sweep's best for the nearest regime."""
        regime = "b64_1k" if batch >= 16 else ("b1_10k" if max_len > 4096 else "b1_1k")
        opts = dict(self.attn_best.get(regime, {}))
        split = {k: opts.pop(k) for k in ("min_keys", "programs_per_sm") if k in opts}
        return opts, split

    def decoder(self, use_gemv: bool, pdl: bool = False, attn_kwargs: dict | None = None,
                **options) -> FusedDecoder:  # fmt: skip
        """options: further FusedDecoder flags (fuse_rotary_attention, merge_splits_in_kernel)."""
        return FusedDecoder(self.w, self.shape, self.caches, self.cos, self.sin, gemv_configs=self.gemv_configs,
                            use_gemv=use_gemv, pdl=pdl, attn_kwargs=attn_kwargs, **options)  # fmt: skip

    def prefill_seqs(self, prompts: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
        """Prefill [B, L] prompts packed in one call; returns last-token logits [B, V]."""
        b, n = prompts.shape
        pos = torch.arange(n, device=DEV).repeat(b)
        slots = (tables.gather(1, (pos.view(b, n) // PAGE)).long() * PAGE + pos.view(b, n) % PAGE).view(-1)
        cu = torch.arange(0, (b + 1) * n, n, device=DEV, dtype=torch.int32)
        sl = torch.full((b,), n, device=DEV, dtype=torch.int32)
        return prefill(self.w, self.shape, self.caches, self.cos, self.sin, prompts.reshape(-1), pos, slots, cu, sl,
                       tables, n, n, attn_kwargs=self.prefill_attn)  # fmt: skip


class GraphedDecode:
    """One captured greedy decode step for a fixed batch; replay() advances the batch by one token, on device."""

    def __init__(self, eng: Engine8B, tables: torch.Tensor, first_ids: torch.Tensor, start_pos: int, max_len: int,
                 max_steps: int, use_gemv: bool, pdl: bool = False, decoder_options: dict | None = None,
                 ) -> None:  # fmt: skip
        batch = tables.shape[0]
        attn_kwargs, split_kwargs = eng.attn_options(batch, max_len)
        self.dec = eng.decoder(use_gemv, pdl, attn_kwargs, **(decoder_options or {}))
        self.state = DecodeState(batch, tables.shape[1], DEV)
        self.state.block_tables.copy_(tables)
        self.first_ids, self.start_pos = first_ids.clone(), start_pos
        self.out = torch.zeros(batch, max_steps, dtype=torch.int64, device=DEV)
        self.step = torch.zeros(1, dtype=torch.int64, device=DEV)
        self.splits, self.max_len = splits_for(batch, HKV, max_len, DEV, **split_kwargs), max_len
        self.reset()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._step()
        torch.cuda.current_stream().wait_stream(stream)
        self.reset()
        B.sync()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self._step()
        self.reset()
        B.sync()

    def _step(self) -> None:
        self.dec.greedy_step(self.state, self.splits, self.max_len, self.out, self.step)

    def reset(self) -> None:
        self.state.input_ids.copy_(self.first_ids)
        self.state.positions.fill_(self.start_pos)
        self.step.zero_()

    def run(self, steps: int) -> float:
        """Replay `steps` tokens; returns ms (device events)."""
        self.reset()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(steps):
            self.graph.replay()
        end.record()
        B.sync()
        return start.elapsed_time(end)


def _tables(batch: int, blocks_each: int, offset: int = 0) -> torch.Tensor:
    return (offset + torch.arange(batch * blocks_each, device=DEV, dtype=torch.int32)).view(batch, blocks_each)


def roofline_tok_s(eng: Engine8B, bw: float, prompt: int, gen: int, batch: int = 1) -> float:
    """Floor step time averaged over the generation: weights once + each sequence's KV at its current length."""
    total_s = 0.0
    for t in range(gen):
        nbytes = eng.weight_bytes + batch * (prompt + t + 1) * KV_BYTES_PER_TOKEN
        flops = 2 * 8.03e9 * batch + batch * 4 * HQ * D * 32 * (prompt + t + 1)
        total_s += max(nbytes / (bw * 1e12), flops / (MATMUL_TFLOPS * 1e12))
    return batch * gen / total_s


def section_batch1(rep, eng: Engine8B, bw: float, prompt: int, gen: int, results: dict) -> None:
    tag = f"{prompt // 1024}K/{gen}"
    ids = torch.randint(0, 128256, (1, prompt), device=DEV, generator=torch.Generator(DEV).manual_seed(prompt))
    results[f"prompt_{prompt}"] = ids
    tables = _tables(1, math.ceil((prompt + gen + 1) / PAGE))
    with torch.inference_mode():
        logits = eng.prefill_seqs(ids, tables)
        ttft = B.wall_ms(lambda: eng.prefill_seqs(ids, tables).argmax(-1).cpu())
        hf_logits = eng.hf(ids, logits_to_keep=1).logits[:, -1]
    rep.row("e2e", f"prefill {tag} vs HF forward", rel_err=rel_err(logits.float(), hf_logits.float()),
            top1_same=bool(logits.argmax() == hf_logits.argmax()), ttft_ms=ttft)  # fmt: skip
    first = logits.argmax(-1)
    roof = roofline_tok_s(eng, bw, prompt, gen)
    variants = (("fused GEMV+PDL graph", True, True), ("fused GEMV graph", True, False),
                ("cuBLAS+Triton graph", False, False))  # fmt: skip
    for name, use_gemv, pdl in variants:
        with torch.inference_mode():
            graph = GraphedDecode(eng, tables, first, prompt, prompt + gen + 1, gen, use_gemv, pdl)
            ms = min(graph.run(gen) for _ in range(3))
            # One step's logits on the state the graph left, against the cuBLAS path on the same state.
            if use_gemv:
                got = graph.dec.forward(graph.state, graph.splits, graph.max_len).float()
                want = eng.decoder(False).forward(graph.state, graph.splits, graph.max_len).float()
                step_err = rel_err(got, want)
            else:
                step_err = 0.0
        tok_s = gen / ms * 1e3
        rep.row("e2e", f"decode {tag} {name}", tok_s=tok_s, step_ms=ms / gen, roofline_tok_s=roof,
                of_roofline=tok_s / roof, e2e_tok_s=gen / (ms + ttft) * 1e3, step_logits_vs_cublas=step_err,
                splits=graph.splits)  # fmt: skip
        results[(prompt, use_gemv, pdl)] = graph.out[0].clone()
        del graph
    results[(prompt, True)] = results[(prompt, True, True)]
    same = (results[(prompt, True, True)] == results[(prompt, False, False)]).float().cumprod(0).sum().item()
    rep.row("e2e", f"greedy {tag} fused vs cuBLAS path", same_prefix_tokens=int(same), of=gen)


def section_accuracy(rep, eng: Engine8B, results: dict, prompt: int = 1024) -> None:
    """How far envex's bf16 prefill and HF's bf16 forward each are from HF in float32 on the same weights: with
    random weights the logits are nearly flat, so greedy tokens flip on rounding and only these errors compare."""
    import copy

    ids = results[f"prompt_{prompt}"]
    tables = _tables(1, math.ceil((prompt + 1) / PAGE))
    with torch.inference_mode():
        mine = eng.prefill_seqs(ids, tables).float()
        hf_bf16 = eng.hf(ids, logits_to_keep=1).logits[:, -1].float()
        hf32 = copy.deepcopy(eng.hf).float()
        ref32 = hf32(ids, logits_to_keep=1).logits[:, -1].float()
        del hf32
    torch.cuda.empty_cache()
    rep.row("e2e", f"accuracy {prompt} vs HF fp32", envex_bf16_rel_err=rel_err(mine, ref32),
            hf_bf16_rel_err=rel_err(hf_bf16, ref32), envex_top1=bool(mine.argmax() == ref32.argmax()),
            hf_bf16_top1=bool(hf_bf16.argmax() == ref32.argmax()))  # fmt: skip


def section_hf(rep, eng: Engine8B, prompt: int, gen: int, results: dict, label: str = "stock") -> dict:
    """HF generate, greedy, exactly `gen` new tokens. Stock: TTFT from a 1-token generate. Compiled: the warm-up is
    the same generate (a static cache of another length would recompile), and no TTFT is taken."""
    import time

    hf = eng.hf
    ids = results[f"prompt_{prompt}"]
    tag = f"{prompt // 1024}K/{gen}"
    compiled = label != "stock"
    with torch.inference_mode():
        t0 = time.perf_counter()
        hf.generate(ids, max_new_tokens=gen if compiled else 4, min_new_tokens=gen if compiled else 4,
                    do_sample=False)  # fmt: skip
        warm_s = time.perf_counter() - t0
        ttft = float("nan") if compiled else B.wall_ms(lambda: hf.generate(ids, max_new_tokens=1, do_sample=False))
        out = {}
        total = B.wall_ms(lambda: out.setdefault("t", hf.generate(ids, max_new_tokens=gen, min_new_tokens=gen,
                                                                  do_sample=False)), repeats=1)  # fmt: skip
    toks = out["t"][0, prompt:]
    mine = results.get((prompt, True))
    same = int((toks[: len(mine)] == mine[: len(toks)]).float().cumprod(0).sum().item()) if mine is not None else -1
    row = dict(tok_s=gen / total * 1e3, ttft_ms=ttft, warmup_s=warm_s, same_greedy_prefix_as_envex=same)
    if not compiled:
        row["decode_tok_s"] = (gen - 1) / (total - ttft) * 1e3
    rep.row("hf", f"HF {label} {tag}", **row)
    return row


def section_ttft(rep, eng: Engine8B, prompt: int = 10240) -> None:
    """Time to first token of one prompt: packed prefill through every layer, LM head, argmax to the host."""
    ids = torch.randint(0, 128256, (1, prompt), device=DEV)
    tables = _tables(1, math.ceil((prompt + 1) / PAGE))
    with torch.inference_mode():
        eng.prefill_seqs(ids, tables)
        ttft = B.wall_ms(lambda: eng.prefill_seqs(ids, tables).argmax(-1).cpu())
    rep.row("e2e", f"TTFT {prompt} prompt", ttft_ms=ttft, attn=str(eng.prefill_attn))


def section_batch_sweep(rep, eng: Engine8B, bw: float, batches: list[int], ctx: int) -> None:
    blocks_each = math.ceil((ctx + 64) / PAGE)
    for batch in batches:
        tables = _tables(batch, blocks_each)
        first = torch.randint(0, 128256, (batch,), device=DEV)
        with torch.inference_mode():
            graph = GraphedDecode(eng, tables, first, ctx, ctx + 64, 32, use_gemv=batch == 1)
            ms = min(graph.run(32) for _ in range(2)) / 32
        del graph
        nbytes = eng.weight_bytes + batch * ctx * KV_BYTES_PER_TOKEN
        flops = 2 * 8.03e9 * batch + batch * 4 * HQ * D * 32 * ctx
        floor_ms = max(nbytes / bw / 1e9, flops / MATMUL_TFLOPS / 1e9)
        rep.row("batch", f"decode B={batch} ctx={ctx}", step_ms=ms, tok_s=batch / ms * 1e3, floor_ms=floor_ms,
                of_floor=floor_ms / ms, bound="bytes" if nbytes / bw / 1e9 >= flops / MATMUL_TFLOPS / 1e9 else "flops")


def section_concurrent(rep, eng: Engine8B, bw: float, batch: int, prompt: int, gen: int, chunk: int) -> None:
    """batch requests of prompt/gen, prefill included: prefill in packed chunks, then one graphed decode batch."""
    blocks_each = math.ceil((prompt + gen + 1) / PAGE)
    tables = _tables(batch, blocks_each)
    ids = torch.randint(0, 128256, (batch, prompt), device=DEV)
    with torch.inference_mode():
        graph_firsts = torch.zeros(batch, dtype=torch.int64, device=DEV)
        graph = GraphedDecode(eng, tables, graph_firsts, prompt, prompt + gen + 1, gen, use_gemv=False)
        eng.prefill_seqs(ids[:chunk], tables[:chunk])  # warm-up: Triton compiles this chunk shape's tiles
        B.sync()
        t0 = torch.cuda.Event(enable_timing=True)
        t1 = torch.cuda.Event(enable_timing=True)
        t0.record()
        firsts = [eng.prefill_seqs(ids[i : i + chunk], tables[i : i + chunk]).argmax(-1)
                  for i in range(0, batch, chunk)]  # fmt: skip
        t1.record()
        B.sync()
        prefill_ms = t0.elapsed_time(t1)
        graph.first_ids.copy_(torch.cat(firsts))
        decode_ms = graph.run(gen - 1)
    total = prefill_ms + decode_ms
    rep.row("batch", f"{batch} x {prompt // 1024}K/{gen} prefill incl.", out_tok_s=batch * gen / total * 1e3,
            prefill_ms=prefill_ms, decode_ms=decode_ms, decode_tok_s=batch * (gen - 1) / decode_ms * 1e3,
            roofline_decode_tok_s=roofline_tok_s(eng, bw, prompt, gen, batch))  # fmt: skip


def hf_compile(eng: Engine8B) -> None:
    """HF's own tuned path: a static cache, with which generate() compiles the forward (CUDA graphs included)."""
    eng.hf.generation_config.cache_implementation = "static"
