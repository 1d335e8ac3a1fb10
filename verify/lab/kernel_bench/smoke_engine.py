"""A quick look at the engine on the GPU before a long benchmark: dummy weights of a model shape, greedy batch-1
decode of a random prompt through LLMEngine (CUDA graphs, overlap), tok/s and the decode graph sizes.

    python3 -m envex.verify.lab.kernel_bench.smoke_engine --shape llama8b [--prompt 1024 --out-tokens 128]
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

from envex.verify.lab.kernel_bench.bench_server import SHAPES, write_model_dir


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="llama8b", choices=sorted(SHAPES))
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--out-tokens", type=int, default=128)
    args = ap.parse_args()
    from envex.runtime.engine import EngineConfig, LLMEngine, SamplingParams

    model_dir = Path("/tmp/envex-models") / args.shape
    write_model_dir(model_dir, SHAPES[args.shape], weights=False)
    t0 = time.monotonic()
    engine = LLMEngine(EngineConfig(model=str(model_dir), load_format="dummy", max_model_len=4096,
                                    enable_prefix_caching=False))  # fmt: skip
    print(f"{args.shape}: engine ready in {time.monotonic() - t0:.1f} s; graphs {engine.runner.decode_graphs.sizes}")
    rng = random.Random(0)
    params = SamplingParams(max_tokens=args.out_tokens, temperature=0.0, ignore_eos=True)
    for rep in range(3):
        prompt = [rng.randrange(1, 30000) for _ in range(args.prompt)]
        t0 = time.perf_counter()
        out = engine.generate([prompt], params)[0]
        wall = time.perf_counter() - t0
        print(f"  run {rep}: {len(out.token_ids)} tokens in {wall:.3f} s = {len(out.token_ids) / wall:.1f} tok/s "
              f"(prefill included)")


if __name__ == "__main__":
    main()
