"""Triton kernels for the CUDA fast path; reference.py holds the pure-torch definition of each.

Modules: norm (RMSNorm, add+RMSNorm), activation (SwiGLU), rotary (rotary + paged KV write), attention (paged
attention, decode and prefill), gemv (batch-1 projections with fused norm/activation prologues), ops (TritonOps,
the engine's interface). Importing this package does not import triton; the kernel modules do.
"""
