"""The GPU acceptance matrix: the product as a user runs it (`envex serve` with its defaults and flags, `envex demo`,
`envex-install`), cell by cell, on the device.

    python3 -P -m envex.verify.lab.gpu_matrix --out DIR [--models llama8b,qwen3-8b,mistral7b,gpt-oss-120b,qwen3-next,
        embedded] [--modes default,no-det,det,spec4,draft,mtp,fp8,int4] [--demo] [--deadline S]
        [--merge EARLIER.json ...]

A cell is one model in one mode. It starts `envex serve` as a child process (`python -P -m envex.installer.commands
serve`, 127.0.0.1; the big shapes with `--load-format dummy`, the embedded model with its real weights) and waits
for /health. A server that exits first is `refused` when it printed one line `error: ...` and exited 1 or 2 (a flag
that model cannot take), `failed` otherwise (its last lines are kept). A ready server answers a chat, a completion
and a streamed chat through the official openai client, shows its resolved settings on /metrics
(envex_engine_info), runs the cell's timed cases (bench_server's: byte-identical token-id prompts, greedy,
ignore_eos, served token counts checked), checks that greedy tokens alone = in a batch of 32 = after a prefix hit
where the mode promises it (deterministic), and must exit 0 on SIGTERM (`shutdown_clean`).

Modes: default (no flag), no-det (--no-deterministic), det (--deterministic), spec4 (--speculative-tokens 4), draft
(--draft-model: a smaller dummy of the same family and tokenizer; the embedded model drafts for itself), mtp
(--draft-model mtp: the model's own multi-token-prediction module, DeepSeek's and Qwen3-Next's), tp2
(--tensor-parallel 2, only where two GPUs are visible), fp8 / fp8-channel / int4 (--weights fp8_block, fp8_channel,
int4_g128_asym: the dummy bf16 projections quantized at load and served packed; their rooflines count the packed
bytes, bench_server.projection_bytes), kv-fp8 / kv-int4 (--kv-cache-dtype fp8, int4: the packed KV cache; their
rooflines count its bytes). default, det and the KV modes run every case of the model (`llama8b-128k`: batch 1 at
1K, 32K and 128K, 64 concurrent at 8K, issue 43's targets); the weights modes batch 1 and 64 concurrent at 1K
(issue 42's); the other modes batch 1 at 1K, beside the default of the same run.

`--demo` runs `envex demo --device cuda` (media, kernel bundle, envex-install's pipeline with gates and benchmark,
activation, serving) and then `envex-install` of the same media into a second prefix, both under the network guard
(a sitecustomize that records any connection or lookup outside loopback), and asks each release the France question.

No new cell starts after --deadline seconds; the JSON is rewritten after every cell, so a call cut short keeps what
ran. Writes DIR/matrix.json (schema envex-gpu-matrix/1; perf_table.py renders it) and one log per server.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from envex.verify.lab.kernel_bench.bench_server import SHAPES, run_case, step_bytes, write_model_dir

SCHEMA = "envex-gpu-matrix/1"
EMBEDDED = "smollm2-135m-instruct"
QUESTION = "What is the capital of France?"
ENVEX = [sys.executable, "-P", "-m", "envex.installer.commands"]
ENVEX_INSTALL = [sys.executable, "-P", "-m", "envex.installer.cli"]

# The embedded model's shape, for its roofline only (SmolLM2-135M: tied embeddings, so the head reads that table).
SMOLLM2 = dict(model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
               num_attention_heads=9, num_key_value_heads=3, vocab_size=49152)  # fmt: skip
MISTRAL_7B = dict(architectures=["MistralForCausalLM"], model_type="mistral", hidden_size=4096,
                  intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                  head_dim=128, vocab_size=32768, rms_norm_eps=1e-5, rope_theta=1000000.0,
                  max_position_embeddings=32768, sliding_window=None, tie_word_embeddings=False,
                  torch_dtype="bfloat16", eos_token_id=2)  # fmt: skip


def _smaller(shape: dict, **changes: Any) -> dict:
    """A draft: the same family, vocabulary and window, fewer and narrower layers."""
    return {**shape, **changes}


DRAFTS = {
    # Llama-3.2-1B's shape; Qwen3-0.6B's; two Mistral layers.
    "llama8b": _smaller(SHAPES["llama8b"], hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                        num_attention_heads=32, num_key_value_heads=8, head_dim=64),
    "qwen3-8b": _smaller(SHAPES["qwen3-8b"], hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                         num_attention_heads=16, num_key_value_heads=8),
    "mistral7b": _smaller(MISTRAL_7B, num_hidden_layers=2),
}  # fmt: skip

# name: (batch, prompt tokens, output tokens, timed runs after one warm-up)
CASES = {"b1_1k": (1, 1024, 256, 3), "b1_10k": (1, 10240, 512, 2), "c64_1k": (64, 1024, 256, 2),
         "b1_32k": (1, 32512, 256, 1), "b1_128k": (1, 130048, 256, 1), "c32_2k": (32, 2048, 256, 1),
         "c64_8k": (64, 8192, 256, 1), "b1_7k": (1, 7680, 256, 2)}  # fmt: skip
MODES = {"default": [], "no-det": ["--no-deterministic"], "det": ["--deterministic"],
         "spec4": ["--speculative-tokens", "4"], "draft": ["--draft-model"], "mtp": ["--draft-model", "mtp"],
         "tp2": ["--tensor-parallel", "2"], "fp8": ["--weights", "fp8_block"],
         "fp8-channel": ["--weights", "fp8_channel"], "int4": ["--weights", "int4_g128_asym"]}
MODES.update({"kv-fp8": ["--kv-cache-dtype", "fp8"], "kv-int4": ["--kv-cache-dtype", "int4"]})
FULL_MODES = ("default", "det", "kv-fp8", "kv-int4")  # every case of the model; the others batch 1 at 1K, but:
WEIGHT_MODES = ("fp8", "fp8-channel", "int4")  # batch 1 and 64 concurrent at 1K (issue 42's targets)


@dataclass(frozen=True)
class Model:
    name: str
    label: str
    shape: dict | None  # config.json of a dummy-weight shape; None: the embedded model, real weights
    max_model_len: int | None  # None: the model's own window
    cases: tuple[str, ...]


MODELS = {
    "llama8b": Model("llama8b", "Llama-3.1-8B shape (dummy bf16)", SHAPES["llama8b"], 12288,
                     ("b1_1k", "b1_10k", "c64_1k")),
    "qwen3-8b": Model("qwen3-8b", "Qwen3-8B shape (dummy bf16)", SHAPES["qwen3-8b"], 12288,
                      ("b1_1k", "b1_10k", "c64_1k")),
    "mistral7b": Model("mistral7b", "Mistral-7B shape (dummy bf16)", MISTRAL_7B, 12288,
                       ("b1_1k", "b1_10k", "c64_1k")),
    "gpt-oss-120b": Model("gpt-oss-120b", "gpt-oss-120b (dummy, MXFP4 experts)", SHAPES["gpt-oss-120b"], 131072,
                          ("b1_1k", "b1_128k", "c32_2k")),
    "llama8b-128k": Model("llama8b-128k", "Llama-3.1-8B shape, 128K window (dummy bf16)", SHAPES["llama8b"], 131072,
                          ("b1_1k", "b1_32k", "b1_128k", "c64_8k")),
    "qwen3-next": Model("qwen3-next", "Qwen3-Next-80B-A3B shape, 24 of 48 layers (dummy bf16)", SHAPES["qwen3-next"],
                        131072, ("b1_1k", "b1_128k", "c64_8k")),
    "qwen3-next-fp8": Model("qwen3-next-fp8", "Qwen3-Next-80B-A3B-FP8 shape, 48 layers (dummy, FP8 as released)",
                            SHAPES["qwen3-next-fp8"], 131072, ("b1_1k", "b1_128k", "c64_8k")),
    # issue 44's MoE models: Qwen3-30B-A3B (GQA); Moonlight-16B-A3B (MLA), whose published window is 8K: its longest
    # batch-1 case is b1_7k, not 10K or 32K; Kimi K2's width at the depth that loads on one H200 (bench_server's
    # KIMI_K2_WIDTH_LAYERS), timed per layer against its bytes
    "qwen3-30b-a3b": Model("qwen3-30b-a3b", "Qwen3-30B-A3B (dummy bf16)", SHAPES["qwen3-30b-a3b"], 12288,
                           ("b1_1k", "b1_10k", "c64_1k")),
    "moonlight": Model("moonlight", "Moonlight-16B-A3B (dummy bf16)", SHAPES["moonlight"], 8192,
                       ("b1_1k", "b1_7k", "c64_1k")),
    "kimi-k2-width": Model("kimi-k2-width", "Kimi K2 width (dummy FP8 experts, "
                           f"{SHAPES['kimi-k2-width']['num_hidden_layers']} of 61 layers)", SHAPES["kimi-k2-width"],
                           12288, ("b1_1k", "c32_2k")),
    "embedded": Model("embedded", "SmolLM2-135M-Instruct (embedded, real weights)", None, None,
                      ("b1_1k", "c64_1k")),
}  # fmt: skip


# ---- model folders ------------------------------------------------------------------------------------------------

CHAT_TEMPLATE = ("{% for m in messages %}t1 {{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}t2 {% endif %}")  # fmt: skip


def write_dummy_dir(path: Path, shape: dict) -> Path:
    """bench_server's config.json and word-level tokenizer (token i is "t{i}", the same for a model and its draft),
    plus a chat template: what `--load-format dummy` needs to serve every endpoint."""
    if not (path / "tokenizer_config.json").is_file():
        write_model_dir(path, shape, weights=False)
        (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}))
    return path


def model_flags(model: Model, mode: str, models_dir: Path) -> list[str]:
    """The `envex serve` flags of one cell, as a user would type them."""
    flags = ["--model", EMBEDDED] if model.shape is None else [
        "--model", str(write_dummy_dir(models_dir / model.name, model.shape)), "--load-format", "dummy"]
    if model.max_model_len:
        flags += ["--max-model-len", str(model.max_model_len)]
    extra = list(MODES[mode])
    if mode == "draft":
        if model.shape is None:
            extra.append(EMBEDDED)
        else:
            shape = DRAFTS.get(model.name, model.shape)  # none smaller of this family: itself
            extra.append(str(write_dummy_dir(models_dir / f"{model.name}-draft", shape)))
    return flags + extra


# ---- one server ---------------------------------------------------------------------------------------------------


@dataclass
class Server:
    proc: subprocess.Popen
    base: str
    log: Path
    started: float = field(default_factory=time.monotonic)


def start(argv: list[str], port: int, log: Path, env: dict[str, str] | None = None) -> Server:
    out = log.open("w")
    proc = subprocess.Popen(argv + ["--port", str(port)], stdout=out, stderr=subprocess.STDOUT,
                            env=env or os.environ.copy(), start_new_session=True)  # fmt: skip
    return Server(proc, f"http://127.0.0.1:{port}", log)


def tail(log: Path, lines: int = 8) -> list[str]:
    text = log.read_text(errors="replace") if log.is_file() else ""
    return [x for x in text.splitlines() if x.strip()][-lines:]


def outcome_before_ready(server: Server) -> tuple[str, str]:
    """(status, line) of a server that exited before it was ready: a one-line `error:` refusal, or a crash."""
    last = tail(server.log, 40)
    errors = [x for x in last if x.startswith("error: ")]
    crashed = any("Traceback (most recent call last)" in x for x in last)
    if server.proc.returncode in (1, 2) and len(errors) == 1 and not crashed:
        return "refused", errors[0]
    return "failed", f"exit {server.proc.returncode}: " + " | ".join(last[-3:])


def wait_ready(server: Server, timeout: float) -> bool:
    import httpx

    while time.monotonic() - server.started < timeout:
        if server.proc.poll() is not None:
            return False
        try:
            if httpx.get(f"{server.base}/health", timeout=2).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"not ready after {timeout:.0f} s")


def stop(server: Server, timeout: float = 60.0) -> bool:
    """SIGTERM as a service manager sends it; True when the server exited 0 in time. Its group is killed after."""
    clean = False
    if server.proc.poll() is None:
        server.proc.send_signal(signal.SIGTERM)
        try:
            clean = server.proc.wait(timeout=timeout) == 0
        except subprocess.TimeoutExpired:
            clean = False
    try:
        os.killpg(server.proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    server.proc.wait()
    return clean


def api_checks(base: str, served: str) -> dict[str, Any]:
    """A chat, a completion and a streamed chat through the official openai client, and /metrics. Each check that
    raises is False, with its one-line reason in `errors`: the cell's timed cases still run."""
    import httpx
    import openai

    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=300)
    out: dict[str, Any] = {"answer": None, "resolved": {}, "errors": {}}
    messages = [{"role": "user", "content": QUESTION}]

    def chat() -> bool:
        done = client.chat.completions.create(model=served, messages=messages, max_tokens=16, temperature=0)
        out["answer"] = done.choices[0].message.content
        return done.usage is not None and done.usage.completion_tokens >= 1

    def completion() -> bool:
        done = client.completions.create(model=served, prompt="The capital of France is", max_tokens=8,
                                         temperature=0)  # fmt: skip
        return done.usage is not None and done.usage.completion_tokens >= 1 and bool(done.choices)

    def stream() -> bool:
        pieces, finish = [], None
        for chunk in client.chat.completions.create(model=served, messages=messages, max_tokens=16, temperature=0,
                                                    stream=True):  # fmt: skip
            if chunk.choices:
                pieces.append(chunk.choices[0].delta.content or "")
                finish = chunk.choices[0].finish_reason or finish
        return finish is not None and "".join(pieces) == out["answer"]  # streaming equals non-streaming

    def metrics() -> bool:
        text = httpx.get(f"{base}/metrics", timeout=30).text
        info = re.search(r"^envex_engine_info\{(.*)\} 1$", text, re.M)
        spec = re.search(r'^envex_speculative_info\{drafter="([^"]*)",max_k="(\d+)"\} 1$', text, re.M)
        resolved: dict[str, Any] = dict(re.findall(r'(\w+)="([^"]*)"', info.group(1))) if info else {}
        if "deterministic" in resolved:
            resolved["deterministic"] = resolved["deterministic"] == "true"
        if spec:
            resolved["drafter"], resolved["num_speculative_tokens"] = spec.group(1), int(spec.group(2))
        if kv := re.search(r'^envex_kv_cache_capacity_tokens\{kv_cache_dtype="([^"]*)"\} (\d+)$', text, re.M):
            resolved["kv_cache_dtype"], resolved["kv_capacity_tokens"] = kv.group(1), int(kv.group(2))
        for name in ("state_bytes_per_sequence", "state_slots_total"):  # a hybrid model's recurrent state
            if found := re.search(rf"^envex_{name} (\d+)$", text, re.M):
                resolved[name] = int(found.group(1))
        out["resolved"] = resolved
        return info is not None and "envex_generation_tokens_total" in text

    for name, check in (("chat", chat), ("completion", completion), ("stream", stream), ("metrics", metrics)):
        try:
            out[name] = bool(check())
        except Exception as exc:  # recorded, not raised: one broken endpoint must not hide the others
            out[name] = False
            out["errors"][name] = f"{type(exc).__name__}: {exc}".replace("\n", " ")[:300]
    return out


