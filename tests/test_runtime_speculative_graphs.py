"""The (batch, k) verify step (spec/graphs.py, SpecGraphs) on the Triton ops equals the model file's plain eager step on
the torch reference: k+1 query rows per sequence, causal over the paged cache, inputs derived on the device from
the token history, padding rows and rows past a sequence's drafts writing nothing. On CPU the Triton kernels run
under the interpreter and the step eagerly (capture=False); on a GPU it is captured and replayed.
"""

from types import SimpleNamespace

import pytest
import torch

from envex.kernels.accuracy import rel_err
from envex.kernels.ops import AttentionMetadata
from envex.kernels.torch_ops import TorchOps
from envex.kernels.triton_ops import TritonOps
from envex.runtime.config import ModelConfig
from envex.runtime.engine.spec.drafters import SpecInputs
from envex.runtime.engine.spec.graphs import SpecGraphs
from envex.runtime.models import dummy_weights
from envex.runtime.models.llama import LlamaForCausalLM, rope_cos_sin
from envex.tests.support.kernels import eager_step

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
PAGE, MAX_LEN, VOCAB, BLOCKS = 8, 64, 40, 16
CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": VOCAB, "hidden_size": 64,
          "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "max_position_embeddings": 128, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
          "tie_word_embeddings": False}  # fmt: skip
TOL = 2e-3 if DEV.type == "cpu" else 5e-3


class _Runner(SimpleNamespace):
    def forward_logits(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        hidden, residual = self.model(self.ops, input_ids, self.kv_caches, meta)
        return self.model.compute_logits(self.ops, hidden, residual)


class _FixedDrafts:
    """A drafter that proposes given tokens (what is drafted does not matter to the forward)."""

    name, in_verify_graph, wants_hidden = "fixed", True, False

    def __init__(self, drafts: torch.Tensor) -> None:
        self.drafts = drafts

    def propose(self, x: SpecInputs) -> None:
        x.drafts.copy_(self.drafts[: x.batch, : x.k])
        x.num_drafts.copy_(x.k_limit.clamp(min=0))


def _runner(model: LlamaForCausalLM, ops, caches) -> _Runner:
    cos, sin = rope_cos_sin(model.config, MAX_LEN, DEV)
    return _Runner(model=model, ops=ops, kv_caches=caches, cos=cos, sin=sin, device=DEV, block_size=PAGE,
                   max_model_len=MAX_LEN, model_config=model.config, states=None)  # fmt: skip


def _eager(runner: _Runner, ids: list[list[int]], starts: list[int], tables: list[list[int]]) -> torch.Tensor:
    """The plain eager step: sequence b feeds ids[b] at positions starts[b].. -> logits of every row."""
    tokens, meta, _ = eager_step(ids, starts, tables, runner.cos, runner.sin, PAGE, DEV)
    with torch.inference_mode():
        return runner.forward_logits(tokens, meta)


@pytest.mark.parametrize(("k", "splits"), [(2, None), (5, 3)])  # q_len <= 4 (split decode tiles) and > 4
def test_verify_step_equals_the_eager_reference(k: int, splits: int | None) -> None:
    config = ModelConfig.from_hf(CONFIG)
    model = LlamaForCausalLM(config, dtype=torch.float32, device=DEV)
    dummy_weights(model, seed=3)
    g = torch.Generator(device=DEV).manual_seed(4)
    shape = (BLOCKS, PAGE, config.num_key_value_heads, config.head_dim)
    caches = [(torch.randn(shape, generator=g, device=DEV), torch.randn(shape, generator=g, device=DEV))
              for _ in range(config.num_hidden_layers)]  # fmt: skip
    ref_caches = [(c.clone(), v.clone()) for c, v in caches]
    lens, tables = [10, 21], [[3, 7], [1, 5, 2, 9]]
    hist = torch.zeros(3, MAX_LEN + 8 + 2, dtype=torch.int64, device=DEV)
    for row, n in enumerate(lens):
        hist[row, :n] = torch.randint(0, VOCAB, (n,), generator=g, device=DEV)
    spec = SimpleNamespace(hist=hist, lens=torch.tensor(lens + [2], device=DEV), spare=2, width=hist.shape[1])
    drafts = torch.randint(0, VOCAB, (4, 8), generator=g, device=DEV)
    fast = _runner(model, TritonOps(), caches)
    graphs = SpecGraphs(fast, spec, _FixedDrafts(drafts), sizes=(1, 4), ks=(2, 5), capture=DEV.type == "cuda")
    graphs.pad = True  # as on a GPU: two sequences in the graph of four, two padding rows
    if splits is not None and DEV.type == "cpu":
        graphs._make_inputs(4, k)
        graphs._splits[(4, k)] = splits
    ks = [k, k - 1]  # the second sequence proposes one draft fewer: its last row must write nothing
    before = [(c.clone(), v.clone()) for c, v in caches]
    x, logits = graphs.run([0, 1], ks, tables, k)
    logits = logits.view(2, k + 1, VOCAB)
    assert x.seq_lens[:2].tolist() == lens and x.num_drafts[:2].tolist() == ks
    ref = _runner(model, TorchOps(), ref_caches)
    ids = [[int(hist[b, lens[b] - 1])] + drafts[b, :ks[b]].tolist() for b in range(2)]
    want = _eager(ref, ids, [n - 1 for n in lens], tables)
    got = torch.cat([logits[0, : k + 1], logits[1, :k]])
    assert rel_err(got, want) < TOL, f"k={k}: {rel_err(got, want):.2e}"
    slots = {t[p // PAGE] * PAGE + p % PAGE for t, n, kk in zip(tables, lens, ks, strict=True)
             for p in range(n - 1, n + kk)}  # fmt: skip
    for (kc, _), (k0, _) in zip(caches, before, strict=True):
        rows = (kc != k0).reshape(-1, kc.shape[2] * kc.shape[3]).any(1)
        assert set(rows.nonzero().flatten().tolist()) == slots, "only the verified rows' slots may be written"
