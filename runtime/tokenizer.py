"""Tokenizer and chat template: the Rust `tokenizers` object plus a Jinja environment set up as transformers'.

The chat template must render byte-identically to `transformers.apply_chat_template`, so the sandbox, filters
and globals below are the same ones transformers installs (tests compare the two).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from functools import cached_property
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The messages could not be rendered by the model's chat template (HTTP 400)."""


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes HTML characters; transformers' does not, and templates rely on that.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def compile_chat_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


class Tokenizer:
    """Encode, decode and render chats for one model. Built by `envex.runtime.loader`."""

    def __init__(self, backend: Any, config: dict[str, Any], *, eos_token_ids: Sequence[int] = ()) -> None:
        self._backend = backend
        self._config = config
        self.chat_template: str | None = config.get("chat_template") or None
        special = {}
        for key in ("bos_token", "eos_token", "unk_token", "pad_token"):
            value = config.get(key)
            if isinstance(value, dict):  # older tokenizer_config.json stores AddedToken dicts
                value = value.get("content")
            special[key] = value
        self.special_tokens: dict[str, str | None] = special
        ids = list(eos_token_ids)
        eos = special.get("eos_token")
        if eos is not None:
            eos_id = backend.token_to_id(eos)
            if eos_id is not None and eos_id not in ids:
                ids.append(eos_id)
        self.eos_token_ids: tuple[int, ...] = tuple(ids)
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)

    @cached_property
    def _template(self) -> jinja2.Template | None:
        return compile_chat_template(self.chat_template) if self.chat_template else None

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return list(self._backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return str(self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens))

    # The batch calls give the same ids and text as encode / decode, but the Rust tokenizer releases the GIL
    # while it works (its single calls do not): a server thread tokenizing a 4 MB prompt for 2 s then leaves
    # the event loop free.
    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = True) -> list[list[int]]:
        encodings = self._backend.encode_batch(list(texts), add_special_tokens=add_special_tokens)
        return [e.ids for e in encodings]  # each a new list

    def decode_batch(self, ids: Sequence[Sequence[int]], skip_special_tokens: bool = True) -> list[str]:
        return [str(t) for t in self._backend.decode_batch([list(i) for i in ids],
                                                           skip_special_tokens=skip_special_tokens)]

    def token_to_id(self, token: str) -> int | None:
        """The id of a token of the vocabulary (special tokens included), or None."""
        return self._backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str:
        """The text of one token as it would be decoded alone (for logprob entries)."""
        return self.decode([token_id], skip_special_tokens=False)

    def apply_chat_template(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
                            **kwargs: Any) -> str:
        if self._template is None:
            raise ChatTemplateError("this model has no chat template; use /v1/completions with a plain prompt")
        try:
            return self._template.render(
                messages=messages, add_generation_prompt=add_generation_prompt, **self.special_tokens, **kwargs
            )
        except jinja2.exceptions.TemplateError as exc:
            raise ChatTemplateError(f"messages: the model's chat template refused them: {exc}") from exc
