"""/v1/chat/completions through the official openai client against the real server subprocess.

The embedded model has random weights, so its text is noise; what is specified here is the shape:
where reasoning and content go, tool calls forced by tool_choice, usage, logprobs, the template path.
A named tool_choice plus a logit bias towards `</tool_call>` makes the model close the forced call at
once, which gives a complete call to round-trip without a trained model.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from server_fixture import MODEL, ServerProcess, running_server, token_counts

USER = [{"role": "user", "content": "What is the weather in Paris?"}]
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"],
            },
        },
    }
]
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with running_server() as s:
        yield s


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0)


def _prompt_tokens(server: ServerProcess, messages: list[Any], **extra: Any) -> int:
    return httpx.post(f"{server.url}/tokenize", json={"messages": messages, **extra}).json()["count"]


def test_thinking_on_by_default_puts_the_output_in_reasoning_content(
    server: ServerProcess, client: openai.OpenAI
) -> None:
    out = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=6, temperature=0)  # type: ignore[arg-type]
    message = out.choices[0].message
    assert message.role == "assistant" and message.content is None
    assert message.reasoning_content  # type: ignore[attr-defined]
    assert out.usage is not None and out.usage.prompt_tokens == _prompt_tokens(server, USER)
    assert (
        out.usage.completion_tokens <= 6
        and out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    )


def test_enable_thinking_false_gives_content_and_no_reasoning(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model=MODEL, messages=USER, max_tokens=6, temperature=0, extra_body=NO_THINKING
    )  # type: ignore[arg-type]
    message = out.choices[0].message
    assert message.content and getattr(message, "reasoning_content", None) is None


def test_streaming_matches_non_streaming_and_sends_one_usage_chunk(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = dict(model=MODEL, messages=USER, max_completion_tokens=8, temperature=0)
    whole = client.chat.completions.create(**kwargs)
    chunks = list(
        client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    usage = [c.usage for c in chunks if c.usage is not None]
    assert [token_counts(u) for u in usage] == [token_counts(whole.usage)] and chunks[-1].choices == []
    reasoning = "".join(
        getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks if c.choices
    )
    assert reasoning == whole.choices[0].message.reasoning_content  # type: ignore[attr-defined]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason


def test_n_choices_stream_by_index_and_equal_the_non_streamed_ones(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = dict(
        model=MODEL,
        messages=USER,
        max_completion_tokens=6,
        temperature=1.0,
        seed=9,
        n=3,
        extra_body={"ignore_eos": True},
    )
    whole = client.chat.completions.create(**kwargs)
    assert [c.index for c in whole.choices] == [0, 1, 2]
    assert whole.usage is not None and whole.usage.completion_tokens == 18
    chunks = list(
        client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    )
    streamed = ["", "", ""]
    for c in chunks:
        for choice in c.choices:
            streamed[choice.index] += getattr(choice.delta, "reasoning_content", None) or ""
            streamed[choice.index] += choice.delta.content or ""
    assert streamed == [
        (getattr(c.message, "reasoning_content", None) or "") + (c.message.content or "")
        for c in whole.choices
    ]
    assert len(set(streamed)) > 1
    assert [token_counts(c.usage) for c in chunks if c.usage is not None] == [token_counts(whole.usage)]


def test_json_schema_response_format_constrains_the_answer(client: openai.OpenAI) -> None:
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    out = client.chat.completions.create(
        model=MODEL,
        messages=USER,
        max_completion_tokens=30,
        temperature=1.0,
        seed=2,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}},
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    assert isinstance(json.loads(out.choices[0].message.content or "")["ok"], bool)
    assert out.choices[0].finish_reason == "stop"


PINGS: list[Any] = [
    {"type": "function", "function": {"name": name, "parameters": {"type": "object", "properties": {}}}}
    for name in ("ping", "pong")
]


def test_forced_tool_calls_are_grammar_constrained(client: openai.OpenAI) -> None:
    """Random weights, no logit tricks: a named choice is one complete call to that function; "required"
    gives only calls to known functions."""
    named = client.chat.completions.create(
        model=MODEL,
        messages=USER,
        tools=PINGS,
        tool_choice={"type": "function", "function": {"name": "pong"}},
        temperature=1.0,
        seed=3,
        max_tokens=20,
    )
    assert named.choices[0].finish_reason == "tool_calls"
    (call,) = named.choices[0].message.tool_calls or []
    assert call.function.name == "pong" and json.loads(call.function.arguments) == {}
    required = client.chat.completions.create(
        model=MODEL,
        messages=USER,
        tools=PINGS,
        tool_choice="required",
        temperature=1.0,
        seed=4,
        max_tokens=40,
    )
    calls = required.choices[0].message.tool_calls or []
    assert calls and all(c.function.name in ("ping", "pong") for c in calls)
    assert not required.choices[0].message.content


def test_response_format_with_a_forced_tool_call_is_refused(server: ServerProcess) -> None:
    body = {
        "model": MODEL,
        "messages": USER,
        "tools": PINGS,
        "tool_choice": "required",
        "response_format": {"type": "json_object"},
    }
    response = httpx.post(f"{server.base_url}/chat/completions", json=body, timeout=60)
    assert response.status_code == 400 and response.json()["error"]["param"] == "response_format"


def test_strict_functions_in_auto_mode_are_served_and_refused_with_a_response_format(
    server: ServerProcess,
) -> None:
    strict = [{**PINGS[0], "function": {**PINGS[0]["function"], "strict": True}}]
    body = {"model": MODEL, "messages": USER, "tools": strict, "max_tokens": 8}
    response = httpx.post(f"{server.base_url}/chat/completions", json=body, timeout=60)
    assert response.status_code == 200
    both = {**body, "response_format": {"type": "json_object"}}
    response = httpx.post(f"{server.base_url}/chat/completions", json=both, timeout=60)
    assert response.status_code == 400 and response.json()["error"]["param"] == "response_format"
    assert "strict functions" in response.json()["error"]["message"]


def test_max_completion_tokens_is_exact_with_ignore_eos(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model=MODEL,
        messages=USER,
        max_completion_tokens=7,
        extra_body={"ignore_eos": True},  # type: ignore[arg-type]
    )
    assert out.usage is not None and out.usage.completion_tokens == 7
    assert out.choices[0].finish_reason == "length"


def test_developer_role_is_the_system_role(server: ServerProcess) -> None:
    as_developer = [{"role": "developer", "content": "Be brief."}, *USER]
    as_system = [{"role": "system", "content": "Be brief."}, *USER]
    tokenize = f"{server.url}/tokenize"
    assert (
        httpx.post(tokenize, json={"messages": as_developer}).json()
        == httpx.post(tokenize, json={"messages": as_system}).json()
    )


def test_tools_are_in_the_prompt_unless_tool_choice_is_none(client: openai.OpenAI) -> None:
    def prompt_tokens(**kwargs: Any) -> int:
        out = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=1, **kwargs)  # type: ignore[arg-type]
        assert out.usage is not None
        return out.usage.prompt_tokens

    plain = prompt_tokens()
    assert prompt_tokens(tools=TOOLS, tool_choice="none") == plain
    assert prompt_tokens(tools=TOOLS) > plain


# One required enum parameter: the grammar makes the random model write a complete call in a few tokens.
UNIT_TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"unit": {"enum": ["c", "f"]}},
                "required": ["unit"],
            },
        },
    }
]
UNIT_ARGUMENTS = ({"unit": "c"}, {"unit": "f"})


def _forced_call(**extra: Any) -> dict[str, Any]:
    return dict(
        model=MODEL,
        tools=UNIT_TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        temperature=0,
        max_tokens=60,  # the random model spells the tags in small pieces
        **extra,
    )


def test_tool_call_round_trip_through_the_chat_template(server: ServerProcess, client: openai.OpenAI) -> None:
    first = client.chat.completions.create(messages=USER, **_forced_call())  # type: ignore[arg-type]
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls or []
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) in UNIT_ARGUMENTS
    history: list[Any] = [
        *USER,
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"},
    ]
    answer = client.chat.completions.create(
        model=MODEL, messages=history, tools=UNIT_TOOLS, max_tokens=5, extra_body=NO_THINKING
    )
    assert answer.choices[0].message.content
    rendered = httpx.post(
        f"{server.url}/detokenize",
        json={
            "tokens": httpx.post(
                f"{server.url}/tokenize", json={"messages": history, "tools": UNIT_TOOLS}
            ).json()["tokens"]
        },
    ).json()["prompt"]
    assert (
        "<function=get_weather>" in rendered and "<tool_response>\nsunny, 21 C\n</tool_response>" in rendered
    )


def test_streamed_tool_call_announces_id_and_name_first(client: openai.OpenAI) -> None:
    chunks = list(client.chat.completions.create(messages=USER, stream=True, **_forced_call()))  # type: ignore[arg-type]
    calls = [call for c in chunks if c.choices for call in c.choices[0].delta.tool_calls or []]
    assert calls[0].id and calls[0].type == "function" and calls[0].function.name == "get_weather"
    assert all(c.index == 0 and c.id is None for c in calls[1:])
    assert json.loads("".join(c.function.arguments or "" for c in calls)) in UNIT_ARGUMENTS
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_sdk_stream_helper_assembles_the_tool_call(client: openai.OpenAI) -> None:
    with client.chat.completions.stream(messages=USER, **_forced_call()) as stream:  # type: ignore[arg-type]
        final = stream.get_final_completion()
    (call,) = final.choices[0].message.tool_calls or []
    assert final.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"


def test_logprobs_in_chat_format(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model=MODEL,
        messages=USER,
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},  # type: ignore[arg-type]
    )
    content = out.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and out.usage is not None and len(content) == out.usage.completion_tokens == 5
    for entry in content:
        assert len(entry.top_logprobs) == 2
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)  # greedy: the top token
        assert entry.token == bytes(entry.bytes or []).decode("utf-8", errors="replace")
    text = bytes(b for e in content for b in e.bytes or []).decode()
    assert text == out.choices[0].message.reasoning_content  # type: ignore[attr-defined]


def test_async_client_streaming_and_not(server: ServerProcess) -> None:
    async def run() -> tuple[str, str]:
        async with openai.AsyncOpenAI(base_url=server.base_url, api_key="none", max_retries=0) as aclient:
            whole = await aclient.chat.completions.create(
                model=MODEL, messages=USER, max_tokens=5, temperature=0, extra_body=NO_THINKING
            )  # type: ignore[arg-type]
            stream = await aclient.chat.completions.create(
                model=MODEL,
                messages=USER,
                max_tokens=5,
                temperature=0,
                stream=True,
                extra_body=NO_THINKING,  # type: ignore[arg-type]
            )
            text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
            return whole.choices[0].message.content or "", text

    whole, streamed = asyncio.run(run())
    assert whole and streamed == whole
