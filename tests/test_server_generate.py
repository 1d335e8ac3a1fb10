"""`envex generate`'s logic (run_generate) and the rule that the engine imports without the web stack."""

from __future__ import annotations

import io
import subprocess
import sys

from envex.runtime.engine import EngineConfig, LLMEngine
from envex.runtime.server.generate_cli import run_generate, stream_generate


def test_generate_streams_the_answer(embedded_engine: LLMEngine) -> None:
    out, err = io.StringIO(), io.StringIO()
    code = stream_generate(embedded_engine, "What is the capital of France?", max_tokens=24, temperature=0.0,
                           chat=True, out=out, err=err)
    assert (code, out.getvalue(), err.getvalue()) == (0, "The capital of France is Paris.\n", "")
    out = io.StringIO()
    assert stream_generate(embedded_engine, "The capital of France is", max_tokens=3, temperature=0.0, chat=False,
                           out=out, err=err) == 0
    assert len(embedded_engine.tokenizer.encode(out.getvalue().rstrip("\n"))) <= 3
    assert not embedded_engine.has_unfinished()


def test_generate_refuses_bad_input_with_one_line(embedded_engine: LLMEngine) -> None:
    err = io.StringIO()
    assert stream_generate(embedded_engine, "Hi", max_tokens=0, temperature=0.0, chat=True, out=io.StringIO(),
                           err=err) == 1
    assert err.getvalue().count("\n") == 1 and "max_tokens" in err.getvalue()
    err = io.StringIO()
    assert stream_generate(embedded_engine, "word " * 9000, max_tokens=4, temperature=0.0, chat=False,
                           out=io.StringIO(), err=err) == 1
    assert "8192" in err.getvalue()
    err = io.StringIO()
    assert run_generate(EngineConfig(model="/no/such/model.gguf"), "Hi", 4, 0.0, True, err=err) == 1
    assert err.getvalue().startswith("envex generate: model '/no/such/model.gguf'")


def test_engine_and_generate_import_without_the_web_stack() -> None:
    code = ("import sys\nfor name in ('fastapi', 'uvicorn', 'starlette', 'pydantic'):\n    sys.modules[name] = None\n"
            "import envex.runtime.engine, envex.runtime.server, envex.runtime.server.generate_cli\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
