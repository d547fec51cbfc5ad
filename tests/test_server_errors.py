"""Every request fault gets its status and the OpenAI error shape, and none of them reaches the engine.

The server runs with an API key and a small body limit. "Never reaches the engine" is measured: the
count of finished engine requests (vllm:e2e_request_latency_seconds_count) does not move.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from server_fixture import MODEL, ServerProcess, running_server

# Asserts wall-clock bounds: `make test` runs it alone, after the tests it runs side by side.
pytestmark = pytest.mark.serial

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
    # Lone UTF-16 surrogates are not text, wherever they are.
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a\ud800"}]}, 400, "messages", None),
    ("/v1/completions", {"prompt": "\udc00"}, 400, "prompt", None),
    ("/v1/completions", {"prompt": ["ok", "\ud800"]}, 400, "prompt", None),
    ("/v1/completions", {"prompt": "x", "stop": ["\ud800"]}, 400, "stop", None),
    (
        "/v1/chat/completions",
        {"messages": USER, "tools": [{"type": "function", "function": {"name": "f\ud800"}}]},
        400,
        "tools",
        None,
    ),
    ("/v1/responses", {"input": "\ud800"}, 400, "input", None),
    ("/v1/responses", {"input": [{"role": "user", "content": "\ud800"}]}, 400, "input", None),
    ("/tokenize", {"prompt": "\ud800"}, 400, "prompt", None),
    # Integers the engine message cannot carry (int64).
    ("/v1/completions", {"prompt": "x", "top_k": 2**64}, 400, "top_k", None),
    ("/v1/completions", {"prompt": "x", "min_tokens": 2**64}, 400, "min_tokens", None),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": [2**64]}, 400, "stop_token_ids", None),
    ("/v1/completions", {"prompt": "x", "seed": 2**64}, 400, "seed", None),
    # Values nested too deeply to parse.
    (
        "/v1/chat/completions",
        {
            "messages": [
                *USER,
                {
                    "role": "assistant",
                    "tool_calls": [
                        {"id": "c", "function": {"name": "f", "arguments": "[" * 10000 + "]" * 10000}}
                    ],
                },
            ]
        },
        400,
        "messages",
        None,
    ),
    # Strict types: no coercion.
    ("/v1/completions", {"prompt": "x", "max_tokens": "10"}, 400, "max_tokens", None),
    ("/v1/completions", {"prompt": "x", "max_tokens": True}, 400, "max_tokens", None),
    ("/v1/completions", {"prompt": "x", "n": "2"}, 400, "n", None),
    ("/v1/completions", {"prompt": "x", "stream": "yes"}, 400, "stream", None),
    ("/v1/completions", {"prompt": "x", "logprobs": "yes"}, 400, "logprobs", None),
    ("/v1/chat/completions", {"messages": USER, "logprobs": "yes"}, 400, "logprobs", None),
    ("/v1/completions", {"prompt": [True]}, 400, "prompt", None),
    ("/v1/completions", {"prompt": "x", "temperature": True}, 400, "temperature", None),
    ("/detokenize", {"tokens": [True]}, 400, "tokens", None),
    (
        "/v1/chat/completions",
        {"messages": [*USER, {"role": "assistant", "tool_calls": [{"id": "c", "function": "x"}]}]},
        400,
        "messages",
        None,
    ),
    (
        "/v1/chat/completions",
        {"messages": [*USER, {"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f"}}]}]},
        400,
        "messages",
        None,
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
        400,
        "messages",
        None,
    ),
    # One request may not fan out past --max-choices-per-request.
    (
        "/v1/completions",
        {"prompt": ["hi"] * 129, "n": 128, "max_tokens": 1},
        400,
        "prompt",
        "too_many_choices",
    ),
    # Fail-closed structured output: schemas the grammar would not enforce are refused by keyword.
    *[
        (
            "/v1/chat/completions",
            {"messages": USER, "response_format": {"type": "json_schema", "json_schema": {"schema": schema}}},
            400,
            "response_format",
            None,
        )
        for schema in (
            {"not": {}},
            {"type": []},
            {"allOf": [{"type": "string"}, {"type": "integer"}]},
            {"$ref": "https://example.com/schema.json"},
            {"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}},
        )
    ],
    (
        "/v1/responses",
        {"input": "x", "text": {"format": {"type": "json_schema", "schema": {"not": {}}}}},
        400,
        "text.format",
        None,
    ),
    # Errors of the Responses API name its field, input.
    ("/v1/responses", {"input": LONG_PROMPT}, 400, "input", "context_length_exceeded"),
    ("/v1/responses", {"input": [{"role": "assistant", "content": "no user turn"}]}, 400, "input", None),
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
    # json.dumps escapes non-ASCII, so a lone surrogate travels as the escape "\ud800", as clients send it.
    return httpx.post(
        f"{server.url}{path}",
        content=json.dumps(body).encode(),
        headers={**headers, "content-type": "application/json"},
        timeout=60,
    )


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
    count = _post(server, "/tokenize", {"prompt": LONG_PROMPT}).json()["count"]
    error = _assert_error_shape(_post(server, "/v1/completions", {"prompt": LONG_PROMPT}), 400)
    assert f"({count} tokens)" in error["message"] and "2048" in error["message"]


@pytest.mark.parametrize(
    ("schema", "says"),
    [
        ({"not": {}}, "schema: the keyword 'not' is not supported"),
        ({"type": []}, "schema: 'type' must be a type name or a non-empty list of them"),
        ({"allOf": [{"type": "string"}, {"type": "integer"}]}, "'allOf' with more than one subschema is not"),
        (
            {"$ref": "https://example.com/s.json"},
            "schema: '$ref' 'https://example.com/s.json' is not supported",
        ),
        ({"properties": {"a": {"not": {"type": "string"}}}}, "schema.properties.a: the keyword 'not' is not"),
    ],
)
def test_unenforceable_schema_is_refused_naming_the_keyword(
    server: ServerProcess, schema: Any, says: str
) -> None:
    body = {"messages": USER, "response_format": {"type": "json_schema", "json_schema": {"schema": schema}}}
    error = _assert_error_shape(_post(server, "/v1/chat/completions", body), 400)
    assert says in error["message"]


def test_schema_compiler_errors_show_no_source_paths(server: ServerProcess) -> None:
    body = {
        "prompt": "x",
        "response_format": {"type": "json_schema", "json_schema": {"schema": {"enum": []}}},
    }
    error = _assert_error_shape(_post(server, "/v1/completions", body), 400)
    assert "enum" in error["message"]
    assert ".cc:" not in error["message"] and "/" not in error["message"].replace("/tokenize", "")


def test_deep_schema_is_refused_with_its_depth(server: ServerProcess) -> None:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(100):
        schema = {"type": "array", "items": schema}
    body = {"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {"schema": schema}}}
    error = _assert_error_shape(_post(server, "/v1/completions", body), 400)
    assert (
        error["param"] == "response_format" and "101 levels" in error["message"] and "64" in error["message"]
    )


def test_strict_type_errors_name_the_field_expected_and_found(server: ServerProcess) -> None:
    error = _assert_error_shape(_post(server, "/v1/completions", {"prompt": "x", "max_tokens": "10"}), 400)
    assert error["message"] == "max_tokens: Input should be a valid integer (got '10')"
    body = {"messages": [{"role": "user", "content": [{"type": "text"}]}]}
    error = _assert_error_shape(_post(server, "/v1/chat/completions", body), 400)
    assert error["message"].startswith("messages[0].content[0]: a content part of type 'text' needs")


def test_lone_surrogate_error_names_where_it_is(server: ServerProcess) -> None:
    body = {"messages": [{"role": "user", "content": "ok"}, {"role": "user", "content": "bad \ud800"}]}
    error = _assert_error_shape(_post(server, "/v1/chat/completions", body), 400)
    assert error["message"].startswith("messages[1].content holds a lone UTF-16 surrogate")


def test_fanout_error_names_the_limit_and_its_flag(server: ServerProcess) -> None:
    body = {"prompt": ["hi"] * 129, "n": 128, "max_tokens": 1}
    error = _assert_error_shape(_post(server, "/v1/completions", body), 400)
    assert "16512 choices" in error["message"] and "--max-choices-per-request" in error["message"]


def test_malformed_json_names_the_problem(server: ServerProcess) -> None:
    error = _assert_error_shape(_post(server, "/v1/chat/completions", None), 400)
    assert "not valid JSON" in error["message"]


def test_missing_or_wrong_api_key_is_401_and_health_needs_none(server: ServerProcess) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        error = _assert_error_shape(_post(server, "/v1/completions", {"prompt": "x"}, headers), 401)
        assert error["type"] == "authentication_error"
    for path in ("/tokenize", "/detokenize"):
        _assert_error_shape(_post(server, path, {"prompt": "x"}, {}), 401)
    for path in ("/load", "/v1/models", "/openapi.json", "/docs"):
        _assert_error_shape(httpx.get(f"{server.url}{path}"), 401)
    for path in ("/health", "/version", "/metrics"):
        assert httpx.get(f"{server.url}{path}").status_code == 200, path
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


def test_body_shorter_than_its_content_length_times_out_with_408() -> None:
    with running_server("--body-read-timeout-s", "1") as server:
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as conn:
            started = time.monotonic()
            conn.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: 100\r\n\r\n" + b'{"prompt": "x"'
            )
            reply = conn.recv(65536).decode()
            waited = time.monotonic() - started
            head, _, body = reply.partition("\r\n\r\n")
            length = int(head.lower().split("content-length: ")[1].split("\r\n")[0])
            while len(body.encode()) < length:
                body += conn.recv(65536).decode()
        assert reply.startswith("HTTP/1.1 408"), reply
        assert "--body-read-timeout-s" in json.loads(body)["error"]["message"] and 0.9 < waited < 5


def test_openapi_documents_400_and_the_error_schema_never_422(server: ServerProcess) -> None:
    doc = httpx.get(f"{server.url}/openapi.json", headers=AUTH).json()
    assert "422" not in json.dumps(doc["paths"]) and "HTTPValidationError" not in json.dumps(doc)
    completions = doc["paths"]["/v1/completions"]["post"]["responses"]
    assert {"200", "400", "401", "404", "413", "503"} <= set(completions)
    schema = completions["400"]["content"]["application/json"]["schema"]
    assert schema == {"$ref": "#/components/schemas/ErrorResponse"}
    assert set(doc["components"]["schemas"]["ErrorBody"]["properties"]) == {
        "message",
        "type",
        "param",
        "code",
    }
    assert "401" not in doc["paths"]["/health"]["get"]["responses"]


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
