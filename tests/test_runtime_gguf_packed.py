"""GGUF Q4_0 projections kept packed (issue 42; runtime/gguf_loader.py q4_0_weight, runtime/packed_load.py): the
repack into int4_group is bit for bit the `gguf` package's own dequantization (llama.cpp's q/k row permutation
undone on words and scales included); a tiny Llama written by the `gguf` package's GGUFWriter with Q4_0
projections loads with them packed, never materialized in float, and serves HF transformers' logits and greedy
tokens on the same file; every other type, and every setting packed weights cannot run with, still dequantizes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize, quantize
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM
from transformers.convert_slow_tokenizer import bytes_to_unicode

from envex.installer.model_card import card_for_model
from envex.kernels import quant
from envex.kernels.accuracy import rel_err
from envex.kernels.backends import backend
from envex.kernels.torch_ops import TorchOps
from envex.kernels.triton_ops import TritonOps
from envex.runtime.engine import EngineConfig, LLMEngine, SamplingParams
from envex.runtime.gguf_loader import _reverse_permute, iter_weights, q4_0_weight
from envex.runtime.loader import load_model_info
from envex.runtime.packed_load import build_device
from envex.tests.test_runtime_packed_weights import _logits as packed_logits
from envex.tests.test_runtime_reference import hf_next_tokens

Q4_0, Q4_1, Q8_0, F32 = (GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0,
                         GGMLQuantizationType.F32)  # fmt: skip
HIDDEN, INTER, HEADS, KV_HEADS, LAYERS = 64, 128, 4, 2, 2
LINEARS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down", "output")
PROMPTS = [[5, 9, 17, 33, 2], [100, 3, 3, 41, 77, 8, 12, 90, 1, 64, 27]]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def write_llama_gguf(path: Path, types: dict[str, GGMLQuantizationType] | None = None, seed: int = 0) -> Path:
    """A tiny random Llama as llama.cpp lays one out (a byte-level BPE vocabulary of 259 tokens, F32 embedding and
    norms), each linear projection quantized by the `gguf` package to its type in `types` by GGUF short name
    (attn_q, ..., output; Q4_0 for any not named)."""
    rng = np.random.default_rng(seed)
    tokens = [*bytes_to_unicode().values(), "he", "ll", "<|endoftext|>"]
    vocab = len(tokens)
    w = GGUFWriter(str(path), "llama")
    w.add_block_count(LAYERS)
    w.add_context_length(128)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(INTER)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(vocab)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([1] * (vocab - 1) + [3])
    w.add_token_merges(["h e", "l l"])  # transformers rebuilds merges from scores when the list is empty
    w.add_bos_token_id(vocab - 1)
    w.add_eos_token_id(vocab - 1)

    def linear(name: str, short: str, n: int, k: int) -> None:
        a = (rng.standard_normal((n, k)) * 4 / np.sqrt(k)).astype(np.float32)  # decisive logits, no near-ties
        t = (types or {}).get(short, Q4_0)
        if t == F32:
            w.add_tensor(name, a)
        else:
            q = quantize(a, t)
            w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=t)

    w.add_tensor("token_embd.weight", rng.standard_normal((vocab, HIDDEN)).astype(np.float32))
    w.add_tensor("output_norm.weight", np.ones(HIDDEN, np.float32))
    linear("output.weight", "output", vocab, HIDDEN)
    hd = HIDDEN // HEADS
    for i in range(LAYERS):
        for norm in ("attn_norm", "ffn_norm"):
            w.add_tensor(f"blk.{i}.{norm}.weight", (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32))
        for short, (n, k) in {"attn_q": (HEADS * hd, HIDDEN), "attn_k": (KV_HEADS * hd, HIDDEN),
                              "attn_v": (KV_HEADS * hd, HIDDEN), "attn_output": (HIDDEN, HEADS * hd),
                              "ffn_gate": (INTER, HIDDEN), "ffn_up": (INTER, HIDDEN),
                              "ffn_down": (HIDDEN, INTER)}.items():  # fmt: skip
            linear(f"blk.{i}.{short}.weight", short, n, k)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _bits(a: np.ndarray | torch.Tensor) -> np.ndarray:
    """float32 values as their bit patterns: equal arrays here are equal bit for bit, the sign of a zero included."""
    return np.asarray(a, dtype=np.float32).view(np.int32)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), rows=st.sampled_from([4, 8, 12]), blocks=st.integers(1, 4))
def test_q4_0_repack_is_bit_exact_to_gguf_dequantize(seed: int, rows: int, blocks: int) -> None:
    """Random Q4_0 bytes (every nibble, any finite fp16 d, negative and zero included): dequantizing the repacked
    int4_group weight gives gguf.quants.dequantize's float32 bit for bit; so does it after llama.cpp's q/k row
    permutation is undone on the packed words and scales (rows of 2 heads) rather than on the floats."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, blocks, 18), dtype=np.uint8)
    d = rng.integers(0, 2**16, (rows, blocks), dtype=np.uint16).view(np.float16)
    d = np.where(np.isfinite(d), d, np.float16(0.0))
    d[0, 0] = -0.0 if seed % 2 else 0.0
    raw[..., :2] = d.view(np.uint8).reshape(rows, blocks, 2)
    stored = raw.reshape(rows, blocks * 18)
    want = dequantize(stored, Q4_0)  # float32 [rows, 32 * blocks]
    pw = q4_0_weight(stored)
    assert (pw.scheme, pw.group, pw.zero, pw.scale.dtype) == (quant.INT4_GROUP, 32, None, torch.float16)
    assert pw.shape == want.shape
    assert np.array_equal(_bits(quant.dequantize(pw, torch.float32)), _bits(want))
    words, scale = _reverse_permute(pw.data.numpy(), 2), _reverse_permute(pw.scale.numpy(), 2)
    permuted = quant.PackedWeight(scheme=quant.INT4_GROUP, shape=pw.shape, data=torch.from_numpy(words.copy()),
                                  scale=torch.from_numpy(scale.copy()), group=32)  # fmt: skip
    assert np.array_equal(_bits(quant.dequantize(permuted, torch.float32)), _bits(_reverse_permute(want, 2)))


