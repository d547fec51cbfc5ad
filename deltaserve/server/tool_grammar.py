"""The grammar of a forced tool call (tool_choice "required" or a named function), in xgrammar's EBNF.

The prompt already ends with the start of the call (`<tool_call>\\n<function=`, or with the function's
name for a named choice, chat_prompt.py); the grammar is the rest, in the Qwen3-Coder XML format the
template teaches (parsers.py):

    NAME>
    <parameter=KEY>
    VALUE
    </parameter>
    </function>
    </tool_call>

Function names come from `tools`, parameter names from each function's `parameters.properties`
(a function without properties takes none). A value is any text without `</parameter>` (where the
parser ends it); it may not end inside an unfinished `<...` that could still become that tag, which
costs nothing in practice: values end with the newline before `</parameter>`. "required" allows further
calls after the first; a named choice is exactly one call. After the last call only a stop token can
follow.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from deltaserve.engine.structured import grammars_available
from deltaserve.sampling_params import StructuredOutputParams

if TYPE_CHECKING:
    from deltaserve.server.chat_prompt import ChatPrompt

_CLOSE = "/parameter>"  # what may not follow a `<` inside a value


def _literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _class_char(ch: str) -> str:
    return {"\\": "\\\\", "]": "\\]", "^": "\\^", "-": "\\-", "\n": "\\n"}.get(ch, ch)


def _value_rules() -> list[str]:
    """value: text without `</parameter>`. After each `<` the rules l0..l10 follow the characters of
    `/parameter>` one by one; a chunk ends only on a character that breaks the match (a new `<` restarts
    it), so the closing tag can never be completed inside a value."""
    rules = ['value ::= ([^<] | "<" l0)*']
    for k, ch in enumerate(_CLOSE):
        options = ['"<" l0']
        if k + 1 < len(_CLOSE):
            options.insert(0, f"{_literal(ch)} l{k + 1}")
        options.append(f"[^{_class_char(ch)}<]")
        rules.append(f"l{k} ::= " + " | ".join(options))
    return rules


def _function_rules(index: int, function: dict[str, Any]) -> list[str]:
    props = (function.get("parameters") or {}).get("properties") or {}
    params = f"p{index}*" if props else ""
    body = f"{params} " if params else ""
    rules = [f'f{index} ::= {body}"</function>\\n</tool_call>"']
    if props:
        names = " | ".join(_literal(name) for name in props)
        rules.append(f'p{index} ::= "<parameter=" ({names}) ">\\n" value "</parameter>\\n"')
    return rules


def tool_call_grammar(tools: list[dict[str, Any]], named: str | None) -> str:
    """EBNF for the rest of a forced call to one of `tools` (chat-shaped), or to the function `named`."""
    functions = [t["function"] for t in tools if t.get("type", "function") == "function"]
    rules: list[str] = []
    if named is not None:
        index = next(i for i, f in enumerate(functions) if f["name"] == named)
        rules.append(f"root ::= f{index}")
        rules += _function_rules(index, functions[index])
    else:
        rules.append('root ::= call ("\\n<tool_call>\\n<function=" call)*')
        rules.append(
            "call ::= "
            + " | ".join(f'{_literal(f["name"] + ">")} "\\n" f{i}' for i, f in enumerate(functions))
        )
        for i, function in enumerate(functions):
            rules += _function_rules(i, function)
    return "\n".join(rules + _value_rules())


def forced_call_output(prompt: ChatPrompt) -> StructuredOutputParams | None:
    """The grammar of a prompt's forced tool call (tool_choice "required" or named); None when the tool
    choice forces nothing or xgrammar is not installed (the prompt prefix alone then steers the model)."""
    choice = prompt.tool_choice
    if choice.mode not in ("required", "named") or not prompt.tools or not grammars_available():
        return None
    return StructuredOutputParams(
        ebnf=tool_call_grammar(prompt.tools, choice.name if choice.mode == "named" else None)
    )
