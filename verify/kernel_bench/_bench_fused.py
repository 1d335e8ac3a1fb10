"""The `fused` section of bench_h200.py: fused decode attention against the unfused chain, then both in
the whole batch-1 step.

1. Kernels, at B=1 L=1K, B=1 L=10K and B=64 L=1K: the unfused chain (rotary_and_store_kv, paged_attention with
   its merge kernel) and decode_attention_fused with the merge as a second launch and in-kernel, each checked
   against the float64 reference (output and the cache row written) and against the unfused chain, then timed in
   a CUDA graph over rotating caches, with and without PDL.
2. A race probe for the in-kernel merge: hundreds of back-to-back launches alternating between caches, each output
   compared bit for bit with the same cache's first result, and the counters checked to be zero at the end.
3. The O projection (4096 x 4096): the chunked config in use against a few persistent ones, with PDL.
4. The batch-1 decode step, CUDA-graphed with PDL, at 1K/256 and 10K/512: unfused, fused + merge kernel, fused +
   in-kernel merge; tokens and one step's logits against the unfused decoder.
"""

from __future__ import annotations

import math

import torch

from envex.kernels import attention, decode_attention, gemv, rotary
from envex.kernels import reference as ref
from envex.kernels.accuracy import TOLERANCE, rel_err
from envex.kernels.fused_decode import splits_for
from envex.verify.kernel_bench import _bench_lib as B

DEV = torch.device("cuda")
BF16 = torch.bfloat16
HQ, HKV, D, PAGE = 32, 8, 128, 16
# (name, merge_in_kernel) of the fused variants; None is the unfused chain.
VARIANTS = (("unfused", None), ("fused+merge kernel", False), ("fused+in-kernel merge", True))
ROTATE_BYTES = 200e6  # K/V bytes the rotating caches of one regime span, well past the 60 MB L2
REGIMES = (("b1_1k", 1, 1024), ("b1_10k", 1, 10240), ("b64_1k", 64, 1024))  # (attention sweep key, batch, seq)


