"""Benchmark workloads: fixed prompt/output lengths and a mixed chat-like set, built as byte-identical prompts.

Every request of a run gets its own prompt (a distinct leading line), so no engine can answer from a prefix cache
what another must compute; the same (repeat, request) gets the same bytes on every engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from envex.verify.bench_engines import BenchRequest
from envex.verify.data import chat_prompts, code_edit_tasks, needle_data


@dataclass(frozen=True, kw_only=True)
class Workload:
    name: str
    prompt_tokens: int  # 0 for the mixed chat workload (its prompts are the chat prompts)
    output_tokens: int
    num_requests: int
    concurrency: int
    # Where prompts come from when prompt_tokens is 0: "chat" (verify/data_prompts.json, little repetition) or
    # "code-edit" (verify/data_code_edit.json: a file to hand back with one small edit; the answer repeats it).
    source: str = "chat"

    def __post_init__(self) -> None:
        if self.output_tokens < 1 or self.num_requests < 1 or not 1 <= self.concurrency <= 256:
            raise ValueError(f"workload {self.name!r}: need output_tokens >= 1, num_requests >= 1 and "
                             f"concurrency in 1..256, got {self.output_tokens}, {self.num_requests}, "
                             f"{self.concurrency}")
        if self.source not in ("chat", "code-edit"):
            raise ValueError(f"workload {self.name!r}: source {self.source!r} is not one of chat, code-edit")

    @property
    def mixed(self) -> bool:
        return self.prompt_tokens == 0


# Named workloads; "cpu-small" is what the installer's CPU check and CI run.
WORKLOADS: dict[str, Workload] = {
    "cpu-small": Workload(name="cpu-small", prompt_tokens=64, output_tokens=16, num_requests=1, concurrency=1),
    "1k-256": Workload(name="1k-256", prompt_tokens=1024, output_tokens=256, num_requests=16, concurrency=1),
    "10k-512": Workload(name="10k-512", prompt_tokens=10240, output_tokens=512, num_requests=8, concurrency=1),
    "chat": Workload(name="chat", prompt_tokens=0, output_tokens=256, num_requests=32, concurrency=8),
    # Speculative decoding's pair, single stream: code edits (the answer copies the prompt's file)
    # and chat (little repetition: drafts rarely match).
    "code-edit": Workload(name="code-edit", prompt_tokens=0, output_tokens=1024, num_requests=16, concurrency=1,
                          source="code-edit"),
    "chat-1": Workload(name="chat-1", prompt_tokens=0, output_tokens=256, num_requests=16, concurrency=1),
}
_CHAT_OUTPUT_LENGTHS = (32, 64, 128, 256, 96, 48)


def named_workload(name: str, *, concurrency: int | None = None, num_requests: int | None = None,
             prompt_tokens: int | None = None, output_tokens: int | None = None) -> Workload:
    """A named workload, optionally with its sizes overridden (e.g. the same 1k-256 at concurrency 64)."""
    if name not in WORKLOADS:
        raise ValueError(f"workload: {name!r} is not one of {', '.join(WORKLOADS)}")
    w = WORKLOADS[name]
    c = concurrency or w.concurrency
    return Workload(name=name if concurrency is None else f"{name}@c{c}",
                    prompt_tokens=w.prompt_tokens if prompt_tokens is None else prompt_tokens,
                    output_tokens=output_tokens or w.output_tokens,
                    num_requests=num_requests or max(w.num_requests, c), concurrency=c, source=w.source)


_BODY_CACHE: dict[tuple[int, int], list[str]] = {}


def _body_words(tokenizer: Any, n_tokens: int) -> list[str]:
    """Filler words that encode to at least n_tokens + 16 tokens (cached: long prompts are built once)."""
    key = (id(tokenizer), n_tokens)
    if key not in _BODY_CACHE:
        filler = needle_data().filler
        words: list[str] = []
        i = 0
        while len(tokenizer.encode(" ".join(words), add_special_tokens=False)) < n_tokens + 16:
            for _ in range(max(1, (n_tokens + 16) // 16)):
                words.extend(filler[i % len(filler)].split(" "))
                i += 1
        _BODY_CACHE[key] = words
    return _BODY_CACHE[key]


def exact_prompt(tokenizer: Any, n_tokens: int, head: str) -> tuple[str, list[int]]:
    """A text that encodes to exactly `n_tokens` tokens, starting with `head`."""
    if n_tokens < 8:
        raise ValueError(f"prompt_tokens: need at least 8, got {n_tokens}")

    def encode(ws: list[str]) -> list[int]:
        return tokenizer.encode(" ".join(ws), add_special_tokens=False)

    words = head.split(" ") + _body_words(tokenizer, n_tokens)
    # Drop whole words in big steps while far too long, then one by one, then pad with single-token words.
    while len(words) > 1 and (excess := len(encode(words)) - n_tokens) > 0:
        del words[len(words) - max(1, excess // 2):]
    for _ in range(n_tokens):
        ids = encode(words)
        if len(ids) == n_tokens:
            return " ".join(words), ids
        words.append("the")
    raise ValueError(f"prompt_tokens: could not build a prompt of exactly {n_tokens} tokens with this tokenizer")


def build_requests(tokenizer: Any, w: Workload, *, repeat: int | str) -> list[BenchRequest]:
    """The requests of one run of `w` (the repeat index makes each run's prompts distinct)."""
    out = []
    edits = code_edit_tasks() if w.source == "code-edit" else []
    chats = [t.prompt for t in edits] or chat_prompts()
    for i in range(w.num_requests):
        head = f"Request {repeat}-{i}."
        if w.mixed:
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": f"{head} {chats[i % len(chats)]}"}], add_generation_prompt=True)
            if edits:  # the answer opens the code block: the model hands the file back
                text += edits[i % len(edits)].answer_prefix
            ids = tokenizer.encode(text, add_special_tokens=False)
            n_out = w.output_tokens if w.source == "code-edit" else min(
                w.output_tokens, _CHAT_OUTPUT_LENGTHS[i % len(_CHAT_OUTPUT_LENGTHS)])
        else:
            text, ids = exact_prompt(tokenizer, w.prompt_tokens, head)
            n_out = w.output_tokens
        out.append(BenchRequest(prompt_ids=list(ids), prompt_text=text, max_tokens=n_out))
    return out
