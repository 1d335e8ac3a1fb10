"""One request's state inside the engine."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from envex.runtime.detokenizer import IncrementalDetokenizer
from envex.runtime.engine.types import SamplingParams, TokenLogprob

if TYPE_CHECKING:
    from envex.runtime.engine.spec.depth import SpecState


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer | None
    arrival: float = field(default_factory=time.monotonic)
    status: Status = Status.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    # Tokens whose K/V are in the cache; on preemption this goes back to 0 and they are recomputed.
    num_computed_tokens: int = 0
    num_cached_prefix_tokens: int = 0  # of the prompt, found in the prefix cache at admission
    block_table: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    # Output bookkeeping: how many tokens / logprobs were already handed to the caller.
    num_emitted_tokens: int = 0
    # Overlapped scheduling: tokens sampled on the device whose values the host has not read yet. They count in
    # num_tokens (the scheduler plans the next step around them) but join output_token_ids only when read.
    num_pending_tokens: int = 0
    pending_row: int = -1  # the newest pending token's row in the in-flight step's sampled-token tensor
    # Speculative decoding: its device row, acceptance and depth (spec/depth.py, SpecState); None until considered.
    spec: SpecState | None = None

    @property
    def all_token_ids(self) -> list[int]:
        """The tokens the host knows (prompt and read outputs; pending ones excluded)."""
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_known_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return self.num_known_tokens + self.num_pending_tokens

    @property
    def awaits_final_token(self) -> bool:
        """A pending token is this sequence's last by max_tokens: there is nothing more to schedule for it."""
        n = self.num_pending_tokens
        return n > 0 and len(self.output_token_ids) + n >= self.params.max_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED
