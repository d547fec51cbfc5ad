"""Reasoning and Qwen XML tool-call parsing: chunk-boundary independence, typed arguments, streaming."""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass, field

import pytest

from deltaserve.server.parsers import (
    OutputParser,
    ReasoningParser,
    ToolCallParser,
    parse_tool_calls,
)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather forecast for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
WRITE_FILE = {
    "type": "function",
    "function": {
        "name": "write_file",
        "parameters": {
            "type": "object",
            "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
        },
    },
}
CONFIGURE = {
    "type": "function",
    "function": {
        "name": "configure",
        "parameters": {
            "type": "object",
            "properties": {
                "retries": {"type": "integer"},
                "count": {"type": "integer"},
                "ratio": {"type": "number"},
                "scale": {"type": "number"},
                "big": {"type": "number"},
                "ceiling": {"type": "number"},
                "verbose": {"type": "boolean"},
                "dry_run": {"type": "boolean"},
                "options": {"type": "object"},
                "tags": {"type": "array"},
                "bounds": {"type": "array"},
                "legacy": {"type": "object"},
                "nothing": {"type": "null"},
                "limit": {"type": ["integer", "null"]},
                "mode": {"anyOf": [{"type": "string"}, {"type": "integer"}]},
                "either": {"type": ["integer", "string"]},
            },
        },
    },
}
TOOLS = [WEATHER, WRITE_FILE, CONFIGURE]
CALL_ID = re.compile(r"call_[0-9a-f]{24}")


@dataclass(slots=True)
class Case:
    text: str
    reasoning: str
    content: str
    calls: list[tuple[str, dict]]
    thinking: bool = True
    parse_tools: bool = True
    tools: list[dict] = field(default_factory=lambda: TOOLS)


TRICKY_VALUE = (
    "if a < b and c </b> d:\n"
    '    print("</param", \'\\\\n\', {"k": [1, 2]})\n'
    "<tool_call> </function> </parameter-ish </parameter\n"
    "\n"
    'café 🌍 日本\t\\u00e9 "quoted" \\\n'
)

