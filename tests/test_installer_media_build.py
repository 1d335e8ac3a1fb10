"""`envex media build`: the card written from the model's own files, refusals before anything is signed, a complete
wheelhouse resolved by pip's own resolver for the target (from a local folder of wheels: no network), signatures,
the trust root and its fingerprint, and --force.

The wheels are tiny and made here as zip files (a wheel is one): a stand-in `envex` that depends on `tinydep`, a
stand-in `torch`, and `tinydep`; pip resolves them for python 3.12 on manylinux_2_28_x86_64 with --no-index.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import zipfile
from pathlib import Path

import pytest

from envex.bundles import generate_key, load_root, verify_bundle, write_key_files
from envex.installer import commands
from envex.installer.cards import RUNTIME_CARD, WHEELHOUSE, ModelCard, RuntimeCard
from envex.installer.media import scan_media
from envex.installer.media_build import TORCH_VERSION, Target

VOCAB = 300


def _wheel(folder: Path, name: str, version: str, requires: list[str]) -> Path:
    """A pure-Python wheel of one empty module, written as the zip it is (no build tool, no network)."""
    dist = f"{name}-{version}.dist-info"
    files = {
        f"{name}/__init__.py": b"",
        f"{dist}/METADATA": "\n".join(["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}",
                                       *[f"Requires-Dist: {r}" for r in requires]]).encode() + b"\n",  # fmt: skip
        f"{dist}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    for path, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(data)}")
    record.append(f"{dist}/RECORD,,")
    path = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for member, data in files.items():
            z.writestr(member, data)
        z.writestr(f"{dist}/RECORD", "\n".join(record) + "\n")
    return path


@pytest.fixture(scope="module")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    index = tmp_path_factory.mktemp("index")
    _wheel(index, "tinydep", "1.0", [])
    _wheel(index, "accelerate", "1.0", [])
    _wheel(index, "torch", TORCH_VERSION, [])
    cpu = tmp_path_factory.mktemp("cpu-index")  # as PyTorch's CPU index: torch 2.11.0+cpu
    _wheel(cpu, "torch", f"{TORCH_VERSION}+cpu", [])
    own = tmp_path_factory.mktemp("envex")
    missing = tmp_path_factory.mktemp("envex-missing")
    return {
        "index": index,
        "cpu_index": cpu,
        "envex": _wheel(own, "envex", "0.1.0", ["tinydep==1.0"]),
        "envex_missing": _wheel(missing, "envex", "0.1.0", ["tinydep==1.0", "tinymissing==1.0"]),
    }


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("keys")
    write_key_files(generate_key(), folder, "publisher")
    return folder


def write_tiny_hf(folder: Path, *, vocab: int = VOCAB, tokenizer_vocab: int = VOCAB, arch: str = "LlamaForCausalLM",
                  shards: int = 2) -> Path:  # fmt: skip
    """A 2-layer Llama's config, word tokenizer and weights in `shards` safetensors files with their index (only the
    tensors the card reads: the card counts what the headers hold)."""
    import torch
    from safetensors.torch import save_file
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    folder.mkdir(parents=True)
    words = {f"w{i}": i for i in range(tokenizer_vocab - 1)} | {"<unk>": tokenizer_vocab - 1}
    Tokenizer(WordLevel(words, unk_token="<unk>")).save(str(folder / "tokenizer.json"))
    (folder / "config.json").write_text(json.dumps({
        "architectures": [arch], "model_type": "llama", "vocab_size": vocab, "hidden_size": 64,
        "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "eos_token_id": 0,
        "torch_dtype": "bfloat16",
    }))  # fmt: skip
    tensors = {
        "model.embed_tokens.weight": torch.zeros(vocab, 64, dtype=torch.bfloat16),
        "model.layers.0.self_attn.q_proj.weight": torch.zeros(64, 64, dtype=torch.bfloat16),
        "model.layers.1.self_attn.q_proj.weight": torch.zeros(64, 64, dtype=torch.bfloat16),
        "lm_head.weight": torch.zeros(vocab, 64, dtype=torch.bfloat16),
    }
    names = sorted(tensors)
    weight_map = {}
    for i in range(shards):
        part = names[i::shards]
        shard = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: tensors[n] for n in part}, str(folder / shard))
        weight_map |= {n: shard for n in part}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


def media_build(
    capsys: pytest.CaptureFixture[str], model: Path, out: Path, keys: Path, envex: Path, index: Path, *extra: str
) -> tuple[int, str, str]:
    """`envex media build` without reference answers (the tiny models here have no weights to run) unless `extra`
    says where they come from."""
    answers = [] if any(e.startswith("--reference") for e in extra) else ["--no-references"]
    argv = ["media", "build", "--model", str(model), "--out", str(out), "--keys", str(keys), "--envex-wheel",
            str(envex), "--find-links", str(index), "--no-index", *answers, *extra]  # fmt: skip
    code = commands.main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def siblings(out: Path) -> list[str]:
    return sorted(p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}."))


def read_card(bundle: Path, root_path: Path, name: str) -> bytes:
    return verify_bundle(bundle, root=load_root(root_path)).read_file(name)


def test_a_tiny_hf_model_becomes_signed_media_with_a_complete_wheelhouse(tmp_path, capsys, wheels, keys):
    model = write_tiny_hf(tmp_path / "Tiny-Llama")
    out = tmp_path / "media"
    code, stdout, err = media_build(capsys, model, out, keys, wheels["envex"], wheels["index"])
    assert code == 0, err
    assert sorted(p.name for p in out.iterdir()) == ["bundles", "install.sh", "offline_docs", "trust"]
    assert os.access(out / "install.sh", os.X_OK) and (out / "offline_docs" / "install.md").is_file()
    assert siblings(out) == [], "the staging folder is left behind"
    assert out.stat().st_mode & 0o777 == 0o755
    root_path = out / "trust" / "root.json"
    root = load_root(root_path)
    assert f"trust root fingerprint: {root.fingerprint}" in stdout
    assert root.fingerprint == load_root(keys / "root.json").fingerprint  # kept for the next build

    scan = scan_media(out)
    names = sorted(p.name for p in scan.bundle_paths)
    assert names == ["envex-runtime-0.1.0.envex", "tiny-llama-1.0.0.envex"]
    card = ModelCard.model_validate_json(read_card(out / "bundles" / names[1], root_path, "envex-model.json"))
    assert (card.served_name, card.format, card.weights, card.architecture) == ("tiny-llama", "hf", ".",
                                                                                "LlamaForCausalLM")  # fmt: skip
    assert (card.num_layers, card.num_kv_heads, card.head_dim, card.max_position_embeddings) == (2, 2, 16, 4096)
    assert card.parameters == 2 * VOCAB * 64 + 2 * 64 * 64 and card.quantization == "bfloat16"
    assert card.defaults.max_model_len == 2048
    # No chat template: a base model, asked to complete a sentence rather than a question.
    assert card.smoke is not None and (card.smoke.prompt, card.smoke.expect) == ("The capital of France is", "Paris")

    runtime = verify_bundle(out / "bundles" / names[0], root=root)
    rcard = RuntimeCard.model_validate_json(runtime.read_file(RUNTIME_CARD))
    assert rcard.wheelhouse == "complete" and rcard.install == ["envex==0.1.0", "accelerate>=0.30"]
    assert rcard.python == ">=3.12,<3.13"
    assert sorted(f.path for f in runtime.manifest.files if f.path.startswith(WHEELHOUSE)) == [
        f"{WHEELHOUSE}/accelerate-1.0-py3-none-any.whl",
        f"{WHEELHOUSE}/envex-0.1.0-py3-none-any.whl", f"{WHEELHOUSE}/tinydep-1.0-py3-none-any.whl",
        f"{WHEELHOUSE}/torch-{TORCH_VERSION}-py3-none-any.whl",
    ]  # fmt: skip
    assert runtime.manifest.targets.python == ">=3.12,<3.13"

    # The command line verifies what it wrote.
    for bundle in scan.bundle_paths:
        assert commands.main(["verify", "bundle", str(bundle), "--trust", str(root_path)]) == 0
    assert "verified" in capsys.readouterr().out


def test_the_cpu_variant_resolves_the_cpu_torch(tmp_path, capsys, wheels, keys):
    model = write_tiny_hf(tmp_path / "m")
    code, _, err = media_build(capsys, model, tmp_path / "media", keys, wheels["envex"], wheels["index"],
                               "--torch", "cpu", "--name", "tiny", "--version", "2.0.0", "--find-links",
                               str(wheels["cpu_index"]))  # fmt: skip
    assert code == 0, err
    runtime = verify_bundle(tmp_path / "media" / "bundles" / "envex-runtime-0.1.0.envex",
                            root=load_root(tmp_path / "media" / "trust" / "root.json"))  # fmt: skip
    assert f"{WHEELHOUSE}/torch-{TORCH_VERSION}+cpu-py3-none-any.whl" in {f.path for f in runtime.manifest.files}
    assert (tmp_path / "media" / "bundles" / "tiny-2.0.0.envex").is_file()
    # Without the CPU index, the one line says where the CPU torch lives; with only it, cu130 is refused.
    code, _, err = media_build(capsys, model, tmp_path / "m2", keys, wheels["envex"], wheels["index"], "--torch", "cpu")
    assert code == 2 and "no wheel of torch==2.11.0+cpu" in err and "download.pytorch.org/whl/cpu" in err, err
    code, _, err = media_build(capsys, model, tmp_path / "m3", keys, wheels["envex"], wheels["cpu_index"],
                               "--find-links", str(wheels["index"]))  # both builds: pip prefers the +cpu one
    assert code == 2 and "pip resolved torch-2.11.0+cpu-py3-none-any.whl, a CPU build" in err, err
    assert not (tmp_path / "m2").exists() and not (tmp_path / "m3").exists()


def test_the_embedded_gguf_model(tmp_path, capsys, wheels, keys):
    from envex.runtime.loader import embedded_model_path

    out = tmp_path / "media"
    code, stdout, err = media_build(capsys, embedded_model_path(), out, keys, wheels["envex"], wheels["index"],
                                    "--name", "smollm2-135m-instruct")  # fmt: skip
    assert code == 0, err
    root_path = out / "trust" / "root.json"
    bundle = out / "bundles" / "smollm2-135m-instruct-1.0.0.envex"
    card = ModelCard.model_validate_json(read_card(bundle, root_path, "envex-model.json"))
    assert (card.format, card.weights, card.architecture) == ("gguf", "SmolLM2-135M-Instruct.Q4_1.gguf",
                                                              "LlamaForCausalLM")  # fmt: skip
    assert (card.num_layers, card.num_kv_heads, card.head_dim, card.max_position_embeddings) == (30, 3, 64, 8192)
    assert card.quantization == "Q4_1" and card.parameters == 134_515_008  # the GGUF's tensors, counted
    assert card.smoke is not None and card.smoke.prompt == "What is the capital of France?"  # it has a chat template
    assert f"trust root fingerprint: {load_root(root_path).fingerprint}" in stdout


def _refused(capsys, tmp_path, wheels, keys, model: Path, *needles: str) -> None:
    out = tmp_path / "media"
    code, stdout, err = media_build(capsys, model, out, keys, wheels["envex"], wheels["index"])
    lines = err.splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), err
    for needle in needles:
        assert needle in lines[0], lines[0]
    assert not out.exists() and siblings(out) == [], "a refusal left something in --out"
    assert "Traceback" not in err and stdout == ""


def test_an_architecture_envex_does_not_serve_is_refused_naming_those_it_does(tmp_path, capsys, wheels, keys):
    model = write_tiny_hf(tmp_path / "m", arch="FalconForCausalLM")
    _refused(capsys, tmp_path, wheels, keys, model, "FalconForCausalLM", "LlamaForCausalLM", "Qwen3ForCausalLM",
             str(model))  # fmt: skip


def test_a_missing_shard_is_refused(tmp_path, capsys, wheels, keys):
    model = write_tiny_hf(tmp_path / "m")
    (model / "model-00002-of-00002.safetensors").unlink()
    _refused(capsys, tmp_path, wheels, keys, model, "model-00002-of-00002.safetensors", "missing",
             "copy every shard")  # fmt: skip


def test_a_shard_the_index_does_not_name_is_refused(tmp_path, capsys, wheels, keys):
    model = write_tiny_hf(tmp_path / "m")
    (model / "model-00003-of-00003.safetensors").write_bytes((model / "model-00001-of-00002.safetensors").read_bytes())
    _refused(capsys, tmp_path, wheels, keys, model, "model-00003-of-00003.safetensors", "not named by")


@pytest.mark.parametrize("tokenizer_vocab", [VOCAB + 50, 5000])
def test_a_tokenizer_of_another_vocabulary_is_refused(tmp_path, capsys, wheels, keys, tokenizer_vocab):
    model = write_tiny_hf(tmp_path / "m", vocab=VOCAB if tokenizer_vocab > VOCAB else 3000,
                          tokenizer_vocab=tokenizer_vocab if tokenizer_vocab > VOCAB else VOCAB)  # fmt: skip
    _refused(capsys, tmp_path, wheels, keys, model, "tokenizer.json", "vocab_size", "another model's")


def test_padding_of_the_vocabulary_is_accepted_and_symlinked_files_are_bundled(tmp_path, capsys, wheels, keys):
    model = write_tiny_hf(tmp_path / "m", vocab=VOCAB + 64)
    blob = tmp_path / "blobs" / "abc123"  # as an HF cache snapshot: each file a symlink to a blob
    blob.parent.mkdir()
    (model / "tokenizer.json").rename(blob)
    (model / "tokenizer.json").symlink_to(blob)
    code, _, err = media_build(capsys, model, tmp_path / "media", keys, wheels["envex"], wheels["index"])
    assert code == 0, err


def test_a_wheel_missing_for_the_target_is_named_in_one_line(tmp_path, capsys, wheels, keys):
    model = write_tiny_hf(tmp_path / "m")
    out = tmp_path / "media"
    code, _, err = media_build(capsys, model, out, keys, wheels["envex_missing"], wheels["index"])
    lines = err.splitlines()
    assert code == 2 and len(lines) == 1, err
    assert "no wheel of tinymissing==1.0 for python 3.12 on manylinux_2_28_x86_64" in lines[0], lines[0]
    assert not out.exists() and siblings(out) == []


def test_a_threshold_the_keys_cannot_reach_is_refused(tmp_path, capsys, wheels):
    from envex.bundles import make_root, sign_root

    folder = tmp_path / "keys"
    a, b = generate_key(), generate_key()
    write_key_files(a, folder, "a")
    root = sign_root(make_root(root_keys=[a.public_key()], bundle_keys=[a.public_key(), b.public_key()],
                               bundle_threshold=2, expires=__import__("datetime").datetime(2099, 1, 1,
                               tzinfo=__import__("datetime").UTC)), [a])  # fmt: skip
    (folder / "root.json").write_bytes(root.to_bytes())
    _refused(capsys, tmp_path, wheels, folder, write_tiny_hf(tmp_path / "m"), "needs 2 signatures", "1 of its keys")
    write_key_files(b, folder, "b")  # the second holder's key: now the threshold is met
    code, stdout, err = media_build(capsys, tmp_path / "m", tmp_path / "media", folder, wheels["envex"],
                                    wheels["index"])  # fmt: skip
    assert code == 0, err
    assert root.fingerprint in stdout
    bundle = next((tmp_path / "media" / "bundles").glob("m-*.envex"))
    assert len(verify_bundle(bundle, root=load_root(tmp_path / "media" / "trust" / "root.json")).signer_keyids) == 2


def test_force_replaces_and_without_it_nothing_is_touched(tmp_path, capsys, wheels, keys):
    model = write_tiny_hf(tmp_path / "m")
    out = tmp_path / "media"
    assert media_build(capsys, model, out, keys, wheels["envex"], wheels["index"])[0] == 0
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*")}
    code, stdout, err = media_build(capsys, model, out, keys, wheels["envex"], wheels["index"], "--version", "2.0.0")
    assert code == 2 and err.splitlines() == [f"error: --out {out}: already holds files; give --force to replace "
                                              "it, or another --out"]  # fmt: skip
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*")} == before
    code, stdout, err = media_build(capsys, model, out, keys, wheels["envex"], wheels["index"], "--version", "2.0.0",
                                    "--force")  # fmt: skip
    assert code == 0, err
    assert sorted(p.name for p in (out / "bundles").iterdir()) == ["envex-runtime-0.1.0.envex", "m-2.0.0.envex"]
    assert siblings(out) == []
    # A failure under --force keeps the old media whole.
    (model / "model-00001-of-00002.safetensors").unlink()
    listing = sorted(str(p) for p in out.rglob("*"))
    code, _, err = media_build(capsys, model, out, keys, wheels["envex"], wheels["index"], "--force")
    assert code == 2 and sorted(str(p) for p in out.rglob("*")) == listing and siblings(out) == []


@pytest.mark.parametrize("bad", ["/dev/null", "/proc/1/mem", "no/such/dir", "a\nb", "p" * 5000, "/"])
def test_bad_paths_fail_in_one_line(tmp_path, capsys, wheels, keys, bad, monkeypatch):
    model = write_tiny_hf(tmp_path / "m")
    monkeypatch.chdir(tmp_path)
    cases = [
        ["--model", bad, "--out", str(tmp_path / "o1"), "--keys", str(keys)],
        ["--model", str(model), "--out", str(tmp_path / "o2"), "--keys", bad],
        ["--model", str(model), "--out", str(tmp_path / "o3"), "--keys", str(keys), "--kernels", bad],
    ]
    if "\n" not in bad:  # a new folder named a<newline>b in the working directory is a fine --out
        cases.append(["--model", str(model), "--out", bad, "--keys", str(keys)])
    for argv in cases:
        code = commands.main(["media", "build", *argv, "--envex-wheel", str(wheels["envex"]), "--find-links",
                              str(wheels["index"]), "--no-index", "--no-references"])  # fmt: skip
        err = capsys.readouterr().err
        lines = err.splitlines()
        assert code != 0 and len(lines) == 1 and lines[0].startswith("error: ") and lines[0].isprintable(), err
    assert not any(p.name.startswith(("o1", "o2", "o3", ".o")) for p in tmp_path.iterdir())


def test_target_platforms_list_the_older_glibc_tags():
    tags = Target(platform="manylinux_2_28_x86_64").platforms()
    assert tags[0] == "manylinux_2_28_x86_64" and "manylinux_2_17_x86_64" in tags and "manylinux2014_x86_64" in tags
    assert Target(platform="win_amd64").platforms() == ["win_amd64"]


def test_kernel_bundles_given_are_added_and_signed(tmp_path, capsys, wheels, keys):
    from envex.bundles import build_bundle

    src = tmp_path / "ksrc"
    src.mkdir()
    (src / "envex-kernels.json").write_text("{}")
    kernels = build_bundle(src, kind="kernels", name="m-kernels", version="1.0.0", out=tmp_path, targets={
        "accelerators": ["sm_90"], "min_driver": "580", "python": ">=3.12,<3.13", "torch": "==2.11.0",
        "triton": "==3.6.0", "cuda": "==13.0", "kernel_sources": "0" * 64,
    }, requires=[{"name": "m", "kind": "model", "version": "==1.0.0"}])  # fmt: skip
    out = tmp_path / "media"
    code, _, err = media_build(capsys, write_tiny_hf(tmp_path / "m"), out, keys, wheels["envex"], wheels["index"],
                               "--kernels", str(kernels))  # fmt: skip
    assert code == 0, err
    root = load_root(out / "trust" / "root.json")
    assert verify_bundle(out / "bundles" / "m-kernels-1.0.0.envex", root=root).kind == "kernels"
    # A model bundle given as --kernels is refused before anything is built.
    model_bundle = out / "bundles" / "m-1.0.0.envex"
    code, _, err = media_build(capsys, tmp_path / "m", tmp_path / "other", keys, wheels["envex"], wheels["index"],
                               "--kernels", str(model_bundle))  # fmt: skip
    assert code == 2 and "a model bundle, not a kernels bundle" in err and not (tmp_path / "other").exists()


def _references_for(model: Path, digest: str | None = None) -> bytes:
    """A valid references file for `model`'s files (or for `digest`), answering nothing: enough to be bundled."""
    from envex.verify.references_file import SCHEMA, ReferencesFile, folder_digest, references_bytes

    return references_bytes(ReferencesFile.model_validate({
        "schema": SCHEMA, "model_digest": digest or folder_digest(model), "reference_policy": "cuda-float32-torch",
        "suites": ["quick"], "max_model_len": 2048, "created": "2026-12-06T00:00:00+00:00",
        "computed_on": {"device": "a bigger machine"}, "greedy": [], "logits": [],
    }))  # fmt: skip


