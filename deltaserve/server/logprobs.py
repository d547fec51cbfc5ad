"""Engine logprobs (TokenLogprobs) in the completions and chat wire formats.

A token's bytes are exact: Qwen's byte-level BPE spells each byte as one printable character, so the
token string maps back to its bytes (added tokens such as `<think>` are ASCII and map to themselves).
Its text is those bytes decoded as UTF-8, with U+FFFD where a character continues in another token.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Protocol

from deltaserve.engine.protocol import TokenLogprobs
from deltaserve.server.protocol import (
    ChatLogprobs,
    CompletionLogprobs,
    PromptLogprob,
    PromptLogprobs,
    TokenLogprob,
    TopLogprob,
)
from deltaserve.tokenizer import Tokenizer


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's bytes_to_unicode, inverted: printable character -> the byte it spells."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


class TokenSpelling(Protocol):
    """How logprobs spell a token: its text and bytes."""

    def lookup(self, token_id: int) -> tuple[str, tuple[int, ...]]: ...

    def text(self, token_id: int) -> str: ...


class TokenIdTexts:
    """vLLM's return_tokens_as_token_ids: every token spelled "token_id:N" (its bytes those of that text),
    so that a client maps logprobs back to ids without the tokenizer, whatever bytes a token holds."""

    def lookup(self, token_id: int) -> tuple[str, tuple[int, ...]]:
        text = f"token_id:{token_id}"
        return text, tuple(text.encode())

    def text(self, token_id: int) -> str:
        return f"token_id:{token_id}"


TOKEN_ID_TEXTS = TokenIdTexts()


class TokenTexts:
    """Token id -> (text, bytes), memoised per id."""

    def __init__(self, tokenizer: Tokenizer, cache_size: int = 1 << 16) -> None:
        self._tokenizer = tokenizer
        self.lookup = lru_cache(maxsize=cache_size)(self._lookup)

    def _lookup(self, token_id: int) -> tuple[str, tuple[int, ...]]:
        piece = self._tokenizer.id_to_token(token_id)
        if piece is None:
            return "", ()
        decoder = _byte_decoder()
        if all(ch in decoder for ch in piece):
            raw = bytes(decoder[ch] for ch in piece)
        else:
            raw = piece.encode("utf-8")
        return raw.decode("utf-8", errors="replace"), tuple(raw)

    def text(self, token_id: int) -> str:
        return self.lookup(token_id)[0]


def completion_logprobs(
    texts: TokenSpelling, token_ids: list[int], logprobs: list[TokenLogprobs], offset: int
) -> CompletionLogprobs:
    """The completions format for consecutive tokens whose first character is at text offset `offset`.
    top_logprobs holds the top alternatives plus the sampled token (vLLM's convention)."""
    out = CompletionLogprobs()
    for token_id, lp in zip(token_ids, logprobs, strict=True):
        text = texts.text(token_id)
        top = {texts.text(t): v for t, v in lp.top}
        top.setdefault(text, lp.logprob)
        out.tokens.append(text)
        out.token_logprobs.append(lp.logprob)
        out.top_logprobs.append(top)
        out.text_offset.append(offset)
        offset += len(text)
    return out


def echoed_prompt_logprobs(
    texts: TokenSpelling, prompt_ids: list[int], scored: list[TokenLogprobs | None]
) -> CompletionLogprobs:
    """The completions format for an echoed prompt: its first token has no logprob (None)."""
    out = CompletionLogprobs()
    offset = 0
    for token_id, lp in zip(prompt_ids, scored, strict=True):
        text = texts.text(token_id)
        out.tokens.append(text)
        out.text_offset.append(offset)
        offset += len(text)
        if lp is None:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            continue
        top = {texts.text(t): v for t, v in lp.top}
        top.setdefault(text, lp.logprob)
        out.token_logprobs.append(lp.logprob)
        out.top_logprobs.append(top)
    return out


def prompt_logprobs(
    texts: TokenSpelling, prompt_ids: list[int], scored: list[TokenLogprobs | None]
) -> PromptLogprobs:
    """vLLM's prompt_logprobs: per prompt token, {token id: logprob, rank, decoded_token} for the token
    itself and its top alternatives (ranks of alternatives are their position)."""
    out: PromptLogprobs = []
    for token_id, lp in zip(prompt_ids, scored, strict=True):
        if lp is None:
            out.append(None)
            continue
        entry = {
            str(token_id): PromptLogprob(logprob=lp.logprob, rank=lp.rank, decoded_token=texts.text(token_id))
        }
        for rank, (t, v) in enumerate(lp.top, start=1):
            entry.setdefault(str(t), PromptLogprob(logprob=v, rank=rank, decoded_token=texts.text(t)))
        out.append(entry)
    return out


def chat_logprobs(texts: TokenSpelling, token_ids: list[int], logprobs: list[TokenLogprobs]) -> ChatLogprobs:
    content = []
    for token_id, lp in zip(token_ids, logprobs, strict=True):
        text, raw = texts.lookup(token_id)
        top = []
        for t, v in lp.top:
            t_text, t_raw = texts.lookup(t)
            top.append(TopLogprob(token=t_text, logprob=v, bytes=list(t_raw)))
        content.append(TokenLogprob(token=text, logprob=lp.logprob, bytes=list(raw), top_logprobs=top))
    return ChatLogprobs(content=content)
