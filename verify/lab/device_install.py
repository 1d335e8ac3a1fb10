"""The whole install on a GPU host (issue 14), step by step with its times, driven through the public commands.

`prepare` (device call 1, beside the GGUF's first half): the demo trust. `run` (call 2): the demo media
(`envex demo --media-only`), a kernel bundle compiled here (`envex bundle build --kind kernels --model`),
`envex-install --yes --trust-fingerprint FP` under the network guard with every line timed, `envex status`, the
release served (`envex serve --launch`) and asked through the official openai client, the admin page's hardware
and benchmark pages, the time from process start to first token with the kernel bundle (no C compiler on PATH,
Triton's cache unwritable; then a varied set of requests, none of which may need a kernel outside the bundle)
and without it (a cold cache, compiler present; then no compiler: it must fail with one line naming what is
missing); then a second model bundle of random bf16 weights in Llama-3.1-8B layer shapes
(ENVEX_DUMMY_LAYERS layers, default 4; the SmolLM2 tokenizer's vocabulary), whose gates must refuse activation
while the first release keeps serving (`dummy` alone: a third call on the same warm machine, when call 2 ran out
of time before it). Each step has a time limit and the run stops taking new steps at --deadline; whatever ran is
in $OUT: summary.json, log.txt, install.txt, dummy-install.txt, status.txt, admin-hardware.html,
admin-benchmarks.html, kernels.json, serve-bundle.log.

Only the commands are used (no envex.installer import: this is verification, above the installer only as an
operator is). verify/lab/device_install.sh prepares the environment and runs this; offline_docs/install.md has the
calls.

    python3 -m envex.verify.lab.device_install prepare|run|dry-run --work DIR --out DIR [--deadline S]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

MODEL = "smollm2-135m-instruct"
KERNELS_NAME = f"{MODEL}-kernels"
DUMMY = "dummy-llama-8b-shape"
PROMPT = "What is the capital of France?"
NO_CACHE = "/proc/envex-no-triton-cache"  # a TRITON_CACHE_DIR nobody can write, root included
ENVEX = [sys.executable, "-m", "envex.installer.commands"]
ENVEX_INSTALL = [sys.executable, "-m", "envex.installer.cli"]
STEP_LINE = re.compile(r"^([✓✗]) (\w+)\s+(.*)$")
TOKEN_LINE = re.compile(r"admin token for the /admin page \(shown once; note it now\): (\S+)")
# Llama-3.1-8B's layer shapes (hidden 4096, MLP 14336, 32 query / 8 KV heads of 128).
LLAMA_8B = {"hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8,
            "head_dim": 128, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 131072}


class StepFailed(RuntimeError):
    """A step ran and its outcome is wrong; the message says what was seen."""


@dataclass
class Step:
    name: str
    status: str  # ok | fail | skip
    seconds: float
    detail: str
    data: dict[str, Any] = field(default_factory=dict)


@dataclass
class Driver:
    work: Path
    out: Path
    deadline: float  # time.monotonic() after which no step starts
    hard_end: float  # time.monotonic() by which every process must be gone (the device call's own limit)
    gpu: bool = True
    steps: list[Step] = field(default_factory=list)
    facts: dict[str, Any] = field(default_factory=dict)

    @property
    def prefix(self) -> Path:
        return self.work / "prefix"

    @property
    def media(self) -> Path:
        return self.prefix / ".demo" / "media"

    @property
    def keys(self) -> Path:
        return self.prefix / ".demo" / "keys"

    def log(self, text: str) -> None:
        line = f"[{time.strftime('%H:%M:%S')}] {text}"
        print(line, flush=True)
        with open(self.out / "log.txt", "a", encoding="utf-8") as handle:
            handle.write(line + "\n")

    def left(self, seconds: float) -> float:
        """`seconds`, or less when the call's limit comes sooner."""
        return max(5.0, min(seconds, self.hard_end - time.monotonic()))

    def ok(self, name: str) -> bool:
        return any(s.name == name and s.status == "ok" for s in self.steps)

    def do(self, name: str, fn: Callable[[], tuple[str, dict[str, Any]]], *, needs: tuple[str, ...] = ()) -> bool:
        missing = [n for n in needs if not self.ok(n)]
        if missing or time.monotonic() > self.deadline:
            why = f"needs {', '.join(missing)}" if missing else "past the run's deadline"
            self.steps.append(Step(name, "skip", 0.0, why))
            self.log(f"SKIP {name}: {why}")
            return False
        self.log(f"---- {name}")
        start = time.monotonic()
        try:
            detail, data = fn()
            status = "ok"
        except Exception as exc:  # every step reports and the run goes on
            detail, data, status = f"{type(exc).__name__}: {exc}", {"traceback": traceback.format_exc()[-3000:]}, "fail"
        step = Step(name, status, round(time.monotonic() - start, 2), detail[:2000], data)
        self.steps.append(step)
        self.log(f"{status.upper()} {name} ({step.seconds:.1f} s): {step.detail[:400]}")
        self.save()
        return status == "ok"

    def save(self) -> None:
        summary = {"facts": self.facts, "steps": [asdict(s) for s in self.steps], "table": table(self.steps)}
        text = json.dumps(summary, indent=2, default=str) + "\n"
        (self.out / "summary.json").write_text(text, encoding="utf-8")
        (self.work / "summary.json").write_text(text, encoding="utf-8")  # for a later call on the same machine

    # ---- processes -------------------------------------------------------------------------------------------

    def sh(self, cmd: list[str], *, timeout: float, env: dict[str, str] | None = None,
           timed_log: Path | None = None) -> tuple[int, str]:
        """Run `cmd` in its own process group; returns (exit code, output). With `timed_log`, each line is written
        there prefixed by the seconds since the start (the install's steps take their times from those)."""
        self.log("$ " + " ".join(cmd))
        start = time.monotonic()
        timeout = max(5.0, min(timeout, self.hard_end - start))
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env or dict(os.environ),
                                text=True, start_new_session=True, bufsize=1)
        lines: list[str] = []
        timer = threading.Timer(timeout, lambda: _kill(proc))
        timer.start()
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                stamped = f"{time.monotonic() - start:7.2f}  {line.rstrip()}"
                lines.append(stamped)
                if timed_log is not None:
                    with open(timed_log, "a", encoding="utf-8") as handle:
                        handle.write(stamped + "\n")
            code = proc.wait()
        finally:
            timer.cancel()
        if time.monotonic() - start >= timeout:
            lines.append(f"(stopped after {timeout:.0f} s)")
            code = 124
        text = "\n".join(lines)
        with open(self.out / "log.txt", "a", encoding="utf-8") as handle:
            handle.write(text[-20000:] + f"\n(exit {code})\n")
        return code, text


