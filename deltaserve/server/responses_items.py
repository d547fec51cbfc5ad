"""Responses API input items and tools -> chat messages and chat-shaped tools, for the chat template.

Item mapping: a message item is a chat message (input_text / output_text parts joined); a reasoning
item starts an assistant turn with `reasoning_content`; function_call items join the assistant turn
before them as `tool_calls`; function_call_output is a `tool` message. Anything else is refused by name.
"""

from __future__ import annotations

from typing import Any

from deltaserve.server.errors import bad_request, unsupported
from deltaserve.server.responses_protocol import InputItem

_TEXT_PARTS = ("input_text", "output_text", "text", "reasoning_text", "summary_text")
_ROLES = ("user", "system", "developer", "assistant")


def _text(content: str | list[dict[str, Any]] | None, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type")
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise unsupported(
                "input", f"{where}.content[{j}]: part type {kind!r} is not supported (text only)"
            )
        texts.append(part["text"])
    return "".join(texts)


def input_messages(items: str | list[InputItem]) -> list[dict[str, Any]]:
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.type or ("message" if item.role is not None else None)
        last = messages[-1] if messages and messages[-1]["role"] == "assistant" else None
        if kind == "message":
            if item.role not in _ROLES:
                raise bad_request(f"{where}: role must be one of {list(_ROLES)}, got {item.role!r}", "input")
            text = _text(item.content, where)
            if (
                item.role == "assistant"
                and last is not None
                and not last["content"]
                and "tool_calls" not in last
            ):
                last["content"] = text  # the answer after a reasoning item: one turn
            else:
                messages.append({"role": item.role, "content": text})
        elif kind == "reasoning":
            reasoning = _text(item.content, where) or _text(getattr(item, "summary", None), where)
            messages.append({"role": "assistant", "content": "", "reasoning_content": reasoning})
        elif kind == "function_call":
            if not item.call_id or not item.name:
                raise bad_request(f"{where}: a function_call item needs call_id and name", "input")
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments or "{}"},
            }
            if last is None:
                last = {"role": "assistant", "content": ""}
                messages.append(last)
            last.setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            if not item.call_id:
                raise bad_request(f"{where}: a function_call_output item needs call_id", "input")
            output = item.output if isinstance(item.output, str) else _text(item.output, where)
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": output})
        else:
            raise unsupported("input", f"{where}: item type {kind!r} is not supported")
    return messages


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses tools are flat ({"type": "function", "name", ...}); the template wants the chat shape.
    A function is enforced as strict when it says `strict: true` (OpenAI's Responses API makes that
    its default; here an omitted `strict` is not enforced, as in chat)."""
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise unsupported(
                "tools", f"tools[{i}]: tool type {tool.get('type')!r} is not supported (function only)"
            )
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            raise bad_request(f"tools[{i}]: a function tool needs a name", "tools")
        function = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
        if tool.get("strict") is True:
            function["strict"] = True
        out.append({"type": "function", "function": function})
    return out
