"""OpenAI's harmony response format (gpt-oss): reasoning and answer told apart in the model's output tokens.

A gpt-oss completion is a run of messages, each

    <|start|>{role}[ to={recipient}]<|channel|>{channel}[ <|constrain|>{type}]<|message|>{body}<|end|>

where the last one ends with <|return|> (the answer: an EOS token) or <|call|> (a tool call) instead of <|end|>.
The chat template's generation prompt ends with `<|start|>assistant`, so the output begins inside a header. The
`analysis` channel is the model's reasoning; `final` is the answer; `commentary` carries tool calls and their
preambles. Decoded with special tokens skipped, all of it runs together ("analysisWe need…assistantfinalHello"),
so the server parses the token ids: `analysis` bodies become `reasoning_content`, every other body `content`.
An output that never opens a message body (the model ignored the format) is content as decoded.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from envex.runtime.detokenizer import IncrementalDetokenizer
from envex.runtime.tokenizer import Tokenizer

REASONING_CHANNEL = "analysis"


@dataclass(frozen=True)
class HarmonyTokens:
    """The ids of harmony's special tokens in one tokenizer (o200k_harmony: 200006, 200005, 200008, ...)."""

    start: int
    channel: int
    message: int
    end: int
    returns: int
    call: int

    @classmethod
    def of(cls, tokenizer: Tokenizer) -> HarmonyTokens | None:
        """The tokenizer's harmony tokens, or None when it lacks any of them (not a harmony model)."""
        names = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>")
        ids = [tokenizer.token_to_id(n) for n in names]
        if any(i is None for i in ids):
            return None
        return cls(*ids)  # type: ignore[arg-type]


class HarmonyStream:
    """Splits one completion's token ids, fed as they arrive, into (reasoning, content) text deltas.

    Bodies are decoded incrementally (multi-byte characters held until complete) and `stop` strings are applied
    to each body as the engine applies them to its text: a body is cut before a stop string, whose prefix is held
    back until it cannot be one."""

    def __init__(self, tokenizer: Tokenizer, tokens: HarmonyTokens, stop: Sequence[str] = ()) -> None:
        self._tok = tokenizer
        self._t = tokens
        self._stop = tuple(stop)
        self._header: list[int] = []  # the open header's ids (the output starts inside one)
        self._body: IncrementalDetokenizer | None = None
        self._reasoning = False  # the open body's channel is analysis
        self._opened = False  # some message body was opened

    def _open(self) -> None:
        header = self._tok.decode(self._header, skip_special_tokens=False)
        _, marker, rest = header.partition("<|channel|>")
        channel = rest.split("<|")[0].split()[0] if marker and rest.strip() else ""
        self._reasoning = channel == REASONING_CHANNEL
        self._body = IncrementalDetokenizer(self._tok, [], self._stop)
        self._header = []
        self._opened = True

    def feed(self, token_ids: Iterable[int]) -> tuple[str, str]:
        reasoning: list[str] = []
        content: list[str] = []
        t = self._t
        for token in token_ids:
            body = self._body
            if body is not None:
                if token in (t.end, t.returns, t.call):
                    (reasoning if self._reasoning else content).append(body.release(final=True))
                    self._body = None
                else:
                    body.add_token(token)
                    (reasoning if self._reasoning else content).append(body.release(final=False))
            elif token == t.message:
                self._open()
            elif token == t.start:
                self._header = []
            else:
                self._header.append(token)
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """What is left at the end of the output: an unclosed body (max_tokens), or the whole output as content
        when it never opened a body."""
        if self._body is not None:
            text = self._body.release(final=True)
            self._body = None
            return (text, "") if self._reasoning else ("", text)
        if not self._opened and self._header:
            return "", self._tok.decode(self._header)
        return "", ""


def split_output(tokenizer: Tokenizer, tokens: HarmonyTokens, token_ids: Sequence[int],
                 stop: Sequence[str] = ()) -> tuple[str, str]:  # fmt: skip
    """A whole completion's (reasoning, content)."""
    stream = HarmonyStream(tokenizer, tokens, stop)
    r1, c1 = stream.feed(token_ids)
    r2, c2 = stream.finish()
    return r1 + r2, c1 + c2
