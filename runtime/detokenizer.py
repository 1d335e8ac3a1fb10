"""Incremental detokenization with stop strings that never leak.

Text is decoded over a sliding window of token ids (the prefix/read offsets vLLM uses), so each step costs a
few tokens, not the whole output, and multi-byte characters split across tokens are held until complete.
A stop string may straddle token boundaries: text that could still turn out to be the start of one is held
back until it cannot, and on a match the output is cut before the stop string.
"""

from __future__ import annotations

from collections.abc import Sequence

from envex.runtime.tokenizer import Tokenizer

_CONTEXT_TOKENS = 5  # prompt tokens decoded with the first outputs so leading spaces come out as in a full decode


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int], stop: Sequence[str]) -> None:
        self._tokenizer = tokenizer
        self._ids: list[int] = list(prompt_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._stop = tuple(stop)
        self.text = ""  # all output text decoded so far (cut at the stop string once one matched)
        self.emitted = 0  # characters of `text` already released to the caller
        self.stopped_on: str | None = None

    def add_token(self, token_id: int) -> None:
        """Decode one more output token (call for each token that is part of the text: not for EOS)."""
        if self.stopped_on is not None:
            return
        self._ids.append(token_id)
        decode = self._tokenizer.decode
        prefix = decode(self._ids[self._prefix_offset:self._read_offset])
        full = decode(self._ids[self._prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            start = len(self.text)
            self.text += full[len(prefix):]
            self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
            self._check_stop(start)

    def _check_stop(self, new_from: int) -> None:
        if not self._stop:
            return
        longest = max(len(s) for s in self._stop)
        search_from = max(self.emitted, new_from - longest + 1)
        best: tuple[int, str] | None = None
        for s in self._stop:
            i = self.text.find(s, search_from)
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        if best is not None:
            self.text = self.text[:best[0]]
            self.stopped_on = best[1]

    def _held_back(self) -> int:
        """Length of the longest suffix of the unreleased text that is a prefix of some stop string."""
        if self.stopped_on is not None or not self._stop:
            return 0
        tail = self.text[self.emitted:]
        for n in range(min(len(tail), max(len(s) for s in self._stop) - 1), 0, -1):
            suffix = tail[-n:]
            if any(s.startswith(suffix) for s in self._stop):
                return n
        return 0

    def release(self, *, final: bool) -> str:
        """The text that can be shown now; on the final call, everything that is left (no stop matched it)."""
        end = len(self.text) if final else len(self.text) - self._held_back()
        out = self.text[self.emitted:end]
        self.emitted = max(self.emitted, end)
        return out
