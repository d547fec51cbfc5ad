"""The multi-turn chat workload: its texts, its per-turn table, and a run against the real tiny server."""

from __future__ import annotations

import argparse
import json

import pytest
from server_fixture import running_server
from tokenizers import Tokenizer

from deltaserve.bench.metrics import RequestRecord
from deltaserve.bench.multi_turn import multi_turn_dataset
from deltaserve.bench.serve import add_bench_serve_arguments, run_bench_serve
from deltaserve.bench.turn_metrics import format_turn_table, per_turn_stats
from deltaserve.bench.words import WORDS
from deltaserve.tokenizer_build import cached_tokenizer_dir

# Tokens the Qwen3.5 chat template puts around a message's text: <|im_start|> role \n ... <|im_end|> \n.
MESSAGE_FRAME = 5
# The generation prompt with thinking off: <|im_start|> assistant \n <think> \n\n </think> \n\n.
ANSWER_START_NO_THINKING = 7


@pytest.fixture(scope="module")
def qwen_tokenizer() -> Tokenizer:
    return Tokenizer.from_file(str(cached_tokenizer_dir() / "tokenizer.json"))


def _num_tokens(tokenizer: Tokenizer, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False).ids)


def test_every_word_is_one_qwen35_token_alone_and_after_a_space(qwen_tokenizer):
    assert len(WORDS) == len(set(WORDS)) > 500
    for word in WORDS:
        assert _num_tokens(qwen_tokenizer, word) == 1, word
        assert _num_tokens(qwen_tokenizer, " " + word) == 1, word


def test_texts_have_the_asked_lengths_in_qwen35_tokens(qwen_tokenizer):
    data = multi_turn_dataset(3, 4, system_prompt_len=50, user_len=7, output_len=9, seed=5)
    assert len(data.system_prompt.split()) == 50 and _num_tokens(qwen_tokenizer, data.system_prompt) == 50
    assert data.output_len == 9 and [c.index for c in data.conversations] == [0, 1, 2]
    for conversation in data.conversations:
        assert len(conversation.user_messages) == 4
        for message in conversation.user_messages:
            assert _num_tokens(qwen_tokenizer, message) == 7


def test_texts_are_reproducible_from_the_seed_and_differ_between_conversations():
    data = multi_turn_dataset(3, 2, system_prompt_len=20, user_len=10, output_len=1, seed=7)
    assert data == multi_turn_dataset(3, 2, system_prompt_len=20, user_len=10, output_len=1, seed=7)
    other = multi_turn_dataset(3, 2, system_prompt_len=20, user_len=10, output_len=1, seed=8)
    assert other.system_prompt != data.system_prompt and other.conversations != data.conversations
    # Conversation i does not depend on how many conversations there are.
    fewer = multi_turn_dataset(1, 2, system_prompt_len=20, user_len=10, output_len=1, seed=7)
    assert fewer.conversations[0] == data.conversations[0] and fewer.system_prompt == data.system_prompt
    firsts = {c.user_messages[0] for c in data.conversations}
    assert len(firsts) == 3  # no two conversations share more than the system prompt
    assert multi_turn_dataset(1, 1, system_prompt_len=0, user_len=1, output_len=1).system_prompt == ""


@pytest.mark.parametrize(
    ("field", "flag"),
    [("num_turns", "--multi-turn-num-turns"), ("user_len", "--multi-turn-user-len")],
)
def test_lengths_below_one_are_refused_naming_the_flag(field, flag):
    lengths = {"num_turns": 2, "system_prompt_len": 3, "user_len": 4, "output_len": 5} | {field: 0}
    with pytest.raises(ValueError, match=flag):
        multi_turn_dataset(1, **lengths)


def _record(ttft_s: float, prompt: int, cached: int | None, success: bool = True) -> RequestRecord:
    return RequestRecord(success, "" if success else "HTTP 500", 0.0, [ttft_s], prompt, 1, "", cached)


def test_per_turn_stats_over_successful_requests_with_hand_computed_values():
    turns = [
        (1, _record(0.100, prompt=10, cached=0)),
        (1, _record(0.300, prompt=20, cached=None)),  # field missing: 0 cached
        (2, _record(0.050, prompt=40, cached=30)),
        (2, _record(0.900, prompt=99, cached=99, success=False)),  # failed: counted only as failed
    ]
    first, second = per_turn_stats(turns)
    assert (first.turn, first.completed, first.failed) == (1, 2, 0)
    assert first.mean_ttft_ms == pytest.approx(200.0) and first.median_ttft_ms == pytest.approx(200.0)
    assert first.p99_ttft_ms == pytest.approx(100 + 0.99 * 200)  # linear interpolation between 100, 300
    assert first.mean_prompt_tokens == 15.0 and first.cached_token_share == 0.0
    assert (second.turn, second.completed, second.failed) == (2, 1, 1)
    assert second.mean_ttft_ms == pytest.approx(50.0) and second.cached_token_share == pytest.approx(0.75)
    assert "75.00%" in format_turn_table([first, second]).splitlines()[3]


def test_per_turn_share_is_not_reported_when_no_response_had_cached_tokens():
    stats = per_turn_stats([(1, _record(0.1, 10, None)), (2, _record(0.1, 20, None))])
    assert [s.cached_token_share for s in stats] == [None, None]
    assert all(line.endswith("not reported") for line in format_turn_table(stats).splitlines()[2:4])


def test_two_conversations_of_three_turns_against_the_tiny_server(tmp_path):
    parser = argparse.ArgumentParser()
    add_bench_serve_arguments(parser)
    flags = ["--dataset-name", "multi-turn", "--num-prompts", "2", "--max-concurrency", "2"]
    flags += ["--multi-turn-num-turns", "3", "--multi-turn-system-prompt-len", "24"]
    flags += ["--multi-turn-user-len", "6", "--multi-turn-output-len", "4"]
    flags += ["--save-result", "--result-dir", str(tmp_path), "--result-filename", "mt.json"]
    with running_server() as server:
        result = run_bench_serve(parser.parse_args(["--base-url", server.url, *flags]))

    assert (result.completed, result.failed) == (6, 0)
    assert [(t.turn, t.completed, t.failed) for t in result.turns] == [(1, 2, 0), (2, 2, 0), (3, 2, 0)]
    # Turn 1: system (24 + frame) + user (6 + frame) + the answer start, exactly (one-token words).
    expected_first = (24 + MESSAGE_FRAME) + (6 + MESSAGE_FRAME) + ANSWER_START_NO_THINKING
    assert result.turns[0].mean_prompt_tokens == expected_first == 47
    for conversation in (result.records[0:3], result.records[3:6]):  # records are per conversation
        prompts = [r.prompt_tokens for r in conversation]
        assert prompts[0] < prompts[1] < prompts[2], prompts
        assert all(r.completion_tokens == 4 for r in conversation)
    saved = json.loads((tmp_path / "mt.json").read_text())
    assert [t["turn"] for t in saved["per_turn"]] == [1, 2, 3]
    assert saved["endpoint"] == "/v1/chat/completions" and saved["completed"] == 6
    # The server may or may not report cached tokens; either way the share is a fraction or None.
    assert all(
        t["cached_token_share"] is None or 0 <= t["cached_token_share"] <= 1 for t in saved["per_turn"]
    )
