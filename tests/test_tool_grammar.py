"""The grammar of forced tool calls: what it accepts and refuses, checked with xgrammar's matcher."""

from __future__ import annotations

import dataclasses
import json

import pytest

from deltaserve.engine.structured import GrammarBackend, grammar_vocabulary
from deltaserve.sampling_params import StructuredOutputParams
from deltaserve.server.chat_prompt import ChatPrompt, ToolChoice
from deltaserve.server.tool_grammar import strict_calls_format, tool_call_grammar, tool_call_output
from deltaserve.tiny import default_model_dir
from deltaserve.tokenizer import Tokenizer

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
    },
    {"type": "function", "function": {"name": "ping", "parameters": {"type": "object", "properties": {}}}},
]
CITY = "get_weather>\n<parameter=city>\n{value}\n</parameter>\n</function>\n</tool_call>"


@pytest.fixture(scope="module")
def backend() -> GrammarBackend:
    tokenizer = Tokenizer.from_dir(default_model_dir())
    return GrammarBackend(lambda: grammar_vocabulary(tokenizer), [248046, 248044])


def accepts(
    backend: GrammarBackend, named: str | None, text: str, tools: list = TOOLS, parallel=True
) -> bool:
    tag = tool_call_grammar(tools, named, parallel)
    grammar = backend.grammar(StructuredOutputParams(structural_tag=tag))
    return bool(grammar.matcher.accept_string(text)) and grammar.matcher.is_completed()


@pytest.mark.parametrize(
    "value",
    ["Paris", "a <b>tag</b> and </param and </parameter", "multi\nline\n</function> too", "<<</", ""],
)
def test_a_value_is_any_text_without_the_closing_tag(backend, value) -> None:
    assert accepts(backend, None, CITY.format(value=value))


def test_the_closing_tag_ends_a_value(backend) -> None:
    assert not accepts(backend, None, CITY.format(value="a</parameter>b"))


def test_required_takes_known_functions_and_parameters_and_more_calls(backend) -> None:
    assert accepts(backend, None, "ping>\n</function>\n</tool_call>")
    two = "ping>\n</function>\n</tool_call>\n<tool_call>\n<function=" + CITY.format(value="Rome")
    assert accepts(backend, None, two)
    assert not accepts(backend, None, "nope>\n</function>\n</tool_call>")
    assert not accepts(backend, None, "ping>\n<parameter=city>\nx\n</parameter>\n</function>\n</tool_call>")
    assert not accepts(backend, None, CITY.format(value="x").replace("city", "zip"))


def test_a_named_choice_is_exactly_one_call_to_that_function(backend) -> None:
    assert accepts(backend, "get_weather", "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>")
    assert accepts(backend, "ping", "</function>\n</tool_call>")
    assert not accepts(backend, "ping", "</function>\n</tool_call>\n<tool_call>\n<function=ping>\n")


TYPED = [
    {
        "type": "function",
        "function": {
            "name": "book",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "nights": {"type": "integer", "minimum": 1},
                    "room": {"type": "string", "enum": ["single", "double"]},
                    "guests": {"type": "array", "items": {"type": "string"}},
                },
                "required": ["city", "room"],
            },
        },
    }
]


def _book(**params: str) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"{body}</function>\n</tool_call>"


def test_call_arguments_follow_the_schema(backend) -> None:
    assert accepts(backend, "book", _book(city="Rome", nights="2", room="double"), TYPED)
    assert accepts(backend, "book", _book(city="Rome", room="single", guests='["a", "b"]'), TYPED)
    assert not accepts(backend, "book", _book(city="Rome"), TYPED)  # room is required
    assert not accepts(backend, "book", _book(city="Rome", room="suite"), TYPED)  # not in the enum
    assert not accepts(backend, "book", _book(city="Rome", nights="two", room="single"), TYPED)
    assert not accepts(backend, "book", _book(city="Rome", nights="0", room="single"), TYPED)  # minimum 1
    assert not accepts(backend, "book", _book(city="Rome", room="single", pets="1"), TYPED)  # undeclared


def test_blank_runs_between_parameters_are_bounded(backend) -> None:
    assert not accepts(backend, "book", _book(city="Rome", room="single").replace("\n<", "\n\n\n<"), TYPED)


def test_parallel_tool_calls_false_allows_one_call(backend) -> None:
    one = "ping>\n</function>\n</tool_call>"
    assert accepts(backend, None, one, parallel=False)
    assert not accepts(backend, None, one + "\n<tool_call>\n<function=" + one, parallel=False)


def _strict_accepts(backend: GrammarBackend, text: str, tools: list, parallel: bool = True) -> bool:
    tag = json.dumps({"type": "structural_tag", "format": strict_calls_format(tools, parallel)})
    grammar = backend.grammar(StructuredOutputParams(structural_tag=tag))
    return bool(grammar.matcher.accept_string(text))


STRICT = [{**TYPED[0], "function": {**TYPED[0]["function"], "strict": True}}, TOOLS[1]]


def test_with_a_strict_function_auto_is_free_text_until_a_call_which_then_follows_the_schema(backend) -> None:
    call = "<tool_call>\n<function=book>\n" + _book(city="Rome", room="double")
    assert _strict_accepts(backend, "Let me book that. ", STRICT)  # text alone is fine
    assert _strict_accepts(backend, "Let me book that.\n\n" + call, STRICT)
    assert not _strict_accepts(backend, "Sure.\n" + call.replace("double", "suite"), STRICT)  # enum
    assert not _strict_accepts(backend, "<tool_call>\n<function=nope>\n", STRICT)  # undeclared function
    # a function that is not strict takes any arguments up to the end of its call
    ping = "<tool_call>\n<function=ping>\n<parameter=x>\nanything\n</parameter>\n</function>\n</tool_call>"
    assert _strict_accepts(backend, ping, STRICT)
    assert not _strict_accepts(backend, call + "\n" + call, STRICT, parallel=False)


def test_auto_enforces_tool_calls_only_when_a_function_is_strict() -> None:
    prompt = ChatPrompt(
        text="", token_ids=[], thinking=False, tools=STRICT, parse_tools=True, forced_prefix="",
        tool_choice=ToolChoice("auto"),
    )  # fmt: skip
    assert tool_call_output(prompt) is not None
    loose = dataclasses.replace(prompt, tools=[TOOLS[0], TOOLS[1]])
    assert tool_call_output(loose) is None
    assert tool_call_output(dataclasses.replace(prompt, tool_choice=ToolChoice("none"))) is None
