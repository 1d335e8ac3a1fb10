"""What every route needs: the engine, the served model's name, the metrics, and the shared request steps."""

from __future__ import annotations

import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from starlette.requests import Request

from envex.runtime.engine import SamplingParams
from envex.runtime.server.async_engine import AsyncEngine
from envex.runtime.server.errors import APIError, bad_request
from envex.runtime.server.generation import sampling_error
from envex.runtime.server.limits import PrepPool, ServerLimits
from envex.runtime.server.metrics import Metrics
from envex.runtime.server.protocol import ChatMessage, Model, parse_request, read_body
from envex.runtime.tokenizer import ChatTemplateError, Tokenizer

T = TypeVar("T")
MIN_LOGPROB = -9999.0  # JSON has no -inf; vLLM clamps the same way


@dataclass
class ServerContext:
    async_engine: AsyncEngine
    served_model_name: str
    metrics: Metrics
    api_key: str | None = None
    limits: ServerLimits = field(default_factory=ServerLimits)
    pool: PrepPool = field(init=False, repr=False)
    _token_texts: dict[int, str] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self.pool = PrepPool(self.limits)

    @property
    def tokenizer(self) -> Tokenizer:
        return self.async_engine.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.async_engine.engine.max_model_len

    def check_api_key(self, request: Request) -> None:
        if self.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise APIError(401, "missing API key: send the header 'Authorization: Bearer <key>'",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        if not secrets.compare_digest(token.strip().encode(), self.api_key.encode()):
            raise APIError(401, "invalid API key: the key given is not this server's --api-key",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.served_model_name:
            raise APIError(404, f"model {name!r} does not exist; this server serves {self.served_model_name!r} "
                           "(see GET /v1/models)", param="model", code="model_not_found")

    async def prep(self, inline: bool, fn: Callable[..., T], *args: object) -> T:
        """Run CPU work for a request: on the loop when `inline` (small), else on the bounded prep pool."""
        return fn(*args) if inline else await self.pool.run(fn, *args)

    async def parse(self, request: Request, model: type[Model]) -> Model:
        """Read the body (413 past max_body_bytes), then decode, bound and validate it (400 naming the field)."""
        body = await read_body(request, self.limits.max_body_bytes)
        return await self.prep(len(body) <= self.limits.inline_bytes, parse_request, body, model, self.limits)

    async def encode(self, texts: list[str], *, add_special_tokens: bool) -> list[list[int]]:
        inline = sum(len(t) for t in texts) <= self.limits.inline_chars
        return await self.prep(inline, self.tokenizer.encode_batch, texts, add_special_tokens)

    async def decode(self, ids: list[list[int]]) -> list[str]:
        inline = sum(len(i) for i in ids) <= self.limits.inline_chars
        return await self.prep(inline, self.tokenizer.decode_batch, ids, False)

    async def encode_chat(self, messages: list[ChatMessage], *, add_generation_prompt: bool = True,
                          add_special_tokens: bool = False) -> list[int]:
        """Render the chat template (400 past max_rendered_chars) and tokenize the result."""
        templated = [m.for_template() for m in messages]

        def run() -> list[int]:
            try:
                text = self.tokenizer.apply_chat_template(templated, add_generation_prompt=add_generation_prompt)
            except ChatTemplateError as exc:
                raise bad_request(str(exc), param="messages") from None
            limit = self.limits.max_rendered_chars
            if len(text) > limit:
                raise bad_request(f"messages: the chat template renders them as {len(text):,} characters, more than "
                                  f"the limit of {limit:,}; send fewer or shorter messages", param="messages")
            return self.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0]

        chars = sum(len(m["content"]) for m in templated)
        return await self.prep(chars <= self.limits.inline_chars and len(messages) <= self.limits.inline_messages, run)

    def check_max_tokens(self, value: int | None, param: str) -> None:
        """A max_tokens the context window cannot hold whatever the prompt: 400 naming the field and the window."""
        if value is not None and value > self.max_model_len:
            raise bad_request(f"{param}: {value:,} is more than this model's context window of {self.max_model_len:,} "
                              "tokens (prompt and output together); lower it", param=param)

    def token_text(self, token_id: int) -> str:
        """A token's text decoded alone (for logprobs); cached, bounded by the vocabulary."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.tokenizer.id_to_token(token_id)
        return text


def sampling_params(req: Any, *, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None = None,
                    seed_offset: int = 0) -> SamplingParams:
    """The engine's settings for one choice of a parsed request (the fields both endpoints share)."""
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if req.temperature is None else float(req.temperature),
            top_p=1.0 if req.top_p is None else float(req.top_p),
            top_k=max(req.top_k or 0, 0),
            seed=None if req.seed is None else (req.seed + seed_offset) % 2**64,
            presence_penalty=float(req.presence_penalty or 0.0),
            frequency_penalty=float(req.frequency_penalty or 0.0),
            stop=tuple(req.stop or ()),
            stop_token_ids=tuple(req.stop_token_ids or ()),
            ignore_eos=bool(req.ignore_eos),
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
        )
    except ValueError as exc:
        raise sampling_error(exc) from None


def clamp(logprob: float) -> float:
    return logprob if logprob > MIN_LOGPROB else MIN_LOGPROB
