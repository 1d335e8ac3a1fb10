"""Signed reference answers: the gates' reference results computed where a reference runs (the build host, or a
bigger machine), shipped in the model bundle as `envex-references.json` (signed with it), and replayed on an
appliance where the reference does not fit.

Recording drives the gates themselves with the reference in both seats (`ReferenceEngine` as the engine, a
`RecordingReference` as the reference), so every question a gate asks its reference is asked once and kept, with
no second list of the gates' prompts to drift from theirs: greedy answers with their top-k logprobs (reference
equality, needle cells, coding tasks) and, for the semantic gate, the top `TOP_LOGPROBS` logprobs of every position
of each corpus text. The stopping and batch-invariance gates judge the engine alone and need no answers.

On the appliance a `SignedReference` answers the same questions from the file. The semantic gate then measures the
KL divergence over the reference's top tokens plus the rest of the vocabulary as one outcome: a lower bound of the
full KL (they are equal where the top tokens hold all the mass); top-1 agreement is exact. A question the file has
no answer for (another suite, another max_model_len for the needle prompts) fails its gate with one line.

The file names the weights it answers for: `model_digest`, a sha256 over the model's own files (every file of the
model bundle but the `envex-*.json` ones, by path and sha256), which the installer checks against the bundle's
signed manifest before it runs a gate. The file's schema, parser and digest are verify/references_file.py.
"""

from __future__ import annotations

import datetime as dt
import platform
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from envex.runtime.engine import SamplingParams, TokenLogprob
from envex.runtime.engine.engine import Completion
from envex.runtime.loader import ModelSource
from envex.verify.reference import HFReference, RefGeneration
from envex.verify.references_file import (
    REFERENCE_CHOICES,
    SCHEMA,
    GreedyAnswer,
    PositionTops,
    ReferencesError,
    ReferencesFile,
    greedy_key,
    load_references,
    logits_key,
)

if TYPE_CHECKING:
    from envex.verify.gates import Suite

TOP_LOGPROBS = 32  # per position of a semantic text
# The gates that ask their reference anything (verify/gates.py runs the rest on the engine alone).
RECORDED_GATES = ("reference_equality", "needle_retrieval", "coding", "semantic_regression")

# ---- replay --------------------------------------------------------------------------------------------------------


