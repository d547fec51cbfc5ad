"""The grammar of forced tool calls: what it accepts and refuses, checked with xgrammar's matcher."""

from __future__ import annotations

import pytest

from deltaserve.engine.structured import GrammarBackend, grammar_vocabulary
from deltaserve.sampling_params import StructuredOutputParams
from deltaserve.server.tool_grammar import tool_call_grammar
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


def accepts(backend: GrammarBackend, named: str | None, text: str) -> bool:
    grammar = backend.grammar(StructuredOutputParams(ebnf=tool_call_grammar(TOOLS, named)))
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
