"""Speculative decoding's pure policy: the flag's JSON, the acceptance rule, the adaptive guard and the
counters, with hand-computed expectations."""

from __future__ import annotations

import pytest

from deltaserve.cache.manager import CacheManager
from deltaserve.engine.scheduler.speculation import (
    PROBE_INTERVAL,
    DraftGuard,
    SpeculationCounters,
    best_draft_length,
    expected_tokens,
    step_cost,
)
from deltaserve.engine.speculative import accepted_drafts
from deltaserve.engine_config import EngineConfig, SpeculativeConfig
from deltaserve.errors import ConfigError


def test_speculative_config_reads_vllms_json():
    spec = SpeculativeConfig.from_json('{"method": "mtp", "num_speculative_tokens": 3}')
    assert (spec.method, spec.num_speculative_tokens, spec.adaptive, spec.max_batch) == ("mtp", 3, True, 32)
    pinned = SpeculativeConfig.from_json({"num_speculative_tokens": 2, "adaptive": False, "max_batch": 4})
    assert (pinned.num_speculative_tokens, pinned.adaptive, pinned.max_batch) == (2, False, 4)
    assert pinned.draft_vocab_size is None
    assert SpeculativeConfig.from_json('{"draft_vocab_size": 32768}').draft_vocab_size == 32768
    assert (
        EngineConfig(speculative_config='{"num_speculative_tokens": 1}').speculative_config
        == SpeculativeConfig()
    )


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("mtp", "must be a JSON object"),
        ("[1]", "must be a JSON object"),
        ("{method:mtp,num_speculative_tokens:3}", "keys lost their double quotes: single-quote the whole"),
        ('{"method": "eagle"}', "'method' must be one of ['mtp'], got 'eagle'"),
        ('{"num_speculative_tokens": 0}', "'num_speculative_tokens' must be an integer in 1..4, got 0"),
        ('{"num_speculative_tokens": 5}', "in 1..4, got 5"),
        ('{"num_speculative_tokens": true}', "in 1..4, got True"),
        ('{"adaptive": "yes"}', "'adaptive' must be true or false, got 'yes'"),
        ('{"max_batch": 0}', "'max_batch' must be an integer >= 1, got 0"),
        ('{"draft_vocab_size": 0}', "'draft_vocab_size' must be absent or an integer >= 1, got 0"),
        ('{"draft_vocab_size": "32k"}', "'draft_vocab_size' must be absent or an integer >= 1, got '32k'"),
        ('{"model": "Qwen/Qwen3.5-0.8B"}', "'model' must be absent or null"),
        ('{"draft_tensor_parallel_size": 1}', "unknown keys ['draft_tensor_parallel_size']"),
        (
            '{"benchmark_draft": "replay"}',
            "goes with 'benchmark_draft' ['record', 'replay', 'wrong'] and only",
        ),
        ('{"benchmark_draft_file": "x"}', "got None and 'x'"),
        ('{"benchmark_draft": "accept", "benchmark_draft_file": "x"}', "got 'accept' and 'x'"),
        ('{"benchmark_draft": "oracle", "benchmark_draft_file": "x"}', "'benchmark_draft' must be absent"),
    ],
)
def test_speculative_config_refuses_with_the_key_and_value(text, message):
    with pytest.raises(ConfigError, match="--speculative-config") as err:
        SpeculativeConfig.from_json(text)
    assert message in str(err.value)


def test_speculation_is_refused_under_tensor_parallelism():
    config = EngineConfig(speculative_config={"num_speculative_tokens": 1}, tensor_parallel_size=2)
    with pytest.raises(
        ConfigError, match="--speculative-config is not supported with --tensor-parallel-size 2"
    ):
        config.validate()


def test_accepted_drafts_counts_the_leading_matches():
    assert accepted_drafts([5, 6, 7], [5, 6, 7, 8]) == 3
    assert accepted_drafts([5, 6, 7], [5, 9, 7, 8]) == 1
    assert accepted_drafts([5, 6, 7], [4, 6, 7, 8]) == 0
    assert accepted_drafts([], [4]) == 0


def test_expected_tokens_and_step_cost_by_hand():
    assert expected_tokens([0.5, 0.5, 0.5], 0) == 1.0
    assert expected_tokens([0.5, 0.5, 0.5], 2) == 1.75  # 1 + 0.5 + 0.25
    assert expected_tokens([1.0, 0.5, 0.0], 3) == 2.5  # 1 + 1 + 0.5 + 0
    assert step_cost(0, 64) == 1.0
    assert step_cost(2, 1) == pytest.approx(1.42)  # 1 + 2 * (0.2 + 0.01)
    assert step_cost(1, 64) == pytest.approx(1.84)  # 1 + (0.2 + 0.64)


