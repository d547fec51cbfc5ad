"""Every request fault gets its status and the OpenAI error shape, and none of them reaches the engine.

The server runs with an API key and a small body limit. "Never reaches the engine" is measured: the
count of finished engine requests (vllm:e2e_request_latency_seconds_count) does not move.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from server_fixture import MODEL, ServerProcess, running_server

KEY = "sk-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
BODY_LIMIT = 65536
USER = [{"role": "user", "content": "Hi"}]
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
LONG_PROMPT = "hello " * 2100  # over the 2048-token context window

# (path, body, status, param, code); body None means "not JSON at all".
BAD_REQUESTS: list[tuple[str, Any, int, str | None, str | None]] = [
    ("/v1/completions", None, 400, None, None),
    ("/v1/completions", {"model": MODEL}, 400, "prompt", None),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, 400, "temperature", None),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature", None),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p", None),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens", None),
    ("/v1/completions", {"prompt": "x", "logprobs": 50}, 400, "logprobs", None),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": [10**9]}, 400, "stop_token_ids", None),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"abc": 1}}, 400, "logit_bias", None),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"5": 500}}, 400, "logit_bias", None),
    ("/v1/completions", {"prompt": [10**9]}, 400, "prompt", None),
    ("/v1/completions", {"prompt": "x", "prompt_logprobs": 21}, 400, "prompt_logprobs", None),
    ("/v1/completions", {"prompt": "x", "n": 0}, 400, "n", None),
    ("/v1/completions", {"prompt": "x", "n": 129}, 400, "n", None),
    ("/v1/responses", {"input": "x", "n": 2}, 400, "n", "unsupported"),
    ("/v1/completions", {"prompt": "x", "best_of": 3}, 400, "best_of", "unsupported"),
    ("/v1/completions", {"prompt": "x", "suffix": "y"}, 400, "suffix", "unsupported"),
    ("/v1/completions", {"prompt": LONG_PROMPT}, 400, "prompt", "context_length_exceeded"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 5000}, 400, "max_tokens", "context_length_exceeded"),
    ("/v1/completions", {"model": "gpt-4", "prompt": "x"}, 404, "model", "model_not_found"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages", None),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "prompt_logprobs": 1, "stream": True},
        400,
        "prompt_logprobs",
        "unsupported",
    ),
    ("/v1/responses", {"input": "x", "prompt_logprobs": 1}, 400, "prompt_logprobs", "unsupported"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages", None),
    (
        "/v1/chat/completions",
        {"messages": USER, "max_completion_tokens": 5000},
        400,
        "max_completion_tokens",
        "context_length_exceeded",
    ),
    (
        "/v1/chat/completions",
        {"messages": USER, "response_format": {"type": "json_schema", "json_schema": {}}},
        400,
        "response_format",
        None,
    ),
    (
        "/v1/completions",
        {
            "prompt": "x",
            "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}},
        },
        400,
        "response_format",
        None,
    ),
    ("/v1/chat/completions", {"messages": USER, "tool_choice": "required"}, 400, "tool_choice", None),
    (
        "/v1/chat/completions",
        {"messages": USER, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "g"}}},
        400,
        "tool_choice",
        None,
    ),
    ("/v1/chat/completions", {"messages": USER, "top_logprobs": 2}, 400, "top_logprobs", None),
    (
        "/v1/chat/completions",
        {"messages": USER, "logprobs": True, "top_logprobs": 50},
        400,
        "top_logprobs",
        None,
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        400,
        "messages",
        None,
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "assistant", "content": "no user turn"}]},
        400,
        "messages",
        None,
    ),
    (
        "/v1/chat/completions",
        {"messages": USER, "chat_template_kwargs": {"messages": []}},
        400,
        "chat_template_kwargs",
        None,
    ),
    (
        "/v1/responses",
        {"input": "x", "text": {"format": {"type": "json_schema"}}},
        400,
        "text.format",
        None,
    ),
    ("/v1/responses", {"input": "x", "tools": [{"type": "web_search"}]}, 400, "tools", "unsupported"),
    (
        "/v1/responses",
        {"input": "x", "previous_response_id": "resp_missing"},
        400,
        "previous_response_id",
        "previous_response_not_found",
    ),
    (
        "/v1/responses",
        {"input": "x", "max_output_tokens": 5000},
        400,
        "max_output_tokens",
        "context_length_exceeded",
    ),
    ("/v1/responses", {"model": "nope", "input": "x"}, 404, "model", "model_not_found"),
]


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with running_server("--api-key", KEY, "--max-request-body-bytes", str(BODY_LIMIT)) as s:
        yield s


def _post(server: ServerProcess, path: str, body: Any, headers: dict[str, str] = AUTH) -> httpx.Response:
    if body is None:
        return httpx.post(
            f"{server.url}{path}",
            content=b'{"prompt": "x",',
            headers={**headers, "content-type": "application/json"},
        )
    return httpx.post(f"{server.url}{path}", json=body, headers=headers, timeout=60)


def _assert_error_shape(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


def _engine_requests(server: ServerProcess) -> float:
    return server.metric("vllm:e2e_request_latency_seconds_count")


@pytest.mark.parametrize(("path", "body", "status", "param", "code"), BAD_REQUESTS)
def test_bad_request_gets_status_param_and_code(
    server: ServerProcess, path: str, body: Any, status: int, param: str | None, code: str | None
) -> None:
    error = _assert_error_shape(_post(server, path, body), status)
    assert error["param"] == param
    assert error["code"] == code
    if code == "unsupported":
        assert "not supported" in error["message"]


def test_context_window_errors_state_the_numbers(server: ServerProcess) -> None:
    error = _assert_error_shape(_post(server, "/v1/completions", {"prompt": "x", "max_tokens": 5000}), 400)
    assert "5000" in error["message"] and "2048" in error["message"]
    count = httpx.post(f"{server.url}/tokenize", json={"prompt": LONG_PROMPT}).json()["count"]
    error = _assert_error_shape(_post(server, "/v1/completions", {"prompt": LONG_PROMPT}), 400)
    assert f"({count} tokens)" in error["message"] and "2048" in error["message"]


def test_malformed_json_names_the_problem(server: ServerProcess) -> None:
    error = _assert_error_shape(_post(server, "/v1/chat/completions", None), 400)
    assert "not valid JSON" in error["message"]


def test_missing_or_wrong_api_key_is_401_and_health_needs_none(server: ServerProcess) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        error = _assert_error_shape(_post(server, "/v1/completions", {"prompt": "x"}, headers), 401)
        assert error["type"] == "authentication_error"
    assert httpx.get(f"{server.url}/health").status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.base_url, api_key="wrong", max_retries=0).models.list()
    models = openai.OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0).models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_oversized_body_is_413_with_or_without_content_length(server: ServerProcess) -> None:
    big = {"prompt": "x" * (BODY_LIMIT + 10)}
    error = _assert_error_shape(_post(server, "/v1/completions", big), 413)
    assert str(BODY_LIMIT) in error["message"]

    def chunked() -> Iterator[bytes]:
        yield b'{"prompt": "'
        for _ in range(BODY_LIMIT // 1024 + 2):
            yield b"x" * 1024
        yield b'"}'

    response = httpx.post(
        f"{server.url}/v1/completions",
        content=chunked(),
        headers={**AUTH, "content-type": "application/json"},
    )
    _assert_error_shape(response, 413)


def test_unknown_route_is_404_in_the_error_shape(server: ServerProcess) -> None:
    error = _assert_error_shape(httpx.get(f"{server.url}/v1/nothing", headers=AUTH), 404)
    assert error["type"] == "not_found_error"


def test_burst_of_bad_requests_leaves_good_outputs_unchanged_and_never_reaches_the_engine(
    server: ServerProcess,
) -> None:
    good = [{"prompt": f"Good request {i}", "max_tokens": 8, "temperature": 0} for i in range(6)]
    alone = [_post(server, "/v1/completions", body).json()["choices"][0]["text"] for body in good]
    engine_before = _engine_requests(server)

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=60) as http:
            calls = []
            for i, body in enumerate(good):
                calls.append(http.post("/v1/completions", json=body))
                for path, bad, *_ in BAD_REQUESTS[i * 5 : i * 5 + 5]:
                    if bad is not None:
                        calls.append(http.post(path, json=bad))
            return await asyncio.gather(*calls)

    responses = asyncio.run(burst())
    goods = [r for r in responses if r.status_code == 200]
    assert len(goods) == len(good) and len(responses) > 2 * len(good)
    assert [r.json()["choices"][0]["text"] for r in goods] == alone
    assert _engine_requests(server) == engine_before + len(good)