def _kill(proc: subprocess.Popen[str]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def table(steps: list[Step]) -> str:
    rows = [f"{'step':<24} {'status':<6} {'seconds':>8}  detail"]
    rows += [f"{s.name:<24} {s.status:<6} {s.seconds:8.1f}  {s.detail[:90]}" for s in steps]
    return "\n".join(rows)


def install_step_times(output: str) -> dict[str, float]:
    """Seconds each installer step took, from its timestamped output (a step ends at its ✓/✗ line)."""
    times: dict[str, float] = {}
    last = 0.0
    for line in output.splitlines():
        stamp, _, text = line.strip().partition("  ")
        match = STEP_LINE.match(text.strip())
        if match is None:
            continue
        at = float(stamp)
        times[match.group(2)] = round(at - last, 2)
        last = at
    return times


# ---- the random-weight model ---------------------------------------------------------------------------------------


def write_dummy_model(dest: Path, tok: Path, *, layers: int, shape: dict[str, Any], device: str) -> dict[str, Any]:
    """An HF directory of random bf16 weights (`shape`, `layers` layers), the tokenizer files of `tok`, and its
    envex-model.json; returns the card."""
    import torch
    from safetensors.torch import save_file

    dest.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(tok / name, dest / name)
    vocab = json.loads((tok / "hf_config.json").read_text())["vocab_size"]
    h, m, heads, kv, d = (shape[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                             "num_key_value_heads", "head_dim"))
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": layers,
              "vocab_size": vocab, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 1,
              "eos_token_id": 2, "hidden_act": "silu", **shape}
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    gen = torch.Generator(device=device).manual_seed(0)

    def rand(*dims: int) -> torch.Tensor:
        return (torch.randn(*dims, generator=gen, device=device) * 0.02).to(torch.bfloat16).cpu()

    tensors = {"model.embed_tokens.weight": rand(vocab, h), "lm_head.weight": rand(vocab, h),
               "model.norm.weight": torch.ones(h, dtype=torch.bfloat16)}
    params = 2 * vocab * h + h
    for i in range(layers):
        p = f"model.layers.{i}."
        layer = {"self_attn.q_proj": (heads * d, h), "self_attn.k_proj": (kv * d, h), "self_attn.v_proj": (kv * d, h),
                 "self_attn.o_proj": (h, heads * d), "mlp.gate_proj": (m, h), "mlp.up_proj": (m, h),
                 "mlp.down_proj": (h, m)}
        for name, dims in layer.items():
            tensors[p + name + ".weight"] = rand(*dims)
            params += dims[0] * dims[1]
        for norm in ("input_layernorm", "post_attention_layernorm"):
            tensors[p + norm + ".weight"] = torch.ones(h, dtype=torch.bfloat16)
            params += h
    save_file(tensors, str(dest / "model.safetensors"), metadata={"format": "pt"})
    card = {"served_name": DUMMY, "format": "hf", "weights": ".", "architecture": "LlamaForCausalLM",
            "parameters": params, "num_layers": layers, "num_kv_heads": kv, "head_dim": d,
            "max_position_embeddings": shape["max_position_embeddings"], "quantization": "bfloat16",
            "defaults": {"max_model_len": 2048, "max_num_seqs": 8},
            "smoke": {"prompt": PROMPT, "expect": "Paris"}}
    (dest / "envex-model.json").write_text(json.dumps(card, indent=2))
    return card


# ---- the server ----------------------------------------------------------------------------------------------------


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Server:
    proc: subprocess.Popen[bytes]
    url: str
    started: float
    log: Path

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                _kill(self.proc)  # type: ignore[arg-type]


def start_server(launch: Path, env: dict[str, str], log: Path) -> Server:
    envex = launch.parent / "venv" / "bin" / "envex"
    port = free_port()
    started = time.monotonic()
    proc = subprocess.Popen([str(envex), "serve", "--launch", str(launch), "--port", str(port)], env=env,
                            stdout=open(log, "wb"), stderr=subprocess.STDOUT, start_new_session=True)
    return Server(proc, f"http://127.0.0.1:{port}", started, log)


def wait_ready(server: Server, timeout: float) -> float:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            tail = server.log.read_text(errors="replace").strip().splitlines()[-1:] or ["(no output)"]
            raise StepFailed(f"the server exited {server.proc.returncode}: {tail[0]}")
        try:
            if httpx.get(f"{server.url}/health", timeout=1).status_code == 200:
                return time.monotonic() - server.started
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise StepFailed(f"the server was not ready after {timeout:.0f} s")


def first_token(server: Server, served: str) -> tuple[float, str]:
    """Seconds from the server process' start to the first streamed token of a chat answer, and the whole answer."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
    stream = client.chat.completions.create(model=served, messages=[{"role": "user", "content": PROMPT}],
                                            max_tokens=16, temperature=0, stream=True)
    first, text = None, ""
    for chunk in stream:
        delta = chunk.choices[0].delta.content if chunk.choices else None
        if delta:
            first = first if first is not None else time.monotonic() - server.started
            text += delta
    if first is None:
        raise StepFailed("the stream carried no token")
    return first, text


def ask(server: Server, served: str, prompt: str = PROMPT) -> str:
    from openai import OpenAI

    client = OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
    reply = client.chat.completions.create(model=served, messages=[{"role": "user", "content": prompt}],
                                           max_tokens=16, temperature=0)
    return reply.choices[0].message.content or ""


WORDS = ("river", "stone", "garden", "window", "market", "silver", "winter", "music", "paper", "orange", "forest",
         "engine", "castle", "bridge", "candle", "harbor", "meadow", "planet", "ticket", "valley", "yellow", "pocket")


def filler(words: int, salt: int) -> str:
    """`words` common words (about one token each), different for each salt: prompts of chosen lengths."""
    return " ".join(WORDS[(i * 7 + salt) % len(WORDS)] for i in range(words))


def request(server: Server, served: str, *, words: int, salt: int, max_tokens: int, stream: bool,
            temperature: float = 0.0, logprobs: bool = False) -> dict[str, Any]:
    """One chat request through the official openai client: `words` words of filler, then the question. Raises
    StepFailed when it fails or carries no text; returns its times (ttft_s for a stream) and sizes."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)
    content = (filler(words, salt) + "\n\n" if words else "") + PROMPT
    args: dict[str, Any] = {"model": served, "messages": [{"role": "user", "content": content}],
                            "max_tokens": max_tokens, "temperature": temperature, "seed": salt}
    if logprobs:
        args.update(logprobs=True, top_logprobs=2)
    start = time.monotonic()
    record: dict[str, Any] = {"words": words, "max_tokens": max_tokens, "stream": stream,
                              "temperature": temperature, "logprobs": logprobs}
    try:
        if stream:
            text, first = "", None
            for chunk in client.chat.completions.create(**args, stream=True):
                delta = chunk.choices[0].delta.content if chunk.choices else None
                if delta:
                    first = first if first is not None else time.monotonic() - start
                    text += delta
            record["ttft_s"] = None if first is None else round(first, 3)
        else:
            reply = client.chat.completions.create(**args)
            text = reply.choices[0].message.content or ""
            record["prompt_tokens"] = reply.usage.prompt_tokens if reply.usage else None
    except Exception as exc:
        raise StepFailed(f"a request of {words} words failed: {type(exc).__name__}: {exc}") from None
    record.update(seconds=round(time.monotonic() - start, 3), chars=len(text))
    if not text:
        raise StepFailed(f"a request of {words} words got no text")
    return record