class _Case:
    """One regime's inputs: rotating caches (so timing reads HBM), a QKV row per sequence, the new token at
    position seq-1 of every sequence, its slot in each table set."""

    def __init__(self, batch: int, seq: int, attn_opts: dict, paged) -> None:
        self.batch, self.seq = batch, seq
        self.sets = max(2, math.ceil(ROTATE_BYTES / (batch * seq * HKV * D * 4)))
        self.kc, self.vc, self.tables = paged(batch, seq, self.sets)  # tables [sets, batch, blocks]
        self.qkv = torch.randn(batch, (HQ + 2 * HKV) * D, device=DEV, dtype=BF16)
        self.pos = torch.full((batch,), seq - 1, device=DEV, dtype=torch.int64)
        self.slots = self.tables[:, :, (seq - 1) // PAGE].long() * PAGE + (seq - 1) % PAGE  # [sets, batch]
        inv = 1.0 / (500000.0 ** (torch.arange(0, D, 2, device=DEV).float() / D))
        freqs = torch.arange(seq, device=DEV).float()[:, None] * inv
        self.cos, self.sin = freqs.cos(), freqs.sin()
        opts = dict(attn_opts)
        self.splits = splits_for(batch, HKV, seq, DEV, min_keys=opts.pop("min_keys", 64),
                                 programs_per_sm=opts.pop("programs_per_sm", 2))  # fmt: skip
        self.opts = opts  # block_n, num_stages
        self.counters = decode_attention.new_split_counters(batch, HKV, DEV)
        self.cu = torch.arange(batch + 1, device=DEV, dtype=torch.int32)
        self.sl = torch.full((batch,), seq, device=DEV, dtype=torch.int32)

    def run(self, i: int, merge: bool | None, pdl: bool = False, out: torch.Tensor | None = None) -> torch.Tensor:
        j = i % self.sets
        if merge is None:
            q = self.qkv[:, : HQ * D].view(self.batch, HQ, D)  # [B, Hq, D] views of the fused row
            k = self.qkv[:, HQ * D : (HQ + HKV) * D].view(self.batch, HKV, D)
            v = self.qkv[:, (HQ + HKV) * D :].view(self.batch, HKV, D)
            q, _ = rotary.rotary_and_store_kv(q, k, v, self.pos, self.cos, self.sin, self.kc, self.vc, self.slots[j],
                                              pdl=pdl)  # fmt: skip
            return attention.paged_attention(q, self.kc, self.vc, self.cu, self.sl, self.tables[j], D**-0.5,
                                             max_q_len=1, max_seq_len=self.seq, num_splits=self.splits, pdl=pdl,
                                             **self.opts)  # fmt: skip
        return decode_attention.decode_attention_fused(
            self.qkv, self.pos, self.slots[j], self.cos, self.sin, self.kc, self.vc, self.tables[j], D**-0.5,
            num_heads=HQ, num_kv_heads=HKV, max_seq_len=self.seq, num_splits=self.splits, merge_in_kernel=merge,
            counters=self.counters, out=out, pdl=pdl, **self.opts,
        )  # fmt: skip

    def written_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The K and V rows at set 0's slots [B, Hkv, D]."""
        flat_k, flat_v = self.kc.view(-1, HKV, D), self.vc.view(-1, HKV, D)
        return flat_k[self.slots[0]].clone(), flat_v[self.slots[0]].clone()


def section_fused(rep, bw: float, attn_best: dict, paged) -> None:
    """Parts 1-3 of the module docstring; `paged` is bench_h200._paged (rotating disjoint block tables)."""
    for regime, batch, seq in REGIMES:
        case = _Case(batch, seq, attn_best.get(regime, {}), paged)
        _check_and_time(rep, bw, case, f"B={batch} L={seq} splits={case.splits}")
        _race_probe(rep, case, f"B={batch} L={seq} splits={case.splits}")
        del case
        torch.cuda.empty_cache()
    _o_gemv(rep, bw)


def _check_and_time(rep, bw: float, case: _Case, tag: str) -> None:
    kc_ref, vc_ref = case.kc.double(), case.vc.double()
    want = ref.decode_attention_fused(case.qkv.double(), case.pos, case.slots[0], case.cos.double(),
                                      case.sin.double(), kc_ref, vc_ref, case.tables[0], D**-0.5, HQ, HKV)  # fmt: skip
    want_k, want_v = kc_ref.view(-1, HKV, D)[case.slots[0]], vc_ref.view(-1, HKV, D)[case.slots[0]]
    del kc_ref, vc_ref
    floor_ms = case.batch * case.seq * HKV * D * 4 / bw / 1e9
    old_out, old_rows, old_us = None, None, None
    for name, merge in VARIANTS:
        flat_k = case.kc.view(-1, HKV, D)
        flat_k[case.slots[0]] = float("nan")  # the cache rows this launch must write
        case.vc.view(-1, HKV, D)[case.slots[0]] = float("nan")
        out = torch.full((case.batch, HQ, D), float("nan"), device=DEV, dtype=BF16)  # poisoned output
        if merge is None:
            del out  # the caching allocator hands this NaN block to paged_attention's output
            out = case.run(0, merge)
        else:
            case.run(0, merge, out=out)
        rows = case.written_rows()
        err = max(rel_err(out, want), rel_err(rows[0], want_k), rel_err(rows[1], want_v))
        fields = dict(rel_err=err, ok=bool(err <= TOLERANCE[BF16]))
        if old_out is None:
            old_out, old_rows = out.clone(), rows
        else:
            fields.update(vs_unfused_rel_err=rel_err(out, old_out),
                          cache_rows_equal_unfused=bool(torch.equal(rows[0], old_rows[0])
                                                        and torch.equal(rows[1], old_rows[1])))  # fmt: skip
        ms = B.graph_time_ms(lambda i, m=merge: case.run(i, m), 2 * case.sets)
        pdl_ms = B.graph_time_ms(lambda i, m=merge: case.run(i, m, pdl=True), 2 * case.sets)
        old_us = old_us or pdl_ms * 1e3
        rep.row("fused", f"attn {name} {tag}", **fields, us=ms * 1e3, pdl_us=pdl_ms * 1e3, floor_us=floor_ms * 1e3,
                of_floor=floor_ms / pdl_ms, vs_unfused=old_us / (pdl_ms * 1e3))  # fmt: skip


def _race_probe(rep, case: _Case, tag: str, launches: int = 400) -> None:
    """Back-to-back in-kernel-merge launches alternating caches (so a stale partial differs from a fresh one); each
    output must equal its cache set's first result bit for bit, and the counters must end at zero."""
    if case.splits == 1:
        return
    firsts = [case.run(j, True).clone() for j in range(case.sets)]
    outs = torch.empty((launches, case.batch, HQ, D), device=DEV, dtype=BF16)
    B.sync()
    for i in range(launches):
        case.run(i, True, out=outs[i])
    B.sync()
    bad = sum(int(not torch.equal(outs[i], firsts[i % case.sets])) for i in range(launches))
    rep.row("fused", f"race probe in-kernel merge {tag}", launches=launches, mismatches=bad,
            counters_zero=bool((case.counters == 0).all()))  # fmt: skip


def _o_gemv(rep, bw: float) -> None:
    """The O projection with the chunked config in use against persistent ones (PDL on, as in the step)."""
    n = k = 4096
    copies = max(2, math.ceil(400e6 / (n * k * 2)))
    ws = [torch.randn(n, k, device=DEV, dtype=BF16) / 64 for _ in range(copies)]
    a = torch.randn(1, k, device=DEV, dtype=BF16)
    want = ref.linear(a.double(), ws[0].double())
    floor_ms = n * k * 2 / bw / 1e9
    in_use = gemv.H200_CONFIGS[(n, k, gemv.PROLOGUE_NONE)]
    configs = [in_use] + [(bn, 0, nw, pps) for bn in (1, 2) for nw in (4, 8) for pps in (2, 4)]
    for cfg in configs:
        err = rel_err(gemv.gemv(a, ws[0], config=cfg)[0], want)
        ms = B.graph_time_ms(lambda i, c=cfg, ws=ws: gemv.gemv(a, ws[i % copies], config=c, pdl=True), 2 * copies)
        rep.row("fused", f"O gemv {'in use ' if cfg == in_use else ''}{cfg}", rel_err=err,
                ok=bool(err <= TOLERANCE[BF16]), us=ms * 1e3, of_floor=floor_ms / ms)  # fmt: skip
    del ws


def section_fused_e2e(rep, eng, bw: float) -> None:
    """Part 4: the batch-1 step with each variant's FusedDecoder flags, graphed with PDL, side by side."""
    from envex.verify.kernel_bench import _bench_e2e as E

    for prompt, gen in ((1024, 256), (10240, 512)):
        tag = f"{prompt // 1024}K/{gen}"
        ids = torch.randint(0, 128256, (1, prompt), device=DEV, generator=torch.Generator(DEV).manual_seed(prompt))
        tables = E._tables(1, math.ceil((prompt + gen + 1) / PAGE))
        with torch.inference_mode():
            first = eng.prefill_seqs(ids, tables).argmax(-1)
        roof = E.roofline_tok_s(eng, bw, prompt, gen)
        tokens, base_ms = None, None
        for name, merge in VARIANTS:
            options = dict(fuse_rotary_attention=merge is not None, merge_splits_in_kernel=bool(merge))
            with torch.inference_mode():
                graph = E.GraphedDecode(eng, tables, first, prompt, prompt + gen + 1, gen, True, True, options)
                ms = min(graph.run(gen) for _ in range(3))
                got = graph.dec.forward(graph.state, graph.splits, graph.max_len).float()
                old = eng.decoder(True, True, graph.dec.attn_kwargs, fuse_rotary_attention=False)
                step_err = rel_err(got, old.forward(graph.state, graph.splits, graph.max_len).float())
            out = graph.out[0].clone()
            tokens = out if tokens is None else tokens
            same = int((out == tokens).float().cumprod(0).sum().item())
            base_ms = base_ms or ms / gen
            rep.row("fused", f"decode {tag} {name}", step_ms=ms / gen, tok_s=gen / ms * 1e3, roofline_tok_s=roof,
                    of_roofline=gen / ms * 1e3 / roof, saved_us_per_layer=(base_ms - ms / gen) * 1e3 / 32,
                    step_logits_vs_unfused=step_err, same_prefix_tokens=same, of=gen, splits=graph.splits)  # fmt: skip
            del graph
