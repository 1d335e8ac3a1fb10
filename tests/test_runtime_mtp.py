"""DeepSeek-V3's multi-token-prediction drafter (draft_model "mtp") on a tiny random V3 checkpoint with an MTP layer
in the published naming (model.layers.{N}.*): the module's logits are HF transformers' MtpLayer over the same
weights; greedy output with MTP speculation is token for token the plain output; an MTP layer built to predict the
model's next token has every draft accepted, as the engine's stats report; the loader skips the MTP layer when it is
unused; a checkpoint without one is refused in one line."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers.modeling_layers import MtpLayer
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer, DeepseekV3RMSNorm

from envex.kernels.accuracy import rel_err
from envex.kernels.ops import AttentionMetadata
from envex.kernels.torch_ops import TorchOps
from envex.runtime.engine import EngineConfig, LLMEngine, SamplingParams
from envex.runtime.engine.accel.cuda_graphs import DecodeGraphs
from envex.runtime.engine.spec import draft_kv_bytes
from envex.runtime.loader import load_model_info
from envex.runtime.models.deepseek import DeepseekMTP
from envex.runtime.models.rope import rope_cos_sin
from envex.tests.test_runtime_deepseek import COMMON, PROMPTS, _hf_model
from envex.tests.test_runtime_gpt_oss import _write_tokenizer

N = COMMON["num_hidden_layers"]  # the MTP layer's index in the checkpoint
H = COMMON["hidden_size"]


def _save(model, path, mtp: dict[str, torch.Tensor] | None) -> None:
    model.save_pretrained(path, safe_serialization=True)
    _write_tokenizer(path)
    if mtp is not None:  # DeepSeek-V3's files keep the MTP layer beside the others
        save_file({f"model.layers.{N}.{k}": v.contiguous() for k, v in mtp.items()}, str(path / "mtp.safetensors"))


def _mtp_tensors(hf_model, block_model, tmp_path, **own: torch.Tensor) -> dict[str, torch.Tensor]:
    """The MTP layer's tensors (HF names after model.layers.N.): block_model's layer 1 as its decoder layer (saved
    by transformers, so in the published per-expert layout), copies of the model's embedding and head, and `own`."""
    block_model.save_pretrained(tmp_path / "block", safe_serialization=True)
    saved = load_file(str(tmp_path / "block" / "model.safetensors"))
    out = {k.removeprefix("model.layers.1."): v for k, v in saved.items() if k.startswith("model.layers.1.")}
    out["embed_tokens.weight"] = hf_model.model.embed_tokens.weight.detach().clone()
    out["shared_head.head.weight"] = hf_model.lm_head.weight.detach().clone()
    return out | own


@pytest.fixture(scope="module")
def random_mtp(tmp_path_factory):
    """(HF model, the HF block of its MTP layer, the MTP tensors, a checkpoint with them, one without)."""
    tmp = tmp_path_factory.mktemp("mtp")
    hf_model = _hf_model("v3")
    block_model = copy.deepcopy(hf_model)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in block_model.model.layers[1].parameters():
            p.add_(torch.randn(p.shape, generator=gen) * p.std())
    norms = {k: torch.rand(H, generator=gen) + 0.5 for k in ("enorm.weight", "hnorm.weight", "shared_head.norm.weight")}
    mtp = _mtp_tensors(hf_model, block_model, tmp, **norms,
                       **{"eh_proj.weight": torch.randn(H, 2 * H, generator=gen) * (2 * H) ** -0.5 * 4})  # fmt: skip
    _save(hf_model, tmp / "with", mtp)
    _save(hf_model, tmp / "without", None)
    return hf_model, block_model.model.layers[1], mtp, tmp / "with", tmp / "without"


def _engine(path, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(path), device="cpu", block_size=4, kv_cache_memory_gb=0.02, **kw))


def test_mtp_logits_equal_transformers_mtp_layer(random_mtp) -> None:
    hf_model, hf_block, mtp, path, _ = random_mtp
    engine = _engine(path, draft_model="mtp", num_speculative_tokens=1)
    module = engine.spec.drafter.module
    assert isinstance(module, DeepseekMTP)
    assert module.embed_tokens_weight.data_ptr() == engine.runner.model.embed_tokens_weight.data_ptr()  # held once
    assert_transformers_mtp_layer(module, hf_model, hf_block, mtp, 1)  # 1: an MoE layer, as N


