"""Bad requests get a clear 4xx in OpenAI's error shape, never a 5xx, and the server keeps serving afterwards."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from envex.runtime.engine import LLMEngine
from envex.runtime.server.app import build_app
from envex.runtime.server.async_engine import AsyncEngine
from envex.tests.support.server import serve_in_thread

API_KEY = "sk-test-errors"
MODEL = "smollm2-135m-instruct"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
CMPL = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def url(embedded_engine: LLMEngine) -> Iterator[str]:
    with serve_in_thread(build_app(AsyncEngine(embedded_engine), api_key=API_KEY)) as base:
        yield base
    assert not embedded_engine.has_unfinished()


@pytest.fixture(scope="module")
def http(url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=url, headers=AUTH, timeout=120) as client:
        yield client


def assert_openai_error(response: httpx.Response, status: int, param: str | None = None) -> str:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    message = body["error"]["message"]
    assert isinstance(message, str) and message and "\n" not in message
    if param is not None:
        assert body["error"]["param"] == param, body
    return message


BAD_COMPLETIONS: list[tuple[dict[str, Any], str]] = [
    ({"max_tokens": -1}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": "5"}, "max_tokens"),
    ({"max_tokens": 2.5}, "max_tokens"),
    ({"temperature": "hot"}, "temperature"),
    ({"temperature": 3}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"n": 1000}, "n"),
    ({"n": 0}, "n"),
    ({"n": True}, "n"),
    ({"logprobs": 50}, "logprobs"),
    ({"stop": [1]}, "stop"),
    ({"stop": [""]}, "stop"),
    ({"stop": ["a"] * 17}, "stop"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [[1], "a"]}, "prompt"),
    ({"prompt": [-1]}, "prompt"),
    ({"prompt": [10**9]}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": ["Hi"] * 17, "n": 4}, "prompt"),
    ({"echo": "yes"}, "echo"),
    ({"stream": 1}, "stream"),
    ({"seed": 2**70}, "seed"),
    ({"logit_bias": {"1": 5}}, "logit_bias"),
    ({"best_of": 3}, "best_of"),
    ({"suffix": "x"}, "suffix"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"stream": True, "stream_options": {"include_usage": True, "extra": 1}}, "stream_options.extra"),
    ({"frobnicate": 1}, "frobnicate"),
    ({"my-field": 1}, "my-field"),
    ({"max_tokens": 100_000}, "max_tokens"),  # more than the window whatever the prompt
]

BAD_CHATS: list[tuple[dict[str, Any], str]] = [
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": "x", "mood": "happy"}]}, "messages[0].mood"),
    ({"top_logprobs": 5}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"logprobs": 3}, "logprobs"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"reasoning": "high"}, "reasoning"),
    ({"max_tokens": -5}, "max_tokens"),
]


@pytest.mark.parametrize(("change", "param"), BAD_COMPLETIONS, ids=[p for _, p in BAD_COMPLETIONS])
def test_bad_completion_fields_are_400_naming_the_field(http: httpx.Client, change: dict, param: str) -> None:
    message = assert_openai_error(http.post("/v1/completions", json={**CMPL, **change}), 400, param)
    assert message.startswith(param.split("[")[0]) or "context length" in message


@pytest.mark.parametrize(("change", "param"), BAD_CHATS, ids=[p for _, p in BAD_CHATS])
def test_bad_chat_fields_are_400_naming_the_field(http: httpx.Client, change: dict, param: str) -> None:
    assert_openai_error(http.post("/v1/chat/completions", json={**CHAT, **change}), 400, param)


def test_missing_messages_and_prompt_are_named(http: httpx.Client) -> None:
    assert "required" in assert_openai_error(http.post("/v1/chat/completions", json={"model": MODEL}), 400,
                                             "messages")
    assert_openai_error(http.post("/v1/completions", json={"model": MODEL}), 400, "prompt")


def test_documented_openai_fields_we_ignore_are_accepted(http: httpx.Client) -> None:
    body = {**CHAT, "user": "u1", "store": False, "metadata": {"k": "v"}, "service_tier": "auto",
            "parallel_tool_calls": True, "response_format": {"type": "text"}, "tool_choice": "none"}
    assert http.post("/v1/chat/completions", json=body).status_code == 200
    assert http.post("/v1/completions", json={**CMPL, "user": "u1", "best_of": 1}).status_code == 200


def test_a_prompt_over_the_window_is_400_stating_it(http: httpx.Client) -> None:
    huge = "hello " * 150_000  # 900 KB: under the character limits (ServerLimits), far over the window
    message = assert_openai_error(http.post("/v1/completions", json={**CMPL, "prompt": huge}), 400, "prompt")
    assert "8192" in message
    message = assert_openai_error(http.post("/v1/chat/completions", json={
        **CHAT, "messages": [{"role": "user", "content": huge}]}), 400, "messages")
    assert "8192" in message
    assert http.post("/v1/chat/completions", json={**CHAT, "messages": [{"role": "user", "content": huge}]}
                     ).json()["error"]["code"] == "context_length_exceeded"


@pytest.mark.parametrize("body", [
    b'{"prompt": "\xff\xfe"}', b"\xff", b'{"prompt":', b"[1, 2]", b"", b"null", b'"text"',
    b'{"model": "m", "prompt": "hi", "temperature": NaN}', b'{"prompt": "hi", "max_tokens": Infinity}',
    b"[" * 100_000, b'{"max_tokens": 1' + b"0" * 5000 + b"}", b'{"prompt": "a\\ud800b", "messages": ["\\udfff"]}',
], ids=["bad-utf8-string", "bad-utf8", "truncated", "array", "empty", "null", "string", "nan", "infinity",
        "deep-nesting", "huge-int", "lone-surrogate"])
def test_unreadable_bodies_are_400(http: httpx.Client, body: bytes) -> None:
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
        assert_openai_error(http.post(path, content=body, headers={"Content-Type": "application/json"}), 400)


def test_a_body_over_the_limit_is_413(http: httpx.Client) -> None:
    body = json.dumps({**CMPL, "prompt": "x" * (5 * 1024 * 1024)})
    assert_openai_error(http.post("/v1/completions", content=body), 413)

    def chunks() -> Iterator[bytes]:  # no Content-Length: the limit is enforced while reading
        for _ in range(80):
            yield b"x" * 65536

    assert_openai_error(http.post("/v1/completions", content=chunks()), 413)


def test_unknown_model_is_404(http: httpx.Client, url: str) -> None:
    response = http.post("/v1/chat/completions", json={**CHAT, "model": "gpt-4o"})
    assert "gpt-4o" in assert_openai_error(response, 404, "model")
    assert response.json()["error"]["code"] == "model_not_found"
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x", max_tokens=1)


def test_api_key_is_required_on_the_api_but_not_health(url: str) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {API_KEY}"},
                    {"Authorization": "Bearer"}):
        for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
                             ("POST", "/tokenize"), ("POST", "/detokenize")):
            response = httpx.request(method, url + path, headers=headers, json=CMPL)
            assert_openai_error(response, 401)
            assert response.headers["www-authenticate"] == "Bearer"
    assert httpx.get(f"{url}/health").status_code == 200
    assert httpx.get(f"{url}/metrics").status_code == 200
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        client.models.list()


def test_unknown_routes_and_methods_are_openai_shaped(http: httpx.Client) -> None:
    assert_openai_error(http.get("/v1/engines"), 404)
    assert_openai_error(http.get("/v1/completions"), 405)


def test_tokenize_and_detokenize_reject_bad_input(http: httpx.Client) -> None:
    assert_openai_error(http.post("/tokenize", json={"prompt": 5}), 400, "prompt")
    assert_openai_error(http.post("/tokenize", json={"messages": []}), 400, "messages")
    assert_openai_error(http.post("/tokenize", json={"prompt": "x", "model": "other"}), 404, "model")
    assert_openai_error(http.post("/detokenize", json={"tokens": [-1]}), 400, "tokens")
    assert_openai_error(http.post("/detokenize", json={"tokens": "abc"}), 400, "tokens")


def test_the_official_client_sees_the_field(url: str) -> None:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=-1)
    assert info.value.body["param"] == "max_tokens"  # type: ignore[index]


# ---- fuzzing ---------------------------------------------------------------------------------------------------

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=8,
)
# Never a valid large max_tokens: a fuzz example must not generate for long on a 2-core machine.
MAX_TOKENS = (st.integers(-3, 2) | st.integers(10**5, 10**30) | st.text(max_size=3) | st.booleans()
              | st.floats(allow_nan=False, allow_infinity=False))
SAMPLING = ["n", "temperature", "top_p", "top_k", "seed", "stop", "presence_penalty", "frequency_penalty", "stream",
            "stream_options", "logit_bias", "user", "ignore_eos", "stop_token_ids", "bogus"]
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "x"]), "content": JSON})
COMPLETION_BODIES = st.fixed_dictionaries(
    {"model": st.just(MODEL) | JSON, "prompt": st.just("Hi") | JSON, "max_tokens": MAX_TOKENS},
    optional={name: JSON for name in [*SAMPLING, "echo", "logprobs", "best_of", "suffix"]},
)
CHAT_BODIES = st.fixed_dictionaries(
    {"model": st.just(MODEL), "messages": st.lists(MESSAGE, max_size=3) | JSON, "max_tokens": MAX_TOKENS},
    optional={**{name: JSON for name in [*SAMPLING, "logprobs", "top_logprobs", "tools", "response_format"]},
              "max_completion_tokens": MAX_TOKENS},
)
FUZZ = settings(max_examples=60, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def check_answer(response: httpx.Response) -> None:
    assert response.status_code < 500, response.text
    if response.status_code != 200:
        assert_openai_error(response, response.status_code)
    elif response.headers["content-type"].startswith("text/event-stream"):
        assert response.text.rstrip().endswith("data: [DONE]")
    else:
        assert response.json()["choices"]


@FUZZ
@given(body=COMPLETION_BODIES)
def test_fuzz_completion_bodies_never_5xx(http: httpx.Client, body: dict) -> None:
    check_answer(http.post("/v1/completions", json=body))


@FUZZ
@given(body=CHAT_BODIES)
def test_fuzz_chat_bodies_never_5xx(http: httpx.Client, body: dict) -> None:
    check_answer(http.post("/v1/chat/completions", json=body))


@settings(max_examples=30, deadline=None, derandomize=True)
@given(body=st.fixed_dictionaries({}, optional={"model": JSON, "prompt": JSON, "messages": JSON, "tokens": JSON,
                                                "add_special_tokens": JSON, "add_generation_prompt": JSON}),
       path=st.sampled_from(["/tokenize", "/detokenize"]))
def test_fuzz_tokenize_bodies_never_5xx(http: httpx.Client, body: dict, path: str) -> None:
    response = http.post(path, json=body)
    assert response.status_code < 500, response.text
    if response.status_code != 200:
        assert_openai_error(response, response.status_code)


@settings(max_examples=30, deadline=None, derandomize=True)
@given(body=st.binary(max_size=300), path=st.sampled_from(["/v1/completions", "/v1/chat/completions", "/tokenize"]))
def test_fuzz_raw_bytes_never_5xx(http: httpx.Client, body: bytes, path: str) -> None:
    check_answer(http.post(path, content=body))


def test_still_serving_after_all_that(url: str) -> None:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0)
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "What is the "
                                           "capital of France?"}], temperature=0, max_tokens=16)
    assert reply.choices[0].message.content == "The capital of France is Paris."
