"""The signed references file, `envex-references.json`: its schema, parser and the model digest that ties it to one
set of weights (verify/signed_reference.py records and replays it). No torch and no engine here: the installer
plans with it (size, digest, the --reference choices) before it runs anything, and its commands start in a second.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from envex.bundles.files import one_line

SCHEMA = "envex-references/1"
REFERENCES_FILE = "envex-references.json"
MAX_BYTES = 512 * 1024 * 1024
# What the gates judge a release against (envex-install --reference; choose_reference says how each is picked).
REFERENCE_CHOICES = ("auto", "local", "signed")


class ReferencesError(ValueError):
    """A references file that cannot be used: unreadable, malformed, for other weights, or missing an answer."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class GreedyAnswer(_Strict):
    key: str = Field(pattern=r"^[0-9a-f]{64}$")
    prompt_tokens: int = Field(ge=1)
    max_tokens: int = Field(ge=1)
    top_k: int = Field(ge=0, le=64)
    token_ids: list[int] = Field(max_length=1 << 16)
    top: list[list[tuple[int, float]]]  # per step: (token id, logprob) pairs
    finish_reason: Literal["stop", "length"]


class PositionTops(_Strict):
    key: str = Field(pattern=r"^[0-9a-f]{64}$")
    tokens: int = Field(ge=1)
    top_ids: list[list[int]]  # [tokens][k], most likely first
    top_logprobs: list[list[float]]


class ReferencesFile(_Strict):
    schema_: Literal["envex-references/1"] = Field(alias="schema")
    model_digest: str = Field(pattern=r"^[0-9a-f]{64}$")
    reference_policy: str = Field(min_length=1, max_length=64)  # how they were computed, e.g. cpu-float32-torch
    suites: list[str] = Field(min_length=1)
    max_model_len: int = Field(ge=2)  # the window the needle prompts were cut for
    created: str
    computed_on: dict[str, str | None]
    greedy: list[GreedyAnswer]
    logits: list[PositionTops]


def greedy_key(prompt_ids: Sequence[int], max_tokens: int, top_k: int, ignore_eos: bool, stop: Sequence[str]) -> str:
    """What identifies one greedy question (HFReference's memo key, hashed)."""
    payload = json.dumps([list(prompt_ids), max_tokens, top_k, ignore_eos, list(stop)], separators=(",", ":"))
    return hashlib.sha256(payload.encode()).hexdigest()


def logits_key(token_ids: Sequence[int]) -> str:
    return hashlib.sha256(json.dumps(list(token_ids), separators=(",", ":")).encode()).hexdigest()


def is_own_file(path: str) -> bool:
    """Envex's files beside the model's in a model bundle (its card, these references): not the model's."""
    return "/" not in path and path.startswith("envex-") and path.endswith(".json")


def model_digest(files: Mapping[str, str]) -> str:
    """sha256 over the model's own files, given as payload path -> sha256 hex (Envex's own files left out)."""
    lines = sorted(f"{sha}  {path}\n" for path, sha in files.items() if not is_own_file(path))
    return hashlib.sha256("".join(lines).encode()).hexdigest()


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def folder_digest(model: Path) -> str:
    """model_digest of a model as a build host holds it: a .gguf file (its payload is that file), or an HF folder
    (its top-level files, as the media build stages them)."""
    files = [model] if model.is_file() else sorted(p for p in model.iterdir() if p.is_file())
    return model_digest({p.name: file_sha256(p.resolve()) for p in files})


def parse_references(data: bytes, where: str) -> ReferencesFile:
    """A references file's bytes -> ReferencesFile, or ReferencesError in one line naming `where`."""
    if len(data) > MAX_BYTES:
        raise ReferencesError(f"{where}: {len(data)} bytes, more than {MAX_BYTES}; not a references file")
    try:
        raw = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ReferencesError(f"{where}: not JSON ({exc}); compute it again with `envex media references`") from None
    if not isinstance(raw, dict) or raw.get("schema") != SCHEMA:
        found = raw.get("schema") if isinstance(raw, dict) else type(raw).__name__
        raise ReferencesError(f"{where}: schema {found!r}, expected {SCHEMA!r}; compute it with `envex media "
                              "references` of this Envex")  # fmt: skip
    try:
        refs = ReferencesFile.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = one_line(".".join(str(p) for p in first["loc"]))  # a key of the file's own may hold a newline
        raise ReferencesError(f"{where}: field {field}: {first['msg']}; compute it again with `envex media "
                              "references`") from None  # fmt: skip
    for answer in refs.greedy:
        if answer.top_k and len(answer.top) != len(answer.token_ids):
            raise ReferencesError(f"{where}: answer {answer.key[:12]} has {len(answer.top)} top-k steps for "
                                  f"{len(answer.token_ids)} tokens; compute it again")  # fmt: skip
    for tops in refs.logits:
        rows = (len(tops.top_ids), len(tops.top_logprobs))
        if rows != (tops.tokens, tops.tokens) or any(len(a) != len(b) or not a for a, b in
                                                     zip(tops.top_ids, tops.top_logprobs, strict=True)):  # fmt: skip
            raise ReferencesError(f"{where}: logits {tops.key[:12]} do not hold one top list per token; compute "
                                  "it again")  # fmt: skip
    return refs


def load_references(path: Path, *, digest: str | None = None) -> ReferencesFile:
    """Read and check a references file; with `digest`, it must answer for those weights."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ReferencesError(f"{path}: cannot read it ({exc.strerror or exc})") from None
    refs = parse_references(data, str(path))
    check_digest(refs, digest, str(path))
    return refs


def check_digest(refs: ReferencesFile, digest: str | None, where: str) -> None:
    if digest is not None and refs.model_digest != digest:
        raise ReferencesError(
            f"{where}: computed for other weights (model digest {refs.model_digest[:12]}, these files' "
            f"{digest[:12]}); compute the references from these files (`envex media references --model ...`)"
        )


def references_bytes(refs: ReferencesFile) -> bytes:
    return (refs.model_dump_json(by_alias=True) + "\n").encode()