class SignedReference:
    """The gates' reference answered from a references file (module docstring)."""

    origin = "signed"

    def __init__(self, refs: ReferencesFile, where: str) -> None:
        self.refs = refs
        self.where = where
        self._greedy = {a.key: a for a in refs.greedy}
        self._logits = {t.key: t for t in refs.logits}

    @property
    def policy_name(self) -> str:
        return f"signed-{self.refs.reference_policy}"

    def describe(self) -> dict[str, Any]:
        return {"origin": self.origin, "file": self.where, "reference_policy": self.refs.reference_policy,
                "suites": self.refs.suites, "max_model_len": self.refs.max_model_len, "created": self.refs.created,
                "model_digest": self.refs.model_digest}  # fmt: skip

    def greedy(self, prompt_ids: list[int], max_tokens: int, *, top_k: int = 5, ignore_eos: bool = False,
               stop: Sequence[str] = (), decode: Callable[[list[int]], str] | None = None) -> RefGeneration:
        key = greedy_key(prompt_ids, max_tokens, top_k, ignore_eos, tuple(stop) if decode is not None else ())
        answer = self._greedy.get(key)
        if answer is None:
            raise self._missing(f"a greedy answer to a {len(prompt_ids)}-token prompt (max_tokens {max_tokens})")
        return RefGeneration(list(answer.token_ids), [dict(step) for step in answer.top], answer.finish_reason)

    def top_logprobs(self, token_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The reference's top token ids [T, k] and their logprobs [T, k] at every position of `token_ids`."""
        tops = self._logits.get(logits_key(token_ids))
        if tops is None:
            raise self._missing(f"the logits of a {len(token_ids)}-token text")
        return (torch.tensor(tops.top_ids, dtype=torch.int64),
                torch.tensor(tops.top_logprobs, dtype=torch.float64))  # fmt: skip

    def _missing(self, what: str) -> ReferencesError:
        return ReferencesError(
            f"{self.where}: no signed answer for {what}; the file answers the {'/'.join(self.refs.suites)} suite at "
            f"max_model_len {self.refs.max_model_len}: gate with that suite and window, or compute the references "
            "for yours (`envex media references`)"
        )


# ---- recording -----------------------------------------------------------------------------------------------------


class RecordingReference:
    """A local reference that keeps every answer it gives, for a references file."""

    origin = "local"

    def __init__(self, inner: HFReference, *, top_logprobs: int = TOP_LOGPROBS) -> None:
        self.inner = inner
        self.top_logprobs_k = top_logprobs
        self.greedy_answers: dict[str, GreedyAnswer] = {}
        self.position_tops: dict[str, PositionTops] = {}

    @property
    def policy_name(self) -> str:
        return self.inner.policy_name

    def greedy(self, prompt_ids: list[int], max_tokens: int, *, top_k: int = 5, ignore_eos: bool = False,
               stop: Sequence[str] = (), decode: Callable[[list[int]], str] | None = None) -> RefGeneration:
        got = self.inner.greedy(prompt_ids, max_tokens, top_k=top_k, ignore_eos=ignore_eos, stop=stop, decode=decode)
        key = greedy_key(prompt_ids, max_tokens, top_k, ignore_eos, tuple(stop) if decode is not None else ())
        if key not in self.greedy_answers:
            self.greedy_answers[key] = GreedyAnswer(
                key=key, prompt_tokens=len(prompt_ids), max_tokens=max_tokens, top_k=top_k,
                token_ids=list(got.token_ids), top=[sorted(step.items(), key=lambda kv: -kv[1]) for step in got.top],
                finish_reason="stop" if got.finish_reason == "stop" else "length",
            )  # fmt: skip
        return got

    def full_logits(self, token_ids: list[int]) -> torch.Tensor:
        logits = self.inner.full_logits(token_ids)
        key = logits_key(token_ids)
        if key not in self.position_tops:
            k = min(self.top_logprobs_k, logits.shape[-1])
            values, ids = torch.log_softmax(logits.double(), dim=-1).topk(k, dim=-1)
            self.position_tops[key] = PositionTops(key=key, tokens=len(token_ids), top_ids=ids.tolist(),
                                                   top_logprobs=values.tolist())  # fmt: skip
        return logits


class ReferenceEngine:
    """The reference in the engine's seat (verify.types.GateEngine's generate and full_logits), so the gates can be
    run on the reference alone to record what they ask it."""

    runner = None  # NumericPolicy.of: the reference's own float32 CPU policy

    def __init__(self, reference: HFReference, tokenizer: Any, max_model_len: int) -> None:
        self.reference = reference
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.source = reference.source

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        out = []
        for i, ids in enumerate(prompts):
            decode = self.tokenizer.decode if params.stop else None
            got = self.reference.greedy(ids, params.max_tokens, top_k=params.logprobs or 0, stop=params.stop,
                                        decode=decode)  # fmt: skip
            logprobs = [TokenLogprob(tok, top.get(tok, 0.0), top) for tok, top in zip(got.token_ids, got.top,
                                                                                       strict=False)]  # fmt: skip
            out.append(Completion(str(i), list(ids), self.tokenizer.decode(got.token_ids), list(got.token_ids),
                                  got.finish_reason, logprobs if params.logprobs else None))  # fmt: skip
        return out

    def full_logits(self, token_ids: list[int]) -> torch.Tensor:
        return self.reference.full_logits(token_ids)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        raise NotImplementedError("the recorded gates never step an engine")

    def step(self) -> list[Any]:
        raise NotImplementedError("the recorded gates never step an engine")


def record_references(source: ModelSource, *, suites: Iterable[str | Suite], max_model_len: int, digest: str,
                      device: str = "cpu", dtype: str = "float32",
                      progress: Callable[[str], None] | None = None) -> ReferencesFile:  # fmt: skip
    """Run the gates that ask a reference (RECORDED_GATES) of each suite on the reference itself and keep its
    answers. The reference is HF transformers on `device` in `dtype` (float32: what "the same answers" means)."""
    import transformers

    from envex.runtime.loader import load_model_info
    from envex.verify.gates import run_gates

    suites = list(dict.fromkeys(suites))
    names = [s if isinstance(s, str) else s.name for s in suites]
    # The caller shows its own progress: transformers' load report and bars would break its lines.
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    if progress:
        progress("loading the reference")
    tokenizer = load_model_info(str(source.path)).tokenizer
    inner = HFReference(source, device=device, dtype=dtype, eos_token_ids=tokenizer.eos_token_ids)
    recorder = RecordingReference(inner)
    engine = ReferenceEngine(inner, tokenizer, max_model_len)
    for suite, name in zip(suites, names, strict=True):
        report = run_gates(engine, reference=recorder, suite=suite, gates=RECORDED_GATES,  # type: ignore[arg-type]
                           progress=(lambda gate, s=name: progress(f"{s} suite: {gate}")) if progress else None)
        for gate in report.gates:  # a gate that could not run asked nothing: its answers would be missing
            if "error" in gate.evidence:
                raise ReferencesError(f"the {name} suite's {gate.name} gate could not ask the reference: "
                                      f"{gate.evidence['error']}")  # fmt: skip

    return ReferencesFile.model_validate({
        "schema": SCHEMA, "model_digest": digest, "reference_policy": inner.policy_name, "suites": names,
        "max_model_len": max_model_len, "created": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "computed_on": {"torch": torch.__version__, "transformers": transformers.__version__,
                        "machine": platform.machine(),
                        "device": torch.cuda.get_device_name(0) if inner.device.type == "cuda" else "cpu"},
        "greedy": [a.model_dump() for a in recorder.greedy_answers.values()],
        "logits": [t.model_dump() for t in recorder.position_tops.values()],
    })  # fmt: skip


# ---- choosing ------------------------------------------------------------------------------------------------------

# The local reference's weights in float32, times this: its activations, cache and allocator slack.
REFERENCE_OVERHEAD = 1.25


def choose_reference(engine: Any, choice: str, references: Path | None,
                     need_bytes: int | None) -> tuple[SignedReference | None, dict[str, Any]]:  # fmt: skip
    """The gates' reference beside `engine`, and what it is and why (for the report): `local` is HF transformers in
    float32 on the engine's device, returned as None (verify.gates.run_gates loads it where a gate needs it);
    `signed` the answers in `references`; `auto` the local one where `need_bytes` (its float32 weights) fits in
    the memory left on that device, else the signed ones, else the local one anyway (it may not load: the gate
    report then says why). ReferencesError in one line when the signed answers are wanted and unusable."""
    from envex.verify.types import NumericPolicy

    if choice not in REFERENCE_CHOICES:
        raise ReferencesError(f"reference: {choice!r} is not auto, local or signed")
    device = NumericPolicy.of(engine).device
    need = int(need_bytes * REFERENCE_OVERHEAD) if need_bytes is not None else None
    free = free_memory(device) if need is not None else None
    fits = need is None or free is None or need <= free
    room = (f"the float32 reference needs {need / 2**30:.2f} GiB and {free / 2**30:.2f} GiB is free on {device}"
            if need is not None and free is not None else "its size was not given")  # fmt: skip
    if choice == "signed" or (choice == "auto" and not fits and references is not None):
        if references is None:
            raise ReferencesError("reference: signed answers were asked for, but the model bundle has none "
                                  "(envex-references.json); build the media with `envex media build`")  # fmt: skip
        signed = SignedReference(load_references(references), str(references))
        why = "asked for (--reference signed)" if choice == "signed" else f"the local reference does not fit: {room}"
        return signed, {**signed.describe(), "why": why}
    why = "asked for (--reference local)" if choice == "local" else (
        f"it fits: {room}" if fits else f"no signed answers to fall back on, though {room}")  # fmt: skip
    return None, {"origin": "local", "reference_policy": f"{device}-float32-torch", "why": why}


def free_memory(device: str) -> int:
    """Bytes free for the reference: on a GPU what the engine left (torch's view), on a CPU the available RAM."""
    if device == "cuda":
        return int(torch.cuda.mem_get_info()[0])
    import psutil

    return int(psutil.virtual_memory().available)
