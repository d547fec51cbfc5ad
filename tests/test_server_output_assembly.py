"""How the server turns streamed output text into chat chunks and Responses events.

A real Qwen3.5-shaped output (reasoning, `</think>`, content, an XML tool call) is fed as engine deltas
split at every character and at random points; whatever the split, the chunks must add up to the same
reasoning, content and typed tool-call arguments, with finish_reason "tool_calls".
"""

from __future__ import annotations

import json
import random

import pytest

from deltaserve.engine.output import OutputDelta
from deltaserve.server.assistant_output import AssistantOutput
from deltaserve.server.chat import stream_choice
from deltaserve.server.chat_prompt import ChatPrompt
from deltaserve.server.protocol import ChatStreamChoice
from deltaserve.server.responses_protocol import (
    FunctionCallItem,
    MessageItem,
    ReasoningItem,
    ResponseObject,
    ResponseUsage,
)
from deltaserve.server.responses_stream import ResponseBuilder

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            },
        },
    }
]
REASONING = "The user wants the weather.\nI should call get_weather."
OUTPUT = (
    f"{REASONING}\n</think>\n\nLet me check that.\n<tool_call>\n<function=get_weather>\n"
    "<parameter=city>\nParis, <France>\n</parameter>\n<parameter=days>\n3\n</parameter>\n"
    "</function>\n</tool_call>"
)
ARGUMENTS = {"city": "Paris, <France>", "days": 3}


def _prompt(thinking: bool = True, forced: str = "") -> ChatPrompt:
    return ChatPrompt(
        text="", token_ids=[], thinking=thinking, tools=TOOLS, parse_tools=True, forced_prefix=forced
    )


def _splits(text: str) -> list[list[str]]:
    rng = random.Random(0)
    splits = [[text], list(text)]
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, 30)))
        splits.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)])
    return splits


def _deltas(pieces: list[str], finish: str) -> list[OutputDelta]:
    last = len(pieces) - 1
    return [
        OutputDelta(p, [], None, finish_reason=finish if i == last else None) for i, p in enumerate(pieces)
    ]


def _stream(prompt: ChatPrompt, pieces: list[str], finish: str = "stop") -> list[ChatStreamChoice]:
    out = AssistantOutput.for_prompt(prompt)
    choices = [stream_choice(out, d, None) for d in _deltas(pieces, finish)]
    return [c for c in choices if c is not None]


def _collect(choices: list[ChatStreamChoice]) -> tuple[str, str, list[dict]]:
    reasoning = "".join(c.delta.reasoning_content or "" for c in choices)
    content = "".join(c.delta.content or "" for c in choices)
    calls: list[dict] = []
    for c in choices:
        for call in c.delta.tool_calls or []:
            if call.id is not None:
                assert call.index == len(calls) and call.type == "function" and call.function.name
                calls.append({"id": call.id, "name": call.function.name, "arguments": ""})
            calls[call.index]["arguments"] += call.function.arguments or ""
    return reasoning, content, calls


@pytest.mark.parametrize("pieces", _splits(OUTPUT), ids=lambda p: f"{len(p)}-pieces")
def test_chat_stream_adds_up_to_reasoning_content_and_typed_tool_call(pieces: list[str]) -> None:
    choices = _stream(_prompt(), pieces)
    reasoning, content, calls = _collect(choices)
    assert reasoning.strip() == REASONING
    assert content.strip() == "Let me check that."
    assert [c["name"] for c in calls] == ["get_weather"] and calls[0]["id"].startswith("call_")
    assert json.loads(calls[0]["arguments"]) == ARGUMENTS
    assert [c.finish_reason for c in choices] == [None] * (len(choices) - 1) + ["tool_calls"]
    # Reasoning is over once content or a call has started (one chunk may hold both, reasoning first).
    first_other = next(i for i, c in enumerate(choices) if c.delta.content or c.delta.tool_calls)
    assert not any(c.delta.reasoning_content for c in choices[first_other + 1 :])


def test_tool_call_inside_reasoning_ends_reasoning_and_is_still_a_call() -> None:
    text = "thinking about it\n<tool_call>\n<function=get_weather>\n<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>"
    for pieces in _splits(text):
        reasoning, content, calls = _collect(_stream(_prompt(), pieces))
        assert reasoning.strip() == "thinking about it" and content.strip() == ""
        assert [json.loads(c["arguments"]) for c in calls] == [{"days": 2}]


def test_named_tool_choice_prefix_announces_the_call_with_the_first_delta() -> None:
    forced = "<tool_call>\n<function=get_weather>\n"
    choices = _stream(
        _prompt(False, forced), ["", "<parameter=city>\nOslo\n</parameter>\n</function>\n</tool_call>"]
    )
    first_calls = choices[0].delta.tool_calls
    assert first_calls is not None and first_calls[0].function.name == "get_weather" and first_calls[0].id
    _, content, calls = _collect(choices)
    assert content == "" and json.loads(calls[0]["arguments"]) == {"city": "Oslo"}
    assert choices[-1].finish_reason == "tool_calls"


