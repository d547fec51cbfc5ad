"""Request text that no tokenizer, template or JSON encoder can take: lone UTF-16 surrogates.

JSON may escape a surrogate on its own ("\\ud800"); Python's decoder keeps it as a code point that has
no UTF-8 form, so it would fail wherever the text is encoded (tokenizer, grammar compiler, the error
response itself). A decoded pair is one code point, so any surrogate code point left is a lone one.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic_core import PydanticCustomError

LONE_SURROGATE = "lone_surrogate"  # the pydantic error type app.py turns into a 400 naming the field
_SURROGATE = re.compile("[\ud800-\udfff]")


def _has_surrogate(text: str) -> bool:
    return not text.isascii() and _SURROGATE.search(text) is not None


_CAN_HOLD_TEXT = (str, dict, list)


def lone_surrogate_path(data: Any) -> list[str | int] | None:
    """The path (keys and indexes) to the first string, or mapping key, holding a lone surrogate.
    Numbers, booleans and nulls hold no text and get no path: a list of token ids is passed over
    after one look at the types it holds (~30 µs for 1,024 ids, against ~550 µs with a path each)."""
    stack: list[tuple[list[str | int], Any]] = [([], data)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            if _has_surrogate(value):
                return path
        elif isinstance(value, dict):
            for key, item in value.items():
                if isinstance(key, str) and _has_surrogate(key):
                    return path
                if isinstance(item, _CAN_HOLD_TEXT):
                    stack.append(([*path, key], item))
        elif isinstance(value, list) and any(issubclass(t, _CAN_HOLD_TEXT) for t in set(map(type, value))):
            for i, item in enumerate(value):
                if isinstance(item, _CAN_HOLD_TEXT):
                    stack.append(([*path, i], item))
    return None


def format_path(path: list[str | int]) -> str:
    """`messages[0].content` for ["messages", 0, "content"]."""
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "the request body"


def refuse_lone_surrogates(data: Any) -> None:
    path = lone_surrogate_path(data)
    if path is None:
        return
    where = format_path(path)
    raise PydanticCustomError(
        LONE_SURROGATE,
        "{where} holds a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff escape), which is not text; "
        "send valid Unicode",
        {"where": where, "field": str(path[0]) if path else None},
    )