async def _greedy(client, base: str, model: str, prompt: list[int], max_tokens: int) -> str:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    r = await client.post(f"{base}/v1/completions", json=body, timeout=600)
    r.raise_for_status()
    return r.json()["choices"][0]["text"]


async def invariance(base: str, model: str, *, batch: int = 32, prompt_len: int = 600, out_len: int = 64) -> dict:
    """A probe's greedy answer alone, inside a batch of `batch` different prompts, and again (a prefix-cache hit):
    identical text in all three when the mode promises it."""
    import random

    import httpx

    rng = random.Random(7)
    prompts = [[rng.randrange(1, 30000) for _ in range(prompt_len + 7 * i)] for i in range(batch)]  # all differ
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=batch + 4)) as client:
        alone = await _greedy(client, base, model, prompts[0], out_len)
        batched = await asyncio.gather(*(_greedy(client, base, model, p, out_len) for p in prompts))
        hit = await _greedy(client, base, model, prompts[0], out_len)
    differing = sum(a != b for a, b in zip(alone.split(), batched[0].split(), strict=False))
    differing += sum(a != b for a, b in zip(alone.split(), hit.split(), strict=False))
    return {"identical": alone == batched[0] == hit, "differing_tokens": differing, "compared_tokens": 2 * out_len}