def test_required_tool_choice_prefix_takes_the_name_from_the_output() -> None:
    text = "get_weather>\n<parameter=days>\n5\n</parameter>\n</function>\n</tool_call>"
    for pieces in _splits(text):
        _, content, calls = _collect(_stream(_prompt(False, "<tool_call>\n<function="), pieces))
        assert content == "" and [(c["name"], json.loads(c["arguments"])) for c in calls] == [
            ("get_weather", {"days": 5})
        ]


def test_output_cut_by_length_inside_a_call_keeps_length_and_valid_json() -> None:
    cut = OUTPUT[: OUTPUT.index("3\n</parameter>")]
    choices = _stream(_prompt(), list(cut), finish="length")
    _, _, calls = _collect(choices)
    assert json.loads(calls[0]["arguments"])["city"] == "Paris, <France>"  # still one valid JSON object
    assert choices[-1].finish_reason == "length"


def test_thinking_off_output_is_all_content() -> None:
    reasoning, content, calls = _collect(_stream(_prompt(thinking=False), list("Plain answer, no tags.")))
    assert (reasoning, content, calls) == ("", "Plain answer, no tags.", [])


def _response_events(pieces: list[str], finish: str = "stop") -> tuple[list, ResponseObject]:
    builder = ResponseBuilder(ResponseObject(id="resp_test", model="m"))
    out = AssistantOutput.for_prompt(_prompt())
    events = builder.start()
    for delta in _deltas(pieces, finish):
        events += builder.add(out.feed(delta.text, final=delta.finished))
    usage = ResponseUsage(input_tokens=1, output_tokens=2, total_tokens=3)
    events += builder.finish(finish, usage)
    return events, builder.response


@pytest.mark.parametrize("pieces", _splits(OUTPUT)[:6], ids=lambda p: f"{len(p)}-pieces")
def test_responses_events_announce_every_item_in_order(pieces: list[str]) -> None:
    events, response = _response_events(pieces)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"] and types[-1] == "response.completed"
    assert [type(item) for item in response.output] == [ReasoningItem, MessageItem, FunctionCallItem]
    assert all(item.status == "completed" for item in response.output)
    reasoning, message, call = response.output
    assert isinstance(reasoning, ReasoningItem) and reasoning.content[0].text.strip() == REASONING
    assert isinstance(message, MessageItem) and message.content[0].text.strip() == "Let me check that."
    assert isinstance(call, FunctionCallItem) and call.name == "get_weather"
    assert json.loads(call.arguments) == ARGUMENTS
    for index, item in enumerate(response.output):
        mine = [e for e in events if getattr(e, "output_index", None) == index]
        assert mine[0].type == "response.output_item.added" and mine[-1].type == "response.output_item.done"
        deltas = "".join(getattr(e, "delta", "") for e in mine)
        whole = call.arguments if item is call else item.content[0].text  # type: ignore[union-attr]
        assert deltas == whole


def test_responses_cut_by_length_is_incomplete() -> None:
    events, response = _response_events(list("just reasoning, never closed"), finish="length")
    assert events[-1].type == "response.completed"  # as vLLM: the status inside says incomplete
    assert response.status == "incomplete" and response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    assert [item.status for item in response.output] == ["incomplete"]


def test_a_completion_delta_of_tokens_with_held_back_text_still_goes_out() -> None:
    from deltaserve.server.completions import carries_output
    from deltaserve.tiny import default_model_dir
    from deltaserve.tokenizer import Tokenizer

    # A character split across tokens: its first byte's token decodes to nothing yet.
    tokenizer = Tokenizer.from_dir(default_model_dir())
    ids = tokenizer.encode("𝄞")  # three tokens
    assert len(ids) == 3, "the test needs a character the vocabulary splits"
    detok = tokenizer.new_detokenizer()
    for token in ids[:2]:
        held = OutputDelta(detok.push([token]), [token], None)
        assert held.text == "" and carries_output(held, "", logprobs=False)  # an empty-text chunk, as vLLM's
    last = OutputDelta(detok.push(ids[2:]), ids[2:], None)
    assert last.text == "𝄞" and carries_output(last, "", logprobs=False)
    assert not carries_output(OutputDelta("", [], None), "", logprobs=False)  # nothing at all
    assert carries_output(OutputDelta("", [], None, finish_reason="length"), "", logprobs=False)


def test_a_chat_delta_of_tokens_with_held_back_text_still_goes_out_empty() -> None:
    out = AssistantOutput.for_prompt(_prompt())
    # "<tool" could begin a tag: the parser holds it back, but the step's token still shows.
    held = stream_choice(out, OutputDelta("<tool", [1234], None), None)
    assert held is not None and held.delta.model_dump(exclude_none=True) == {}
    assert stream_choice(out, OutputDelta("", [], None), None) is None  # nothing at all: no chunk
    shown = stream_choice(out, OutputDelta("s are", [99], None), None)
    assert shown is not None and (shown.delta.reasoning_content or shown.delta.content) == "<tools are"
