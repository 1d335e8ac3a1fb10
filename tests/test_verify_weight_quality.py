"""verify/weight_quality.py: low-bit weights policies measured on the embedded model (SmolLM2-135M-Instruct, the
Q4_1 GGUF dequantized as the runtime loads it) against its bf16 self, and held to issue 42's bands.

These are real measurements, over the first 256 tokens of the local text (verify/data_corpus.json's prose) in two
128-token windows, 128 scored positions, float32 on one CPU core (mean KLD in nats, p99, top-1 agreement):

    bf16 (itself)                 0        0       100%      (exactly: the sanity zero)
    fp8_block                     0.01548  0.2063  92.97%    refused: the FP8 band is mean KLD <= 0.002, top-1 >= 98%
    fp8_channel                   0.01074  0.0742  96.09%    refused
    int4_g128_sym                 0.43768  3.1518  72.66%    refused: the INT4 band is mean KLD <= 0.02, top-1 >= 93%
    int4_g32_sym                  0.31551  2.0252  74.22%    refused
    lm_head int4_g128_sym         0.10599  0.4233  81.25%    refused (the deliberately bad policy)
    layers.15 fp8_block only      0.00039  0.0043  98.44%    inside the FP8 band (the pass side, on real figures)

The embedded model misses both bands with every whole-model scheme (offline_docs/quantization.md has the
4096-token table and why): the bands are kept as the issue sets them, and these tests pin the measured outcome,
with the figures' ranges wide enough for summation-order noise and narrow enough to catch a broken quantizer.
"""

import json
import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from envex.verify import weight_quality as wq

TOKENS, WINDOW = 256, 128
CHECKOUT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def bench() -> wq.QualityBench:
    return wq.embedded_bench(TOKENS, window=WINDOW)


def _measure(bench: wq.QualityBench, policy: object) -> tuple[wq.QualityResult, wq.BandVerdict]:
    result = bench.measure(wq.parse_policy(policy))
    print(f"{policy}: mean KLD {result.mean_kld:.5f}, p99 {result.p99_kld:.4f}, top-1 {result.top1:.2%}")
    return result, wq.check_band(result)


def test_bf16_against_itself_is_exactly_zero(bench: wq.QualityBench) -> None:
    result, verdict = _measure(bench, "bf16")
    assert result.positions == (TOKENS // WINDOW) * (WINDOW // 2)
    assert (result.mean_kld, result.p99_kld, result.max_kld, result.top1) == (0.0, 0.0, 0.0, 1.0)
    assert result.quantized == 0 and result.linear_bytes == result.bf16_linear_bytes
    assert verdict.passed and verdict.band == "fp8"


@pytest.mark.parametrize("scheme,kld,top1", [
    # one scheme of each kind here (the suite runs on 2 cores); every scheme is in the lab run the doc's table is
    # generated from, which test_the_docs_table_is_the_committed_runs checks
    ("fp8_block", (0.005, 0.03), (0.88, 0.98)),
    ("int4_g128_sym", (0.2, 0.8), (0.6, 0.9)),
])  # fmt: skip
def test_whole_model_schemes_are_measured_and_refused(bench: wq.QualityBench, scheme: str,
                                                      kld: tuple[float, float], top1: tuple[float, float]) -> None:
    result, verdict = _measure(bench, scheme)
    band = wq.BANDS[scheme.split("_")[0]]
    assert kld[0] < result.mean_kld < kld[1] and top1[0] < result.top1 < top1[1], result
    assert result.mean_kld <= result.p99_kld <= result.max_kld
    assert result.quantized == 30 * 7  # every decoder projection, the LM head kept
    ratio = result.linear_bytes / result.bf16_linear_bytes  # the LM head (28M of 134M weights) stays bf16
    assert (0.55 < ratio < 0.65) if scheme.startswith("fp8") else (0.35 < ratio < 0.5)
    assert not verdict.passed and verdict.band == band.name
    assert f"mean KLD {result.mean_kld:.5f} > {band.max_mean_kld}" in verdict.reason
    assert "\n" not in verdict.reason


def test_int4_lm_head_is_refused_with_its_figure(bench: wq.QualityBench) -> None:
    result, verdict = _measure(bench, {"default": "bf16", "lm_head": "int4_g128_sym"})
    assert result.quantized == 1 and result.mean_kld > 0.05
    assert not verdict.passed and verdict.band == "int4"
    assert verdict.reason.startswith('weights policy {"default":"bf16","lm_head":"int4_g128_sym"} refused')
    assert f"mean KLD {result.mean_kld:.5f} > 0.02" in verdict.reason


def test_one_fp8_layer_passes_the_fp8_band(bench: wq.QualityBench) -> None:
    result, verdict = _measure(bench, {"default": "bf16", "overrides": {"layers.15": "fp8_block"}})
    assert result.quantized == 7 and 0 < result.mean_kld <= 0.002 and result.top1 >= 0.98
    assert verdict.passed and "inside the fp8 band" in verdict.reason


def test_band_check_edges_and_choice() -> None:
    def result(policy: object, kld: float, top1: float) -> wq.QualityResult:
        return wq.QualityResult(policy=wq.parse_policy(policy).to_dict(), positions=100, mean_kld=kld, p99_kld=kld,
                                max_kld=kld, top1=top1, quantized=1, linear_bytes=1, bf16_linear_bytes=2)  # fmt: skip

    assert wq.check_band(result("fp8_channel", 0.002, 0.98)).passed  # the bands are inclusive
    assert not wq.check_band(result("fp8_channel", 0.0021, 0.99)).passed
    assert not wq.check_band(result("fp8_channel", 0.001, 0.979)).passed
    assert "top-1 97.90% < 98%" in wq.check_band(result("fp8_channel", 0.001, 0.979)).reason
    mixed = {"default": "fp8_block", "overrides": {"down_proj": "int4_g32_asym"}}
    assert wq.band_for(wq.parse_policy(mixed)) == wq.BANDS["int4"]  # the lowest precision's band
    assert wq.check_band(result(mixed, 0.019, 0.95)).passed
    assert wq.check_band(result(mixed, 0.001, 0.99), wq.BANDS["fp8"]).band == "fp8"


def test_policy_resolution() -> None:
    p = wq.parse_policy({"default": "int4_g128_sym", "lm_head": "fp8_channel",
                         "overrides": {"down_proj": "fp8_block", "layers.1": "bf16", "layers.2.down_proj": "bf16"}})
    r = {k: s.name for k, s in p.resolve(3).items()}
    assert r["model.layers.0.mlp.down_proj"] == "fp8_block" and r["model.layers.0.self_attn.q_proj"] == "int4_g128_sym"
    assert r["model.layers.1.mlp.down_proj"] == "bf16" and r["model.layers.2.mlp.down_proj"] == "bf16"
    assert r["model.layers.2.mlp.up_proj"] == "int4_g128_sym" and r["lm_head"] == "fp8_channel"
    assert len(r) == 3 * 7 + 1
    with pytest.raises(wq.PolicyError, match=r"'layers.2.down_proj' names a layer the model lacks \(it has 2: layers"):
        p.resolve(2)
    with pytest.raises(wq.PolicyError, match=r"layer 0's q_proj, k_proj, v_proj are one matrix"):
        wq.parse_policy({"default": "bf16", "overrides": {"layers.0.k_proj": "fp8_block"}}).resolve(2)


@pytest.mark.parametrize("bad,message", [
    ({"default": "int4_g100_sym"}, "the group must be a multiple of 8"),
    ({"default": "int8"}, "'int8' is not a scheme"),
    ({"default": "bf16", "extra": 1}, "unknown key 'extra'"),
    ({"lm_head": "bf16"}, '"default" is required'),
    ({"default": "bf16", "overrides": {"lm_head": "fp8_block"}}, "selector 'lm_head'"),
    ({"default": "bf16", "overrides": {"layers.01": "fp8_block"}}, "without leading zeros"),
    ({"default": "bf16", "overrides": ["down_proj"]}, "expected an object of selector: scheme"),
    (7, "expected an object or a scheme name, got int"),
])  # fmt: skip
def test_policy_errors_are_one_line(bad: object, message: str) -> None:
    with pytest.raises(wq.PolicyError) as info:
        wq.parse_policy(bad)
    assert message in str(info.value) and "\n" not in str(info.value)


_INT4 = st.builds(lambda g, s: f"int4_g{8 * g}_{s}", st.integers(1, 512), st.sampled_from(["sym", "asym"]))
_SCHEMES = st.one_of(st.sampled_from(["bf16", "fp8_block", "fp8_channel", "fp8_tensor"]), _INT4)
_SELECTORS = st.one_of(st.sampled_from(wq.PROJECTIONS), st.integers(0, 40).map(lambda i: f"layers.{i}"),
                       st.builds(lambda i, p: f"layers.{i}.{p}", st.integers(0, 40), st.sampled_from(wq.PROJECTIONS)))
_JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=12),
                     lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=12), c, max_size=3),
                     max_leaves=8)  # fmt: skip


