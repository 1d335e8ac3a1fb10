"""OpenAI request bodies as strict pydantic models, and the parser that turns any bad body into a 400 naming the field.

Models reject unknown fields and coercions (strict): "5" is not an integer, 1 is not a boolean. Documented OpenAI
fields we do not act on (`user`, `store`, `metadata`, `service_tier`, `parallel_tool_calls`) are accepted and
ignored; fields whose meaning we cannot honour (`logit_bias`, `tools`, `suffix`, ...) are accepted only when they
ask for nothing, so a request is never silently answered differently from what it asked.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from envex.runtime.engine.types import MAX_TOP_LOGPROBS
from envex.runtime.server.errors import APIError, bad_request

if TYPE_CHECKING:
    from envex.runtime.server.limits import ServerLimits

MAX_N = 16
MAX_CHOICES = 64  # prompts x n in one completions request
MAX_STOP = 16
_INT64 = 2**63
_SEED_MIN, _SEED_MAX = -_INT64, 2**64 - 1  # torch accepts seeds in [-2**63, 2**64)

Model = TypeVar("Model", bound=BaseModel)
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool | None = False


def _unsupported(name: str, what: str = "is not supported by this server") -> ValueError:
    """For model-level checks: the message starts with the field's name, which becomes the error's param."""
    return ValueError(f"{name}: {what}; remove it")


class _SamplingRequest(_Strict):
    """The fields /v1/completions and /v1/chat/completions share."""

    model: str | None = None  # optional as in vLLM: the served model when absent
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int | None = Field(1, ge=1, le=MAX_N)
    seed: int | None = Field(None, ge=_SEED_MIN, le=_SEED_MAX)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    stop: Any = None  # a string, a list of strings, or null
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None  # accepted, ignored
    # Extensions (vLLM's names).
    top_k: int | None = Field(None, ge=-1)  # 0 or -1: no top-k cut
    ignore_eos: bool | None = False
    stop_token_ids: list[int] | None = None

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, value: Any) -> list[str]:
        if value is None:
            return []
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
            raise ValueError("must be a string, a list of strings, or null")
        stops: list[str] = value
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop strings are allowed, got {len(stops)}")
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        return stops

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, value: dict[str, float] | None) -> None:
        if value:
            raise ValueError("is not supported by this server; remove it")
        return None

    @model_validator(mode="after")
    def _check_stream_options(self) -> _SamplingRequest:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed when stream is true")
        return self

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


def _prompt_list(value: Any) -> list[str] | list[list[int]]:
    """OpenAI's four prompt forms -> a list of strings or a list of token-id lists."""

    def is_ids(x: Any) -> bool:
        return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)

    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value:
        if all(isinstance(p, str) for p in value):
            return list(value)
        if is_ids(value):
            return [list(value)]
        if all(is_ids(p) and p for p in value):
            return [list(p) for p in value]
    raise ValueError(
        "must be a string, a non-empty list of strings, a non-empty list of token ids, or a list of non-empty "
        "token-id lists"
    )


class CompletionRequest(_SamplingRequest):
    prompt: Any
    max_tokens: int | None = Field(16, ge=1)
    echo: bool | None = False
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    best_of: int | None = None
    suffix: str | None = None
    add_special_tokens: bool | None = True  # extension: add the tokenizer's special tokens to string prompts

    @field_validator("prompt")
    @classmethod
    def _check_prompt(cls, value: Any) -> list[str] | list[list[int]]:
        return _prompt_list(value)

    @field_validator("suffix")
    @classmethod
    def _check_suffix(cls, value: str | None) -> None:
        if value:
            raise ValueError("is not supported by this server; remove it")
        return None

    @model_validator(mode="after")
    def _check_best_of(self) -> CompletionRequest:
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise ValueError("best_of: only best_of equal to n (or absent) is supported")
        return self


def _non_empty(messages: list[ChatMessage]) -> list[ChatMessage]:
    if not messages:
        raise ValueError("must contain at least one message")
    return messages


Role = Literal["system", "developer", "user", "assistant", "tool"]