CASES = {
    "reasoning_then_content": Case(
        text="The user greets me.\nI should answer politely.\n</think>\n\nHello! How can I help you today?",
        reasoning="The user greets me.\nI should answer politely.\n",
        content="Hello! How can I help you today?",
        calls=[],
    ),
    "reasoning_then_tool_call_without_think_end": Case(
        text=(
            "I need the weather for Paris.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
            "</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
        ),
        reasoning="I need the weather for Paris.\n",
        content="",
        calls=[("get_weather", {"city": "Paris", "days": 3})],
    ),
    "content_then_two_tool_calls": Case(
        text=(
            "Two cities.\n</think>\n\nLet me check both cities.\n\n<tool_call>\n<function=get_weather>\n"
            "<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n"
            "<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n<parameter=days>\n7\n"
            "</parameter>\n</function>\n</tool_call>\n\nBoth requested."
        ),
        reasoning="Two cities.\n",
        content="Let me check both cities.\n\nBoth requested.",
        calls=[("get_weather", {"city": "Paris"}), ("get_weather", {"city": "New York", "days": 7})],
    ),
    "tricky_multiline_string_values": Case(
        text=(
            '<tool_call>\n<function=write_file>\n<parameter=path>\n/tmp/a "b".txt\n</parameter>\n'
            f"<parameter=content>\n{TRICKY_VALUE}\n</parameter>\n</function>\n</tool_call>"
        ),
        reasoning="",
        content="",
        calls=[("write_file", {"path": '/tmp/a "b".txt', "content": TRICKY_VALUE})],
        thinking=False,
    ),
    "typed_parameters": Case(
        text=(
            "<tool_call>\n<function=configure>\n"
            "<parameter=retries>\n3\n</parameter>\n"
            "<parameter=count>\nmany\n</parameter>\n"
            "<parameter=ratio>\n0.25\n</parameter>\n"
            "<parameter=scale>\n2\n</parameter>\n"
            "<parameter=big>\n1e3\n</parameter>\n"
            "<parameter=ceiling>\nInfinity\n</parameter>\n"
            "<parameter=verbose>\nTRUE\n</parameter>\n"
            "<parameter=dry_run>\nfalse\n</parameter>\n"
            '<parameter=options>\n{"a": 1,\n "b": [true, null]}\n</parameter>\n'
            "<parameter=tags>\n['x', 'y']\n</parameter>\n"
            "<parameter=bounds>\n[0, 1e999]\n</parameter>\n"
            "<parameter=legacy>\n{not json\n</parameter>\n"
            "<parameter=nothing>\nnull\n</parameter>\n"
            "<parameter=limit>\nNull\n</parameter>\n"
            "<parameter=mode>\n42\n</parameter>\n"
            "<parameter=either>\n7\n</parameter>\n"
            "<parameter=extra>\n12\n</parameter>\n"
            "</function>\n</tool_call>"
        ),
        reasoning="",
        content="",
        calls=[
            (
                "configure",
                {
                    "retries": 3,
                    "count": "many",
                    "ratio": 0.25,
                    "scale": 2,
                    "big": 1000.0,
                    "ceiling": "Infinity",
                    "verbose": True,
                    "dry_run": False,
                    "options": {"a": 1, "b": [True, None]},
                    "tags": ["x", "y"],
                    "bounds": "[0, 1e999]",
                    "legacy": "{not json",
                    "nothing": None,
                    "limit": None,
                    "mode": "42",
                    "either": "7",
                    "extra": "12",
                },
            )
        ],
        thinking=False,
    ),
    "unknown_function_keeps_strings": Case(
        text=(
            "<tool_call>\n<function=search>\n<parameter=query>\nrust async\n</parameter>\n"
            "<parameter=limit>\n5\n</parameter>\n</function>\n</tool_call>"
        ),
        reasoning="",
        content="",
        calls=[("search", {"query": "rust async", "limit": "5"})],
        thinking=False,
    ),
    "compact_tags_without_newlines": Case(
        text=(
            "Sure.<tool_call><function= get_weather ><parameter=city>Oslo</parameter>"
            "<parameter=days> 2 </parameter></function></tool_call>"
        ),
        reasoning="",
        content="Sure.",
        calls=[("get_weather", {"city": "Oslo", "days": 2})],
        thinking=False,
    ),
    "thinking_off_all_content": Case(
        text="Sure: a < b, and </think> here is literal <b>text</b>.\n",
        reasoning="",
        content="Sure: a < b, and </think> here is literal <b>text</b>.\n",
        calls=[],
        thinking=False,
    ),
    "output_opens_think_with_thinking_off": Case(
        text="<think>\nShort thought.\n</think>\n\nAnswer.",
        reasoning="Short thought.\n",
        content="Answer.",
        calls=[],
        thinking=False,
    ),
    "output_opens_think_with_thinking_on": Case(
        text="<think>\nShort thought.\n</think>\n\nAnswer.",
        reasoning="Short thought.\n",
        content="Answer.",
        calls=[],
    ),
    "tool_syntax_in_reasoning_is_reasoning": Case(
        text="I could write <function=get_weather> myself.\n</think>\n\nNo tool needed.",
        reasoning="I could write <function=get_weather> myself.\n",
        content="No tool needed.",
        calls=[],
    ),
    "unterminated_call_is_closed": Case(
        text=(
            "Writing.\n</think>\n\n<tool_call>\n<function=write_file>\n<parameter=path>\nnotes.txt\n"
            "</parameter>\n<parameter=content>\nline one\nline two\n"
        ),
        reasoning="Writing.\n",
        content="",
        calls=[("write_file", {"path": "notes.txt", "content": "line one\nline two"})],
    ),
    "cut_inside_parameter_name_drops_it": Case(
        text="<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n<parameter=da",
        reasoning="",
        content="",
        calls=[("get_weather", {"city": "Rome"})],
        thinking=False,
    ),
    "cut_before_function_name_is_content": Case(
        text="Let me look.\n<tool_call>\n<function=get_wea",
        reasoning="",
        content="Let me look.\n<tool_call>\n<function=get_wea",
        calls=[],
        thinking=False,
    ),
    "block_without_function_is_content": Case(
        text='<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>\nDone.',
        reasoning="",
        content='<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>\nDone.',
        calls=[],
        thinking=False,
    ),
    "output_ends_after_function_end": Case(
        text="<tool_call>\n<function=get_weather>\n<parameter=city>\nLima\n</parameter>\n</function>\n",
        reasoning="",
        content="",
        calls=[("get_weather", {"city": "Lima"})],
        thinking=False,
    ),
    "tool_call_closed_without_function_end": Case(
        text="<tool_call>\n<function=get_weather>\n<parameter=city>\nLima\n</parameter>\n</tool_call>",
        reasoning="",
        content="",
        calls=[("get_weather", {"city": "Lima"})],
        thinking=False,
    ),
    "parse_tools_off_keeps_tool_text_as_content": Case(
        text="Plan.\n<tool_call>\n<function=get_weather>\n</function>\n</tool_call>",
        reasoning="Plan.\n",
        content="<tool_call>\n<function=get_weather>\n</function>\n</tool_call>",
        calls=[],
        parse_tools=False,
    ),
}