@settings(max_examples=150, deadline=None)
@given(default=_SCHEMES, head=_SCHEMES, overrides=st.dictionaries(_SELECTORS, _SCHEMES, max_size=4))
def test_valid_policies_round_trip(default: str, head: str, overrides: dict[str, str]) -> None:
    policy = wq.parse_policy({"default": default, "lm_head": head, "overrides": overrides})
    assert wq.parse_policy(json.loads(json.dumps(policy.to_dict()))) == policy
    try:
        resolved = policy.resolve(41)
    except wq.PolicyError as exc:  # only a fused group split across schemes
        assert "are one matrix in the runtime" in str(exc)
        return
    assert resolved["lm_head"].name == head and len(resolved) == 41 * 7 + 1


@settings(max_examples=300, deadline=None)
@given(data=st.one_of(_JSON, st.dictionaries(st.sampled_from([*wq.POLICY_KEYS, "x"]), _JSON | _SCHEMES, max_size=3),
                      st.fixed_dictionaries({"default": _SCHEMES}, optional={
                          "overrides": st.dictionaries(st.text(max_size=20) | _SELECTORS, _JSON | _SCHEMES)})))
def test_any_input_is_a_policy_or_one_line(data: object) -> None:
    try:
        policy = wq.parse_policy(data)
    except wq.PolicyError as exc:
        assert "\n" not in str(exc) and str(exc).startswith("weights policy")
        return
    assert isinstance(policy, wq.WeightPolicy)
    assert wq.parse_policy(policy.to_dict()) == policy


def test_the_docs_table_is_the_committed_runs() -> None:
    page = (CHECKOUT / "offline_docs" / "quantization.md").read_text(encoding="utf-8")
    names = set(re.findall(r"verify/lab/results/([\w.-]+-weight-quality\.json)", page))
    assert len(names) == 1, names
    report = json.loads((CHECKOUT / "verify" / "lab" / "results" / names.pop()).read_text(encoding="utf-8"))
    assert report["schema"] == "envex-weight-quality/1" and report["tokens"] == 4096
    assert report["results"][0]["policy"] == {"default": "bf16", "lm_head": "bf16"}
    assert report["results"][0]["mean_kld"] == 0.0 and report["results"][0]["top1"] == 1.0
    assert wq.markdown_table(report) in page
