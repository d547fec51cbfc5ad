"""/v1/responses through the official openai client against the real server subprocess."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from server_fixture import MODEL, ServerProcess, running_server, token_counts

NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
TOOLS: list[Any] = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "Weather for a city",
        # One required enum parameter: the grammar makes the random model write a complete call quickly.
        "parameters": {"type": "object", "properties": {"unit": {"enum": ["c", "f"]}}, "required": ["unit"]},
    }
]
UNIT_ARGUMENTS = ({"unit": "c"}, {"unit": "f"})


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with running_server("--response-store-size", "3") as s:
        yield s


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0)


def test_string_input_with_thinking_gives_a_reasoning_item(client: openai.OpenAI) -> None:
    out = client.responses.create(model=MODEL, input="Hello", max_output_tokens=5, temperature=0)
    assert out.object == "response" and out.id.startswith("resp_")
    assert [item.type for item in out.output] == ["reasoning"]
    assert out.status == "incomplete" and out.incomplete_details is not None
    assert out.usage is not None and out.usage.output_tokens == 5
    assert out.usage.output_tokens_details.reasoning_tokens == 5
    assert out.usage.total_tokens == out.usage.input_tokens + 5


def test_message_items_and_instructions_give_output_text(client: openai.OpenAI) -> None:
    out = client.responses.create(
        model=MODEL,
        instructions="Answer briefly.",
        input=[{"role": "user", "content": [{"type": "input_text", "text": "Hi"}]}],
        max_output_tokens=5,
        temperature=0,
        extra_body=NO_THINKING,
    )
    assert [item.type for item in out.output] == ["message"]
    assert out.output_text and out.instructions == "Answer briefly."
    bare = client.responses.create(model=MODEL, input="Hi", max_output_tokens=1, extra_body=NO_THINKING)
    assert (
        out.usage is not None and bare.usage is not None and out.usage.input_tokens > bare.usage.input_tokens
    )


def test_streaming_events_in_order_and_completed_response_matches(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = dict(
        model=MODEL, input="Stream", max_output_tokens=6, temperature=0, extra_body=NO_THINKING
    )
    whole = client.responses.create(**kwargs)
    events = list(client.responses.create(**kwargs, stream=True))
    types = [e.type for e in events]
    assert types[0] == "response.created" and types[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "response.output_item.added" in types and "response.output_item.done" in types
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text
    final = events[-1].response  # type: ignore[union-attr]
    assert final.output_text == whole.output_text and token_counts(final.usage) == token_counts(whole.usage)


def test_sdk_stream_helper_assembles_the_final_response(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = dict(model=MODEL, input="Helper", max_output_tokens=4, temperature=0)
    with client.responses.stream(**kwargs) as stream:
        final = stream.get_final_response()
    whole = client.responses.create(**kwargs)
    assert [item.type for item in final.output] == ["reasoning"] and final.status == "incomplete"
    assert final.output[0].content[0].text == whole.output[0].content[0].text  # type: ignore[union-attr, index]
    assert token_counts(final.usage) == token_counts(whole.usage)


def test_streaming_reasoning_deltas(client: openai.OpenAI) -> None:
    events = list(
        client.responses.create(model=MODEL, input="Think", max_output_tokens=4, temperature=0, stream=True)
    )
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    final = events[-1].response  # type: ignore[union-attr]
    assert reasoning and final.output[0].type == "reasoning"
    assert final.output[0].content[0].text == reasoning


def test_previous_response_id_continues_the_conversation(client: openai.OpenAI) -> None:
    first = client.responses.create(
        model=MODEL, input="My name is Ada.", max_output_tokens=4, temperature=0, extra_body=NO_THINKING
    )
    follow = client.responses.create(
        model=MODEL,
        input="What is my name?",
        previous_response_id=first.id,
        max_output_tokens=4,
        extra_body=NO_THINKING,
    )
    alone = client.responses.create(
        model=MODEL, input="What is my name?", max_output_tokens=4, extra_body=NO_THINKING
    )
    assert follow.previous_response_id == first.id
    assert first.usage and follow.usage and alone.usage
    # The follow-up's prompt holds the first turn (input and output) before the new input.
    assert follow.usage.input_tokens >= alone.usage.input_tokens + first.usage.input_tokens
    assert client.responses.retrieve(follow.id).output_text == follow.output_text


def test_store_is_bounded_and_unknown_previous_id_is_a_400(client: openai.OpenAI) -> None:
    oldest = client.responses.create(model=MODEL, input="one", max_output_tokens=1)
    for text in ("two", "three", "four"):  # the store holds 3 (--response-store-size 3)
        client.responses.create(model=MODEL, input=text, max_output_tokens=1)
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(
            model=MODEL, input="again", previous_response_id=oldest.id, max_output_tokens=1
        )
    assert err.value.body["param"] == "previous_response_id"  # type: ignore[index]
    not_stored = client.responses.create(model=MODEL, input="private", max_output_tokens=1, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(not_stored.id)


def test_function_call_item_round_trip(client: openai.OpenAI) -> None:
    forced: dict[str, Any] = dict(
        model=MODEL,
        tools=TOOLS,
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=60,  # the random model spells the tags in small pieces
        temperature=0,
    )
    first = client.responses.create(input="Weather in Paris?", **forced)
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and json.loads(call.arguments) in UNIT_ARGUMENTS
    assert first.status == "completed"
    answer = client.responses.create(
        model=MODEL,
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],
        tools=TOOLS,
        max_output_tokens=4,
        extra_body=NO_THINKING,
    )
    assert answer.output_text
    events = list(client.responses.create(input="Weather in Paris?", stream=True, **forced))
    added = [e for e in events if e.type == "response.output_item.added" and e.item.type == "function_call"]
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(added) == 1 and added[0].item.name == "get_weather"
    assert json.loads(done[0].arguments) in UNIT_ARGUMENTS


def test_text_format_json_schema_constrains_the_answer_not_the_reasoning(server: ServerProcess) -> None:
    """With thinking on, the schema applies after </think> (the reasoning stays free text); with thinking
    off, from the first token."""
    schema = {
        "type": "object",
        "properties": {"n": {"enum": [1, 2]}},
        "required": ["n"],
        "additionalProperties": False,
    }
    fmt = {"format": {"type": "json_schema", "name": "pick", "schema": schema}}
    body = {"model": MODEL, "input": "Pick", "max_output_tokens": 30, "text": fmt}
    off = {**body, "chat_template_kwargs": {"enable_thinking": False}}
    out = httpx.post(f"{server.base_url}/responses", json=off, timeout=60).json()
    text = next(i for i in out["output"] if i["type"] == "message")["content"][0]["text"]
    assert json.loads(text)["n"] in (1, 2)
    on = httpx.post(f"{server.base_url}/responses", json={**body, "max_output_tokens": 12}, timeout=60).json()
    reasoning = [i for i in on["output"] if i["type"] == "reasoning"]
    assert reasoning  # the random model never closes its reasoning: free text until max_output_tokens
    bad = {**body, "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}}
    error = httpx.post(f"{server.base_url}/responses", json=bad, timeout=60).json()["error"]
    assert error["param"] == "text.format" and "cannot be compiled" in error["message"]


def test_async_client(server: ServerProcess) -> None:
    async def run() -> str:
        async with openai.AsyncOpenAI(base_url=server.base_url, api_key="none", max_retries=0) as aclient:
            out = await aclient.responses.create(
                model=MODEL, input="Async", max_output_tokens=3, extra_body=NO_THINKING
            )
            return out.output_text

    assert asyncio.run(run())
