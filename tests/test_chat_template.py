"""deltaserve/chat_template.jinja rendered through Tokenizer.apply_chat_template: exact prompts."""

from __future__ import annotations

import copy

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.models import WordLevel

from deltaserve.errors import RequestValidationError
from deltaserve.tokenizer import Tokenizer
from deltaserve.tokenizer_build import chat_template

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather <°C> for a city, e.g. 北京",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}

TOOLS_PREAMBLE = (
    "<|im_start|>system\n# Tools\n\nYou have access to the following functions:\n\n<tools>\n"
    '{"type": "function", "function": {"name": "get_weather", "description": "Current weather <°C> for a '
    'city, e.g. 北京", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, '
    '"required": ["city"]}}}\n'
    "</tools>\n\n"
    "To call a function, reply with the call and nothing after it, in exactly this format:\n\n"
    "<tool_call>\n<function=function_name>\n<parameter=parameter_name>\nparameter value\n</parameter>\n"
    "</function>\n</tool_call>\n\n"
    "<IMPORTANT>\n"
    "- Each <function=...></function> block goes inside its own <tool_call></tool_call> tags.\n"
    "- Give every required parameter. A value may span several lines; write non-string values as JSON.\n"
    "- You may explain your reasoning before a function call, never after it.\n"
    "- If no function fits, answer directly and do not mention the functions.\n"
    "</IMPORTANT>"
)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    # Rendering does not depend on the vocabulary: a one-word backend keeps these tests instant.
    return Tokenizer(HFTokenizer(WordLevel({"a": 0}, unk_token="a")), chat_template())


def test_user_turn_opens_thinking_by_default(tokenizer: Tokenizer) -> None:
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert prompt == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n"


def test_thinking_off_prefills_an_empty_think_block(tokenizer: Tokenizer) -> None:
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], enable_thinking=False)
    assert prompt == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"


def test_without_generation_prompt_the_prompt_ends_after_the_last_turn(tokenizer: Tokenizer) -> None:
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=False)
    assert prompt == "<|im_start|>user\nHi<|im_end|>\n"


def test_system_then_user_with_trimmed_text_parts(tokenizer: Tokenizer) -> None:
    messages = [
        {"role": "system", "content": "  Be brief.\n"},
        {"role": "user", "content": [{"type": "text", "text": "Hello "}, {"type": "text", "text": "there"}]},
    ]
    assert tokenizer.apply_chat_template(messages) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHello there<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n"
    )


def test_tools_are_described_in_the_system_turn_before_the_system_text(tokenizer: Tokenizer) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}]
    assert tokenizer.apply_chat_template(messages, tools=[WEATHER_TOOL]) == (
        TOOLS_PREAMBLE + "\n\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n"
    )


def test_tools_without_a_system_message_make_their_own_system_turn(tokenizer: Tokenizer) -> None:
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    assert tokenizer.apply_chat_template(messages, tools=[WEATHER_TOOL], enable_thinking=False) == (
        TOOLS_PREAMBLE + "<|im_end|>\n"
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )


TOOL_CALL_CONVERSATION = [
    {"role": "user", "content": "Weather in Paris and Oslo?"},
    {
        "role": "assistant",
        "content": "Checking both.",
        "reasoning_content": "Two cities, two calls.",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'},
            },
            {
                "id": "call_2",
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Oslo", "units": {"temp": "°C"}}},
            },
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "18°C, sunny"},
    {"role": "tool", "tool_call_id": "call_2", "content": "9°C, rain"},
]


