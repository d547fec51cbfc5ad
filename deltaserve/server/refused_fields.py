"""Request fields of the OpenAI and vLLM APIs that this server does not implement and that change what
a request means. Sent with a value that asks for something, such a field is refused (400 naming it)
rather than dropped; any other unknown field is logged and ignored (clients send many that change
nothing: `metadata`, `store`, `service_tier`, `priority` 0, ...)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from deltaserve.server.errors import unsupported


def _set(value: Any) -> bool:
    return value is not None and value is not False and value != [] and value != {}


def _not_text_only(value: Any) -> bool:
    return isinstance(value, list) and any(m != "text" for m in value)


def _asks_for_logprobs(value: Any) -> bool:
    return isinstance(value, list) and any("logprobs" in str(v) for v in value)


# field -> (does this value ask for something?, what to send instead)
Rule = tuple[Callable[[Any], bool], str]

_SAMPLING: dict[str, Rule] = {
    "use_beam_search": (_set, "there is no beam search; omit it"),
    "logits_processors": (_set, "omit it"),
    # vLLM refuses a priority other than 0 unless its scheduling policy is "priority"; ours is arrival order
    "priority": (
        lambda v: v is not None and v != 0,
        "requests are served in arrival order; send 0 or omit it",
    ),
    "guided_whitespace_pattern": (_set, "structured output never has free whitespace; omit it"),
    "prompt_embeds": (_set, "send text or token ids"),
    "kv_transfer_params": (_set, "there is no disaggregated serving"),
    "vllm_xargs": (_set, "omit it"),
}

_CHAT: dict[str, Rule] = {
    **_SAMPLING,
    "best_of": (lambda v: _set(v) and v != 1, "use n"),
    "functions": (_set, "send tools (functions is the legacy form)"),
    "function_call": (_set, "send tool_choice (function_call is the legacy form)"),
    "modalities": (_not_text_only, "the output is text only; send ['text'] or omit it"),
    "audio": (_set, "the output is text only"),
    "prediction": (_set, "omit it"),
    "web_search_options": (_set, "there is no web search tool"),
    "documents": (_set, "put them in a message"),
}

_RESPONSES: dict[str, Rule] = {
    **_SAMPLING,
    "background": (_set, "omit it"),
    "conversation": (_set, "use previous_response_id"),
    "prompt": (_set, "send input"),
    "top_logprobs": (_set, "/v1/chat/completions returns logprobs"),
    "include": (_asks_for_logprobs, "/v1/chat/completions returns logprobs"),
    "max_tool_calls": (_set, "parallel_tool_calls false allows one call"),
}

RULES: dict[str, dict[str, Rule]] = {
    "/v1/completions": _SAMPLING,
    "/v1/chat/completions": _CHAT,
    "/v1/responses": _RESPONSES,
}


def refuse_meaningful_fields(endpoint: str, extra: dict[str, Any] | None) -> None:
    """400 (code unsupported) for the first unknown field of `extra` that asks for something."""
    rules = RULES[endpoint]
    for field, value in (extra or {}).items():
        rule = rules.get(field)
        if rule is not None and rule[0](value):
            shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
            raise unsupported(field, f"{field} is not supported by this server, got {shown}; {rule[1]}")