def test_best_draft_length_by_hand():
    # All accepted, one row: 2/1.21, 3/1.42, 4/1.63 tokens per cost: the most drafts win.
    assert best_draft_length([1.0, 1.0, 1.0], 3, 1) == 3
    # Half accepted: 1.5/1.21 = 1.240 > 1.75/1.42 = 1.232 > 1.875/1.63 = 1.150.
    assert best_draft_length([0.5, 0.5, 0.5], 3, 1) == 1
    # Nothing accepted: no draft pays for itself.
    assert best_draft_length([0.0, 0.0, 0.0], 3, 1) == 0
    # 64 rows at 0.8: one draft gives 1.8 tokens for 1.84 steps, below plain decoding.
    assert best_draft_length([0.8, 0.8, 0.8], 3, 64) == 0


def test_guard_steps_down_with_the_batch_and_pins_when_asked():
    guard = DraftGuard(SpeculativeConfig(num_speculative_tokens=3, max_batch=8))
    guard.acceptance = [1.0, 1.0, 1.0]
    assert guard.draft_length(1) == 3
    assert guard.draft_length(8) == 3  # 4 / (1 + 3 * 0.28) = 2.17
    assert guard.draft_length(9) == 0  # past max_batch
    assert guard.draft_length(0) == 0
    pinned = DraftGuard(SpeculativeConfig(num_speculative_tokens=2, adaptive=False, max_batch=8))
    pinned.acceptance = [0.0, 0.0]
    assert pinned.draft_length(1) == 2
    assert pinned.draft_length(100) == 2  # the planner caps the verify rows at max_batch


def test_guard_measures_acceptance_per_position_and_probes_when_off():
    guard = DraftGuard(SpeculativeConfig(num_speculative_tokens=3))
    assert guard.acceptance == [0.8, 0.8, 0.8]
    guard.record_verify(3, 1)  # draft 1 accepted, draft 2 rejected, draft 3 never judged
    assert guard.acceptance == pytest.approx([0.82, 0.72, 0.8])
    guard.record_verify(2, 2)  # both judged and accepted; position 3 was not drafted
    assert guard.acceptance == pytest.approx([0.838, 0.748, 0.8])
    guard.acceptance = [0.0, 0.0, 0.0]
    assert guard.draft_length(1) == 0
    for _ in range(PROBE_INTERVAL - 1):
        guard.record_step(drafted=False)
    assert guard.draft_length(1) == 0
    guard.record_step(drafted=False)
    assert guard.draft_length(1) == 1  # a one-draft probe: this step drafts,
    guard.record_step(drafted=True)
    assert guard.draft_length(1) == 1  # and the next verifies its proposals
    guard.record_step(drafted=True)
    assert guard.draft_length(1) == 0
    for _ in range(PROBE_INTERVAL):
        guard.record_step(drafted=False)
    guard.record_step(drafted=True)
    guard.record_step(drafted=False)  # a plain step in between (more rows than max_batch, say)
    assert guard.draft_length(1) == 0  # ends the probe: its proposals were dropped


def test_counters_match_vllms_metrics():
    counters = SpeculationCounters()
    counters.record(3, 2)
    counters.record(3, 0)
    counters.record(2, 2)
    assert (counters.num_drafts, counters.num_draft_tokens, counters.num_accepted_tokens) == (3, 8, 4)
    assert counters.accepted_per_position == [2, 2, 0]
    assert counters.mean_acceptance_length == pytest.approx(1 + 4 / 3)


def test_the_cache_manager_never_hands_out_a_verify_scratch_slot():
    cache = CacheManager(num_pages=8, page_size=4, num_slots=10, scratch_slots=4)
    assert list(cache.scratch_slots) == [6, 7, 8, 9]
    held = [cache.open() for _ in range(5)]  # slot 0 is reserved: 1..5 are the sequences'
    assert sorted(s.slot for s in held) == [1, 2, 3, 4, 5]
    with pytest.raises(MemoryError):
        cache.open()
    cache.release(held[0])
    assert cache.open().slot == held[0].slot


def test_rewind_takes_back_only_what_was_advanced():
    cache = CacheManager(num_pages=8, page_size=4, num_slots=4)
    seq = cache.open()
    cache.reserve(seq, 6)
    cache.advance(seq, 6)
    cache.rewind(seq, 2)
    assert seq.num_computed == 4
    with pytest.raises(AssertionError, match="cannot rewind 5 of 4"):
        cache.rewind(seq, 5)