@dataclass(slots=True)
class Result:
    reasoning: str
    content: str
    calls: list[tuple[str, str]]  # (name, arguments JSON text)


def run(case: Case, chunks: list[str]) -> Result:
    """Feeds `chunks` and aggregates the deltas, checking the per-delta invariants on the way."""
    parser = OutputParser(thinking=case.thinking, tools=case.tools, parse_tools=case.parse_tools)
    reasoning, content, calls = [], [], []
    for delta in [parser.feed(chunk) for chunk in chunks] + [parser.finish()]:
        reasoning.append(delta.reasoning)
        content.append(delta.content)
        for call in delta.tool_calls:
            if call.index == len(calls):  # a new call: its first delta, and only it, has id and name
                assert CALL_ID.fullmatch(call.id or ""), call
                assert call.name is not None
                calls.append([call.name, call.arguments])
            else:
                assert call.index == len(calls) - 1 and call.id is None and call.name is None, call
                calls[-1][1] += call.arguments
    return Result("".join(reasoning), "".join(content), [(name, args) for name, args in calls])


def check_expected(case: Case, result: Result) -> None:
    assert result.reasoning == case.reasoning
    assert result.content == case.content
    assert [(name, json.loads(args)) for name, args in result.calls] == case.calls
    # The streamed fragments concatenate to exactly what json.dumps gives for the final arguments.
    assert [args for _, args in result.calls] == [json.dumps(a, ensure_ascii=False) for _, a in case.calls]


def random_chunks(text: str, rng: random.Random) -> list[str]:
    chunks, i = [], 0
    while i < len(text):
        n = rng.randint(1, 12)
        chunks.append(text[i : i + n])
        i += n
    return chunks


@pytest.mark.parametrize("name", CASES)
def test_whole_output_parses_to_expected(name: str) -> None:
    case = CASES[name]
    check_expected(case, run(case, [case.text]))


@pytest.mark.parametrize("name", CASES)
def test_every_two_chunk_split_matches_whole(name: str) -> None:
    case = CASES[name]
    whole = run(case, [case.text])
    for i in range(len(case.text) + 1):
        assert run(case, [case.text[:i], case.text[i:]]) == whole, f"split at {i}"


@pytest.mark.parametrize("name", CASES)
def test_char_by_char_and_random_chunks_match_whole(name: str) -> None:
    case = CASES[name]
    whole = run(case, [case.text])
    assert run(case, list(case.text)) == whole
    rng = random.Random(name)
    for _ in range(30):
        chunks = random_chunks(case.text, rng)
        assert run(case, chunks) == whole, chunks


def test_call_id_and_name_arrive_before_function_closes() -> None:
    parser = ToolCallParser([WEATHER])
    assert parser.feed("<tool_call>\n<function=get_wea").tool_calls == []
    [call] = parser.feed("ther>\n").tool_calls
    assert (call.index, call.name, call.arguments) == (0, "get_weather", "{")
    assert CALL_ID.fullmatch(call.id or "")


