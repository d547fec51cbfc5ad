"""The assistant's output text, split into reasoning, content and tool calls as it streams.

Wraps the streaming OutputParser for one response: feeds the forced tool-call prefix first (its deltas
come out with the first real delta) and remembers everything for the non-streaming form. Invariant:
the concatenation of all deltas handed out equals the final `reasoning`, `content` and `tool_calls`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from deltaserve.server.chat_prompt import ChatPrompt
from deltaserve.server.parsers import OutputParser, ParsedDelta, ToolCallDelta


def _extend_calls(calls: list[ToolCallDelta], more: list[ToolCallDelta]) -> None:
    """Appends `more`, folding an argument fragment into the previous delta of the same call."""
    for call in more:
        last = calls[-1] if calls else None
        if last is not None and call.id is None and last.index == call.index:
            last.arguments += call.arguments
        else:
            calls.append(ToolCallDelta(call.index, call.id, call.name, call.arguments))


@dataclass(slots=True)
class CallState:
    id: str
    name: str
    arguments: str = ""


@dataclass(slots=True)
class AssistantOutput:
    parser: OutputParser
    pending: ParsedDelta = field(default_factory=ParsedDelta)  # deltas of the forced prefix, not yet sent
    # The output so far as pieces (a long reasoning is never copied whole per delta).
    reasoning_pieces: list[str] = field(default_factory=list)
    content_pieces: list[str] = field(default_factory=list)
    calls: list[CallState] = field(default_factory=list)
    single_call: bool = False  # parallel_tool_calls false: calls after the first are dropped

    @classmethod
    def for_prompt(cls, prompt: ChatPrompt) -> AssistantOutput:
        parser = OutputParser(thinking=prompt.thinking, tools=prompt.tools, parse_tools=prompt.parse_tools)
        out = cls(parser, single_call=not prompt.parallel_tool_calls)
        if prompt.forced_prefix:
            out.pending = parser.feed(prompt.forced_prefix)
        return out

    def feed(self, text: str, *, final: bool = False) -> ParsedDelta:
        """The delta `text` completes; with `final`, also everything held back (end of the output)."""
        delta, self.pending = self.pending, ParsedDelta()
        for part in (self.parser.feed(text) if text else None, self.parser.finish() if final else None):
            if part is not None:
                delta.reasoning += part.reasoning
                delta.content += part.content
                _extend_calls(delta.tool_calls, part.tool_calls)
        if self.single_call:
            delta.tool_calls = [c for c in delta.tool_calls if c.index == 0]
        self._record(delta)
        return delta

    @property
    def reasoning(self) -> str:
        return "".join(self.reasoning_pieces)

    @property
    def content(self) -> str:
        return "".join(self.content_pieces)

    def _record(self, delta: ParsedDelta) -> None:
        if delta.reasoning:
            self.reasoning_pieces.append(delta.reasoning)
        if delta.content:
            self.content_pieces.append(delta.content)
        for call in delta.tool_calls:
            if call.id is not None:
                self.calls.append(CallState(call.id, call.name or "", call.arguments))
            else:
                self.calls[call.index].arguments += call.arguments

    @property
    def complete_calls(self) -> list[CallState]:
        """The calls the output closed: a call that max_tokens (or a stop) cut off is not one of them."""
        cut_off = self.parser.cut_off_calls
        return [c for i, c in enumerate(self.calls) if i not in cut_off]

    def finish_reason(self, engine_reason: str | None) -> str | None:
        """OpenAI's: a turn that ended normally with tool calls finished with "tool_calls"."""
        if engine_reason == "stop" and self.complete_calls:
            return "tool_calls"
        return engine_reason

    def tool_call_dicts(self) -> list[dict[str, Any]]:
        """The calls as an assistant message's `tool_calls` (for conversation history)."""
        return [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in self.calls
        ]
