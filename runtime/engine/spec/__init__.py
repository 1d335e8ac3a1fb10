"""Speculative decoding, beside the engine's core: the engine knows it through one hook (step.StepHook), which
`SpecDecoder` implements; `build_speculation` wraps the engine's runner in it.

decoder.py: the sequences' tokens on the device, verify steps with acceptance and rejection sampling, the hook;
depth.py: the per-request depth controller and the (batch, k) cost table; drafters.py: n-gram lookup and a draft
model; graphs.py: the verify steps' CUDA graphs. The n-gram rule and a verify step's inputs have their torch
references in kernels/reference.py.
"""

from envex.runtime.engine.spec.decoder import SpecDecoder, build_speculation, draft_kv_bytes, load_draft

__all__ = ["SpecDecoder", "build_speculation", "draft_kv_bytes", "load_draft"]
