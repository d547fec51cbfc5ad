"""Cutting a long text into pieces that tokenize independently, so that the tokenizer's batch entry
point encodes them on all cores: the concatenated ids equal those of the whole text.

Where a piece may start: at a U+0020 space whose preceding character is not whitespace. That is a
pre-token boundary of the Qwen2 / Qwen3.5 split regex (QWEN_SPLIT_PATTERNS): the pre-token holding the
preceding character cannot reach over the space (a letter run stops at it, a punctuation run takes only
newlines after it, and the whitespace alternatives do not hold a non-whitespace character), and every
pre-token after the cut depends only on the text after it (the regex's one lookahead, `(?!\\S)`, reads
forward). BPE and the byte-level mapping work inside pre-tokens, and NFC never composes a space with
what precedes it. So this holds only for a tokenizer whose whole pipeline is that: `splits_at_spaces`
checks the configuration (NFC or no normalizer, the regex split then byte-level, no added token that
holds a space or strips or matches whole words) and anything else is encoded in one piece.
"""

from __future__ import annotations

import json

from tokenizers import Tokenizer as HFTokenizer

# The split regexes of Qwen2's and Qwen3.5's tokenizer.json, as the Rust regex crate reads them.
QWEN_SPLIT_PATTERNS = frozenset(
    {
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
        r"|\s+(?!\S)|\s+",
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
        r"|\s*[\r\n]+|\s+(?!\S)|\s+",
    }
)


def _state(component: object) -> dict | None:
    return None if component is None else json.loads(component.__getstate__())


def splits_at_spaces(tokenizer: HFTokenizer) -> bool:
    """Whether `tokenizer` encodes a text cut before a space (after a non-space) as it encodes the whole
    (the module docstring): its normalizer, pre-tokenizer and added tokens are checked."""
    normalizer = _state(tokenizer.normalizer)
    if normalizer is not None and normalizer != {"type": "NFC"}:
        return False
    pre = _state(tokenizer.pre_tokenizer)
    if pre is None or pre.get("type") != "Sequence" or len(pre.get("pretokenizers", [])) != 2:
        return False
    split, byte_level = pre["pretokenizers"]
    if not (
        split.get("type") == "Split"
        and split.get("pattern", {}).get("Regex") in QWEN_SPLIT_PATTERNS
        and split.get("behavior") == "Isolated"
        and not split.get("invert")
        and byte_level.get("type") == "ByteLevel"
        and not byte_level.get("add_prefix_space")
        and not byte_level.get("use_regex")
    ):
        return False
    return not any(
        token.lstrip or token.rstrip or token.single_word or " " in token.content
        for token in tokenizer.get_added_tokens_decoder().values()
    )


def split_at_spaces(text: str, piece_chars: int) -> list[str]:
    """`text` in pieces of about `piece_chars` characters (or more: a piece ends at the first space after
    that many characters whose predecessor is not whitespace), joined back they are `text`."""
    pieces: list[str] = []
    start = 0
    while len(text) - start > piece_chars:
        cut = text.find(" ", start + piece_chars)
        while cut != -1 and text[cut - 1].isspace():
            cut = text.find(" ", cut + 1)
        if cut == -1:
            break
        pieces.append(text[start:cut])
        start = cut
    pieces.append(text[start:])
    return pieces
