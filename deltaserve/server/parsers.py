"""Streaming-safe parsers for Qwen3.5 output: reasoning (`<think>`) and Qwen XML tool calls.

Output layout. With thinking on, the chat template ends the prompt with `<think>\\n`, so the output is
reasoning until `</think>` (usually followed by `\\n\\n`), then content. With thinking off the prompt ends
with `<think>\\n\\n</think>\\n\\n` and the output is content. Either way an output that itself starts with
`<think>` opens reasoning (templates that do not pre-open it). A `<tool_call>` seen during reasoning ends
the reasoning and belongs to the content: tool calls are never reasoning (vllm#39056).

Tool calls (the Qwen3-Coder XML format that the Qwen3.5 template teaches):

    <tool_call>
    <function=NAME>
    <parameter=KEY>
    VALUE
    </parameter>
    </function>
    </tool_call>

Streaming invariants:
- Only the shortest suffix that could still begin a tag is held back; text without `<` is emitted by the
  same `feed` that received it. Exceptions: one trailing `\\n` of a string argument (it may be the newline
  that precedes `</parameter>`, which is stripped) and non-string argument values (converted when their
  parameter closes).
- A call's `id` and `name` are emitted once `<function=NAME>` is complete; the concatenation of all
  `arguments` fragments of a call is `json.dumps(args, ensure_ascii=False)`.

Documented choices:
- A parameter whose schema lists its values (`enum`, `const`) gets the member its text spells,
  whitespace around it ignored (` c ` is "c", ` 3` is 3); text that spells none stays a string. A
  string with a length, pattern or format constraint is stripped of the whitespace around it.
- Types come from the request's `tools` schema: integer/number, boolean, null, object/array are converted;
  string, anyOf/oneOf, a list of several non-null types, a parameter missing from the schema and a function
  missing from `tools` keep the value text verbatim as a JSON string (as vLLM does). For converted types
  the text `null` (any case) is null; a value that does not convert to its schema type is kept as a
  string, and so is a non-finite number. object/array accept JSON, else a Python literal.
- A value ends only at `</parameter>`: values may contain any other text, including other tags. A
  parameter the model repeats appears twice in the arguments text (JSON parsers keep the last).
- Text inside a function but outside its parameters is ignored; whitespace right after `<think>`,
  `</think>` and `</tool_call>` is dropped. `</tool_call>` also closes a function missing `</function>`.
- A `<tool_call>` block that does not open with `<function=NAME>` is not a call: its raw text is content.
- At `finish()` (e.g. max_tokens cut the output), a call whose name was not complete comes back as raw
  content; an open call is closed so its arguments stay valid JSON: a cut-off value keeps the text it had
  received, a parameter whose name was cut off is dropped, and the call is listed in `cut_off` (it is
  not a complete call). A missing final `</tool_call>` after `</function>` is no error.
"""

from __future__ import annotations

import ast
import json
import math
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum, auto

_THINK_OPEN = "<think>"
_THINK_CLOSE = "</think>"
_TOOL_OPEN = "<tool_call>"
_TOOL_CLOSE = "</tool_call>"
_FUNC_OPEN = "<function="
_FUNC_CLOSE = "</function>"
_PARAM_OPEN = "<parameter="
_PARAM_CLOSE = "</parameter>"

# Schema types whose values are converted; any other type keeps the value text as a string.
_CONVERTED_TYPES = frozenset({"integer", "number", "boolean", "null", "object", "array"})
_ENUM = "enum"  # a value with listed members (enum or const) is matched against them
# A string with a length, pattern or format constraint is the text between any whitespace around it
# (a forced call's grammar lets layout whitespace surround it); other strings are kept verbatim.
_TRIMMED = "trimmed string"
_STRING_CONSTRAINTS = frozenset({"minLength", "maxLength", "pattern", "format"})


@dataclass(slots=True)
class ToolCallDelta:
    index: int  # 0-based position of the call in the response
    id: str | None  # set only on the call's first delta
    name: str | None  # set only on the call's first delta
    arguments: str  # a fragment of the call's JSON arguments text


