"""The tokenizer as the server and engine see it: HF `tokenizers` for text <-> ids, a jinja2 chat template,
and an incremental detokenizer for streaming."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jinja2.ext
from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Encoding
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.decoders import DecodeStream

from deltaserve.errors import ConfigError, RequestValidationError
from deltaserve.tokenizer_split import split_at_spaces, splits_at_spaces

# Texts of this many characters or more (~1.5k tokens) encode in pieces of ~ENCODE_PIECE_CHARS on all
# cores: 8,192 random tokens (51k characters) took 14 ms in one piece, 4.2 ms in pieces, on 2 cores.
PARALLEL_ENCODE_FROM_CHARS = 8192
ENCODE_PIECE_CHARS = 2048


class _TemplateRaised(TemplateError):
    """Raised by the template's raise_exception(): its message is written for the client as-is."""


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Unlike jinja2's own tojson: keeps non-ASCII and '<', '>', '&' as they are, and keeps key order.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _template_environment() -> ImmutableSandboxedEnvironment:
    # The settings transformers' apply_chat_template uses, so official templates render identically.
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    return env


def _load_chat_template(model_dir: Path) -> tuple[str | None, Path | None]:
    """(template, file it came from): chat_template.jinja wins over tokenizer_config.json's chat_template."""
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8"), jinja_file
    config_file = model_dir / "tokenizer_config.json"
    if not config_file.is_file():
        return None, None
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{config_file}: not valid JSON ({exc})") from exc
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}, ...]
        named = {entry.get("name"): entry.get("template") for entry in template if isinstance(entry, dict)}
        if "default" not in named:
            raise ConfigError(
                f"{config_file}: chat_template is a list without a 'default' entry (found {sorted(map(str, named))})"
            )
        template = named["default"]
    if template is not None and not isinstance(template, str):
        raise ConfigError(f"{config_file}: chat_template must be a string, found {type(template).__name__}")
    return template, config_file


def _dense_vocab_size(tokenizer: HFTokenizer, source: str) -> int:
    """Number of ids, checked to be exactly 0..N-1 (the engine samples only ids < N)."""
    ids = tokenizer.get_vocab(with_added_tokens=True).values()
    size = len(ids)
    if size == 0:
        raise ConfigError(f"{source}: the vocabulary is empty")
    if len(set(ids)) != size or min(ids) != 0 or max(ids) != size - 1:
        raise ConfigError(
            f"{source}: token ids must be dense 0..{size - 1}, found {len(set(ids))} distinct ids in "
            f"{min(ids)}..{max(ids)}"
        )
    return size


