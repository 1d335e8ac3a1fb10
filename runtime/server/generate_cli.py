"""`envex generate`: one prompt through the LLMEngine directly (no server), tokens printed as they come."""

from __future__ import annotations

import sys
from typing import TextIO

from envex.runtime.engine import EngineConfig, EngineError, LLMEngine, SamplingParams
from envex.runtime.tokenizer import ChatTemplateError


def stream_generate(engine: LLMEngine, prompt: str, *, max_tokens: int, temperature: float, chat: bool,
                    out: TextIO, err: TextIO) -> int:
    """Generate on an idle engine, writing text to `out` as it is released; the exit code (0 ok, 1 refused)."""
    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature)
        if chat:
            text = engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
            ids = engine.tokenizer.encode(text, add_special_tokens=False)
        else:
            ids = engine.tokenizer.encode(prompt)
        request_id = "generate-0"
        engine.add_request(request_id, ids, params)
    except (ValueError, EngineError, ChatTemplateError) as exc:
        print(f"envex generate: {exc}", file=err)
        return 1
    try:
        while engine.has_unfinished():
            for output in engine.step():
                if output.text:
                    out.write(output.text)
                    out.flush()
    except KeyboardInterrupt:
        engine.abort_request(request_id)
        out.write("\n")
        print("envex generate: interrupted", file=err)
        return 130
    out.write("\n")
    out.flush()
    return 0


def run_generate(config: EngineConfig, prompt: str, max_tokens: int, temperature: float, chat: bool, *,
                 out: TextIO | None = None, err: TextIO | None = None) -> int:
    """Load the model in `config` and stream one completion of `prompt` (chat: through its chat template)."""
    err = err or sys.stderr
    try:
        engine = LLMEngine(config)
    except (ValueError, OSError) as exc:  # ModelNotFoundError and ConfigError are ValueErrors
        print(f"envex generate: {exc}", file=err)
        return 1
    return stream_generate(engine, prompt, max_tokens=max_tokens, temperature=temperature, chat=chat,
                           out=out or sys.stdout, err=err)