class ChatMessage(_Strict):
    role: Role
    content: Any = None
    name: str | None = None
    refusal: str | None = None  # accepted on assistant messages sent back, ignored
    # An assistant message's reasoning sent back (gpt-oss answers carry it): given to the chat template as
    # `reasoning_content` and as `thinking` (the names templates read; gpt-oss's drops it from later turns).
    reasoning_content: str | None = None
    tool_calls: list[Any] | None = None
    tool_call_id: str | None = None

    @field_validator("content")
    @classmethod
    def _check_content(cls, value: Any) -> str:
        """A string, null, or OpenAI's list of text parts (joined with newlines, as vLLM does)."""
        if value is None:
            return ""
        if isinstance(value, str):
            return value
        if isinstance(value, list):
            texts = []
            for part in value:
                if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                    raise ValueError('only text content parts {"type": "text", "text": "..."} are supported')
                if set(part) - {"type", "text"}:
                    raise ValueError(f"unknown keys in a content part: {sorted(set(part) - {'type', 'text'})}")
                texts.append(part["text"])
            return "\n".join(texts)
        raise ValueError("must be a string, null, or a list of text content parts")

    @model_validator(mode="after")
    def _check_tools(self) -> ChatMessage:
        if self.tool_calls or self.role == "tool":
            raise ValueError("tool calls are not supported by this server; send plain text messages")
        return self

    def for_template(self) -> dict[str, Any]:
        # "developer" is OpenAI's newer name for the system role; chat templates only know "system".
        message: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role,
                                   "content": self.content}
        if self.name is not None:
            message["name"] = self.name
        if self.reasoning_content is not None:
            message["reasoning_content"] = message["thinking"] = self.reasoning_content
        return message


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    # Documented OpenAI fields: accepted and ignored.
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    parallel_tool_calls: bool | None = None
    modalities: list[Literal["text"]] | None = None
    # Documented OpenAI fields accepted only when they ask for nothing we cannot do.
    response_format: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    audio: Any = None
    prediction: Any = None
    # Extension (vLLM's name).
    add_generation_prompt: bool | None = True

    @field_validator("messages")
    @classmethod
    def _check_messages(cls, value: list[ChatMessage]) -> list[ChatMessage]:
        return _non_empty(value)

    @model_validator(mode="after")
    def _check_unsupported(self) -> ChatCompletionRequest:
        if self.response_format not in (None, {"type": "text"}):
            raise _unsupported("response_format", 'only {"type": "text"} is supported')
        if self.tools or self.functions:
            raise _unsupported("tools", "tools and functions are not supported by this server")
        if self.tool_choice not in (None, "none") or self.function_call not in (None, "none"):
            raise _unsupported("tool_choice", 'only "none" is supported for tool_choice and function_call')
        if self.audio is not None or self.prediction is not None:
            raise _unsupported("audio", "audio and prediction are not supported by this server")
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs: requires logprobs to be true")
        return self

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class TokenizeCompletionRequest(_Strict):
    model: str | None = None
    prompt: str
    add_special_tokens: bool | None = True


class TokenizeChatRequest(_Strict):
    model: str | None = None
    messages: list[ChatMessage]
    add_generation_prompt: bool | None = True
    add_special_tokens: bool | None = False

    @field_validator("messages")
    @classmethod
    def _check_messages(cls, value: list[ChatMessage]) -> list[ChatMessage]:
        return _non_empty(value)


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]


# ---- parsing -------------------------------------------------------------------------------------------------


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not valid JSON")