def test_q4_0_codes_sit_in_the_internal_nibble_order() -> None:
    """llama.cpp's block: byte j's low nibble is input j, its high nibble input 16 + j; the internal form puts
    input 8c + i in nibble i of word c (quant.pack_int4)."""
    codes = np.arange(32, dtype=np.uint8) // 2  # input i has code i // 2: the two halves differ
    block = np.concatenate([np.array([1.0], np.float16).view(np.uint8), codes[:16] | (codes[16:] << 4)])
    pw = q4_0_weight(block[None, :])
    assert torch.equal(pw.data, quant.pack_int4(torch.from_numpy(codes)[None, :]))


@pytest.fixture(scope="module")
def q4_0_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_llama_gguf(tmp_path_factory.mktemp("q4_0") / "tiny-q4_0.gguf")


@pytest.fixture(scope="module")
def hf_model(q4_0_file: Path) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(str(q4_0_file.parent), gguf_file=q4_0_file.name,
                                                 dtype=torch.float32)  # fmt: skip
    return model.eval()


def _engine(path: Path, **kw: object) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(path), device="cpu", kv_cache_memory_gb=0.02, max_model_len=64, **kw))


def test_a_q4_0_gguf_serves_packed_as_transformers_serves_it(q4_0_file: Path, hf_model: torch.nn.Module) -> None:
    """Every projection (fused q/k/v and gate/up, o, down, the untied LM head) is an int4_group PackedWeight in
    groups of 32 with float16 scales; the model was built on the meta device and its float copies of them never
    exist; dequantized, each is HF's float32 weight exactly (q/k rows un-permuted as transformers does); logits
    within float32 rounding and greedy tokens equal to HF's."""
    cpu = torch.device("cpu")
    info = load_model_info(str(q4_0_file))
    assert build_device(info, "auto", cpu, backend=backend("torch")) == torch.device("meta")
    engine = _engine(q4_0_file)
    assert set(engine.runner.packed.values()) == {quant.INT4_GROUP} and len(engine.runner.packed) == 4 * LAYERS + 1
    model = engine.runner.model
    params = dict(model.named_parameters())
    assert not any(p.is_meta for p in params.values())
    assert not any(name.endswith("proj_weight") or name == "lm_head_weight" for name in params)
    hf = hf_model.model
    for i, layer in enumerate(model.layers):
        h = hf.layers[i]
        want = {"qkv_proj_weight": [h.self_attn.q_proj, h.self_attn.k_proj, h.self_attn.v_proj],
                "o_proj_weight": [h.self_attn.o_proj], "gate_up_proj_weight": [h.mlp.gate_proj, h.mlp.up_proj],
                "down_proj_weight": [h.mlp.down_proj]}  # fmt: skip
        for attr, parts in want.items():
            pw = getattr(layer, attr)
            assert isinstance(pw, quant.PackedWeight) and (pw.group, pw.scale.dtype) == (32, torch.float16)
            assert torch.equal(quant.dequantize(pw), torch.cat([p.weight for p in parts])), (i, attr)
    assert torch.equal(quant.dequantize(model.lm_head_weight), hf_model.lm_head.weight)
    with torch.no_grad():
        want_logits = hf_model(torch.tensor([PROMPTS[1]])).logits[0]
    assert rel_err(engine.full_logits(PROMPTS[1]), want_logits) < 1e-5
    for ids, out in zip(PROMPTS, engine.generate(PROMPTS, GREEDY), strict=True):
        assert out.token_ids == hf_next_tokens(hf_model, ids, out.token_ids)