def assert_transformers_mtp_layer(module: DeepseekMTP, hf_model, block, own: dict[str, torch.Tensor], index: int
                                  ) -> None:  # fmt: skip
    """DeepseekMTP over a prompt's positions (through its latent cache) = HF's MtpLayer (eh_proj over
    [enorm(embed(t_{i+1})); hnorm(h_i)], the decoder layer `block` at layer `index` of hf_model's config, shared_head's
    norm; those tensors from `own`) then hf_model's head, at HF's positions i+1 (ours sit at i: rotary attention sees
    the same offsets); the hidden state it chains on is MtpLayer's output (after shared_head's norm), as
    transformers' MTP generation chains."""
    t = len(PROMPTS[0])
    tokens, hidden = torch.tensor(PROMPTS[0]), torch.randn(t, H, generator=torch.Generator().manual_seed(2)) * 3
    weights = [own[n] for n in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight")]
    out, want = transformers_mtp(hf_model, (DeepseekV3DecoderLayer, DeepseekV3RMSNorm, index), block, *weights,
                                 tokens, hidden)  # fmt: skip
    meta, cache = _prefill(module.config, t), module.make_kv_cache(_blocks(t), 4, torch.float32, torch.device("cpu"))
    with torch.inference_mode():
        got, chained = module.compute_logits(TorchOps(), *module(TorchOps(), tokens, hidden, cache, meta))
    assert rel_err(got, want) < 1e-5
    assert rel_err(chained, out) < 1e-5


def transformers_mtp(hf_model, layer: tuple, block, enorm: torch.Tensor, hnorm: torch.Tensor, proj: torch.Tensor,
                     post_norm: torch.Tensor, tokens: torch.Tensor, hidden: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """HF's generic MtpLayer (layer: its decoder-layer class, norm class and layer index in hf_model's config; the
    decoder layer's weights from `block`) over tokens t_{i+1} [T] and hidden states h_i [T, H] at HF's positions
    i+1, eager attention -> (its output after post_norm [T, H]: the state MTP generation chains on, hf_model's head
    on it [T, V])."""
    config = copy.deepcopy(hf_model.config)
    config._attn_implementation = "eager"
    ref = MtpLayer(config, *layer).eval()
    t = tokens.shape[0]
    with torch.no_grad():
        for target, value in ((ref.enorm, enorm), (ref.hnorm, hnorm), (ref.eh_proj, proj), (ref.post_norm, post_norm)):
            target.weight.copy_(value)
        ref.mtp_block.load_state_dict(block.state_dict())
        pos = torch.arange(1, t + 1)[None]
        mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
        out = ref(hf_model.model.embed_tokens(tokens)[None], hidden[None], hf_model.model.rotary_emb(hidden, pos),
                  mask, pos, None)[0]  # fmt: skip
        return out, hf_model.lm_head(out)


def test_the_drafter_reads_the_targets_states_after_the_final_norm(random_mtp) -> None:
    """After a prompt's step, the state waiting for the first draft is HF's hidden_states[-1] at the prompt's last
    position: the final norm applied (what transformers' MTP generation feeds its MtpLayer), with a final norm
    weight that is not uniform, so a state taken before it differs."""
    hf_model, _, _, path, _ = random_mtp
    engine = _engine(path, draft_model="mtp", num_speculative_tokens=1)
    model = engine.runner.model
    with torch.no_grad():
        model.norm_weight.copy_(torch.rand(H, generator=torch.Generator().manual_seed(5)) + 0.5)
        ref = copy.deepcopy(hf_model)
        ref.model.norm.weight.copy_(model.norm_weight)
        want = ref(torch.tensor([PROMPTS[0]]), output_hidden_states=True).hidden_states[-1][0, -1]
    engine.add_request("a", PROMPTS[0], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    seq = engine.scheduler.waiting[0]
    engine.step()
    row = seq.spec.row
    assert int(engine.spec.drafter.start[row]) == len(PROMPTS[0]) - 1 and bool(engine.spec.drafter.pending[row])
    assert rel_err(engine.spec.drafter.hidden[row], want) < 1e-5


def _prefill(config, t: int) -> AttentionMetadata:
    """Positions 0..t-1 of one sequence in blocks 0, 1, ... of 4 tokens (fresh caches: _blocks(t) of them)."""
    blocks = _blocks(t)
    cos, sin = rope_cos_sin(config, 64, torch.device("cpu"))
    meta = AttentionMetadata(
        positions=torch.arange(t), slot_mapping=torch.arange(t), cu_seqlens_q=torch.tensor([0, t], dtype=torch.int32),
        block_tables=torch.arange(blocks, dtype=torch.int32)[None], cos=cos, sin=sin, max_q_len=t, max_seq_len=t,
        seq_lens=torch.tensor([t], dtype=torch.int32),
    )  # fmt: skip
    return meta


def _blocks(t: int) -> int:
    return -(-t // 4)


def _predicting_mtp(tmp, noise: float, eh_hidden: float = 0.0):
    """A model whose layers add nothing (o_proj and every down projection zero: the logits at i depend on t_i
    alone) and an MTP layer that is then its next-token predictor: eh_proj = [I, 0], a decoder layer that adds
    nothing, unit enorm and shared_head.norm = the model's final norm, so MTP(t_{i+1}) = the model's logits at i+1;
    noise > 0: the MTP layer's own head is the model's plus that much noise (relative), so some drafts miss;
    eh_hidden > 0: eh_proj's hidden-state half random at that scale (the drafts then depend on the states too). The
    final norm's weight is not uniform, so states taken before it would not give the same rows."""
    hf_model = layers_adding_nothing()
    gen = torch.Generator().manual_seed(3)
    own = {"enorm.weight": torch.ones(H), "hnorm.weight": torch.ones(H),
           "eh_proj.weight": torch.cat([torch.eye(H), eh_hidden * torch.randn(H, H, generator=gen) * H**-0.5], dim=1),
           "shared_head.norm.weight": hf_model.model.norm.weight.detach().clone()}  # fmt: skip
    if noise:
        head = hf_model.lm_head.weight.detach()
        own["shared_head.head.weight"] = head + noise * head.std() * torch.randn(head.shape, generator=gen)
    _save(hf_model, tmp, _mtp_tensors(hf_model, hf_model, tmp, **own))
    return tmp


def layers_adding_nothing():
    """The tiny V3 with o_proj and every down projection zero (its logits at i depend on t_i alone) and a final
    norm weight that is not uniform."""
    hf_model = _hf_model("v3")
    with torch.no_grad():
        for name, p in hf_model.named_parameters():
            if "o_proj" in name or "down_proj" in name:
                p.zero_()
        hf_model.model.norm.weight.copy_(torch.rand(H, generator=torch.Generator().manual_seed(4)) + 0.5)
    return hf_model


@pytest.fixture(scope="module")
def predicting_mtp(tmp_path_factory):
    return _predicting_mtp(tmp_path_factory.mktemp("mtp-predicting"), 0.0)


@pytest.fixture(scope="module")
def noisy_mtp(tmp_path_factory):
    return _predicting_mtp(tmp_path_factory.mktemp("mtp-noisy"), 0.3)


@pytest.mark.parametrize(("drafts", "k", "overlap"), [("random", 1, False), ("random", 3, True), ("noisy", 1, True),
                                                      ("noisy", 3, False), ("predicting", 3, True)])  # fmt: skip
def test_greedy_output_with_mtp_drafts_is_the_plain_output(random_mtp, noisy_mtp, predicting_mtp, drafts: str, k: int,
                                                           overlap: bool) -> None:  # fmt: skip
    """Several prompts in one batch, drafts of an MTP layer that misses (random), sometimes hits (noisy) or always
    hits (predicting), with verify steps chained under overlapped scheduling or not; up to the context's end."""
    path = {"random": random_mtp[3], "noisy": noisy_mtp, "predicting": predicting_mtp}[drafts]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (16, 16, 40 - len(PROMPTS[2]))]
    want = [c.token_ids for c in _engine(path, max_model_len=40).generate(PROMPTS, params)]  # MTP tensors skipped
    spec = _engine(path, max_model_len=40, draft_model="mtp", num_speculative_tokens=k, async_scheduling=overlap)
    assert [c.token_ids for c in spec.generate(PROMPTS, params)] == want
    stats = spec.stats()
    assert stats.speculative_drafter == "mtp" and stats.spec_verify_steps_total > 0
    assert stats.spec_draft_tokens_total > 0 and spec.stats().kv_blocks_used == 0


@pytest.mark.parametrize("k", [1, 3])
def test_acceptance_is_measured_from_the_drafts(predicting_mtp, noisy_mtp, k: int) -> None:
    """An MTP layer that predicts the model has every draft accepted (k + 1 tokens a step); a noisy one some."""
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    engine = _engine(predicting_mtp, draft_model="mtp", num_speculative_tokens=k)
    engine.generate(PROMPTS, params)
    stats = engine.stats()
    assert stats.spec_draft_tokens_total >= 3 * 8 * k // (k + 1)  # most of 3 x 16 tokens came through drafts
    assert stats.accepted_draft_tokens_total == stats.spec_draft_tokens_total
    assert stats.spec_tokens_per_step > k  # k + 1 a step but where max_tokens capped it
    engine = _engine(noisy_mtp, draft_model="mtp", num_speculative_tokens=k)
    engine.generate(PROMPTS, params)
    stats = engine.stats()
    assert 0 < stats.accepted_draft_tokens_total < stats.spec_draft_tokens_total
    assert 1.0 < stats.spec_tokens_per_step < k + 1


@pytest.mark.parametrize(("decode_graphs", "overlap"), [(False, False), (True, False), (True, True)],
                         ids=["eager", "decode-graphs", "decode-graphs-overlapped"])  # fmt: skip
def test_the_mtp_cache_holds_the_modules_rows_of_the_verified_tokens(tmp_path, decode_graphs: bool,
                                                                     overlap: bool) -> None:  # fmt: skip
    """After every step (verify steps, and plain ones once speculation turns itself off): the MTP layer's latent
    rows at positions 0 .. start-1 (start: the position of the target's state waiting for the next draft pass) are
    the module's over the sequence's tokens and the target's hidden states, computed afresh: prompts and plain
    decodes through `absorb`, verified tokens through `record` (drafted positions, written with the module's own
    states, are rewritten). The model's layers add nothing here (noisy MTP layer), but eh_proj reads the hidden
    states too, so each row's token and state must pair up. decode_graphs: plain decode steps go through
    DecodeGraphs (run eagerly here, as the CUDA graphs would replay them), which hand their hidden states over;
    overlap: a step's tokens are read a step late (a decode's fed token still on the device, verify steps chained),
    so the rows before the newest host-known tokens are checked."""
    path = _predicting_mtp(tmp_path, 0.3, eh_hidden=0.5)
    engine = _engine(path, draft_model="mtp", num_speculative_tokens=3, async_scheduling=overlap)
    if decode_graphs:
        engine.runner.decode_graphs = graphs = DecodeGraphs(engine.runner, max_batch=4, capture=False,
                                                            with_hidden=True)  # fmt: skip
    drafter, model, ops = engine.spec.drafter, engine.runner.model, TorchOps()
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    checked = 0
    while engine.has_unfinished():
        engine.step()
        for seq in engine.scheduler.running:
            tokens = seq.all_token_ids
            start = int(drafter.start[seq.spec.row])  # the waiting state's position: the newest, whatever the step
            assert drafter.pending[seq.spec.row] and (start >= len(tokens) - 2 if overlap else start == len(tokens) - 2)
            start = len(tokens) - 2
            meta, cpu = _prefill(model.config, start), torch.device("cpu")
            cache = drafter.module.make_kv_cache(_blocks(start), 4, torch.float32, cpu)
            with torch.inference_mode():
                caches = model.make_kv_caches(_blocks(start), 4, torch.float32, cpu)
                hidden, residual = model(ops, torch.tensor(tokens[:start]), caches, meta)
                normed = model.final_hidden(ops, hidden, residual)  # the target's states after the final norm
                drafter.module(ops, torch.tensor(tokens[1 : start + 1]), normed, cache, meta)
            got = torch.stack([drafter.kv_cache[0][seq.block_table[p // 4], p % 4] for p in range(start)])
            assert rel_err(got, cache[0].view(-1, got.shape[-1])[:start]) < 1e-5
            checked += 1
    assert checked > 10 and engine.stats().spec_verify_steps_total > 5
    assert not decode_graphs or graphs.hidden is not None  # plain steps went through them
    assert (engine.stats().overlapped_steps_total > 0) == overlap


def test_the_mtp_layer_is_not_read_from_the_files_unless_it_drafts(random_mtp, monkeypatch) -> None:
    """The model's load leaves the MTP layer's tensors unread (unread_prefixes); the drafter reads only them."""
    from envex.runtime.loader import LoadedModel

    _, _, mtp, path, _ = random_mtp
    read: list[list[str]] = []
    real = LoadedModel.iter_weights

    def spy(self, prefix: str = "", skip: tuple[str, ...] = ()):
        read.append([])
        for name, tensor in real(self, prefix, skip):
            read[-1].append(name)
            yield name, tensor

    monkeypatch.setattr(LoadedModel, "iter_weights", spy)
    _engine(path)
    assert len(read) == 1 and read[0] and not any(n.startswith(f"model.layers.{N}.") for n in read[0])
    read.clear()
    _engine(path, draft_model="mtp", num_speculative_tokens=1)
    assert len(read) == 2 and sorted(read[1]) == sorted(f"model.layers.{N}.{k}" for k in mtp)


def test_a_model_without_an_mtp_layer_is_refused_in_one_line(random_mtp, tmp_path) -> None:
    _, _, _, path, without = random_mtp
    with pytest.raises(ValueError, match=r"'mtp' needs the multi-token-prediction layer's weights \(model.layers.2"):
        _engine(without, draft_model="mtp")
    for name in ("config.json", "tokenizer.json", "model.safetensors"):
        (tmp_path / name).write_bytes((without / name).read_bytes())
    config = json.loads((without / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 0}))
    with pytest.raises(ValueError, match=r"'mtp' needs a multi-token-prediction module") as err:
        _engine(tmp_path, draft_model="mtp")
    assert "\n" not in str(err.value)


def test_the_mtp_cache_takes_one_latent_layer_of_the_budget(random_mtp) -> None:
    _, _, _, path, _ = random_mtp
    config = EngineConfig(model=str(path), dtype="float32", block_size=4, draft_model="mtp")
    rows = COMMON["kv_lora_rank"] + COMMON["qk_rope_head_dim"]
    assert draft_kv_bytes(config, load_model_info(str(path))) == 4 * rows * 4
    plain, spec = _engine(path), _engine(path, draft_model="mtp")
    assert spec.runner.num_blocks == int(0.02 * 2**30 // (4 * rows * 4 * (N + 1)))
    assert plain.runner.num_blocks == int(0.02 * 2**30 // (4 * rows * 4 * N))
    assert tuple(spec.spec.drafter.kv_cache[0].shape) == (spec.runner.num_blocks, 4, rows)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("k", [1, 3])
def test_mtp_speculation_on_cuda_with_captured_graphs_gives_the_plain_output(predicting_mtp, noisy_mtp, k: int) -> None:
    """On a GPU with CUDA graphs captured (decode graphs keeping their hidden states, verify graphs, the draft pass):
    greedy output with MTP drafts is the plain engine's, with warm-up on (the cost table priced) and off. With
    warm-up on, the tiny model's measured verify costs may keep the depth at 0 for 16 tokens (H100, 2026-12-06: no
    draft was made, the answer was right), so the drafts are asserted where warm-up is off: every draft of the
    predicting layer accepted."""
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)

    def engine(path, **kw) -> LLMEngine:
        return LLMEngine(EngineConfig(model=str(path), device="cuda", dtype="float32", block_size=4, num_kv_blocks=256,
                                      max_model_len=64, max_num_seqs=4, use_cuda_graphs=True, **kw))  # fmt: skip

    for path in (predicting_mtp, noisy_mtp):
        want = [c.token_ids for c in engine(path).generate(PROMPTS, params)]
        for warm_up in (True, False):
            spec = engine(path, draft_model="mtp", num_speculative_tokens=k, warm_up=warm_up)
            assert spec.runner.decode_graphs is not None and spec.runner.decode_graphs.capture
            assert [c.token_ids for c in spec.generate(PROMPTS, params)] == want, (path, warm_up)
            stats = spec.stats()
            if not warm_up:
                assert stats.spec_draft_tokens_total > 0
                if path == predicting_mtp:
                    assert stats.accepted_draft_tokens_total == stats.spec_draft_tokens_total