def _param(loc: tuple[int | str, ...], *, keep_all: bool = False) -> str:
    """pydantic's error location -> a field path such as messages[0].content (union member tags dropped unless
    keep_all: an unknown field's name is whatever the client sent)."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif keep_all or (part.isidentifier() and part not in {"str", "int", "float", "bool", "list", "dict", "none"}):
            out += f".{part}" if out else part
        else:
            break  # a union member tag such as "list[str]" or "function-after[...]": the path ends here
    return out


def _message(err: Mapping[str, Any], param: str) -> str:
    kind = err.get("type", "")
    if kind == "extra_forbidden":
        return f"{param}: unknown field; remove it (the accepted fields are listed in offline_docs/api.md)"
    if kind == "missing":
        return f"{param}: this field is required"
    msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
    shown = repr(err.get("input"))
    if len(shown) > 60:
        shown = shown[:57] + "..."
    return f"{param}: {msg} (got {shown})" if kind != "value_error" else f"{param}: {msg}"


def validate(model: type[Model], data: Any) -> Model:
    """Build `model` from decoded JSON, or raise a 400 naming the first bad field."""
    if not isinstance(data, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        err = exc.errors(include_url=False)[0]
        param = _param(tuple(err.get("loc", ())), keep_all=err.get("type") == "extra_forbidden")
        if not param and err.get("type") == "value_error":
            # A model-level check: its message starts with the field it is about ("stream_options: ...").
            msg = str(err.get("msg", "")).removeprefix("Value error, ")
            head = msg.split(":", 1)[0]
            raise bad_request(msg, param=head if head.isidentifier() else None) from None
        param = param or "body"
        raise bad_request(_message(err, param), param=param) from None


async def read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"request body is {int(declared)} bytes; the limit is {limit} bytes",
                       code="request_too_large")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"request body is over the limit of {limit} bytes", code="request_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


def decode_json(body: bytes) -> Any:
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise bad_request(f"the request body is not valid UTF-8 (byte {exc.start}); send UTF-8 JSON") from None
    if not text.strip():
        raise bad_request("the request body is empty; send a JSON object")
    try:
        data = json.loads(text, parse_constant=_reject_constant)
        # "\ud800" decodes to a str that no tokenizer or encoder accepts (the byte test first: the regex over a
        # 4 MB body holds the interpreter lock for milliseconds, and most bodies have no escape at all).
        if b"\\u" in body and _SURROGATE_ESCAPE.search(text):
            json.dumps(data, ensure_ascii=False).encode("utf-8")
        return data
    except UnicodeEncodeError:
        raise bad_request("the request body has an unpaired UTF-16 surrogate escape (such as \\ud800) in a string; "
                          "send valid Unicode") from None
    except json.JSONDecodeError as exc:
        raise bad_request(f"the request body is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}"
                          ) from None
    except (ValueError, RecursionError) as exc:  # NaN/Infinity, over-long integers, absurd nesting
        raise bad_request(f"the request body is not valid JSON: {exc}") from None


def _text_chars(content: Any) -> int:
    """Characters of a message's content as the template will see it (a string, or text parts joined)."""
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        texts = [p.get("text") for p in content if isinstance(p, dict)]
        return sum(len(t) for t in texts if isinstance(t, str)) + max(len(content) - 1, 0)
    return 0


def check_limits(data: Any, limits: ServerLimits) -> None:
    """Refuse a decoded body that would cost more than `limits` allow, before validation does any of that work
    (pydantic on 50,000 messages holds the GIL for 0.2 s). Only sizes are checked here; types are validate's."""
    if not isinstance(data, dict):
        return

    def over(param: str, what: str, size: int, limit: int, fix: str) -> APIError:
        return bad_request(f"{param}: {size:,} {what} is more than the limit of {limit:,}; {fix}", param=param)

    messages = data.get("messages")
    if isinstance(messages, list):
        if len(messages) > limits.max_messages:
            raise over("messages", "messages", len(messages), limits.max_messages,
                       "send fewer messages (drop or summarise the oldest)")
        for i, message in enumerate(messages):
            size = _text_chars(message.get("content")) if isinstance(message, dict) else 0
            if size > limits.max_message_chars:
                raise over(f"messages[{i}].content", "characters", size, limits.max_message_chars,
                           "shorten the message")
    prompt = data.get("prompt")
    items = prompt if isinstance(prompt, list) else [prompt]
    chars = sum(len(p) for p in items if isinstance(p, str))
    if chars > limits.max_prompt_chars:
        raise over("prompt", "characters", chars, limits.max_prompt_chars, "shorten the prompt or split the request")
    # A list of token ids, or a list of token-id lists (a list of strings counts 0 here).
    ids = sum(len(p) if isinstance(p, list) else isinstance(p, int) for p in items)
    if ids > limits.max_token_ids:
        raise over("prompt", "token ids", ids, limits.max_token_ids, "shorten the prompt or split the request")
    for name, limit in (("tokens", limits.max_token_ids), ("stop_token_ids", limits.max_stop_token_ids)):
        value = data.get(name)
        if isinstance(value, list) and len(value) > limit:
            raise over(name, "entries", len(value), limit, "send fewer")


def parse_request(body: bytes, model: type[Model], limits: ServerLimits) -> Model:
    """Decode, bound and validate a body: CPU work, run inline for small bodies and on the prep pool otherwise."""
    data = decode_json(body)
    check_limits(data, limits)
    return validate(model, data)


def parse_tokenize(body: bytes, limits: ServerLimits) -> TokenizeChatRequest | TokenizeCompletionRequest:
    """/tokenize takes either shape: with `messages` it is the chat form."""
    data = decode_json(body)
    check_limits(data, limits)
    if isinstance(data, dict) and "messages" in data:
        return validate(TokenizeChatRequest, data)
    return validate(TokenizeCompletionRequest, data)
