"""Quality gates and the benchmark harness: the evidence that an install serves the same answers, measured.

- `envex.verify.gates.run_gates(engine, reference=..., suite="quick"|"full")` -> `GateReport`
- `envex.verify.bench.run_bench(BenchConfig(...))` -> `BenchReport`
- `envex.verify.roofline.roofline(...)`: the memory-bandwidth bound of one decode step on this device

Modules import torch/transformers lazily where they can, so `envex.verify.stats` stays light.
"""