# Filler lengths of the concurrent requests: 1 to 1000 words, odd lengths, multiples of 16 and their neighbours
# (each prompt adds the chat template and the question, ~30 tokens).
CONCURRENT_WORDS = (0, 1, 2, 3, 7, 15, 16, 17, 31, 33, 64, 100, 127, 129, 255, 300, 513, 1000)


def workload(server: Server, served: str, *, long_words: int) -> dict[str, Any]:
    """What a served engine meets after its first question: concurrent requests of varied lengths and settings
    (streamed or not, greedy or sampled, logprobs), a long prompt, then the same long prompt again (a prefix-cache
    hit, whose first step computes only the prompt's tail). Every request must succeed."""
    from concurrent.futures import ThreadPoolExecutor

    specs = [dict(words=w, salt=i, max_tokens=(1, 4, 16, 33)[i % 4], stream=i % 2 == 0,
                  temperature=0.0 if i % 3 else 0.8, logprobs=i % 5 == 4)
             for i, w in enumerate(CONCURRENT_WORDS)]  # fmt: skip
    start = time.monotonic()
    with ThreadPoolExecutor(len(specs)) as pool:
        concurrent = list(pool.map(lambda spec: request(server, served, **spec), specs))
    concurrent_s = time.monotonic() - start
    long = request(server, served, words=long_words, salt=99, max_tokens=8, stream=True)
    hits = metric(server, "envex_prefix_cache_hit_tokens_total") or 0.0
    repeat = request(server, served, words=long_words, salt=99, max_tokens=8, stream=True)
    hit = (metric(server, "envex_prefix_cache_hit_tokens_total") or 0.0) - hits
    if hit <= 0:
        raise StepFailed("the repeated long prompt found nothing in the prefix cache")
    ttfts = sorted(r["ttft_s"] for r in concurrent if r.get("ttft_s") is not None)
    return {"concurrent": concurrent, "concurrent_s": round(concurrent_s, 2), "long": long, "repeat": repeat,
            "prefix_hit_tokens": hit, "concurrent_ttft_max_s": ttfts[-1] if ttfts else None}


def check_served(server: Server) -> None:
    """The server still runs and its log names no kernel it had to compile (with the bundle, Triton's cache
    unwritable and no C compiler, a kernel missing from the bundle fails its request: bundle_cache.KernelCacheMiss)."""
    if server.proc.poll() is not None:
        raise StepFailed(f"the server exited {server.proc.returncode} during the requests")
    log = server.log.read_text(errors="replace")
    missed = [x for x in log.splitlines() if "KernelCacheMiss" in x or "is not in the kernel bundle" in x]
    if missed:
        raise StepFailed(f"a kernel was missing from the bundle: {missed[0][:400]}")


def gpu_name() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30, check=False).stdout.strip().splitlines()
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out[0].strip() if out else None


HEADLINE_FIGURE = re.compile(r'<table class="kv headline">.*?<td>-?[0-9]', re.S)


def check_admin(pages: dict[str, str], gpu: str | None) -> dict[str, Any]:
    """The hardware page shows what the install recorded (and this GPU's name), the benchmarks page figures."""
    hw, bench = pages.get("hardware", ""), pages.get("benchmarks", "")
    seen = {"hardware_recorded": "recorded by the install" in hw, "gpu": gpu,
            "hardware_names_gpu": gpu is None or gpu in hw, "benchmark_figures": bool(HEADLINE_FIGURE.search(bench))}
    if not (seen["hardware_recorded"] and seen["hardware_names_gpu"] and seen["benchmark_figures"]):
        raise StepFailed(f"admin pages: {seen}")
    return seen


def admin_pages(server: Server, token: str) -> dict[str, str]:
    import httpx

    with httpx.Client(base_url=server.url, headers={"Origin": server.url}, timeout=30) as client:
        form = client.get("/admin/login").text
        nonce = re.search(r'name="csrf" value="([^"]+)"', form)
        if nonce is None:
            raise StepFailed("no CSRF field on /admin/login")
        done = client.post("/admin/login", data={"token": token, "csrf": nonce.group(1)}, follow_redirects=False)
        if done.status_code != 303:
            raise StepFailed(f"admin login answered {done.status_code}")
        return {page: client.get(f"/admin/{page}").text for page in ("hardware", "benchmarks")}