@pytest.mark.parametrize("kind", ["q4_1", "q8_0", "mixed-qkv"])
def test_other_types_stay_dequantized(tmp_path: Path, kind: str) -> None:
    """Q4_1 (its min is no integer zero point) and Q8_0 (no 8-bit scheme) load as float, as before; a fused
    matrix with one part of another type (q/k Q4_0, v Q8_0) is dequantized whole while the rest stays packed.
    Either way each float weight is the `gguf` package's dequantization of the stored bytes."""
    types = {"q4_1": dict.fromkeys(LINEARS, Q4_1), "q8_0": dict.fromkeys(LINEARS, Q8_0),
             "mixed-qkv": {"attn_v": Q8_0}}[kind]  # fmt: skip
    path = write_llama_gguf(tmp_path / f"tiny-{kind}.gguf", types)
    engine = _engine(path)
    layer = engine.runner.model.layers[0]
    assert isinstance(layer.qkv_proj_weight, torch.nn.Parameter)
    if kind == "mixed-qkv":
        rest = {f"layers.{i}.{p}_proj_weight" for i in range(LAYERS) for p in ("o", "gate_up", "down")}
        assert set(engine.runner.packed) == {*rest, "lm_head_weight"}
        assert not any(p.is_meta for p in engine.runner.model.parameters())
    else:
        assert engine.runner.packed == {}
    v = dict(iter_weights(path, load_model_info(str(path)).hf_config))["model.layers.0.self_attn.v_proj.weight"]
    assert torch.equal(layer.qkv_proj_weight[-v.shape[0] :], v)


def test_settings_packed_weights_cannot_run_with_dequantize_as_before(q4_0_file: Path) -> None:
    """--deterministic (no packed kernels) and a weights policy (it quantizes the float model) take the Q4_0 file
    dequantized, as before this change, rather than refusing it; the float weights are the packed ones' values."""
    packed = _engine(q4_0_file).runner.model.layers[0].qkv_proj_weight
    det = _engine(q4_0_file, deterministic=True)
    assert det.runner.packed == {}
    assert torch.equal(det.runner.model.layers[0].qkv_proj_weight, quant.dequantize(packed))
    policy = _engine(q4_0_file, weights="int4_g32_sym")
    assert set(policy.runner.packed) == {f"layers.{i}.{p}_proj_weight" for i in range(LAYERS)
                                         for p in ("qkv", "o", "gate_up", "down")}  # fmt: skip


def test_triton_ops_read_the_repacked_q4_0_weights(q4_0_file: Path) -> None:
    """The packed GEMV (decode rows, every prologue) and the norm + dequantize path (prefill) under the Triton
    interpreter, on the loaded Q4_0 model with its float16 group scales, against the torch ops: < 1e-4."""
    engine = _engine(q4_0_file)
    model = engine.runner.model
    for i, (want, got) in enumerate(zip(packed_logits(model, TorchOps()), packed_logits(model, TritonOps()),
                                        strict=True)):  # fmt: skip
        assert rel_err(got, want) < 1e-4, f"step {i}: {rel_err(got, want):.2e}"


@pytest.mark.parametrize("kind", ["q4_0", "mixed-qkv", "q8_0"])
def test_the_card_counts_the_packed_weights_the_engine_holds(tmp_path: Path, kind: str) -> None:
    """The install plan's byte count (installer/model_card.py, ModelCard.weights_bytes): the card's packed
    parameters and bytes are those of the PackedWeights the engine holds for the same file (none for Q8_0; q/k/v
    dequantized whole where v is Q8_0)."""
    types = {"q4_0": None, "mixed-qkv": {"attn_v": Q8_0}, "q8_0": dict.fromkeys(LINEARS, Q8_0)}[kind]
    path = write_llama_gguf(tmp_path / f"tiny-{kind}.gguf", types)
    card = card_for_model(path, "tiny")
    runner = _engine(path).runner
    model, held = runner.model, []
    for name in runner.packed:
        owner, _, attr = name.rpartition(".")
        held.append(getattr(model.get_submodule(owner) if owner else model, attr))
    assert (card.packed_parameters, card.packed_bytes) == (sum(w.shape[0] * w.shape[1] for w in held),
                                                           sum(w.nbytes for w in held))  # fmt: skip
    assert (card.packed_parameters > 0) == (kind != "q8_0")
