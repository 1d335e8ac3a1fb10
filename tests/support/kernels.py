"""What the kernel tests share: float64 upcasts for the reference, an assertion against the accuracy contract
(kernels/accuracy.py, which the H200 benches use too), and the inputs of one eager model step."""

from __future__ import annotations

from typing import Any

import torch

from envex.kernels.accuracy import TOLERANCE, rel_err
from envex.kernels.ops import AttentionMetadata


def f64(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """Float tensors upcast to float64 (for the reference); integer tensors unchanged."""
    return [t.to(torch.float64) if t.is_floating_point() else t for t in tensors]


def planes_of(x: torch.Tensor) -> torch.Tensor:
    """Rows [T, H] as float32 planes, in torch: input c + 8j of a row at c·(H/8) + j (norm.plane_offsets)."""
    t, h = x.shape
    return x.float().reshape(t, h // 8, 8).transpose(1, 2).reshape(t, h)


def assert_close(name: str, out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> float:
    err = rel_err(out, ref)
    tol = TOLERANCE[dtype]
    assert err <= tol, f"{name}: relative error {err:.3g} > {tol:.3g} for {dtype}"
    return err


def eager_step(ids: list[list[int]], starts: list[int], tables: list[list[int]], cos: torch.Tensor, sin: torch.Tensor,
               page: int, device: torch.device) -> tuple[torch.Tensor, AttentionMetadata, torch.Tensor]:  # fmt: skip
    """One eager step's inputs: sequence b feeds ids[b] at positions starts[b].. through its block table tables[b]
    -> (the flat token ids, their AttentionMetadata, the row index of each sequence's last token)."""
    flat, pos, slots, cu = [], [], [], [0]
    for toks, start, table in zip(ids, starts, tables, strict=True):
        flat += toks
        for p in range(start, start + len(toks)):
            pos.append(p)
            slots.append(table[p // page] * page + p % page)
        cu.append(cu[-1] + len(toks))
    q_lens = [len(t) for t in ids]
    seq_lens = [s + n for s, n in zip(starts, q_lens, strict=True)]
    width = max(len(t) for t in tables)
    meta = AttentionMetadata(
        positions=torch.tensor(pos, device=device), slot_mapping=torch.tensor(slots, device=device),
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=device),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device),
        cos=cos, sin=sin, max_q_len=max(q_lens), max_seq_len=max(seq_lens),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device), q_lens_host=q_lens,
        seq_lens_host=seq_lens,
    )  # fmt: skip
    return torch.tensor(flat, device=device), meta, torch.tensor(cu[1:], device=device) - 1


def compile_for_hopper(script: str) -> Any:
    """Run `script` (Python source that compiles kernels for sm_90 with Triton's own ptxas, no GPU, and prints one
    JSON line last; it may call sm90_build) in a child without the interpreter; its JSON. Skips where this Triton
    bundles no ptxas."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    import pytest
    import triton  # here, not at the top: Triton reads TRITON_INTERPRET when first imported

    if not list(Path(triton.__file__).parent.glob("backends/nvidia/bin/ptxas")):
        pytest.skip("this Triton has no bundled ptxas")
    import inspect

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    # The child cannot import envex.tests (the package maps the product's folders only): sm90_build goes as source.
    script = f"from typing import Any\n{inspect.getsource(sm90_build)}\n{script}"
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def sm90_build(fn: Any, ptrs: dict[str, str], consts: dict[str, Any], *, num_warps: int = 4,
               any_size: tuple[str, ...] = ("M", "N")) -> tuple[str, int, int]:  # fmt: skip
    """For a compile_for_hopper script: a @triton.jit kernel compiled for sm_90 with its integers specialized as a
    launch would (divisible by 16, except the sizes in any_size) -> (its PTX, registers, stack bytes: spills), the
    last two from the cubin as the driver loads it."""
    import pathlib
    import re
    import subprocess
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = {n: "constexpr" if n in consts else ptrs.get(n, "i32") for n in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
             if n not in consts and n not in any_size}  # fmt: skip
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                       target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})  # fmt: skip
    tool = pathlib.Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump"
    with tempfile.TemporaryDirectory() as d:
        (pathlib.Path(d) / "k.cubin").write_bytes(k.asm["cubin"])
        info = subprocess.run([str(tool), "-res-usage", f"{d}/k.cubin"], capture_output=True, text=True,
                              check=True).stdout  # fmt: skip
    regs, stack = (int(re.search(rf"{what}:(\d+)", info).group(1)) for what in ("REG", "STACK"))
    return k.asm["ptx"], regs, stack