def cell_cases(model: Model, mode: str, only: tuple[str, ...] | None = None) -> tuple[str, ...]:
    """The timed cases of a model in a mode: all of the model's in FULL_MODES, batch 1 and 64 concurrent at 1K in
    WEIGHT_MODES, batch 1 at 1K otherwise; `only` (--cases) keeps those of them it names."""
    if mode in FULL_MODES:
        cases = model.cases
    else:
        cases = ("b1_1k", "c64_1k") if mode in WEIGHT_MODES else ("b1_1k",)
    return cases if only is None else tuple(c for c in cases if c in only)


def formats(mode: str) -> tuple[str, str]:
    """(weights scheme, KV-cache dtype) a mode serves, for its roofline."""
    weights = MODES[mode][1] if mode in WEIGHT_MODES else "bf16"
    return weights, MODES[mode][1] if mode.startswith("kv-") else "bf16"


def timed_case(base: str, served: str, case: str, shape: dict | None, bandwidth: float | None,
               weights: str = "bf16", kv_cache_dtype: str = "bf16") -> dict[str, Any]:  # fmt: skip
    batch, prompt_len, out_len, reps = CASES[case]
    rows = [asyncio.run(run_case(base, served, batch, prompt_len, out_len, seed=r)) for r in range(reps + 1)][1:]
    ok = [r for r in rows if r["completion_tokens"] == out_len]  # a row whose served count differs is excluded
    metric = "decode_tok_s" if batch == 1 else "output_tok_s"
    values = [r[metric] for r in ok]
    median = statistics.median(values) if values else None
    roof = None
    if batch == 1 and bandwidth and shape is not None:
        roof = bandwidth * 1e12 / step_bytes(shape, prompt_len + out_len // 2, weights, kv_cache_dtype)
    return {"metric": metric, "median": median, "runs": values, "excluded": len(rows) - len(ok),
            "ttft_ms": statistics.median(r["ttft_ms"] for r in ok) if ok else None,
            "roofline_tok_s": roof, "share_of_roofline": median / roof if roof and median else None}  # fmt: skip


def run_cell(model: Model, mode: str, *, port: int, out: Path, models_dir: Path, bandwidth: float | None,
             ready_timeout: float = 600.0, only: tuple[str, ...] | None = None) -> dict[str, Any]:  # fmt: skip
    flags = model_flags(model, mode, models_dir)
    cell: dict[str, Any] = {"model": model.name, "model_label": model.label, "mode": mode, "flags": flags,
                            "status": "ok", "line": None, "resolved": {}, "api": {}, "cases": {},
                            "invariance": None}  # fmt: skip
    log = out / f"serve-{model.name}-{mode}.log"
    server = start([*ENVEX, "serve", *flags], port, log)
    try:
        if not wait_ready(server, ready_timeout):
            cell["status"], cell["line"] = outcome_before_ready(server)
            return cell
        cell["ready_s"] = time.monotonic() - server.started
        import httpx

        served = httpx.get(f"{server.base}/v1/models", timeout=30).json()["data"][0]["id"]
        api = api_checks(server.base, served)
        cell["resolved"], cell["answer"] = api.pop("resolved"), api.pop("answer")
        if api["errors"]:
            cell["api_errors"] = api["errors"]
        del api["errors"]
        cell["api"] = api
        window = model.max_model_len or 8192
        for case in cell_cases(model, mode, only):
            _, prompt_len, out_len, _ = CASES[case]
            if prompt_len + out_len > window:
                continue
            shape = SMOLLM2 if model.shape is None else model.shape
            cell["cases"][case] = timed_case(server.base, served, case, shape, bandwidth, *formats(mode))
        promised = bool(cell["resolved"].get("deterministic"))
        if promised:
            probe = min(600, window // 2 - 7 * 32)
            cell["invariance"] = {"promised": True, **asyncio.run(invariance(server.base, served, prompt_len=probe))}
    except Exception as exc:  # one cell's failure must not lose the others
        cell["status"], cell["line"] = "failed", f"{type(exc).__name__}: {exc}".replace("\n", " ")[:500]
    finally:
        clean = stop(server)
        if cell["status"] == "ok":
            cell["api"]["shutdown_clean"] = clean
    return cell


# ---- demo and install under the network guard -------------------------------------------------------------------


def guarded_env(work: Path) -> tuple[dict[str, str], Path]:
    """The environment of the product as installed: envex from a wheel of this tree (not the checkout), and every
    connection or lookup outside loopback recorded (and refused) by a sitecustomize."""
    from envex.installer.netguard import sitecustomize_source

    guard = work / "guard"
    guard.mkdir(parents=True, exist_ok=True)
    record = guard / "violations.jsonl"
    record.write_text("")
    (guard / "sitecustomize.py").write_text(sitecustomize_source(record))
    site, wheels = work / "envex-site", work / "wheel"
    root = Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index",
                    "-w", str(wheels), str(root)], check=True)  # fmt: skip
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--upgrade", "--target",
                    str(site), *map(str, wheels.glob("envex-*.whl"))], check=True)  # fmt: skip
    env = os.environ.copy()
    # the carried dependencies stay on the path (the device image lacks them); the checkout's namespace does not
    deps = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and not (Path(p) / "envex").is_dir()]
    env["PYTHONPATH"] = os.pathsep.join([str(guard), str(site), *deps])
    return env, record