def metric(server: Server, name: str) -> float | None:
    import httpx

    for line in httpx.get(f"{server.url}/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return None


COMPILERS = re.compile(r"^(cc|c89|c99|gcc|g\+\+|c\+\+|cpp|clang|clang\+\+|tcc|ld|ld\..*|.*-gcc|.*-gcc-.*|gcc-.*|"
                       r"clang-.*|cpp-.*|.*-g\+\+.*|.*-cpp.*)$")


def no_compiler_env(base: dict[str, str], venv_bin: Path) -> dict[str, str]:
    """The environment of a host without a C compiler: the release's venv, then every other tool on PATH except
    the compilers (checked with `which`). Only the compilers go: Triton keys its C modules by
    platform.architecture(), which runs `file`, so a PATH without `file` is another host, not one without cc."""
    tools = Path(tempfile.mkdtemp(prefix="envex-nocc-"))
    for folder in base.get("PATH", os.defpath).split(os.pathsep):
        if not folder or not os.path.isdir(folder):
            continue
        for entry in sorted(os.listdir(folder)):
            target = Path(folder) / entry
            if not COMPILERS.match(entry) and not (tools / entry).exists() and os.access(target, os.X_OK):
                (tools / entry).symlink_to(target)
    env = {**base, "PATH": f"{venv_bin}{os.pathsep}{tools}"}
    env.pop("CC", None)
    found = [c for c in ("cc", "gcc", "clang", "c99") if shutil.which(c, path=env["PATH"])]
    if found:
        raise StepFailed(f"a C compiler is still on PATH: {found}")
    return env


# ---- the steps -----------------------------------------------------------------------------------------------------


def envex_status(d: Driver) -> tuple[str, dict[str, Any]]:
    """`envex status`, saved to status.txt; it must show the hardware the install recorded."""
    code, text = d.sh([*ENVEX, "status", "--prefix", str(d.prefix)], timeout=60)
    (d.out / "status.txt").write_text(text + "\n")
    if code != 0 or "hardware (recorded by the install" not in text:
        raise StepFailed(f"envex status exited {code} or shows no recorded hardware")
    return next((x for x in text.splitlines() if "hardware (" in x), "")[9:], {}


def model_media(d: Driver, media: Path, src: Path, name: str) -> Path:
    """`media` with the demo trust (trust/root.json) and the model bundle of `src` (NAME-1.0.0, requiring the
    runtime), signed with the demo key; returns the bundle."""
    from envex.bundles import build_bundle, load_private_key, sign_bundle

    (media / "trust").mkdir(parents=True, exist_ok=True)
    (media / "bundles").mkdir(parents=True, exist_ok=True)
    shutil.copyfile(d.keys / "root.json", media / "trust" / "root.json")
    built = build_bundle(src, kind="model", name=name, version="1.0.0", out=media / "bundles",
                         requires=[{"name": "envex-runtime", "kind": "runtime", "version": ">=0.1.0"}])
    sign_bundle(built, [load_private_key(d.keys / "demo.key")])
    return built


def prepare(d: Driver, *, dummy_bundle: bool = True) -> None:
    """The demo trust, and the random-weight model's signed bundle on its own media (no GGUF needed for either)."""
    from envex.bundles import make_demo_trust

    def trust() -> tuple[str, dict[str, Any]]:
        if not (d.keys / "root.json").is_file():
            make_demo_trust(d.keys, expires=datetime.now(UTC) + timedelta(days=365))
        return f"demo trust in {d.keys}", {}

    def dummy() -> tuple[str, dict[str, Any]]:
        media2 = d.work / "media2"
        bundle = media2 / "bundles" / f"{DUMMY}-1.0.0.envex"
        if bundle.is_file():
            return f"{bundle} already built", {}
        layers = int(os.environ.get("ENVEX_DUMMY_LAYERS", "4"))
        shape = LLAMA_8B if d.gpu else {**LLAMA_8B, "hidden_size": 64, "intermediate_size": 128,
                                        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}
        src = d.work / "dummy-src"
        shutil.rmtree(src, ignore_errors=True)
        tok = Path(os.environ.get("ENVEX_DEVICE_TOK", ".devcarry/tok"))
        card = write_dummy_model(src, tok, layers=layers, shape=shape, device="cuda" if d.gpu else "cpu")
        built = model_media(d, media2, src, DUMMY)
        shutil.rmtree(src)
        size = built.stat().st_size
        return f"{layers} layers of Llama-3.1-8B shape, {card['parameters'] / 1e9:.2f} B params, {size >> 20} MiB", {
            "card": card, "bundle_bytes": size}

    if not d.ok("prepare-trust"):
        d.do("prepare-trust", trust)
    if dummy_bundle:
        d.do("prepare-dummy-bundle", dummy, needs=("prepare-trust",))


def run_main(d: Driver) -> None:
    env = dict(os.environ)
    fp: dict[str, str] = {}

    def media() -> tuple[str, dict[str, Any]]:
        wheel = sorted((d.work / "wheel").glob("envex-*.whl"))
        args = [*ENVEX, "demo", "--prefix", str(d.prefix), "--media-only", "--device", "cpu"]
        code, text = d.sh(args + (["--wheel", str(wheel[-1])] if wheel else []), timeout=240)
        found = re.search(r"trust fingerprint: ([0-9a-f]{64})", text)
        if code != 0 or found is None:
            raise StepFailed(f"envex demo --media-only exited {code}: {text.strip().splitlines()[-1:]}")
        fp["fp"] = found.group(1)
        return f"runtime and model bundles signed; root {fp['fp'][:16]}…", {"fingerprint": fp["fp"]}

    def kernels() -> tuple[str, dict[str, Any]]:
        out = d.media / "bundles"
        target = out / f"{KERNELS_NAME}-1.0.0.envex"
        target.unlink(missing_ok=True)
        code, text = d.sh([*ENVEX, "bundle", "build", "--kind", "kernels", "--model", MODEL, "--name", KERNELS_NAME,
                           "--version", "1.0.0", "--out", str(out), "--requires", f"{MODEL}:model:==1.0.0"],
                          timeout=420)
        if code != 0:
            raise StepFailed(f"bundle build exited {code}: {text.strip().splitlines()[-1:]}")
        code, text = d.sh([*ENVEX, "bundle", "sign", str(target), "--key", str(d.keys / "demo.key")], timeout=60)
        if code != 0:
            raise StepFailed(f"bundle sign exited {code}: {text.strip().splitlines()[-1:]}")
        with tarfile.open(target) as tar:
            manifest = json.loads(tar.extractfile("manifest.json").read())  # type: ignore[union-attr]
            card = json.loads(tar.extractfile("payload/envex-kernels.json").read())  # type: ignore[union-attr]
        (d.out / "kernels.json").write_text(json.dumps({"targets": manifest["targets"], "card": card}, indent=2))
        data = {"targets": manifest["targets"], "files": len(manifest["files"]), "bytes": target.stat().st_size,
                "kernels": len(card["kernels"]), "c_modules": card["c_modules"], "warm_up_s": card["warm_up_seconds"]}
        return (f"{data['kernels']} kernel variants + {data['c_modules']} C modules, {data['bytes'] >> 10} KiB, "
                f"keyed {manifest['targets']['accelerators']} triton {manifest['targets']['triton']}"), data

    def install() -> tuple[str, dict[str, Any]]:
        log = d.out / "install.txt"
        code, text = d.sh([*ENVEX_INSTALL, "--media", str(d.media), "--prefix", str(d.prefix), "--yes",
                           "--trust-fingerprint", fp["fp"]], timeout=420, timed_log=log)
        token = TOKEN_LINE.search(text)
        if token:
            fp["token"] = token.group(1)
        times = install_step_times(text)
        lines = {m.group(2): m.group(3) for m in (STEP_LINE.match(x.strip().partition("  ")[2].strip())
                                                  for x in text.splitlines()) if m}
        launch = json.loads((d.prefix / "current" / "launch.json").read_text()) if code == 0 else {}
        data = {"exit": code, "step_seconds": times, "lines": lines, "launch": launch}
        d.facts.update(install_step_seconds=times, probe=lines.get("probe"), plan=lines.get("plan"))
        if code != 0:
            raise StepFailed(f"envex-install exited {code}: {text.strip().splitlines()[-1:]}")
        kv = launch.get("kv_cache", {})
        return (f"{sum(times.values()):.1f} s; kernels {'installed' if launch.get('kernels') else 'NOT installed'}; "
                f"KV {kv}"), data

    launch = d.prefix / "current" / "launch.json"

    def serve_bundle() -> tuple[str, dict[str, Any]]:
        bundle = d.prefix / "current" / "kernels"
        before = sorted((str(p), p.stat().st_mtime_ns) for p in bundle.rglob("*"))
        cenv = no_compiler_env({**env, "TRITON_CACHE_DIR": NO_CACHE}, launch.parent / "venv" / "bin")
        server = start_server(launch, cenv, d.work / "serve-bundle.log")
        engine = json.loads(launch.read_text()).get("engine") or {}
        try:
            ready = wait_ready(server, d.left(240))
            ttft, streamed = first_token(server, MODEL)  # the lone first question
            answer = ask(server, MODEL)
            served = workload(server, MODEL, long_words=(engine.get("max_model_len") or 2048) // 2)
            check_served(server)
            blocks = metric(server, "envex_kv_blocks_total")
            pages = admin_pages(server, fp["token"]) if "token" in fp else {}
        finally:
            server.stop()
            shutil.copyfile(server.log, d.out / "serve-bundle.log")
        for page, html in pages.items():
            (d.out / f"admin-{page}.html").write_text(html)
        if "Paris" not in answer:
            raise StepFailed(f"answer without Paris: {answer!r}")
        unchanged = sorted((str(p), p.stat().st_mtime_ns) for p in bundle.rglob("*")) == before
        if not unchanged:
            raise StepFailed("the kernel bundle changed while serving")
        admin = check_admin(pages, gpu_name()) if pages else {}
        data = {"ready_s": round(ready, 2), "ttft_s": round(ttft, 2), "answer": answer, "streamed": streamed,
                "kv_blocks_total": blocks, "bundle_unchanged": unchanged, "admin": admin, "workload": served}
        d.facts["ttft_with_bundle_no_cc_s"] = data["ttft_s"]
        d.facts["workload_with_bundle_no_cc"] = {k: served[k] for k in ("concurrent_s", "concurrent_ttft_max_s",
                                                                        "prefix_hit_tokens")}  # fmt: skip
        n = len(served["concurrent"]) + 2
        return (f"TTFT {ttft:.2f} s from process start (ready {ready:.2f} s); {answer!r}; then {n} more requests "
                f"(concurrent {served['concurrent_s']:.1f} s, a {served['long']['words']}-word prompt and its "
                f"repeat), none compiled; bundle unchanged"), data

    def no_kernels_launch() -> Path:
        value = json.loads(launch.read_text())
        value["kernels"] = None
        path = launch.parent / "launch-nokernels.json"  # beside launch.json: its paths are relative to the release
        path.write_text(json.dumps(value, indent=2))
        return path

    def serve_cold() -> tuple[str, dict[str, Any]]:
        cache = d.work / "cold-triton-cache"
        shutil.rmtree(cache, ignore_errors=True)
        server = start_server(no_kernels_launch(), {**env, "TRITON_CACHE_DIR": str(cache)}, d.work / "serve-cold.log")
        try:
            ready = wait_ready(server, d.left(420))
            ttft, answer = first_token(server, MODEL)
        finally:
            server.stop()
        d.facts["ttft_without_bundle_cold_cache_s"] = round(ttft, 2)
        return f"TTFT {ttft:.2f} s from process start (ready {ready:.2f} s), compiling; {answer!r}", {
            "ready_s": round(ready, 2), "ttft_s": round(ttft, 2), "answer": answer}

    def serve_no_cc() -> tuple[str, dict[str, Any]]:
        cache = d.work / "nocc-triton-cache"
        shutil.rmtree(cache, ignore_errors=True)
        cenv = no_compiler_env({**env, "TRITON_CACHE_DIR": str(cache)}, launch.parent / "venv" / "bin")
        server = start_server(no_kernels_launch(), cenv, d.work / "serve-nocc.log")
        try:
            wait_ready(server, d.left(300))
        except StepFailed as exc:
            seconds = time.monotonic() - server.started
            message = next((x for x in reversed(server.log.read_text(errors="replace").splitlines())
                            if x.startswith("error:")), str(exc))
            d.facts["no_bundle_no_cc_message"] = message
            if "C compiler" not in message:
                raise StepFailed(f"failed, but not naming the missing compiler: {message}") from None
            return f"refused after {seconds:.1f} s: {message}", {"seconds": round(seconds, 2), "message": message}
        finally:
            server.stop()
        raise StepFailed("served without a kernel bundle and without a C compiler: the test is not what it seems")

    d.do("media", media)
    d.do("kernel-bundle", kernels, needs=("media",))
    d.do("install", install, needs=("media",))
    d.do("status", lambda: envex_status(d), needs=("install",))
    d.do("serve-bundle-no-cc", serve_bundle, needs=("install",))
    d.do("serve-no-bundle-cold", serve_cold, needs=("install",))
    d.do("serve-no-bundle-no-cc", serve_no_cc, needs=("install",))
    if not d.ok("kernel-bundle"):
        d.log("no kernel bundle was built: the serve steps above measured a release without one")


def run_dummy(d: Driver) -> None:
    launch = d.prefix / "current" / "launch.json"
    media2 = d.work / "media2"
    answers: list[tuple[float, str]] = []
    holder: dict[str, Server] = {}

    def media() -> tuple[str, dict[str, Any]]:
        runtime = sorted((d.media / "bundles").glob("envex-runtime-*.envex"))
        if not runtime:
            raise StepFailed("no runtime bundle on the first media")
        shutil.copyfile(runtime[-1], media2 / "bundles" / runtime[-1].name)
        return f"{media2}: {', '.join(p.name for p in sorted((media2 / 'bundles').iterdir()))}", {}

    def serving() -> tuple[str, dict[str, Any]]:
        # The active release keeps serving during the next install. Two engines share the GPU only if the first
        # leaves memory: this copy of launch.json differs from the active one in gpu_memory_utilization alone.
        value = json.loads(launch.read_text())
        value["engine"]["gpu_memory_utilization"] = 0.4
        shared = launch.parent / "launch-shared-gpu.json"
        shared.write_text(json.dumps(value, indent=2))
        server = holder["s"] = start_server(shared, dict(os.environ), d.work / "serve-shared.log")
        wait_ready(server, d.left(240))
        return f"serving {ask(server, MODEL)!r}", {}

    def install() -> tuple[str, dict[str, Any]]:
        stop = threading.Event()

        def poll() -> None:
            while not stop.wait(5):
                try:
                    answers.append((time.monotonic(), ask(holder["s"], MODEL)))
                except Exception as exc:
                    answers.append((time.monotonic(), f"ERROR {type(exc).__name__}: {exc}"))

        poller = threading.Thread(target=poll, daemon=True)
        poller.start()
        try:
            code, text = d.sh([*ENVEX_INSTALL, "--media", str(media2), "--prefix", str(d.prefix), "--yes"],
                              timeout=420, timed_log=d.out / "dummy-install.txt")
        finally:
            stop.set()
            poller.join(timeout=70)
        served = [a for _, a in answers]
        data = {"exit": code, "step_seconds": install_step_times(text), "answers_during": served}
        if code == 0:
            raise StepFailed("the random-weight release passed its gates and was activated")
        if "nothing was activated" not in text:
            raise StepFailed(f"exit {code} without 'nothing was activated': {text.strip().splitlines()[-1:]}")
        if not served or not all("Paris" in a for a in served):
            raise StepFailed(f"the first release did not answer Paris throughout the install: {served}")
        failed = re.search(r"gates: \d+ failed \(([^)]*)\)", text)
        return (f"refused: gates failed ({failed.group(1) if failed else '?'}); the first release answered Paris "
                f"{len(served)} times during it"), data

    def after() -> tuple[str, dict[str, Any]]:
        code, text = d.sh([*ENVEX, "status", "--prefix", str(d.prefix)], timeout=60)
        with open(d.out / "status.txt", "a", encoding="utf-8") as handle:
            handle.write("\n# after the random-weight install\n" + text + "\n")
        active = re.search(r"active: (\S+)", text)
        answer = ask(holder["s"], MODEL)
        if active is None or not active.group(1).startswith("0001-") or "Paris" not in answer:
            raise StepFailed(f"active {active.group(1) if active else None}, answer {answer!r}")
        return f"still active: {active.group(1)}; answers {answer!r}", {}

    try:
        d.do("dummy-media", media, needs=("install", "prepare-dummy-bundle"))
        d.do("serve-during-install", serving, needs=("dummy-media",))
        d.do("dummy-install-refused", install, needs=("serve-during-install",))
        d.do("first-release-serves", after, needs=("serve-during-install",))
    finally:
        if "s" in holder:
            holder["s"].stop()


def guard_report(d: Driver) -> None:
    def guard() -> tuple[str, dict[str, Any]]:
        record = Path(os.environ.get("ENVEX_GUARD_RECORD", d.work / "guard" / "violations.jsonl"))
        seen = [json.loads(x) for x in record.read_text().splitlines() if x.strip()] if record.is_file() else []
        try:
            unshare = subprocess.run(["unshare", "-n", "true"], capture_output=True, timeout=10, check=False)
            unshared = unshare.returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            unshared = False
        data = {"violations": seen, "record": str(record), "unshare_n": unshared}
        d.facts["non_loopback_connections"] = len(seen)
        if not record.is_file():
            raise StepFailed(f"no guard record at {record}: was the guard's sitecustomize on PYTHONPATH?")
        if seen:
            raise StepFailed(f"{len(seen)} non-loopback attempts: {seen[:3]}")
        unshare_word = "works" if data["unshare_n"] else "refused"
        return f"0 non-loopback connections or lookups recorded; unshare -n {unshare_word}", data

    d.do("network-guard", guard)


# ---- gpt-oss at reduced depth, installed against signed references (issue 40) -----------------------------------

GPT_OSS = "gpt-oss-120b-reduced"
# The dry run's width in place of gpt-oss-120b's: the same layout (MXFP4 experts, sinks, a window, then a full layer).
GPT_OSS_TINY = {"hidden_size": 64, "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
                "head_dim": 16, "num_local_experts": 8, "experts_per_token": 4, "num_experts_per_tok": 4,
                "sliding_window": 32}  # fmt: skip
GPT_OSS_LEN = 2048  # the card's max_model_len: the window the needle prompts of the references are cut for
# gpt-oss-build (model, references, card, media), then gpt-oss-install (a second device call: envex-install, serve);
# gpt-oss both in one call; gpt-oss-dry-run both on the CPU at GPT_OSS_TINY's width (tests/test_lab_gpt_oss_install.py).
GPT_OSS_PHASES = ("gpt-oss-build", "gpt-oss-install", "gpt-oss", "gpt-oss-dry-run")
SMOKE_PROMPTS = ("Name a river.", "What is two plus two?", "Say hello.", "Write one word.")


def write_gpt_oss(dest: Path, tok: Path, *, layers: int, gpu: bool) -> dict[str, Any]:
    """gpt-oss-120b at `layers` layers (full width on a GPU, GPT_OSS_TINY's on the CPU) in the published MXFP4
    layout with random weights (bench_gpt_oss.write_reduced_checkpoint: decisive logits and expert choices; a random
    router's near-ties fail any bf16 engine's semantic gate, HF's own bf16 included), and the embedded model's
    tokenizer in place of the word-level one, so the gates' English prompts are real tokens (the vocabulary is then
    the tokenizer's, 49,152, not 201,088). Returns the config written."""
    from envex.verify.lab.kernel_bench.bench_gpt_oss import write_reduced_checkpoint
    from envex.verify.lab.kernel_bench.bench_server import SHAPES

    hf = json.loads((tok / "hf_config.json").read_text())
    cfg = {**SHAPES["gpt-oss-120b"], **({} if gpu else GPT_OSS_TINY), "vocab_size": hf["vocab_size"],
           "eos_token_id": hf["eos_token_id"], "pad_token_id": hf.get("pad_token_id") or hf["eos_token_id"],
           "bos_token_id": hf.get("bos_token_id")}  # fmt: skip
    shutil.rmtree(dest, ignore_errors=True)
    write_reduced_checkpoint(dest, cfg, layers, device="cuda" if gpu else "cpu", router_bias_spacing=8.0,
                             embed_scale=50.0)  # fmt: skip
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(tok / name, dest / name)
    return json.loads((dest / "config.json").read_text())


# The card's smoke test for a model of random weights, which cannot answer "Paris": the first words HF
# transformers answers a short prompt with greedily, the prompt rendered as the smoke gate renders it. Its own
# process (the installed wheel's envex: the lab is not in it), so the reference's GPU memory goes when it exits.
# argv: MODEL DEVICE PROMPT...; prints "smoke: [prompt, answer]".
SMOKE_SCRIPT = """import json, sys
from envex.runtime.loader import load_model_info
from envex.verify.reference import HFReference
model, device, prompts = sys.argv[1], sys.argv[2], sys.argv[3:]
tok = load_model_info(model).tokenizer
ref = HFReference(model, device=device)
for prompt in prompts:
    text = prompt if tok.chat_template is None else tok.apply_chat_template([{"role": "user", "content": prompt}])
    answer = tok.decode(ref.greedy(tok.encode(text), 3, top_k=0).token_ids).strip()
    if answer:
        print("smoke:", json.dumps([prompt, answer]))
        break
"""


def gpt_oss_build(d: Driver) -> None:
    """The model written, its signed references computed (`envex media references`, HF transformers on this
    machine's GPU), its card (the product's own: installer.model_card) with a smoke test it can pass, and media:
    the demo trust, a demo runtime bundle, the model bundle, each signed."""
    src, media = d.work / "gpt-oss-src", d.work / "media-gpt-oss"
    refs = d.work / "gpt-oss-references.json"
    device = "cuda" if d.gpu else "cpu"

    def model() -> tuple[str, dict[str, Any]]:
        layers = int(os.environ.get("ENVEX_GPT_OSS_LAYERS", "2"))
        tok = Path(os.environ.get("ENVEX_DEVICE_TOK", ".devcarry/tok"))
        cfg = write_gpt_oss(src, tok, layers=layers, gpu=d.gpu)
        size = sum(p.stat().st_size for p in src.iterdir())
        keys = ("hidden_size", "num_local_experts", "num_attention_heads", "vocab_size", "layer_types")
        return f"{layers} layers, {size / 1e9:.2f} GB on disk", {k: cfg[k] for k in keys} | {"bytes": size}

    def references() -> tuple[str, dict[str, Any]]:
        code, text = d.sh([*ENVEX, "media", "references", "--model", str(src), "--out", str(refs), "--device", device,
                           "--max-model-len", str(GPT_OSS_LEN), "--force"], timeout=480)
        if code != 0:
            raise StepFailed(f"envex media references exited {code}: {text.strip().splitlines()[-1:]}")
        data = json.loads(refs.read_text())
        return (f"{len(data['greedy'])} greedy answers, {len(data['logits'])} logit rows ({data['reference_policy']}, "
                f"{refs.stat().st_size >> 10} KiB)"), {"policy": data["reference_policy"], "bytes": refs.stat().st_size}

    def card() -> tuple[str, dict[str, Any]]:
        from envex.installer.cards import SmokeTest
        from envex.installer.model_card import card_for_model
        from envex.verify.references_file import REFERENCES_FILE

        code, text = d.sh([sys.executable, "-c", SMOKE_SCRIPT, str(src), device, *SMOKE_PROMPTS], timeout=300)
        found = re.search(r"^\s*[0-9.]+  smoke: (.*)$", text, re.M)
        if code != 0 or found is None:
            raise StepFailed(f"the smoke reference exited {code} with no answer to {SMOKE_PROMPTS}: "
                             f"{text.strip().splitlines()[-1:]}")  # fmt: skip
        prompt, expect = json.loads(found.group(1))
        built = card_for_model(src, GPT_OSS).model_copy(update={"smoke": SmokeTest(prompt=prompt, expect=expect)})
        (src / "envex-model.json").write_text(json.dumps(built.model_dump(), indent=2) + "\n")
        shutil.copyfile(refs, src / REFERENCES_FILE)
        return f"smoke {prompt!r} -> {expect!r}; {built.quantization}, {built.parameters / 1e9:.2f} B params", {
            "card": built.model_dump()}

    def bundles() -> tuple[str, dict[str, Any]]:
        from envex.bundles import load_private_key, root_fingerprint
        from envex.bundles.trust import load_root
        from envex.installer.demo import build_demo_runtime

        shutil.rmtree(media, ignore_errors=True)
        model_media(d, media, src, GPT_OSS)
        wheel = sorted((d.work / "wheel").glob("envex-*.whl"))
        build_demo_runtime(media, load_private_key(d.keys / "demo.key"), "0.1.0", wheel[-1] if wheel else None)
        d.facts["gpt_oss_fingerprint"] = root_fingerprint(load_root(d.keys / "root.json"))
        sizes = {p.name: p.stat().st_size for p in sorted((media / "bundles").iterdir())}
        return ", ".join(f"{n} {b >> 20} MiB" for n, b in sizes.items()), {"bundles": sizes}

    d.do("gpt-oss-model", model, needs=("prepare-trust",))
    d.do("gpt-oss-references", references, needs=("gpt-oss-model",))
    d.do("gpt-oss-card", card, needs=("gpt-oss-references",))
    d.do("gpt-oss-media", bundles, needs=("gpt-oss-card",))
    if d.ok("gpt-oss-media"):
        shutil.rmtree(src)  # the bundle holds it; the disk is small


def gpt_oss_install(d: Driver) -> None:
    """`envex-install --reference signed` of the gpt-oss media into its own prefix (the network guard on), then the
    release served and asked its smoke prompt through the official openai client: the answer the card expects."""
    media, prefix = d.work / "media-gpt-oss", d.work / "prefix-gpt-oss"

    def install() -> tuple[str, dict[str, Any]]:
        shutil.rmtree(prefix, ignore_errors=True)
        code, text = d.sh([*ENVEX_INSTALL, "--media", str(media), "--prefix", str(prefix), "--yes",
                           "--trust-fingerprint", d.facts["gpt_oss_fingerprint"], "--reference", "signed",
                           *([] if d.gpu else ["--cpu"])], timeout=540, timed_log=d.out / "gpt-oss-install.txt")
        times = install_step_times(text)
        if code != 0:
            raise StepFailed(f"envex-install exited {code}: {text.strip().splitlines()[-1:]}")
        state = json.loads((prefix / "state.json").read_text())
        release = next(r for r in state["releases"] if r["id"] == state["active"])
        checks = release["checks"]
        report = json.loads((prefix / checks["report"]).read_text())["details"]
        policy = report["verify.gates"]["reference_policy"]
        data = {"step_seconds": times, "gates": checks["gates"], "suite": checks["suite"],
                "reference": report["reference"], "reference_policy": policy, "launch": json.loads(
                    (prefix / "current" / "launch.json").read_text())}  # fmt: skip
        d.facts.update(gpt_oss_install_step_seconds=times, gpt_oss_reference_policy=policy)
        if checks.get("reference") != "signed" or not str(policy).startswith("signed-"):
            raise StepFailed(f"the gates did not judge against the signed answers: {checks.get('reference')}, {policy}")
        passed = sum(v == "pass" for v in checks["gates"].values())
        return (f"{sum(times.values()):.1f} s; {passed}/{len(checks['gates'])} gates passed ({checks['suite']}, "
                f"{policy}); {state['active']} active"), data

    def serve() -> tuple[str, dict[str, Any]]:
        launch = prefix / "current" / "launch.json"
        model_dir = prefix / "current" / json.loads(launch.read_text())["model"]["path"]
        smoke = json.loads((model_dir / "envex-model.json").read_text())["smoke"]
        server = start_server(launch, dict(os.environ), d.work / "serve-gpt-oss.log")
        try:
            ready = wait_ready(server, d.left(300))
            answer = ask(server, GPT_OSS, prompt=smoke["prompt"])
        finally:
            server.stop()
            shutil.copyfile(server.log, d.out / "serve-gpt-oss.log")
        if smoke["expect"].lower() not in answer.lower():
            raise StepFailed(f"{smoke['prompt']!r} answered {answer!r}, not the reference's {smoke['expect']!r}")
        return f"ready {ready:.1f} s; {smoke['prompt']!r} -> {answer!r}", {"ready_s": round(ready, 2), "answer": answer}

    d.do("gpt-oss-install", install, needs=("gpt-oss-media",))
    d.do("gpt-oss-serve", serve, needs=("gpt-oss-install",))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m envex.verify.lab.device_install", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("phase", choices=("prepare", "run", "main", "dummy", "dry-run", *GPT_OSS_PHASES))
    parser.add_argument("--work", type=Path, default=Path(".device/install"))
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".device/install/out")))
    parser.add_argument("--deadline", type=float, default=480, help="seconds after which no step starts")
    parser.add_argument("--limit", type=float, default=570, help="seconds by which every step is stopped")
    args = parser.parse_args(argv)
    args.work, args.out = args.work.resolve(), args.out.resolve()
    args.work.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    now = time.monotonic()
    d = Driver(args.work, args.out, now + args.deadline, now + args.limit,
               gpu=args.phase not in ("dry-run", "gpt-oss-dry-run"))  # fmt: skip
    summary = args.work / "summary.json"
    if summary.is_file() and args.phase in ("dummy", "gpt-oss-install"):  # a later call on this machine: keep what ran
        d.steps = [Step(**s) for s in json.loads(summary.read_text())["steps"]]
        d.facts = json.loads(summary.read_text())["facts"]
    if args.phase in GPT_OSS_PHASES:
        prepare(d, dummy_bundle=False)
        if args.phase != "gpt-oss-install":
            gpt_oss_build(d)
        if args.phase != "gpt-oss-build":
            gpt_oss_install(d)
        if d.gpu:
            guard_report(d)
    else:
        # Call 1 (`prepare`) makes the trust only: it carries half the GGUF and the wheels, with no room for the
        # tokenizer the random-weight model needs. `run` does the main chain first, the random-weight model last.
        prepare(d, dummy_bundle=args.phase == "dry-run")
        if args.phase in ("run", "main"):
            run_main(d)
        if args.phase in ("run", "dummy"):
            prepare(d)
            run_dummy(d)
        if args.phase in ("run", "main", "dummy"):
            guard_report(d)
        if args.phase == "dry-run":
            dry_run(d)
    d.save()
    print("\n" + table(d.steps) + "\n\n" + json.dumps(d.facts, indent=1, default=str), flush=True)
    return 0 if all(s.status != "fail" for s in d.steps) else 1


