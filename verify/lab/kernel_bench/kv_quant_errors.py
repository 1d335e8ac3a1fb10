"""The KV-cache formats' errors on real activations (offline_docs/kv_cache.md, "Measured errors"): the embedded
SmolLM2-135M's q, k, v of every layer over a 598-token text (HF transformers, float32 on CPU), each format's
relative error of K, V and of the causal attention output against the unquantized cache, in float64. Also the
same on synthetic keys with a few large outlier channels. CPU, about 4 minutes on 2 cores
(verify/lab/results/cpu-2026-12-06-e241abc-kv-quant-errors.txt):

    python -P -m envex.verify.lab.kernel_bench.kv_quant_errors
"""

from __future__ import annotations

import math

import torch

from envex.kernels import reference as ref

TEXT = (
    "The KV cache, not the weights, caps how many sessions a GPU holds and how fast long contexts decode. "
    "In 1869 Dmitri Mendeleev published a periodic table that left gaps for elements not yet discovered; "
    "gallium (1875), scandium (1879) and germanium (1886) filled them with the properties he had predicted. "
    "def merge(a, b):\n    out = []\n    while a and b:\n        out.append(a.pop(0) if a[0] < b[0] else b.pop(0))\n"
    "    return out + a + b\n"
    "Paris, 14 juillet : la foule envahit la Bastille. Tokyo 東京 は日本の首都です。 3.14159 2.71828 1.41421 "
) * 3


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def capture() -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(q, k, v) of every layer, [T, H, D] float64, q and k after rotary."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from envex.runtime.loader import embedded_model_path

    path = embedded_model_path()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    ids = tok(TEXT, return_tensors="pt").input_ids
    cfg = model.config
    d = cfg.hidden_size // cfg.num_attention_heads
    got: dict[tuple[int, str], torch.Tensor] = {}
    hooks = []
    for i, layer in enumerate(model.model.layers):
        for name in ("q_proj", "k_proj", "v_proj"):
            def hook(_m, _inp, out, key=(i, name)):  # noqa: ANN001
                got[key] = out[0].detach()
            hooks.append(getattr(layer.self_attn, name).register_forward_hook(hook))
    with torch.no_grad():
        model(ids)
        pos = torch.arange(ids.shape[1])[None]
        cos, sin = model.model.rotary_emb(torch.zeros(1, dtype=torch.float32), pos)
    for h in hooks:
        h.remove()
    layers = []
    for i in range(cfg.num_hidden_layers):
        q = got[(i, "q_proj")].view(-1, cfg.num_attention_heads, d)
        k = got[(i, "k_proj")].view(-1, cfg.num_key_value_heads, d)
        v = got[(i, "v_proj")].view(-1, cfg.num_key_value_heads, d)
        q, k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
        layers.append((q[0].transpose(0, 1).double(), k[0].transpose(0, 1).double(), v.double()))
    return layers


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq, D], float64."""
    t, hq, d = q.shape
    group = hq // k.shape[1]
    kk, vv = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = torch.einsum("thd,shd->hts", q, kk) / math.sqrt(d)
    s = s.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("hts,shd->thd", s.softmax(-1), vv)


def roundtrip(x: torch.Tensor, scheme: str, group: int, rotated: bool) -> torch.Tensor:
    y = ref.hadamard_rotate(x) if rotated else x
    if scheme == "fp8":
        data, s = ref.quantize_fp8(y)
        out = ref.dequantize_fp8(data, s)
    else:
        codes, s, z = ref.quantize_int4(y, group, zero_point=scheme == "int4-zp")
        out = ref.dequantize_int4(codes, s, z)
    return ref.hadamard_rotate(out) if rotated else out


SCHEMES = [("int4", 32), ("int4", 64), ("int4-zp", 32), ("int4-zp", 64), ("fp8", 0)]


def main() -> None:
    layers = capture()
    print(f"SmolLM2-135M, {len(layers)} layers, {layers[0][1].shape[0]} tokens; mean relative error over layers")
    print(f"{'scheme':10} {'G':>3} {'rot K':>5} {'rot V':>5} {'K':>8} {'V':>8} {'attn out':>9}")
    for scheme, group in SCHEMES:
        for rot_k, rot_v in ((False, False), (True, False), (True, True)):
            ek = ev = eo = 0.0
            for q, k, v in layers:
                kq, vq = roundtrip(k, scheme, group, rot_k), roundtrip(v, scheme, group, rot_v)
                ek += _rel(kq, k)
                ev += _rel(vq, v)
                eo += _rel(causal_attention(q, kq, vq), causal_attention(q, k, v))
            n = len(layers)
            print(f"{scheme:10} {group:>3} {rot_k!s:>5} {rot_v!s:>5} {ek / n:8.4f} {ev / n:8.4f} {eo / n:9.4f}")
    g = torch.Generator().manual_seed(0)
    k = torch.randn(512, 8, 128, generator=g, dtype=torch.float64)
    k[..., [3, 70, 111]] = k[..., [3, 70, 111]] * 4 + 15  # outlier channels, as real keys have
    print("synthetic keys [512, 8, 128] with 3 outlier channels (|x| ~ 15 vs 1): relative error of K")
    for scheme, group in SCHEMES:
        for rot in (False, True):
            print(f"{scheme:10} {group:>3} {rot!s:>5} {_rel(roundtrip(k, scheme, group, rot), k):8.4f}")


if __name__ == "__main__":
    main()