def ask(base: str) -> str:
    import httpx
    import openai

    served = httpx.get(f"{base}/v1/models", timeout=30).json()["data"][0]["id"]
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=300)
    chat = client.chat.completions.create(model=served, messages=[{"role": "user", "content": QUESTION}],
                                          max_tokens=16, temperature=0)  # fmt: skip
    return chat.choices[0].message.content or ""


def run_demo(out: Path, work: Path, port: int, timeout: float) -> tuple[dict[str, Any], dict[str, Any]]:
    """`envex demo --device cuda` served and asked, then `envex-install` of its media into another prefix."""
    env, record = guarded_env(work)
    prefix = work / "demo-prefix"
    demo: dict[str, Any] = {"status": "ok", "line": None}
    t0 = time.monotonic()
    wheel = next((work / "wheel").glob("envex-*.whl"))  # the demo ships the wheel of this tree, as built above
    server = start([*ENVEX, "demo", "--device", "cuda", "--prefix", str(prefix), "--wheel", str(wheel)], port,
                   out / "demo.log", env)
    try:
        if not wait_ready(server, timeout):
            demo["status"], demo["line"] = outcome_before_ready(server)
        else:
            demo["seconds"] = time.monotonic() - t0
            demo["answer"] = ask(server.base)
    except Exception as exc:
        demo["status"], demo["line"] = "failed", f"{type(exc).__name__}: {exc}"[:500]
    finally:
        demo["shutdown_clean"] = stop(server)
    install: dict[str, Any] = {"status": "skipped", "line": "the demo media were not built"}
    media = prefix / ".demo" / "media"
    # the fingerprint an operator is given out of band: demo --media-only prints it (the media exist: no rebuild)
    shown = subprocess.run([*ENVEX, "demo", "--media-only", "--device", "cuda", "--prefix", str(prefix), "--wheel",
                            str(wheel)],
                           capture_output=True, text=True, env=env, timeout=300, check=False).stdout  # fmt: skip
    fingerprint = re.search(r"trust fingerprint: (\S+)", shown)
    if (media / "bundles").is_dir() and fingerprint:
        t0 = time.monotonic()
        proc = subprocess.run([*ENVEX_INSTALL, "--media", str(media), "--prefix", str(work / "install-prefix"),
                               "--yes", "--trust-fingerprint", fingerprint.group(1)],
                              capture_output=True, text=True, env=env, timeout=timeout, check=False)  # fmt: skip
        (out / "install.log").write_text(proc.stdout + proc.stderr)
        install = {"status": "ok" if proc.returncode == 0 else "failed", "seconds": time.monotonic() - t0,
                   "line": None if proc.returncode == 0 else (tail(out / "install.log", 1) or [""])[0]}
        if proc.returncode == 0:
            launch = work / "install-prefix" / "current" / "launch.json"
            server = start([*ENVEX, "serve", "--launch", str(launch)], port + 1, out / "install-serve.log", env)
            try:
                install["answer"] = ask(server.base) if wait_ready(server, 300) else None
            finally:
                install["shutdown_clean"] = stop(server)
            state = json.loads((work / "install-prefix" / "state.json").read_text())
            install["gates"] = _gate_verdicts(state)
    seen = [json.loads(x) for x in record.read_text().splitlines() if x.strip()]
    for result in (demo, install):
        result["network_guard"] = not seen
        result["non_loopback_attempts"] = seen[:5]
    return demo, install


