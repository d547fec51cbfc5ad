"""Chat messages + tools + tool_choice -> the prompt text and ids, and how to parse the output.

Shared by /v1/chat/completions and /v1/responses. Decisions:
- OpenAI's `developer` role is the template's `system`.
- Thinking is on when the rendered prompt ends with an open `<think>` (the Qwen3.5 template opens it
  unless chat_template_kwargs has enable_thinking=false, which reasoning effort "none" also sets); the
  output is then reasoning until `</think>`. Without a generation prompt, or continuing the final
  message, the output is content.
- tool_choice "none" leaves the tools out of the prompt and tool-call text stays content.
- tool_choice "required" or a named function is enforced by starting the
  assistant turn with the call (and, where xgrammar is installed, by its grammar: tool_grammar.py): the prompt ends with `<tool_call>\\n<function=` (required) or
  `<tool_call>\\n<function=NAME>\\n` (named), thinking is off, and the parser is fed that prefix first,
  so the call is in the output whatever the model does next.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from deltaserve.errors import RequestValidationError
from deltaserve.server.errors import bad_request, from_validation
from deltaserve.server.sampling import check_prompt_text
from deltaserve.tokenizer import Tokenizer

_RESERVED_TEMPLATE_KWARGS = frozenset(
    {"messages", "tools", "add_generation_prompt", "continue_final_message"}
)
_TOOL_CALL_START = "<tool_call>\n<function="


@dataclass(frozen=True, slots=True)
class ToolChoice:
    """A normalised tool_choice: mode is none | auto | required | named (then `name` is set)."""

    mode: str
    name: str | None = None


@dataclass(frozen=True, slots=True)
class ChatPrompt:
    text: str  # what the model sees, forced prefix included
    token_ids: list[int]
    thinking: bool  # the output starts inside <think>
    tools: list[dict[str, Any]] | None  # chat-shaped tool definitions, for typing call arguments
    parse_tools: bool
    forced_prefix: str  # output text the prompt already contains; feed it to the parser first
    tool_choice: ToolChoice = ToolChoice("auto")  # "required"/"named" calls are also grammar-constrained
    cache_points: list[int] = field(default_factory=list)  # message boundaries for the prefix cache
    parallel_tool_calls: bool = True  # False: one call at most (the grammar's, or the first parsed)


def answer_start_token(tokenizer: Tokenizer, prompt: ChatPrompt) -> int | None:
    """The token an answer constraint starts after: `</think>` when the output opens inside reasoning."""
    return tokenizer.token_to_id("</think>") if prompt.thinking else None


def normalise_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """developer -> system; a missing content (an assistant turn that only calls tools) -> ""."""
    out = []
    for m in messages:
        m = {**m, "content": m.get("content") or ""}
        if m.get("role") == "developer":
            m["role"] = "system"
        out.append(m)
    return out


def check_tool_choice(choice: ToolChoice, tools: list[dict[str, Any]] | None) -> None:
    names = [t["function"]["name"] for t in tools or ()]
    if choice.mode in ("required", "named") and not names:
        raise bad_request(f"tool_choice {choice.mode!r} needs a non-empty tools list", "tool_choice")
    if choice.mode == "named" and choice.name not in names:
        raise bad_request(
            f"tool_choice names the function {choice.name!r}, which is not in tools ({names})", "tool_choice"
        )


def template_kwargs(
    server_defaults: dict[str, Any], request: dict[str, Any] | None, reasoning_effort: str | None
) -> dict[str, Any]:
    """The kwargs the template gets: the server's --default-chat-template-kwargs, under reasoning effort
    "none" (thinking off), under the request's own chat_template_kwargs."""
    effort = {"enable_thinking": False} if reasoning_effort == "none" else {}
    return {**server_defaults, **effort, **(request or {})}


def render_chat_prompt(
    tokenizer: Tokenizer,
    messages: list[dict[str, Any]],
    *,
    tools: list[dict[str, Any]] | None,
    tool_choice: ToolChoice,
    template_kwargs: dict[str, Any],
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    parallel_tool_calls: bool = True,
    max_model_len: int | None = None,
    messages_field: str = "messages",
) -> ChatPrompt:
    """Raises APIError (400, naming `messages_field`) for messages the template refuses, a tool_choice
    that cannot be met, or, with `max_model_len`, a rendered text too long to fit it (refused before
    it is tokenized). With `continue_final_message` the output continues the last message (no
    generation prompt)."""
    tools = tools or None
    check_tool_choice(tool_choice, tools)
    reserved = sorted(_RESERVED_TEMPLATE_KWARGS & template_kwargs.keys())
    if reserved:
        raise bad_request(f"chat_template_kwargs must not set {reserved}", "chat_template_kwargs")
    if continue_final_message and add_generation_prompt:
        raise bad_request(
            "continue_final_message continues the last message, add_generation_prompt opens a new one; "
            "set add_generation_prompt to false",
            "add_generation_prompt",
        )
    if tool_choice.mode in ("required", "named") and not add_generation_prompt:
        raise bad_request(
            f"tool_choice {tool_choice.mode!r} starts a new assistant turn with the call; it cannot be "
            "combined with add_generation_prompt false or continue_final_message",
            "tool_choice",
        )
    forced = ""
    kwargs = dict(template_kwargs)
    if tool_choice.mode == "required":
        forced = _TOOL_CALL_START
    elif tool_choice.mode == "named":
        forced = f"{_TOOL_CALL_START}{tool_choice.name}>\n"
    if forced:
        kwargs["enable_thinking"] = False
    template_tools = None if tool_choice.mode == "none" else tools
    try:
        text = tokenizer.apply_chat_template(
            normalise_messages(messages),
            tools=template_tools,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            **kwargs,
        )
    except RequestValidationError as err:
        raise from_validation(err, {"messages": messages_field}) from err
    thinking = text.rstrip().endswith("<think>")
    text += forced
    if max_model_len is not None:
        check_prompt_text(text, max_model_len, tokenizer.max_token_chars, param=messages_field)
    token_ids = tokenizer.encode(text)
    return ChatPrompt(
        text=text,
        token_ids=token_ids,
        thinking=thinking,
        tools=tools,
        parse_tools=tools is not None and tool_choice.mode != "none",
        forced_prefix=forced,
        tool_choice=tool_choice,
        cache_points=chat_cache_points(tokenizer, token_ids),
        parallel_tool_calls=parallel_tool_calls,
    )


def chat_cache_points(tokenizer: Tokenizer, token_ids: list[int]) -> list[int]:
    """Where the next turn of this conversation is likely to diverge, for the prefix cache: the end
    of a leading system turn (system message and tools, shared across conversations) and the end of
    the last message before the generation prompt (the template renders earlier assistant turns
    without their reasoning, so the next turn's prompt leaves this one's there). A message ends after
    its `<|im_end|>` and the newline that follows."""
    end, newline = tokenizer.encode("<|im_end|>\n")
    bounds, i = [], -1
    while True:
        try:
            i = token_ids.index(end, i + 1)
        except ValueError:
            break
        if i + 1 < len(token_ids) and token_ids[i + 1] == newline:
            bounds.append(i + 2)
    if not bounds:
        return []
    points = {bounds[-1]}
    if token_ids[:2] == tokenizer.encode("<|im_start|>system"):
        points.add(bounds[0])
    return sorted(points)
