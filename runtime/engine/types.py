"""The engine's public request and output types: what the server, the gates and the benchmark build on."""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_TOP_LOGPROBS = 20
# A temperature below this samples as greedy (argmax): dividing logits by a smaller one only sharpens the
# distribution past what float32 can tell from argmax, and near 1e-38 it overflows to inf (offline_docs/api.md).
GREEDY_TEMPERATURE = 1e-5


class EngineError(Exception):
    """Base class of the errors a request can meet inside the engine; the message is meant for people."""


class EngineInternalError(EngineError):
    """A step of the engine failed (a bug, or the device failed); the request cannot be answered (HTTP 500)."""


class QueueFullError(EngineError):
    """The engine's waiting queue is full; the caller should retry later (HTTP 429)."""


class PromptTooLongError(EngineError):
    """The prompt plus the requested output does not fit the model's context window (HTTP 400)."""

    def __init__(self, message: str, *, max_model_len: int) -> None:
        super().__init__(message)
        self.max_model_len = max_model_len


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """Per-request decoding settings. Validated here, so an invalid one cannot exist.

    temperature 0 (or any below GREEDY_TEMPERATURE) means greedy. top_k 0 means no top-k cut. logprobs None means
    none are returned; an integer n returns the chosen token's logprob and the n most likely alternatives at each
    generated position.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            err = ValueError(f"{name}: {why}")
            err.param = name  # type: ignore[attr-defined]
            return err

        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise bad("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if not 0.0 <= self.temperature <= 2.0:
            raise bad("temperature", f"must be between 0 and 2, got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if self.top_k < 0:
            raise bad("top_k", f"must be >= 0 (0 disables it), got {self.top_k!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise bad(name, f"must be between -2 and 2, got {value!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_TOP_LOGPROBS:
                raise bad(name, f"must be between 0 and {MAX_TOP_LOGPROBS}, got {value!r}")
        if any(not s for s in self.stop):
            raise bad("stop", "stop strings must not be empty")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE


@dataclass(frozen=True)
class TokenLogprob:
    """One position's chosen token with its logprob and the top alternatives (token id -> logprob)."""

    token_id: int
    logprob: float
    top: dict[int, float] = field(default_factory=dict)


@dataclass
class RequestOutput:
    """What one engine step produced for one request: the newly released text and tokens since the last output.

    `text` is only ever text that can no longer turn out to be part of a stop string. On the last output
    `finished` is True and `finish_reason` is "stop" (EOS, stop token or stop string), "length" (max_tokens or
    the context window), "abort" (cancelled) or "error" (this request's sampling failed; `error` says why, and
    the other requests in the batch go on).
    """

    request_id: str
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    finished: bool
    finish_reason: str | None
    prompt_token_count: int
    completion_token_count: int
    prompt_logprobs: list[TokenLogprob | None] | None = None
    stop_reason: str | int | None = None
    error: str | None = None  # set only with finish_reason "error": one line for people