def _parse_tool_call_arguments(messages: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """OpenAI sends tool_calls[].function.arguments as a JSON string; templates iterate it as a mapping.
    Returns new message dicts where that changes; the caller's messages are never mutated."""
    parsed: list[Mapping[str, Any]] = []
    for i, message in enumerate(messages):
        calls = message.get("tool_calls") if isinstance(message, Mapping) else None
        if not calls:
            parsed.append(message)
            continue
        new_calls = []
        for j, call in enumerate(calls):
            function = call.get("function") if isinstance(call, Mapping) else None
            arguments = function.get("arguments") if isinstance(function, Mapping) else None
            if isinstance(arguments, str):
                try:
                    arguments = json.loads(arguments) if arguments.strip() else {}
                except json.JSONDecodeError as exc:
                    raise RequestValidationError(
                        "messages",
                        f"messages[{i}].tool_calls[{j}].function.arguments is not valid JSON ({exc}); "
                        "send a JSON object as a string",
                    ) from exc
                except RecursionError as exc:
                    raise RequestValidationError(
                        "messages",
                        f"messages[{i}].tool_calls[{j}].function.arguments nests too deeply to parse",
                    ) from exc
                call = {**call, "function": {**function, "arguments": arguments}}
            new_calls.append(call)
        parsed.append({**message, "tool_calls": new_calls})
    return parsed


def _final_text(message: Mapping[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, list):  # the last text part
        texts = [p.get("text") for p in content if isinstance(p, Mapping) and isinstance(p.get("text"), str)]
        content = texts[-1] if texts else None
    return content.strip() if isinstance(content, str) else ""


def _ending_in_final_message(text: str, messages: Sequence[Mapping[str, Any]]) -> str:
    """`text` cut right after the last message's content, where the template put it."""
    final = _final_text(messages[-1]) if messages else ""
    if not final:
        raise RequestValidationError(
            "messages", "continue_final_message needs a last message with text content to continue"
        )
    end = text.rfind(final)
    if end < 0:
        raise RequestValidationError(
            "messages", "continue_final_message: the chat template does not render the last message's content"
        )
    return text[: end + len(final)]


class Tokenizer:
    """Text <-> token ids for one model, plus its chat template."""

    def __init__(
        self,
        tokenizer: HFTokenizer,
        chat_template: str | None,
        *,
        source: str = "<memory>",
        template_source: str | None = None,
    ) -> None:
        """`source` names where the tokenizer came from and `template_source` the template (default:
        `source`), for error messages."""
        self._tokenizer = tokenizer
        self._template_source = template_source or source
        self._vocab_size = _dense_vocab_size(tokenizer, source)
        self.special_token_ids: frozenset[int] = frozenset(
            i for i, token in tokenizer.get_added_tokens_decoder().items() if token.special
        )
        self._chat_template = chat_template
        self._max_token_chars: int | None = None
        self._splits_at_spaces = splits_at_spaces(tokenizer)
        self._template: jinja2.Template | None = None
        if chat_template is not None:
            try:
                self._template = _template_environment().from_string(chat_template)
            except TemplateError as exc:
                raise ConfigError(
                    f"{self._template_source}: the chat template does not parse ({exc})"
                ) from exc

    @classmethod
    def from_dir(
        cls,
        model_dir: str | os.PathLike[str],
        *,
        chat_template: str | None = None,
        chat_template_source: str | None = None,
    ) -> Tokenizer:
        """Loads tokenizer.json and the chat template (chat_template.jinja, else tokenizer_config.json);
        `chat_template` replaces the model's (`chat_template_source` names where it came from)."""
        model_dir = Path(model_dir)
        tokenizer_file = model_dir / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise ConfigError(f"{tokenizer_file}: not found; the model directory must contain tokenizer.json")
        try:
            tokenizer = HFTokenizer.from_file(str(tokenizer_file))
        except Exception as exc:  # the Rust side raises a bare Exception for any parse failure
            raise ConfigError(f"{tokenizer_file}: cannot be loaded ({exc})") from exc
        if chat_template is not None:
            return cls(
                tokenizer,
                chat_template,
                source=str(tokenizer_file),
                template_source=chat_template_source or "--chat-template",
            )
        template, template_file = _load_chat_template(model_dir)
        return cls(
            tokenizer, template, source=str(tokenizer_file), template_source=str(template_file or model_dir)
        )

    @property
    def chat_template(self) -> str | None:
        """The template source text, or None when the model has none (chat requests are then refused)."""
        return self._chat_template

    @property
    def vocab_size(self) -> int:
        """Size of the dense id space (base vocab + added tokens); the model's logits may be wider."""
        return self._vocab_size

    def encode(self, text: str) -> list[int]:
        """Ids of `text`. No BOS/EOS is added; added-token strings in the text match as single tokens.
        Releases the GIL while it runs (the batch entry point does; `encode` would hold it) and tracks
        no offsets, so tokenizing a long prompt on a worker thread never stalls other threads. A long
        text is cut into pieces that the batch entry point encodes on all cores, where the tokenizer
        allows it (deltaserve/tokenizer_split.py): the same ids."""
        encodings = self._encode_pieces(text)
        return encodings[0].ids if len(encodings) == 1 else [i for e in encodings for i in e.ids]

    def count(self, text: str) -> int:
        """len(encode(text)), without building the id list."""
        return sum(len(e) for e in self._encode_pieces(text))

    def _encode_pieces(self, text: str) -> list[Encoding]:
        if self._splits_at_spaces and len(text) >= PARALLEL_ENCODE_FROM_CHARS:
            pieces = split_at_spaces(text, ENCODE_PIECE_CHARS)
        else:
            pieces = [text]
        return self._tokenizer.encode_batch_fast(pieces, add_special_tokens=False)

    @property
    def max_token_chars(self) -> int:
        """No token covers more characters than this (the longest token's bytes, or an added token's
        text): a text of n characters has at least n / max_token_chars tokens."""
        if self._max_token_chars is None:
            vocab = self._tokenizer.get_vocab(with_added_tokens=True)  # byte-level: one char per byte
            self._max_token_chars = max(len(token) for token in vocab)
        return self._max_token_chars

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`. Ids >= vocab_size (padding of the logit width) decode as empty text."""
        limit = self._vocab_size
        return self._tokenizer.decode([i for i in ids if i < limit], skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tokenizer.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tokenizer.id_to_token(token_id)

    def new_detokenizer(self, skip_special_tokens: bool = True) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self, skip_special_tokens)

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        **template_kwargs: Any,
    ) -> str:
        """Renders OpenAI-shaped messages (plain dicts) to the prompt text. Extra keyword arguments reach
        the template (e.g. enable_thinking=False). With `continue_final_message` the prompt ends right
        after the last message's content (transformers' rule), so the output continues that message.
        Messages the template rejects raise RequestValidationError(field="messages")."""
        if self._template is None:
            raise RequestValidationError(
                "messages",
                f"this model has no chat template (none in {self._template_source}); use the completions API",
            )
        messages = _parse_tool_call_arguments(messages)
        try:
            text = self._template.render(
                messages=messages, tools=tools, add_generation_prompt=add_generation_prompt, **template_kwargs
            )
        except _TemplateRaised as exc:
            raise RequestValidationError("messages", str(exc)) from exc
        except RecursionError as exc:
            raise RequestValidationError(
                "messages", "the chat template cannot render these messages: a value nests too deeply"
            ) from exc
        except (TemplateError, TypeError, ValueError) as exc:
            raise RequestValidationError(
                "messages", f"the chat template cannot render these messages: {exc}"
            ) from exc
        return _ending_in_final_message(text, messages) if continue_final_message else text


class IncrementalDetokenizer:
    """Streams the text of a growing id sequence, one push of new ids at a time.

    `tokenizers`' DecodeStream decodes a window of the last emitted ids plus the new ones and returns only
    text that does not end in U+FFFD, so a UTF-8 character split across tokens is held back until it
    completes (O(new ids) per push). Invariant: `_held` are the ids pushed since the last emitted text;
    the emitted text ended on a whole character, and ByteLevel decoding is concatenative at such a
    boundary, so flush() = decode(_held) completes the stream exactly: the pushes plus flush() equal
    decode(all ids).
    """

    __slots__ = ("_tokenizer", "_backend", "_stream", "_held", "_skip_special_tokens")

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._backend = tokenizer._tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._held: list[int] = []

    def push(self, token_ids: list[int]) -> str:
        """Adds ids; returns the text they complete (possibly empty)."""
        pieces = []
        for token_id in token_ids:  # one id per step: list steps need tokenizers >= 0.22
            text = self._stream.step(self._backend, token_id)
            if text is None:
                self._held.append(token_id)
            else:
                self._held.clear()
                pieces.append(text)
        return "".join(pieces)

    def flush(self) -> str:
        """Ends the stream: returns held-back text, with U+FFFD for a character that never completed."""
        text = self._tokenizer.decode(self._held, skip_special_tokens=self._skip_special_tokens)
        self._held.clear()
        return text
