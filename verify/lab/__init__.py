"""The lab: source-only tools and evidence, importable from a checkout (editable install) and never in the wheel.

- device scripts (`device_*.sh`, sourced or run from the repo root on a GPU machine; `device_setup.sh` first) and
  their Python halves: `cuda_check` (gates and bench on the device), `devcarry` (split and join what a call
  carries), `device_install` (the installer's own steps, timed)
- `kernel_bench/`: the kernel, engine, server, MoE, speculation, invariance and tensor-parallel benches
- `bench_install` (the installer against a plain copy) and `admin_screenshot` (offline_docs/admin-overview.png)
- `results/`: the raw JSON and text those runs wrote

Nothing in a product package imports it (tests/test_layering.py); the wheel leaves it out (setup.py,
tests/test_wheel_contents.py).
"""