def test_tool_calls_render_as_xml_and_tool_results_share_one_user_turn(tokenizer: Tokenizer) -> None:
    assert tokenizer.apply_chat_template(TOOL_CALL_CONVERSATION) == (
        "<|im_start|>user\nWeather in Paris and Oslo?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nTwo cities, two calls.\n</think>\n\n"
        "Checking both.\n\n"
        "<tool_call>\n<function=get_weather>\n"
        "<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\n2\n</parameter>\n"
        "</function>\n</tool_call>\n"
        "<tool_call>\n<function=get_weather>\n"
        "<parameter=city>\nOslo\n</parameter>\n"
        '<parameter=units>\n{"temp": "°C"}\n</parameter>\n'
        "</function>\n</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n18°C, sunny\n</tool_response>\n"
        "<tool_response>\n9°C, rain\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n<think>\n"
    )


def test_tool_call_arguments_are_parsed_without_mutating_the_request(tokenizer: Tokenizer) -> None:
    messages = copy.deepcopy(TOOL_CALL_CONVERSATION)
    tokenizer.apply_chat_template(messages)
    assert messages == TOOL_CALL_CONVERSATION


def test_tool_call_without_content_starts_directly_with_the_call(tokenizer: Tokenizer) -> None:
    messages = [
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"function": {"name": "now", "arguments": "{}"}}],
        },
    ]
    assert tokenizer.apply_chat_template(messages, add_generation_prompt=False) == (
        "<|im_start|>user\nWeather?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
        "<tool_call>\n<function=now>\n</function>\n</tool_call><|im_end|>\n"
    )


def test_reasoning_is_kept_only_after_the_last_real_user_query(tokenizer: Tokenizer) -> None:
    messages = [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "<think>\nAdd them.\n</think>\n\n4"},
        {"role": "user", "content": "And 3+3? Use the tool."},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "Call add.",
            "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 3, "b": 3}}}],
        },
        # A user turn that only wraps a tool result is not a query: the turn above keeps its reasoning.
        {"role": "user", "content": "<tool_response>\n6\n</tool_response>"},
        {"role": "assistant", "content": "<think>\nDone.\n</think>\n\n6"},
    ]
    assert tokenizer.apply_chat_template(messages, add_generation_prompt=False) == (
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        "<|im_start|>assistant\n4<|im_end|>\n"
        "<|im_start|>user\nAnd 3+3? Use the tool.<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nCall add.\n</think>\n\n"
        "<tool_call>\n<function=add>\n<parameter=a>\n3\n</parameter>\n<parameter=b>\n3\n</parameter>\n"
        "</function>\n</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n6\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n<think>\nDone.\n</think>\n\n6<|im_end|>\n"
    )


@pytest.mark.parametrize(
    ("messages", "message"),
    [
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}],
            r"messages\[0\]: content part of type 'image_url' is not supported; this server is text-only",
        ),
        (
            [{"role": "user", "content": "Hi"}, {"role": "system", "content": "Late."}],
            r"messages\[1\]: a system message must be the first message",
        ),
        ([{"role": "system", "content": "Alone."}], "messages must contain at least one user message"),
        (
            [{"role": "developer", "content": "x"}, {"role": "user", "content": "Hi"}],
            r"messages\[0\]: unexpected role 'developer'",
        ),
        (
            [
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]},
            ],
            r"messages\[1\]\.tool_calls\[0\]\.function\.arguments is not valid JSON",
        ),
        (
            [
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[1, 2]"}}]},
            ],
            r"messages\[1\]: tool call arguments must be a JSON object",
        ),
    ],
    ids=[
        "image-part",
        "system-not-first",
        "no-user",
        "unknown-role",
        "bad-json-arguments",
        "array-arguments",
    ],
)
def test_unrenderable_messages_are_rejected_with_the_reason(
    tokenizer: Tokenizer, messages: list[dict], message: str
) -> None:
    with pytest.raises(RequestValidationError, match=message) as caught:
        tokenizer.apply_chat_template(messages)
    assert caught.value.field == "messages"


def test_a_model_without_a_chat_template_rejects_chat_requests() -> None:
    tokenizer = Tokenizer(HFTokenizer(WordLevel({"a": 0}, unk_token="a")), None)
    with pytest.raises(RequestValidationError, match="this model has no chat template"):
        tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
