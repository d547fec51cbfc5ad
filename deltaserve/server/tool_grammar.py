"""The grammar of a forced tool call (tool_choice "required" or a named function): an xgrammar
structural tag whose call arguments follow each function's JSON schema.

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


def _arguments(function: dict[str, Any]) -> dict[str, Any]:
    """The call's parameters, as the function's schema says, then the end of the call."""
    schema = function.get("parameters") or _NO_PARAMETERS
    parameters = {
        "type": "json_schema",
        "json_schema": schema,
        "style": "qwen_xml",
        "max_whitespace_cnt": MAX_WHITESPACE,
    }
    return _sequence(parameters, _const(CALL_END))


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


def tool_call_grammar(tools: list[dict[str, Any]], named: str | None, parallel: bool = True) -> str:
    """The structural tag (JSON text) of `tool_call_format`."""
    tag = {"type": "structural_tag", "format": tool_call_format(tools, named, parallel)}
    return json.dumps(tag, ensure_ascii=False)


def forced_call_output(prompt: ChatPrompt) -> StructuredOutputParams | None:
    """The grammar of a prompt's forced tool call (tool_choice "required" or named); None when the tool
    choice forces nothing or xgrammar is not installed (the prompt prefix alone then steers the model)."""
    choice = prompt.tool_choice
    if choice.mode not in ("required", "named") or not prompt.tools or not grammars_available():
        return None
    named = choice.name if choice.mode == "named" else None
    tag = tool_call_grammar(prompt.tools, named, prompt.parallel_tool_calls)
    return StructuredOutputParams(structural_tag=tag)