def test_string_argument_streams_before_parameter_closes() -> None:
    parser = ToolCallParser([WEATHER])
    parser.feed("<tool_call>\n<function=get_weather>\n")
    assert parser.feed("<parameter=city>\nPar").tool_calls[0].arguments == '"city": "Par'
    assert parser.feed('is "F"').tool_calls[0].arguments == 'is \\"F\\"'
    # The newline may precede </parameter> (and be stripped), so it waits for the next text.
    assert parser.feed("\n").tool_calls == []
    assert parser.feed("rance\n").tool_calls[0].arguments == "\\nrance"
    assert parser.feed("</parameter>\n").tool_calls[0].arguments == '"'


def test_typed_argument_is_emitted_when_its_parameter_closes() -> None:
    parser = ToolCallParser([WEATHER])
    parser.feed("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n")
    assert parser.feed("<parameter=days>\n1").tool_calls[0].arguments == ', "days": '
    assert parser.feed("4\n").tool_calls == []
    assert parser.feed("</parameter>\n</function>").tool_calls[0].arguments == "14}"


def test_plain_text_is_never_held_back() -> None:
    parser = OutputParser(thinking=True, tools=[WEATHER], parse_tools=True)
    assert parser.feed("Thinking about ").reasoning == "Thinking about "
    assert parser.feed("it.\n").reasoning == "it.\n"
    assert parser.feed("</think>\n\n").reasoning == ""
    assert parser.feed("Hello ").content == "Hello "
    assert parser.feed("world, 3 > 2.\n").content == "world, 3 > 2.\n"


def test_only_a_possible_tag_start_is_held_back() -> None:
    reasoning = ReasoningParser(thinking=True)
    assert reasoning.feed("a < b </th") == ("a < b ", "")
    assert reasoning.feed("ing") == ("</thing", "")
    assert reasoning.feed("</thi") == ("", "")
    assert reasoning.finish() == ("</thi", "")

    tools = ToolCallParser([WEATHER])
    assert tools.feed("x <tool_").content == "x "
    assert tools.feed("x").content == "<tool_x"
    assert tools.feed("<tool").content == ""
    assert tools.finish().content == "<tool"


def test_think_end_tag_is_emitted_nowhere() -> None:
    parser = ReasoningParser(thinking=True)
    assert parser.feed("r</think>") == ("r", "")
    assert parser.feed("\n\n") == ("", "")
    assert parser.feed(" \nDone") == ("", "Done")
    assert parser.finish() == ("", "")


def test_parse_tool_calls_strips_content_and_agrees_with_streaming() -> None:
    case = CASES["content_then_two_tool_calls"]
    text = case.text.split("</think>\n\n", 1)[1]
    content, calls = parse_tool_calls(text, TOOLS)
    assert content == "Let me check both cities.\n\nBoth requested."
    assert [(call.name, json.loads(call.arguments)) for call in calls] == case.calls
    streamed = run(Case(text, "", case.content, case.calls, thinking=False), [text])
    assert [(call.name, call.arguments) for call in calls] == streamed.calls
    assert all(CALL_ID.fullmatch(call.id) for call in calls)
    assert calls[0].id != calls[1].id


def test_responses_api_flat_tool_shape_gives_types() -> None:
    flat = {"type": "function", **WEATHER["function"]}
    _, [call] = parse_tool_calls("<tool_call><function=get_weather><parameter=days>2</parameter>", [flat])
    assert json.loads(call.arguments) == {"days": 2}


def test_id_factory_names_the_calls() -> None:
    ids = iter(["call_a", "call_b"])
    parser = ToolCallParser(None, id_factory=lambda: next(ids))
    delta = parser.feed("<tool_call><function=f></function><function=g></function></tool_call>")
    assert [(call.id, call.name, call.arguments) for call in delta.tool_calls] == [
        ("call_a", "f", "{}"),
        ("call_b", "g", "{}"),
    ]