def dry_run(d: Driver) -> None:
    """CPU: the media, the dummy media, an install with injected gates, `envex status`, and the serve step's
    requests and admin pages on the CPU release (what the tests run before a GPU does)."""
    fp: dict[str, str] = {}

    def media() -> tuple[str, dict[str, Any]]:
        wheel = sorted((d.work / "wheel").glob("envex-*.whl"))
        args = [*ENVEX, "demo", "--prefix", str(d.prefix), "--media-only", "--device", "cpu"]
        code, text = d.sh(args + (["--wheel", str(wheel[-1])] if wheel else []), timeout=300)
        found = re.search(r"trust fingerprint: ([0-9a-f]{64})", text)
        if code != 0 or found is None:
            raise StepFailed(f"envex demo --media-only exited {code}: {text.strip().splitlines()[-3:]}")
        fp["fp"] = found.group(1)
        return "media built", {}

    def install() -> tuple[str, dict[str, Any]]:
        code, text = d.sh([*ENVEX_INSTALL, "--media", str(d.media), "--prefix", str(d.prefix), "--yes", "--cpu",
                           "--trust-fingerprint", fp["fp"]], timeout=300, timed_log=d.out / "install.txt")
        times = install_step_times(text)
        if code != 0 or set(times) != {"verify", "probe", "plan", "install", "gates", "activate"}:
            raise StepFailed(f"exit {code}, steps {times}: {text.strip().splitlines()[-3:]}")
        token = TOKEN_LINE.search(text)
        if token:
            fp["token"] = token.group(1)
        return f"steps {times}", {"step_seconds": times, "token": bool(token)}

    def serve() -> tuple[str, dict[str, Any]]:
        """The GPU step's requests and admin checks on the CPU release (the torch ops: nothing to compile)."""
        server = start_server(d.prefix / "current" / "launch.json", dict(os.environ), d.work / "serve-cpu.log")
        try:
            ready = wait_ready(server, d.left(240))
            ttft, answer = first_token(server, MODEL)
            served = workload(server, MODEL, long_words=300)
            check_served(server)
            pages = admin_pages(server, fp["token"])
        finally:
            server.stop()
        for page, html in pages.items():
            (d.out / f"admin-{page}.html").write_text(html)
        admin = check_admin(pages, None)
        return (f"TTFT {ttft:.2f} s from process start (ready {ready:.2f} s); {answer!r}; "
                f"{len(served['concurrent']) + 2} more requests"), {"workload": served, "admin": admin}

    d.do("media", media)
    d.do("install", install, needs=("media",))
    d.do("status", lambda: envex_status(d), needs=("install",))
    d.do("serve-workload", serve, needs=("install",))
    d.do("dummy-media", lambda: (str(sorted((d.work / "media2" / "bundles").glob("*.envex"))), {}),
         needs=("prepare-dummy-bundle",))


if __name__ == "__main__":
    raise SystemExit(main())
