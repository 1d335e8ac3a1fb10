"""A hybrid model's card (issue 45, Qwen3-Next): only the full-attention layers hold paged K/V, so the card's bytes
per token count those layers only, and the plan reserves the engine's per-sequence recurrent state (its live and
snapshot state slots) from the memory budget beside the weights before the KV cache takes the rest.

The reference is the runtime itself: Qwen3NextForCausalLM's own caches (make_kv_caches, what the model runner
allocates) and the real StateSlots' pools, on a tiny random config built the way tests/test_runtime_qwen3_next.py
builds one; the real plan on real signed media.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from envex.bundles import make_demo_trust, verify_bundle
from envex.installer.cards import HybridCard, ModelCard
from envex.installer.media import InstallError
from envex.installer.plan import CPU_RAM_FRACTION, GPU_MEMORY_UTILIZATION, make_plan
from envex.runtime.config import ModelConfig
from envex.runtime.engine import EngineConfig
from envex.runtime.engine.caches.state_slots import StateSlots
from envex.runtime.models.qwen3_next import Qwen3NextForCausalLM
from envex.tests.support import installer as itest
from envex.tests.test_installer_deterministic import cpu_probe, cuda_probe, signed_media
from envex.tests.test_installer_kv_cache_dtype import EXPIRES
from envex.tests.test_runtime_qwen3_next import PUBLISHED, TINY

# Eight layers, every 4th full attention (as the published model's 48): layers 3 and 7 hold K/V.
HF = {**transformers.Qwen3NextConfig(**{**TINY, "num_hidden_layers": 8, "full_attention_interval": 4,
                                        "mlp_only_layers": []}).to_dict(),
      "architectures": ["Qwen3NextForCausalLM"]}  # fmt: skip
DTYPES = {torch.float32: 4, torch.bfloat16: 2}


def card_of(mc: ModelConfig, **overrides: Any) -> ModelCard:
    fields = dict(architecture=mc.architecture, num_layers=mc.num_hidden_layers, num_kv_heads=mc.num_key_value_heads,
                  head_dim=mc.head_dim, parameters=2_000_000, max_position_embeddings=mc.max_position_embeddings,
                  hybrid=HybridCard.of(mc))  # fmt: skip
    return itest.fake_model_card(**{**fields, **overrides})


@pytest.mark.parametrize("dtype", list(DTYPES), ids=["float32", "bfloat16"])
def test_the_cards_bytes_per_token_and_state_are_what_the_model_allocates(dtype: torch.dtype) -> None:
    mc = ModelConfig.from_hf(HF)
    card = card_of(mc)
    assert card.hybrid is not None and card.kv_layers == 2 and card.hybrid.linear_attention_layers == 6
    model = Qwen3NextForCausalLM(mc, dtype=dtype, device=torch.device("cpu"))
    # one block of one token in the engine's pool: K and V of the full layers only, () for the linear ones
    caches = model.make_kv_caches(1, 1, dtype, torch.device("cpu"))
    allocated = sum(t.nbytes for layer in caches for t in layer)
    assert card.kv_bytes_per_token(DTYPES[dtype]) == allocated == model.kv_cache_bytes_per_block(1, dtype)
    assert allocated == 2 * 2 * mc.num_key_value_heads * mc.head_dim * DTYPES[dtype]  # not 8 layers' worth
    # one sequence's state slot over the six linear layers
    pools = model.make_state_pools(3, dtype, torch.device("cpu"))
    per_slot = sum(t.nbytes for layer in pools.values() for t in layer) // 3
    assert card.state_bytes_per_sequence(DTYPES[dtype]) == per_slot == model.state_bytes_per_slot(dtype)
    # a model without linear layers: every layer, no state
    dense = card.model_copy(update={"hybrid": None})
    assert dense.kv_bytes_per_token(DTYPES[dtype]) == 4 * allocated and dense.state_bytes_per_sequence(2) == 0


def test_the_published_qwen3_next_holds_kv_in_12_of_48_layers() -> None:
    mc = ModelConfig.from_hf(PUBLISHED)
    card = card_of(mc)
    assert card.kv_layers == 12
    assert card.kv_bytes_per_token(2) == 12 * 2 * 2 * 256 * 2  # 24 KiB a token, not 96
    model = Qwen3NextForCausalLM(mc, dtype=torch.bfloat16, device=torch.device("meta"))
    assert card.state_bytes_per_sequence(2) == model.state_bytes_per_slot(torch.bfloat16)
    with pytest.raises(ValueError, match="hybrid: 12 full-attention . 36 linear-attention layers are not num_layers"):
        card_of(mc, num_layers=40)


@pytest.fixture(scope="module")
def trust(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return make_demo_trust(tmp_path_factory.mktemp("keys"), expires=EXPIRES)


@pytest.mark.parametrize("probe", [cpu_probe(), cuda_probe()], ids=["cpu", "cuda"])
def test_the_plan_reserves_the_engines_state_slots_from_the_budget(tmp_path: Path, trust: Any, probe: Any) -> None:
    mc = ModelConfig.from_hf(HF)
    card = card_of(mc)
    media = signed_media(tmp_path, trust, card)
    bundles = [verify_bundle(p, root=trust.root) for p in sorted((media / "bundles").glob("*.envex"))]
    plan = make_plan(bundles, probe)
    dtype = torch.bfloat16 if probe.mode == "cuda" else torch.float32
    # what the engine allocates for these settings: StateSlots' pools (live + snapshot slots, 2 x max_num_seqs, and
    # the scratch slot that a decode graph's padding rows use)
    config = EngineConfig(model="x", max_num_seqs=int(plan.engine["max_num_seqs"]))
    slots = StateSlots(config, Qwen3NextForCausalLM(mc, dtype=dtype, device=torch.device("meta")),
                       torch.device("meta"), dtype)  # fmt: skip
    assert slots.num_slots + slots.num_snapshots == slots.scratch_slot == 2 * config.max_num_seqs
    allocated = sum(t.nbytes for layer in slots.pools.values() for t in layer)
    assert plan.state_bytes == allocated > 0
    assert plan.kv_bytes_per_token == card.kv_bytes_per_token(DTYPES[dtype])
    if probe.mode == "cuda":  # the pool takes what the weights and the state leave
        budget = int(probe.gpus[0].memory_total * GPU_MEMORY_UTILIZATION)
        assert plan.kv_capacity_tokens == (budget - plan.weights_bytes - allocated) // plan.kv_bytes_per_token
    needs = (plan.weights_bytes + plan.kv_bytes + allocated) / 2**30
    assert f"needs {needs:.2f} of" in plan.summary()
    if probe.mode == "cpu":  # RAM that holds the weights and the KV pool but not the state: refused in one line
        short = int((plan.weights_bytes + plan.kv_bytes + allocated // 2) / CPU_RAM_FRACTION)
        with pytest.raises(InstallError, match=r"recurrent state\) but available RAM allows"):
            make_plan(bundles, replace(probe, ram_available=short))
