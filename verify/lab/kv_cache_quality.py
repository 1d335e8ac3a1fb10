"""Measure a packed KV cache (fp8, int4) on a model against its bf16-KV self: mean KLD, top-1, needle, stopping.

`python -P -m envex.verify.lab.kv_cache_quality --lengths 512,1024,2048,4096 [--model M] [--json OUT]`: for each
prompt length and dtype, verify.gate_kv_cache.measure_kv_quality (one prompt a length by default; the needle and
stopping parts with --needle / --stopping), printed as a Markdown table with the gate's verdict against KV_BANDS.
The numbers set the bands in verify/gate_kv_cache.py (verify/lab/journal.md, 2026-12-06). CPU: float32
activations, the torch backend.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from envex.runtime.engine import EngineConfig
from envex.verify.gate_kv_cache import STOPPING_PROMPTS, judge, measure_kv_quality


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -P -m envex.verify.lab.kv_cache_quality", description=__doc__)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--lengths", default="512,1024,2048", help="prompt lengths in tokens, comma-separated")
    ap.add_argument("--prompts", type=int, default=1)
    ap.add_argument("--dtypes", default="fp8,int4")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--needle", action="store_true", help="also the needle at the window's end (depths 0, 0.5, 1)")
    ap.add_argument("--stopping", action="store_true")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    rows = []
    print("| dtype | prompt tokens | positions | mean KLD | p99 KLD | max KLD | top-1 | needle kept | verdict |")
    print("|---|---|---|---|---|---|---|---|---|")
    for length in (int(x) for x in args.lengths.split(",")):
        base = EngineConfig(model=args.model, device=args.device, dtype="float32" if args.device == "cpu" else "auto",
                            max_model_len=max(length, 256), kv_cache_memory_gb=0.5)  # fmt: skip
        for dtype in args.dtypes.split(","):
            q = measure_kv_quality(base, dtype, prompt_tokens=length, prompts=args.prompts,
                                   needle_depths=(0.0, 0.5, 1.0) if args.needle else (),
                                   stopping_prompts=STOPPING_PROMPTS if args.stopping else ())
            passed, reason = judge(q)
            rows.append({**q.to_dict(), "passed": passed, "reason": reason})
            print(f"| {dtype} | {length} | {q.positions} | {q.mean_kld:.5f} | {q.p99_kld:.4f} | {q.max_kld:.3f} | "
                  f"{q.top1:.2%} | {q.needle_hits_kept}/{q.needle_reference_hits} | "
                  f"{'pass' if passed else 'refused'} |", flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps({"model": args.model, "rows": rows}, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