@dataclass(slots=True)
class ParsedDelta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


@dataclass(slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a complete JSON object text


def _new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def _partial_tag_len(text: str, tags: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `tags` (0 if none)."""
    longest = 0
    for tag in tags:
        for n in range(min(len(tag) - 1, len(text)), longest, -1):
            if text.endswith(tag[:n]):
                longest = n
                break
    return longest


def _find_first(text: str, tags: tuple[str, ...]) -> tuple[int, str]:
    """Position and text of the earliest complete tag in `text`, or (-1, "")."""
    best, found = -1, ""
    for tag in tags:
        i = text.find(tag)
        if i >= 0 and (best < 0 or i < best):
            best, found = i, tag
    return best, found


class ReasoningParser:
    """Splits one response's text into reasoning and content, incrementally."""

    def __init__(self, *, thinking: bool) -> None:
        self._in_reasoning = thinking
        self._at_start = True  # nothing consumed yet: the output may still open with <think>
        self._skip_ws = False  # drop whitespace right after a <think> or </think> tag
        self._buf = ""  # text received but not yet emitted; only ever a possible tag prefix

    def feed(self, text: str) -> tuple[str, str]:
        """Returns the (reasoning, content) text that `text` completes."""
        self._buf += text
        reasoning: list[str] = []
        content: list[str] = []
        while self._buf and self._step(reasoning, content):
            pass
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """Flushes the held-back text at the end of the output."""
        rest, self._buf = self._buf, ""
        return (rest, "") if self._in_reasoning else ("", rest)

    def _step(self, reasoning: list[str], content: list[str]) -> bool:
        """Consumes the start of the buffer; False when more text is needed."""
        if self._at_start:
            if self._buf.startswith(_THINK_OPEN):
                self._buf = self._buf[len(_THINK_OPEN) :]
                self._in_reasoning = self._skip_ws = True
            elif _THINK_OPEN.startswith(self._buf):
                return False
            self._at_start = False
            return True
        if self._skip_ws:
            self._buf = self._buf.lstrip()
            self._skip_ws = not self._buf
            return not self._skip_ws
        if not self._in_reasoning:
            content.append(self._buf)
            self._buf = ""
            return False
        i, tag = _find_first(self._buf, (_THINK_CLOSE, _TOOL_OPEN))
        if i < 0:
            cut = len(self._buf) - _partial_tag_len(self._buf, (_THINK_CLOSE, _TOOL_OPEN))
            reasoning.append(self._buf[:cut])
            self._buf = self._buf[cut:]
            return False
        reasoning.append(self._buf[:i])
        self._in_reasoning = False
        if tag == _THINK_CLOSE:
            self._buf = self._buf[i + len(_THINK_CLOSE) :]
            self._skip_ws = True
        else:  # <tool_call> ends reasoning and stays in the text: the tool parser needs it
            self._buf = self._buf[i:]
        return True


class _State(Enum):
    TEXT = auto()  # content, watching for <tool_call>
    BLOCK = auto()  # inside <tool_call>, expecting <function= or </tool_call>
    FUNC_NAME = auto()  # after <function=, reading the name up to '>'
    BODY = auto()  # inside a function, expecting <parameter=, </function> or </tool_call>
    PARAM_NAME = auto()  # after <parameter=, reading the key up to '>'
    VALUE = auto()  # inside a parameter value, up to </parameter>


def _tool_schemas(tools: list[dict] | None) -> dict[str, dict]:
    """Function name -> JSON-schema `properties`. Accepts the Chat (`{"function": {...}}`) and the
    Responses (flat) tool shapes; tools that are not functions are skipped."""
    schemas: dict[str, dict] = {}
    for tool in tools or ():
        fn = tool.get("function", tool)
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            params = fn.get("parameters")
            props = params.get("properties") if isinstance(params, dict) else None
            schemas[fn["name"]] = props if isinstance(props, dict) else {}
    return schemas


def _param_type(schema: object) -> str | None:
    """The schema type to convert a value to, or None to keep the value text as a string."""
    if not isinstance(schema, dict):
        return None
    if isinstance(schema.get("enum"), list) or "const" in schema:
        return _ENUM
    kind = schema.get("type")
    if kind == "string" and _STRING_CONSTRAINTS & schema.keys():
        return _TRIMMED
    if isinstance(kind, list):
        non_null = [k for k in kind if k != "null"]
        kind = non_null[0] if len(non_null) == 1 else ("null" if not non_null else None)
    return kind if kind in _CONVERTED_TYPES else None


def _parse_structured(text: str) -> object:
    """`text` parsed as JSON, else as a Python literal (models sometimes write `['a', True]`).
    Raises ValueError when neither gives a value with a JSON form."""
    for parse in (json.loads, ast.literal_eval):
        try:
            parsed = parse(text)
            json.dumps(parsed, allow_nan=False)  # a set, bytes, NaN or inf has no JSON form
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            continue
        return parsed
    raise ValueError(f"not a JSON or Python literal: {text[:40]!r}")


def _listed_value(value: str, schema: dict) -> object:
    """The enum (or const) member the value text spells, whitespace around it ignored; the text itself
    when it spells none."""
    members = schema["enum"] if isinstance(schema.get("enum"), list) else [schema.get("const")]
    text = value.strip()
    for member in members:
        if member == text or (not isinstance(member, str) and json.dumps(member) == text):
            return member
    return value


def _convert(value: str, kind: str, schema: object = None) -> object:
    """The value text converted to schema type `kind`; the text itself when it does not convert."""
    if kind == _ENUM:
        return _listed_value(value, schema)  # type: ignore[arg-type]
    if kind == _TRIMMED:
        return value.strip()
    text = value.strip()
    if text.lower() == "null":  # any converted type may be null (optional parameters)
        return None
    if kind in ("integer", "number"):
        try:
            return int(text)
        except ValueError:
            pass
        try:
            number = float(text)
        except ValueError:
            return value
        return number if math.isfinite(number) else value
    if kind == "boolean":
        return text.lower() == "true" if text.lower() in ("true", "false") else value
    if kind in ("object", "array"):
        try:
            return _parse_structured(text)
        except ValueError:
            return value
    return value


def _json_fragment(text: str) -> str:
    """`text` escaped as the inside of a JSON string. Escaping is per character, so the fragments of a
    string concatenate to the escape of the whole string."""
    return json.dumps(text, ensure_ascii=False)[1:-1]


class ToolCallParser:
    """Separates Qwen XML tool calls from content and streams them as OpenAI tool-call deltas."""

    def __init__(self, tools: list[dict] | None, *, id_factory: Callable[[], str] = _new_call_id) -> None:
        self._schemas = _tool_schemas(tools)
        self._new_id = id_factory
        self._buf = ""  # text received but not yet consumed
        self._state = _State.TEXT
        self._skip_ws = False  # drop whitespace right after </tool_call>
        # Text consumed since <tool_call> (or since the block's last call) that belongs to no call yet;
        # it becomes content if no call comes out of it.
        self._raw = ""
        self._block_has_call = False
        self._index = -1  # index of the current (or last) call
        self.cut_off: set[int] = set()  # calls the output ended inside of (closed by finish())
        self._props: dict | None = None  # schema properties of the current call; None if unknown
        self._num_params = 0  # parameters emitted in the current call
        self._value_schema: object = None  # the current parameter's schema
        self._value_type: str | None = None  # None: the value streams as a JSON string
        self._value_started = False  # the value's first character (a newline to strip) was seen
        self._value = ""  # consumed text of a converted (non-string) value
        self._handlers: dict[_State, Callable[[ParsedDelta], bool]] = {
            _State.TEXT: self._text,
            _State.BLOCK: self._block,
            _State.FUNC_NAME: self._func_name,
            _State.BODY: self._body,
            _State.PARAM_NAME: self._param_name,
            _State.VALUE: self._value_text,
        }

    def feed(self, text: str) -> ParsedDelta:
        """Returns the content and tool-call deltas that `text` completes."""
        self._buf += text
        out = ParsedDelta()
        # Each handler consumes from the buffer and returns False when it needs more text.
        while self._buf and self._handlers[self._state](out):
            pass
        return out

    def finish(self) -> ParsedDelta:
        """Flushes held-back text and closes a call cut off mid-way (see the module docstring)."""
        out = ParsedDelta()
        rest, self._buf = self._buf, ""
        if self._state is _State.TEXT:
            out.content = rest
        elif self._state in (_State.BLOCK, _State.FUNC_NAME):
            pending = self._raw + rest
            if pending.strip():
                out.content = pending
        else:
            if self._state is _State.VALUE:
                self._close_value(self._value + rest, out)
            self._emit_args(out, "}")
            self.cut_off.add(self._index)
        self._state = _State.TEXT
        return out

    def _consume(self, n: int) -> str:
        head, self._buf = self._buf[:n], self._buf[n:]
        return head

    def _emit_args(self, out: ParsedDelta, fragment: str) -> None:
        last = out.tool_calls[-1] if out.tool_calls else None
        if last is not None and last.index == self._index:
            last.arguments += fragment
        else:
            out.tool_calls.append(ToolCallDelta(self._index, None, None, fragment))

    def _text(self, out: ParsedDelta) -> bool:
        if self._skip_ws:
            self._buf = self._buf.lstrip()
            self._skip_ws = not self._buf
            return not self._skip_ws
        i = self._buf.find(_TOOL_OPEN)
        if i < 0:
            out.content += self._consume(len(self._buf) - _partial_tag_len(self._buf, (_TOOL_OPEN,)))
            return False
        out.content += self._consume(i)
        self._raw = self._consume(len(_TOOL_OPEN))
        self._block_has_call = False
        self._state = _State.BLOCK
        return True

    def _block(self, out: ParsedDelta) -> bool:
        stripped = self._buf.lstrip()
        self._raw += self._consume(len(self._buf) - len(stripped))
        if not self._buf:
            return False
        if self._buf.startswith(_FUNC_OPEN):
            self._raw += self._consume(len(_FUNC_OPEN))
            self._state = _State.FUNC_NAME
        elif self._buf.startswith(_TOOL_CLOSE):
            closing = self._consume(len(_TOOL_CLOSE))
            if not self._block_has_call:
                out.content += self._raw + closing
            self._raw = ""
            self._state = _State.TEXT
            self._skip_ws = self._block_has_call
        elif _FUNC_OPEN.startswith(self._buf) or _TOOL_CLOSE.startswith(self._buf):
            return False
        else:  # not a call: the block's raw text is content (after a call, the block just ended)
            if not self._block_has_call:
                out.content += self._raw
            self._raw = ""
            self._state = _State.TEXT
        return True

    def _func_name(self, out: ParsedDelta) -> bool:
        i = self._buf.find(">")
        if i < 0:
            return False
        name = self._consume(i + 1)[:-1].strip()
        self._index += 1
        self._props = self._schemas.get(name)
        self._num_params = 0
        self._raw = ""
        self._block_has_call = True
        out.tool_calls.append(ToolCallDelta(self._index, self._new_id(), name, "{"))
        self._state = _State.BODY
        return True

    def _body(self, out: ParsedDelta) -> bool:
        tags = (_PARAM_OPEN, _FUNC_CLOSE, _TOOL_CLOSE)
        i, tag = _find_first(self._buf, tags)
        if i < 0:  # stray text between parameters is ignored; keep only a possible tag start
            self._consume(len(self._buf) - _partial_tag_len(self._buf, tags))
            return False
        self._consume(i + len(tag))
        if tag == _PARAM_OPEN:
            self._state = _State.PARAM_NAME
            return True
        self._emit_args(out, "}")
        self._state = _State.BLOCK if tag == _FUNC_CLOSE else _State.TEXT
        self._skip_ws = tag == _TOOL_CLOSE
        return True

    def _param_name(self, out: ParsedDelta) -> bool:
        i = self._buf.find(">")
        if i < 0:
            return False
        key = self._consume(i + 1)[:-1].strip()
        self._value_schema = self._props.get(key) if self._props is not None else None
        self._value_type = _param_type(self._value_schema)
        self._value_started = False
        self._value = ""
        separator = ", " if self._num_params else ""
        quote = '"' if self._value_type is None else ""
        self._emit_args(out, f"{separator}{json.dumps(key, ensure_ascii=False)}: {quote}")
        self._num_params += 1
        self._state = _State.VALUE
        return True

    def _value_text(self, out: ParsedDelta) -> bool:
        if not self._value_started:  # the newline after <parameter=KEY> is not part of the value
            if self._buf.startswith("\n"):
                self._consume(1)
            self._value_started = True
        i = self._buf.find(_PARAM_CLOSE)
        if i >= 0:
            text = self._consume(i)
            self._consume(len(_PARAM_CLOSE))
            self._close_value(self._value + text, out)
            self._state = _State.BODY
            return True
        # Hold back a possible start of </parameter> and the one newline that may precede it.
        cut = len(self._buf) - _partial_tag_len(self._buf, (_PARAM_CLOSE,))
        if cut and self._buf[cut - 1] == "\n":
            cut -= 1
        text = self._consume(cut)
        if self._value_type is None:
            if text:
                self._emit_args(out, _json_fragment(text))
        else:
            self._value += text
        return False

    def _close_value(self, text: str, out: ParsedDelta) -> None:
        """Emits the rest of the current value. `text` is everything not yet emitted of it."""
        if text.endswith("\n"):
            text = text[:-1]
        if self._value_type is None:
            self._emit_args(out, _json_fragment(text) + '"')
        else:
            converted = _convert(text, self._value_type, self._value_schema)
            self._emit_args(out, json.dumps(converted, ensure_ascii=False))


def parse_tool_calls(text: str, tools: list[dict] | None) -> tuple[str, list[ToolCall]]:
    """Non-streaming form: (content without the tool-call blocks, stripped; the calls in order)."""
    parser = ToolCallParser(tools)
    content: list[str] = []
    calls: list[ToolCall] = []
    for delta in (parser.feed(text), parser.finish()):
        content.append(delta.content)
        for call in delta.tool_calls:
            if call.id is not None:  # a call's first delta carries its id and name
                calls.append(ToolCall(call.id, call.name or "", call.arguments))
            else:
                calls[call.index].arguments += call.arguments
    return "".join(content).strip(), calls


class OutputParser:
    """Reasoning, content and tool calls of one response. Reasoning text never reaches the tool parser;
    with `parse_tools` False (tool_choice "none" or no tools) tool-call text stays content."""

    def __init__(self, *, thinking: bool, tools: list[dict] | None, parse_tools: bool) -> None:
        self._reasoning = ReasoningParser(thinking=thinking)
        self._tools = ToolCallParser(tools) if parse_tools else None

    def feed(self, text: str) -> ParsedDelta:
        reasoning, content = self._reasoning.feed(text)
        if self._tools is None:
            return ParsedDelta(reasoning, content)
        delta = self._tools.feed(content)
        delta.reasoning = reasoning
        return delta

    @property
    def cut_off_calls(self) -> set[int]:
        """Indices of calls the output ended inside of: their arguments are what came before the end."""
        return self._tools.cut_off if self._tools is not None else set()

    def finish(self) -> ParsedDelta:
        reasoning, content = self._reasoning.finish()
        if self._tools is None:
            return ParsedDelta(reasoning, content)
        delta = self._tools.feed(content)
        tail = self._tools.finish()
        delta.reasoning = reasoning
        delta.content += tail.content
        delta.tool_calls.extend(tail.tool_calls)
        return delta
