"""One forward per architecture: the model file on the Triton ops (prefill, eager decode, batch-1 GEMV decode, and
the decode graphs' captured step) equals the same model file on the torch reference ops.

On CPU the Triton kernels run under the interpreter and the graphs run their step eagerly (capture=False); on a
GPU the graphs are captured and replayed.
"""

from types import SimpleNamespace

import pytest
import torch

from envex.kernels import triton_ops
from envex.kernels.accuracy import rel_err
from envex.kernels.ops import AttentionMetadata
from envex.kernels.torch_ops import TorchOps
from envex.kernels.triton_ops import TritonOps
from envex.runtime.config import ModelConfig
from envex.runtime.engine.accel.cuda_graphs import DecodeGraphs, graph_ladder
from envex.runtime.models import dummy_weights
from envex.runtime.models.llama import LlamaForCausalLM, rope_cos_sin
from envex.tests.support.kernels import eager_step

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
PAGE, MAX_LEN, VOCAB = 8, 64, 40
BASE = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "tie_word_embeddings": False}  # fmt: skip
ARCHS = {  # the three shapes of attention the family has: plain, QKV bias, q/k norm (and a wider head)
    "llama": {"architectures": ["LlamaForCausalLM"], "model_type": "llama"},
    "qwen2": {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"},
    "qwen3": {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "head_dim": 32},
    "mistral": {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "sliding_window": None},
}
# float32: exact arithmetic under the interpreter stays far below 2e-3; on a GPU the Triton attention's tf32 dots
# against cuBLAS's fp32 compound over the layers (2.1e-3 seen for Qwen3 on the H200, 2026-11-30).
TOL = 2e-3 if DEV.type == "cpu" else 5e-3


class _Runner(SimpleNamespace):
    """What DecodeGraphs needs of a ModelRunner: the model, its ops, its caches and rope tables."""

    def forward_logits(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        hidden, residual = self.model(self.ops, input_ids, self.kv_caches, meta)
        return self.model.compute_logits(self.ops, hidden, residual)


def _model(arch: str) -> LlamaForCausalLM:
    config = ModelConfig.from_hf({**BASE, **ARCHS[arch]})
    model = LlamaForCausalLM(config, dtype=torch.float32, device=DEV)
    dummy_weights(model, seed=1)
    g = torch.Generator(device=DEV).manual_seed(2)
    with torch.no_grad():  # norm weights and biases away from 1 and 0, so a dropped one would show
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn(p.shape, generator=g, device=DEV) * 0.3)
    return model


def _runner(model: LlamaForCausalLM, ops) -> _Runner:
    c = model.config
    cos, sin = rope_cos_sin(c, MAX_LEN, DEV)
    caches = [(torch.zeros(12, PAGE, c.num_key_value_heads, c.head_dim, device=DEV),
               torch.zeros(12, PAGE, c.num_key_value_heads, c.head_dim, device=DEV))
              for _ in range(c.num_hidden_layers)]  # fmt: skip
    return _Runner(model=model, ops=ops, kv_caches=caches, cos=cos, sin=sin, device=DEV, block_size=PAGE,
                   max_model_len=MAX_LEN, model_config=c)  # fmt: skip


def _step(runner: _Runner, ids: list[list[int]], starts: list[int], tables: list[list[int]]) -> torch.Tensor:
    """One eager step: sequence b feeds ids[b] at positions starts[b]..; logits of each sequence's last token."""
    tokens, meta, last = eager_step(ids, starts, tables, runner.cos, runner.sin, PAGE, DEV)
    with torch.inference_mode():
        hidden, residual = runner.model(runner.ops, tokens, runner.kv_caches, meta)
        hidden = runner.ops.materialize(hidden, residual.dtype)  # as ModelRunner.execute: rows are picked
        return runner.model.compute_logits(runner.ops, hidden[last], residual[last])


@pytest.mark.parametrize("arch", sorted(ARCHS))
@pytest.mark.parametrize("split_k", [False, True])
def test_one_forward_on_triton_ops_equals_the_reference(arch: str, split_k: bool,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """split_k: O and down (K = 64 and 96 here) as split-K partials summed by the next norm, as the 8B shape's
    are at 2-16 rows (the prefill step has 16 tokens, decode 2)."""
    splits = []
    if split_k:
        monkeypatch.setattr(triton_ops, "SPLIT_K_MIN", 64)
        product = triton_ops._split_k_product
        monkeypatch.setattr(triton_ops, "_split_k_product", lambda x, w, s: splits.append(s) or product(x, w, s))
    model = _model(arch)
    ref, fast = _runner(model, TorchOps()), _runner(model, TritonOps())
    tables = [[3, 7], [1, 5, 2]]
    prompts = [[4, 11, 29, 3, 8], [1, 2, 3, 5, 8, 13, 21, 34, 7, 11, 18]]
    for name, ids, starts in (("prefill", prompts, [0, 0]), ("decode", [[9], [17]], [5, 11]),
                              ("decode again", [[22], [6]], [6, 12])):  # fmt: skip
        want, got = _step(ref, ids, starts, tables), _step(fast, ids, starts, tables)
        assert rel_err(got, want) < TOL, f"{arch} {name}: {rel_err(got, want):.2e}"
    # Batch-1 decode (the GEMV kernels with the norms, bias and SwiGLU folded in) on the first sequence.
    want, got = _step(ref, [[30]], [7], tables[:1]), _step(fast, [[30]], [7], tables[:1])
    assert rel_err(got, want) < TOL, f"{arch} batch-1 decode: {rel_err(got, want):.2e}"
    for (k, v), (k0, v0) in zip(fast.kv_caches, ref.kv_caches, strict=True):
        assert rel_err(k, k0) < TOL and rel_err(v, v0) < TOL, f"{arch}: KV caches differ"
    # The decode graphs run the same forward: batch 2 (padded into the graph of 2) and batch 1.
    graphs = DecodeGraphs(fast, max_batch=2, capture=DEV.type == "cuda")
    want = _step(ref, [[12], [19]], [8, 13], tables)
    got = graphs.run([12, 19], [8, 13], tables)
    assert rel_err(got, want) < TOL, f"{arch} graph decode: {rel_err(got, want):.2e}"
    # Two halves for O and down in every layer of the prefill, both decodes and the graph step (a GPU also runs
    # the graph's warm-up and capture); none at batch 1.
    calls = 2 * model.config.num_hidden_layers * 4
    assert (set(splits) == {2} and len(splits) >= calls) if split_k else not splits


def test_graph_ladder() -> None:
    assert graph_ladder(1) == (1,)
    assert graph_ladder(20) == (1, 2, 4, 8, 16, 20)
    assert graph_ladder(64)[-3:] == (32, 48, 64)
    with pytest.raises(ValueError, match="max_batch"):
        graph_ladder(0)


def test_padded_batch_matches_single_steps_and_writes_only_its_slots() -> None:
    runner = _runner(_model("llama"), TritonOps())
    for k, v in runner.kv_caches:  # cached keys 0..pos-1 are random contents
        k.normal_()
        v.normal_()
    graphs = DecodeGraphs(runner, max_batch=4, capture=DEV.type == "cuda")
    assert graphs.sizes == (1, 2, 4)
    tables = [[3, 7], [1], [5, 2, 9]]
    positions = [10, 5, 17]
    ids = [4, 11, 29]
    before = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    batched = graphs.run(ids, positions, tables).clone()  # B=3 runs the B=4 graph with one padding row
    assert batched.shape == (3, VOCAB)
    slots = {t[p // PAGE] * PAGE + p % PAGE for t, p in zip(tables, positions, strict=True)}
    for (k, _), (k0, _) in zip(runner.kv_caches, before, strict=True):
        rows = (k != k0).reshape(-1, k.shape[2] * k.shape[3]).any(1)  # [num_blocks * PAGE]: slot written?
        changed = set(rows.nonzero().flatten().tolist())
        assert changed == slots, "only the three real tokens' slots may be written"
    for row in range(3):  # each sequence alone through the batch-1 (GEMV) step sees the same cache
        single = graphs.run([ids[row]], [positions[row]], [tables[row]])
        assert rel_err(single, batched[row : row + 1]) < 1e-3


def test_a_short_context_graph_exists_only_where_attention_launches_differently(monkeypatch) -> None:
    """As on an H200 (132 SMs): gpt-oss's 8 KV heads of 64 at 131K take 64 splits of 128-key tiles at batch 1, but
    32 splits of 64-key tiles at 4K, so batch 1 gets a 4K graph too; 64 sequences launch alike at both lengths;
    Llama's heads of 128 at 8K launch alike (32 splits), so one graph a size."""
    from envex.kernels import attention
    from envex.runtime.engine.accel import cuda_graphs

    monkeypatch.setattr(attention, "_sm_count", lambda _device: 132)
    monkeypatch.setattr(cuda_graphs, "num_splits_for", lambda b, h, n, dev: attention.choose_num_splits(b, h, n, dev))

    def lengths(batch: int, head_dim: int, max_len: int) -> tuple[int, ...]:
        return cuda_graphs.context_lengths(max_len, lambda n: cuda_graphs.attention_shape(
            batch, 8, head_dim, n, torch.device("cpu")))  # fmt: skip

    assert cuda_graphs.attention_shape(1, 8, 64, 131072, torch.device("cpu")) == (64, True)
    assert cuda_graphs.attention_shape(1, 8, 64, 4096, torch.device("cpu")) == (32, False)
    assert lengths(1, 64, 131072) == (cuda_graphs.SHORT_CONTEXT, 131072)
    assert lengths(64, 64, 131072) == (131072,)
    assert lengths(1, 128, 8192) == (8192,)
    assert lengths(1, 64, 4096) == (4096,)


def test_a_step_whose_sequences_fit_replays_the_short_context_graph(monkeypatch) -> None:
    """With a short context of 16 tokens that launches differently (forced here): a step whose sequences all hold
    at most 16 keys runs the 16-token graph, one longer sequence sends it to the max_model_len graph, and both
    give the eager step's logits."""
    from envex.runtime.engine.accel import cuda_graphs

    monkeypatch.setattr(cuda_graphs, "SHORT_CONTEXT", 16)
    monkeypatch.setattr(cuda_graphs, "attention_shape", lambda b, h, d, n, dev: n)
    runner = _runner(_model("llama"), TritonOps())
    for k, v in runner.kv_caches:
        k.normal_()
        v.normal_()
    graphs = DecodeGraphs(runner, max_batch=2, capture=DEV.type == "cuda")
    assert graphs.keys == [(1, 16), (1, MAX_LEN), (2, 16), (2, MAX_LEN)]
    assert graphs.key_for(2, [15, 3]) == (2, 16) and graphs.key_for(2, [16, 3]) == (2, MAX_LEN)
    seen: list[int] = []
    forward = _Runner.forward_logits  # spied on the class: a wrapper on the instance would make a reference
    # cycle, and graphs freed by the cyclic collector during a later test's capture break that capture

    def spy(self: _Runner, input_ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        seen.append(meta.max_seq_len)
        return forward(self, input_ids, meta)

    monkeypatch.setattr(_Runner, "forward_logits", spy)
    tables = [[3, 7, 1], [5, 2, 9]]
    for positions in ([12, 15], [12, 20]):
        ids = [4, 11]
        want = _step(runner, [[i] for i in ids], positions, tables)  # writes the same K/V the graph step writes
        got = graphs.run(ids, positions, tables).clone()
        assert rel_err(got, want) < 1e-3, positions
    if DEV.type == "cpu":  # eager: the step ran the forward of the graph it chose
        assert seen == [16, MAX_LEN]


def test_run_chunks_takes_only_pure_decode_steps() -> None:
    graphs = DecodeGraphs(_runner(_model("llama"), TritonOps()), max_batch=2, capture=DEV.type == "cuda")

    def chunk(start: int, n: int, prompt_len: int) -> SimpleNamespace:
        seq = SimpleNamespace(prompt_token_ids=list(range(prompt_len)),
                              output_token_ids=list(range(prompt_len, start + n)), block_table=[0, 1, 2])  # fmt: skip
        return SimpleNamespace(seq=seq, start=start, num_tokens=n, completes=True)

    assert graphs.run_chunks([chunk(6, 1, 5)]).shape == (1, VOCAB)
    assert graphs.run_chunks([chunk(0, 5, 5)]) is None  # prefill
    assert graphs.run_chunks([chunk(6, 1, 5)] * 3) is None  # more than the largest graph
    with pytest.raises(ValueError, match="largest captured decode graph takes 2"):
        graphs.run([1, 2, 3], [1, 1, 1], [[0]] * 3)