def test_reference_answers_computed_elsewhere_are_signed_into_the_model_bundle(tmp_path, capsys, wheels, keys):
    from envex.verify.references_file import REFERENCES_FILE

    model = write_tiny_hf(tmp_path / "Tiny")
    (model / REFERENCES_FILE).write_text("a stale file beside the weights: never bundled, never written to")
    run = tmp_path / "RUN.json"
    run.write_bytes(_references_for(model))
    out = tmp_path / "media"
    code, stdout, err = media_build(capsys, model, out, keys, wheels["envex"], wheels["index"], "--reference-from",
                                    str(run))  # fmt: skip
    assert code == 0, err
    assert "reference answers for the quick suite (cuda-float32-torch)" in stdout
    bundle = out / "bundles" / "tiny-1.0.0.envex"
    assert read_card(bundle, out / "trust" / "root.json", REFERENCES_FILE) == run.read_bytes()
    assert (model / REFERENCES_FILE).read_text().startswith("a stale file")  # the source folder is untouched


def test_reference_answers_for_other_weights_are_refused_before_anything_is_signed(tmp_path, capsys, wheels, keys):
    model = write_tiny_hf(tmp_path / "Tiny")
    run = tmp_path / "RUN.json"
    run.write_bytes(_references_for(model, digest="0" * 64))
    out = tmp_path / "media"
    code, stdout, err = media_build(capsys, model, out, keys, wheels["envex"], wheels["index"], "--reference-from",
                                    str(run))  # fmt: skip
    lines = err.splitlines()
    assert code == 2 and len(lines) == 1 and "computed for other weights" in lines[0] and str(run) in lines[0], err
    assert not out.exists() and siblings(out) == [] and stdout == ""
    run.write_text("{not json")
    code, _, err = media_build(capsys, model, out, keys, wheels["envex"], wheels["index"], "--reference-from",
                               str(run))  # fmt: skip
    assert code == 2 and len(err.splitlines()) == 1 and "not JSON" in err and not out.exists(), err