def _gate_verdicts(state: dict[str, Any]) -> dict[str, str]:
    """{gate: verdict} of the active release in an appliance prefix's state.json."""
    active = next((r for r in state.get("releases", []) if r.get("id") == state.get("active")), None)
    return dict((active or {}).get("checks", {}).get("gates", {}))


# ---- the run -------------------------------------------------------------------------------------------------------


def environment(commit: str) -> dict[str, Any]:
    import torch
    import triton

    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    slug = re.sub(r"[^a-z0-9]+", "", name.lower().replace("nvidia", "").split()[0]) if name != "cpu" else "cpu"
    return {"device": name, "device_slug": slug, "gpus": torch.cuda.device_count(), "commit": commit,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "torch": torch.__version__,
            "triton": triton.__version__, "argv": " ".join(sys.argv)}  # fmt: skip


def git_commit() -> tuple[str, bool]:
    root = Path(__file__).resolve().parents[2]
    try:
        sha = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, check=True).stdout.strip()  # fmt: skip
        dirty = bool(subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                                    capture_output=True, text=True, check=True).stdout.strip())  # fmt: skip
        return sha, dirty
    except (OSError, subprocess.CalledProcessError):
        return os.environ.get("ENVEX_COMMIT", "unknown"), False


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m envex.verify.lab.gpu_matrix", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "matrix-out")))
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--modes", default="default,no-det,det,spec4,draft,tp2")
    ap.add_argument("--cells", default=None, help="model:mode,... in this order (instead of --models x --modes)")
    ap.add_argument("--cases", default=None,
                    help="time only these of each cell's cases, e.g. b1_1k,b1_32k (a quick check between full runs)")
    ap.add_argument("--demo", action="store_true", help="envex demo and envex-install on this GPU, guarded")
    ap.add_argument("--deadline", type=float, default=540.0, help="seconds after which no new cell starts")
    ap.add_argument("--work", type=Path, default=Path("/tmp/envex-matrix"))
    ap.add_argument("--commit", default=None, help="the commit measured (default: git's HEAD of this tree)")
    ap.add_argument("--merge", type=Path, action="append", default=[], help="an earlier matrix.json to carry on")
    ap.add_argument("--bandwidth", action=argparse.BooleanOptionalAction, default=True,
                    help="measure the read bandwidth for the rooflines first (about 10 s)")
    args = ap.parse_args(argv)
    t0 = time.monotonic()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.cells:
        cells = [tuple(c.split(":", 1)) if ":" in c else (c, "?") for c in args.cells.split(",")]
    else:
        cells = [(m, mode) for m in args.models.split(",") for mode in args.modes.split(",")]
    only = tuple(args.cases.split(",")) if args.cases else None
    unknown = sorted({m for m, _ in cells if m not in MODELS} | {mode for _, mode in cells if mode not in MODES}
                     | set(only or ()) - set(CASES))  # fmt: skip
    if unknown:
        print(f"error: unknown model, mode or case {', '.join(unknown)}; models: {', '.join(MODELS)}; modes: "
              f"{', '.join(MODES)}; cases: {', '.join(CASES)}", file=sys.stderr)
        return 2
    sha, dirty = git_commit()
    report: dict[str, Any] = {"schema": SCHEMA, "env": environment(args.commit or sha), "cells": []}
    report["env"]["dirty"] = dirty if args.commit is None else False
    for earlier in args.merge:  # an earlier call's cells (and its demo and install, when it ran them)
        data = json.loads(earlier.read_text())
        report["cells"] += data["cells"]
        report.update({k: data[k] for k in ("demo", "install") if k in data})
    bandwidth = None
    if args.bandwidth:
        from envex.verify.lab.kernel_bench._bench_lib import measure_bandwidth

        bw = measure_bandwidth()
        report["env"]["read_TBps"] = bandwidth = bw["read_TBps"]
        report["env"]["bandwidth"] = bw
    print(json.dumps(report["env"]), flush=True)
    path = args.out / "matrix.json"
    port = 18100
    for name, mode in cells:
        if mode == "tp2" and report["env"]["gpus"] < 2:
            continue
        if time.monotonic() - t0 > args.deadline:
            print(f"deadline: {name} {mode} not started", flush=True)
            continue
        port += 2
        cell = run_cell(MODELS[name], mode, port=port, out=args.out, models_dir=args.work / "models",
                        bandwidth=bandwidth, only=only)  # fmt: skip
        report["cells"].append(cell)
        path.write_text(json.dumps(report, indent=1))
        print(summary_line(cell), flush=True)
    if args.demo and time.monotonic() - t0 < args.deadline:
        report["demo"], report["install"] = run_demo(args.out, args.work, port + 2, timeout=600)
        path.write_text(json.dumps(report, indent=1))
        print("demo", json.dumps(report["demo"]), "\ninstall", json.dumps(report["install"]), flush=True)
    print(f"wrote {path} after {time.monotonic() - t0:.0f} s", flush=True)
    return 0


def summary_line(cell: dict[str, Any]) -> str:
    head = f"{cell['model']:>13} {cell['mode']:>7} {cell['status']:>7}"
    if cell["status"] != "ok":
        return f"{head}  {cell['line']}"
    cases = "  ".join(f"{k} {v['median']:.1f}" if v["median"] else f"{k} -" for k, v in cell["cases"].items())
    inv = cell["invariance"]
    return (f"{head} ready {cell.get('ready_s', 0):5.1f}s api {all(cell['api'].values())} {cases}"
            + (f" inv {inv['differing_tokens']}" if inv else "") + f"  {cell.get('answer', '')!r:.40}")


if __name__ == "__main__":
    raise SystemExit(main())
