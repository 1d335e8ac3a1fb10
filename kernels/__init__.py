"""Triton kernels for the CUDA fast path; reference.py holds the pure-torch definition of each.

Modules: norm (RMSNorm, add+RMSNorm), activation (SwiGLU), rotary (rotary + paged KV write), attention (paged
attention, decode and prefill, with per-head sinks and sliding windows), gemv (batch-1 projections with fused
norm/activation prologues), mxfp4 (the MXFP4 weight format, pure torch), moe_mxfp4 (gpt-oss's mixture of experts:
routing and the expert projections reading MXFP4), ops (the engine's interface) and its backends (backends.py:
torch_ops, triton_ops, invariant_ops). Importing this package does not import triton; the kernel modules do.
"""
