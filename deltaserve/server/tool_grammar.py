"""The grammar of tool calls: an xgrammar structural tag whose call arguments follow each function's
JSON schema. A forced call (tool_choice "required" or a named function) is the whole output; with
tool_choice "auto" and a function declared `strict: true`, the output is free text until a call
starts (`<tool_call>`), and every call is then a well-formed call to a declared function, the strict
ones' arguments following their schemas (OpenAI's strict function calling).

The prompt already ends with the start of the call (`<tool_call>\\n<function=`, or with the function's
name for a named choice, chat_prompt.py); the grammar is the rest, in the Qwen3-Coder XML format the
template teaches (parsers.py):

    NAME>
    <parameter=KEY>
    VALUE
    </parameter>
    </function>
    </tool_call>

The parameters of a call are xgrammar's `qwen_xml` rendering of the function's `parameters` schema:
the required ones present, in the declared order, no undeclared ones (xgrammar's strict mode); a
string value is any text without `</parameter>`, any other value is JSON of its schema (types, enums,
bounds, nested objects and arrays). At most one whitespace character in a row outside string values,
so a random or confused model cannot fill its budget with blank lines. A function without
`parameters` takes none. "required" allows further calls after the first unless parallel_tool_calls
is false; a named choice is exactly one call. After the last call only a stop token can follow.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from deltaserve.engine.structured import grammars_available
from deltaserve.sampling_params import StructuredOutputParams
from deltaserve.server.errors import bad_request

if TYPE_CHECKING:
    from deltaserve.server.chat_prompt import ChatPrompt

CALL_START = "<tool_call>\n<function="
CALL_END = "</function>\n</tool_call>"
_NO_PARAMETERS = {"type": "object", "properties": {}}
MAX_WHITESPACE = 1


def _const(text: str) -> dict[str, Any]:
    return {"type": "const_string", "value": text}


def _sequence(*elements: dict[str, Any]) -> dict[str, Any]:
    return {"type": "sequence", "elements": list(elements)}


def _parameters(function: dict[str, Any]) -> dict[str, Any]:
    """The call's parameters, as the function's schema says."""
    return {
        "type": "json_schema",
        "json_schema": function.get("parameters") or _NO_PARAMETERS,
        "style": "qwen_xml",
        "max_whitespace_cnt": MAX_WHITESPACE,
    }


def _arguments(function: dict[str, Any]) -> dict[str, Any]:
    """The call's parameters, then the end of the call."""
    return _sequence(_parameters(function), _const(CALL_END))


def _functions(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [t["function"] for t in tools if t.get("type", "function") == "function"]


def tool_call_format(tools: list[dict[str, Any]], named: str | None, parallel: bool = True) -> dict[str, Any]:
    """The structural-tag format of the rest of a forced call to one of `tools` (chat-shaped), or to
    the function `named`; with `parallel` a "required" choice may make further calls."""
    functions = _functions(tools)
    if named is not None:
        return _arguments(next(f for f in functions if f["name"] == named))
    call = {
        "type": "or",
        "elements": [_sequence(_const(f"{f['name']}>\n"), _arguments(f)) for f in functions],
    }
    if not parallel:
        return call
    more = {"type": "star", "content": _sequence(_const("\n" + CALL_START), call)}
    return _sequence(call, more)


def strict_calls_format(tools: list[dict[str, Any]], parallel: bool = True) -> dict[str, Any]:
    """Free text, in which each call (from `<tool_call>`) is to a declared function and ends properly:
    a strict function's arguments follow its schema, another's are any text up to the call's end."""
    tags = [
        {
            "type": "tag",
            "begin": f"{CALL_START}{f['name']}>\n",
            "content": _parameters(f) if f.get("strict") else {"type": "any_text"},
            "end": CALL_END,
        }
        for f in _functions(tools)
    ]
    return {
        "type": "triggered_tags",
        "triggers": ["<tool_call>"],
        "tags": tags,
        "stop_after_first": not parallel,
    }


def tool_call_grammar(tools: list[dict[str, Any]], named: str | None, parallel: bool = True) -> str:
    """The structural tag (JSON text) of `tool_call_format`."""
    tag = {"type": "structural_tag", "format": tool_call_format(tools, named, parallel)}
    return json.dumps(tag, ensure_ascii=False)


def tool_call_output(prompt: ChatPrompt) -> StructuredOutputParams | None:
    """The grammar of a prompt's tool calls: its forced call (tool_choice "required" or named), or, with
    tool_choice "auto", its calls when a function is strict. None when nothing is enforced; without
    xgrammar a forced call is steered by the prompt prefix alone and a strict function is refused."""
    choice, tools = prompt.tool_choice, prompt.tools
    if not tools or choice.mode == "none":
        return None
    if choice.mode == "auto":
        if not any(f.get("strict") for f in _functions(tools)):
            return None
        if not grammars_available():
            raise bad_request(
                "a function with strict: true needs structured output on the server (xgrammar is not "
                "installed); drop strict",
                "tools",
            )
        fmt = strict_calls_format(tools, prompt.parallel_tool_calls)
        return StructuredOutputParams(structural_tag=json.dumps({"type": "structural_tag", "format": fmt}))
    if not grammars_available():
        return None
    named = choice.name if choice.mode == "named" else None
    tag = tool_call_grammar(tools, named, prompt.parallel_tool_calls)
    return StructuredOutputParams(structural_tag=tag)
