"""H200 benchmarks of the kernels and the engine (run on the device machine; raw outputs in verify/lab/results/).

    python -m envex.verify.lab.kernel_bench.bench_h200 --out $OUT      # kernels, bandwidth, batch-1 and HF baselines
    python -m envex.verify.lab.kernel_bench.bench_engine --out $OUT    # the LLMEngine through its own step loop
"""