def test_reference_answers_are_computed_here_by_default(tmp_path, capsys, wheels, keys):
    from envex.verify.references_file import REFERENCES_FILE, folder_digest, parse_references

    model = write_tiny_hf(tmp_path / "Tiny")  # HF fills the weights the files lack: answers of a random model
    (model / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": "{% for m in messages %}{{ m['content'] }} {% endfor %}w1", "eos_token": "w0"}))
    out = tmp_path / "media"
    code, stdout, err = media_build(capsys, model, out, keys, wheels["envex"], wheels["index"],
                                    "--reference-suite", "quick")  # fmt: skip
    assert code == 0, err
    data = read_card(out / "bundles" / "tiny-1.0.0.envex", out / "trust" / "root.json", REFERENCES_FILE)
    refs = parse_references(data, "bundled")
    assert refs.suites == ["quick"] and refs.reference_policy == "cpu-float32-torch"
    assert refs.model_digest == folder_digest(model) and refs.max_model_len == 2048  # the card's default window
    # Greedy answers with top-5 (reference equality) and without (needle, coding), and the texts' top logprobs. (A
    # word-level tokenizer of w0..w299 reads most prompts as the same few tokens: fewer distinct questions.)
    assert {a.top_k for a in refs.greedy} == {5, 0} and refs.logits and all(t.tokens for t in refs.logits)


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a host without a GPU")
def test_a_model_the_reference_cannot_run_here_says_how_to_go_on(tmp_path, capsys, wheels, keys):
    model = write_tiny_hf(tmp_path / "Tiny")
    out = tmp_path / "media"
    code, stdout, err = media_build(capsys, model, out, keys, wheels["envex"], wheels["index"],
                                    "--reference-device", "cuda")  # fmt: skip
    lines = err.splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: reference answers: "), err
    assert "--reference-from RUN.json" in lines[0] and "--no-references" in lines[0]
    assert not out.exists() and siblings(out) == []
    code, _, err = media_build(capsys, model, out, keys, wheels["envex"], wheels["index"], "--reference-suite", "huge")
    assert code == 2 and "--reference-suite huge: use quick or full" in err and not out.exists(), err


def test_envex_media_references_computes_answers_another_build_host_bundles(tmp_path, capsys, wheels, keys):
    from envex.verify.references_file import REFERENCES_FILE, folder_digest, parse_references

    model = write_tiny_hf(tmp_path / "Tiny")
    (model / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": "{% for m in messages %}{{ m['content'] }} {% endfor %}w1", "eos_token": "w0"}))
    run = tmp_path / "RUN.json"
    code = commands.main(["media", "references", "--model", str(model), "--out", str(run), "--max-model-len", "1024"])
    out, err = capsys.readouterr()
    assert code == 0, err
    refs = parse_references(run.read_bytes(), "RUN.json")
    assert refs.model_digest == folder_digest(model) and refs.max_model_len == 1024 and refs.suites == ["quick"]
    assert f"wrote {run}: {len(refs.greedy)} greedy answers" in out and "--reference-from" in out
    # An existing file is kept without --force; bad choices are one line each, and nothing is written.
    before = run.read_bytes()
    for argv, needle in (([], "exists; give --force"), (["--force", "--suite", "huge"], "use quick or full"),
                         (["--force", "--device", "tpu"], "--reference-device 'tpu': use cpu or cuda")):  # fmt: skip
        code = commands.main(["media", "references", "--model", str(model), "--out", str(run), *argv])
        lines = capsys.readouterr().err.splitlines()
        assert code == 2 and len(lines) == 1 and needle in lines[0], lines
        assert run.read_bytes() == before
    media = tmp_path / "media"
    code, stdout, err = media_build(capsys, model, media, keys, wheels["envex"], wheels["index"], "--reference-from",
                                    str(run))  # fmt: skip
    assert code == 0, err
    assert read_card(media / "bundles" / "tiny-1.0.0.envex", media / "trust" / "root.json", REFERENCES_FILE) == before
