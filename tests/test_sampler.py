from __future__ import annotations

import math

import pytest
import torch

import deltaserve.engine.sampler as sampler_module
from deltaserve.engine.sampler import Sampler, SamplingRow, make_seed, process_logits
from deltaserve.sampling_params import SamplingParams

NEG_INF = float("-inf")
sample = Sampler()


def row(
    seed: int = 0,
    step: int = 0,
    prompt: tuple[int, ...] = (),
    output: tuple[int, ...] = (),
    suppressed: tuple[int, ...] = (),
    **params: object,
) -> SamplingRow:
    return SamplingRow(SamplingParams(**params), seed, step, prompt, output, suppressed)


def draws(logits: torch.Tensor, n: int, **params: object) -> list[int]:
    """One token for each of the seeds 0..n-1 from the same one-row logits, drawn as one batch."""
    rows = [row(seed=s, **params) for s in range(n)]
    return sample(logits.expand(n, -1), rows).token_ids.tolist()


# --- the documented noise: a pure-Python splitmix64 (uint64 arithmetic) --------------------------------

MASK64 = 2**64 - 1


def splitmix64(z: int) -> int:
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def uniform_bits(seed: int, step: int, token: int) -> int:
    key = splitmix64((splitmix64(seed & MASK64) + step) & MASK64)  # a negative seed is its int64 bits
    return splitmix64((key + (token + 1) * 0x9E3779B97F4A7C15) & MASK64) >> 41


@pytest.mark.parametrize(
    ("seed", "step"),
    [(0, 0), (1, 0), (0, 1), (12345, 7), (2**63 - 1, 3), (2**62 + 5, 1000), (-1, 2), (-(2**63), 5)],
)
def test_flat_distribution_draws_the_token_with_the_largest_documented_uniform(seed: int, step: int) -> None:
    # With equal logits, argmax(logit - log(-log u)) is argmax u: the draw exposes the hash bit for bit,
    # including int64 wraparound and the logical (masked) right shifts.
    vocab = 50
    expected = max(range(vocab), key=lambda v: uniform_bits(seed, step, v))
    got = sample(torch.zeros(1, vocab), [row(seed=seed, step=step)]).token_ids.tolist()
    assert got == [expected]


# --- greedy --------------------------------------------------------------------------------------------


def test_greedy_takes_the_argmax_and_ties_go_to_the_lowest_id() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0, 3.0, 2.0, 0.0, 0.0, 0.0], [5.0] * 8, [0, 0, 0, 0, 0, 0, 0, 9.0]])
    rows = [row(temperature=0), row(temperature=0), row(temperature=0)]
    assert sample(logits, rows).token_ids.tolist() == [1, 0, 7]


@pytest.mark.parametrize("params", [{"top_k": 1}, {"top_k": 1, "temperature": 5.0}, {"temperature": 1e-6}])
def test_top_k_1_and_tiny_temperatures_are_greedy(params: dict) -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0, 3.0, 2.0, 2.9, 0.0, 0.0]])
    assert set(draws(logits, 64, **params)) == {1}


# --- logit processing (exact values) ---------------------------------------------------------------------


def test_penalties_match_hand_computed_logits() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, -0.5, 3.0, 1.0], [2.0, -1.0, 0.5, -0.5, 3.0, 1.0]])
    penalised = row(
        prompt=(0, 1),
        output=(2, 2, 3),
        repetition_penalty=2.0,
        frequency_penalty=0.5,
        presence_penalty=0.25,
    )
    got = process_logits(logits, [row(), penalised])
    # token 0 (prompt, positive): 2 / 2 = 1.  token 1 (prompt, negative): -1 * 2 = -2.
    # token 2 (output twice): 0.5 / 2 - 0.5 * 2 - 0.25 = -1.  token 3 (output once): -0.5 * 2 - 0.5 - 0.25.
    # tokens 4, 5 were never seen: unchanged. Row 0 uses no penalty: unchanged.
    assert got[1].tolist() == [1.0, -2.0, -1.0, -1.75, 3.0, 1.0]
    assert torch.equal(got[0], logits[0])


def test_bias_comes_before_penalties_and_suppression_after_bias() -> None:
    logits = torch.tensor([[-1.0, 0.0, 0.5, 4.0, 0.0, 0.0, 0.0, 0.0]])
    # token 0: (-1 + 3) / 2 = 1 (bias first, then the penalty sees a positive logit).
    # token 3: a +100 bias does not survive suppression.
    r = row(output=(0,), suppressed=(3,), logit_bias={0: 3.0, 3: 100.0}, repetition_penalty=2.0)
    assert process_logits(logits, [r]).tolist() == [[1.0, 0.0, 0.5, NEG_INF, 0.0, 0.0, 0.0, 0.0]]


def test_frequency_and_presence_ignore_prompt_tokens() -> None:
    logits = torch.zeros(1, 8)
    r = row(prompt=(1, 1, 1), output=(2, 2, 2), frequency_penalty=1.0, presence_penalty=0.5)
    assert process_logits(logits, [r]).tolist() == [[0.0, 0.0, -3.5, 0.0, 0.0, 0.0, 0.0, 0.0]]


def test_nothing_to_process_returns_the_logits_themselves() -> None:
    logits = torch.randn(2, 8)
    assert process_logits(logits, [row(), row(temperature=0, top_p=0.5)]) is logits


def test_the_callers_logits_are_never_written() -> None:
    logits = torch.randn(3, 16, generator=torch.Generator().manual_seed(0))
    before = logits.clone()
    rows = [
        row(temperature=0, logit_bias={1: 2.0}, suppressed=(0,)),
        row(seed=1, output=(3,), repetition_penalty=1.5, top_p=0.8, min_p=0.1, logprobs=2),
        row(seed=2, top_k=4, frequency_penalty=1.0, output=(5, 5)),
    ]
    sample(logits, rows)
    assert torch.equal(logits, before)


# --- forcing and suppression -----------------------------------------------------------------------------


def test_logit_bias_forces_a_token_for_greedy_and_sampled_rows() -> None:
    logits = torch.randn(1, 10, generator=torch.Generator().manual_seed(1))
    assert set(draws(logits, 50, temperature=0, logit_bias={7: 100.0})) == {7}
    assert set(draws(logits, 50, logit_bias={7: 100.0})) == {7}


def test_suppressed_ids_are_never_sampled_even_with_huge_logits() -> None:
    logits = torch.tensor([[0.0, 1.0, 0.5, 1e4, 0.2, 1e3, 0.1, 0.3]])
    r = row(temperature=0, suppressed=(3, 5))
    assert sample(logits, [r]).token_ids.tolist() == [1]
    tokens = draws(logits, 400, suppressed=(3, 5), logit_bias={3: 100.0})
    assert not {3, 5} & set(tokens)
    assert set(tokens) == {0, 1, 2, 4, 6, 7}


# --- filtered distributions --------------------------------------------------------------------------------

# Tokens 0..3 have probability 0.4, 0.3, 0.2, 0.1 after temperature 0.5; tokens 4..7 have logit -inf.
# The raw logits are 0.5 * log p, so filters applied before temperature would see p ∝ sqrt(p): min_p 0.6
# would keep token 2, and every renormalised probability below would move by more than 0.04.
FOUR = torch.tensor([[0.5 * math.log(p) for p in (0.4, 0.3, 0.2, 0.1)] + [NEG_INF] * 4])
DRAWS = 4000
FILTER_CASES = [
    ({}, [0.4, 0.3, 0.2, 0.1]),
    ({"top_k": 2}, [4 / 7, 3 / 7, 0, 0]),
    # mass before token 2 is 0.7 < 0.75 (kept); before token 3 it is 0.9 (dropped).
    ({"top_p": 0.75}, [4 / 9, 3 / 9, 2 / 9, 0]),
    # keeps p >= 0.6 * 0.4 = 0.24.
    ({"min_p": 0.6}, [4 / 7, 3 / 7, 0, 0]),
    # top_p over the top-k renormalised [4/9, 3/9, 2/9]: mass before token 2 is 7/9 >= 0.75.
    ({"top_k": 3, "top_p": 0.75}, [4 / 7, 3 / 7, 0, 0]),
    ({"top_k": 20, "top_p": 0.95, "min_p": 0.3}, [4 / 9, 3 / 9, 2 / 9, 0]),
]


def assert_follows(tokens: list[int], expected: list[float]) -> None:
    n = len(tokens)
    counts = [tokens.count(v) for v in range(8)]
    assert counts[4:] == [0, 0, 0, 0]
    for v, p in enumerate(expected):
        if p == 0:
            assert counts[v] == 0, f"token {v} is outside the allowed set"
        else:
            # counts[v] ~ Binomial(n, p) for a correct sampler: 4 standard deviations (0.031 at p = 0.4) is
            # a 6e-5 two-sided tail per token, while every filter bug in FILTER_CASES moves some p by > 0.04.
            sigma = math.sqrt(p * (1 - p) / n)
            assert abs(counts[v] / n - p) < 4 * sigma, (v, counts[v] / n, p)


@pytest.mark.parametrize(("params", "expected"), FILTER_CASES)
def test_filtered_draws_follow_the_renormalised_distribution(params: dict, expected: list[float]) -> None:
    assert_follows(draws(FOUR, DRAWS, temperature=0.5, **params), expected)


def test_each_row_of_a_mixed_batch_follows_its_own_filters() -> None:
    # Rows without top_k but with top_p make the batch sort the whole vocabulary, so top_k rows take their
    # thresholds from a wider sort than when alone.
    rows = [row(seed=s, temperature=0.5, **params) for params, _ in FILTER_CASES for s in range(DRAWS)]
    tokens = sample(FOUR.expand(len(rows), -1), rows).token_ids.view(len(FILTER_CASES), DRAWS).tolist()
    for (_, expected), case_tokens in zip(FILTER_CASES, tokens, strict=True):
        assert_follows(case_tokens, expected)


def test_ties_at_the_top_k_boundary_are_all_kept() -> None:
    logits = torch.tensor([[2.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0]])
    assert set(draws(logits, 400, top_k=2)) == {0, 1, 2, 3}


# --- seeded determinism --------------------------------------------------------------------------------------


def test_seeded_row_draws_the_same_alone_or_anywhere_in_a_mixed_batch() -> None:
    vocab, steps = 50, 5
    gen = torch.Generator().manual_seed(7)
    target_logits = 2 * torch.randn(steps, vocab, generator=gen)
    companion_logits = 2 * torch.randn(7, vocab, generator=gen)
    companions = [
        row(temperature=0),
        row(seed=9, top_p=0.5),  # no top_k: the batch sorts the whole vocabulary
        row(seed=10, temperature=1.3),
        row(seed=11, top_k=3, min_p=0.1),
        row(seed=12, prompt=(1, 2), output=(3,), repetition_penalty=1.3),
        row(seed=13, logit_bias={4: 5.0}, logprobs=2),
        row(temperature=0, presence_penalty=1.0, output=(5,)),
    ]
    produced = []
    for step in range(steps):
        target = row(seed=1234, step=step, output=tuple(range(step)), temperature=0.8, top_k=20, top_p=0.9)
        alone = sample(target_logits[step : step + 1], [target]).token_ids.tolist()
        for position in (0, 5):
            rows = companions[:position] + [target] + companions[position:]
            logits = torch.cat(
                [companion_logits[:position], target_logits[step : step + 1], companion_logits[position:]]
            )
            assert sample(logits, rows).token_ids[position].item() == alone[0], (step, position)
        produced.append(alone[0])
    assert len(set(produced)) > 1


def test_seed_and_step_both_change_the_draw() -> None:
    vocab, seeds, steps = 50, 20, 8
    rows = [row(seed=s, step=t) for s in range(seeds) for t in range(steps)]
    tokens = sample(torch.zeros(len(rows), vocab), rows).token_ids.view(seeds, steps).tolist()
    assert len({tuple(seq) for seq in tokens}) == seeds  # no two seeds give the same sequence
    assert all(len(set(seq)) > 1 for seq in tokens)  # no seed repeats one token for every step


def test_noise_chunking_does_not_change_draws(monkeypatch: pytest.MonkeyPatch) -> None:
    logits = torch.randn(9, 40, generator=torch.Generator().manual_seed(3))
    rows = [row(seed=100 + i, step=i) for i in range(9)]
    whole = sample(logits, rows).token_ids
    monkeypatch.setattr(sampler_module, "_NOISE_CHUNK_ELEMS", 2 * 40)
    assert torch.equal(sample(logits, rows).token_ids, whole)


def test_make_seed_is_a_63_bit_seed_that_validates() -> None:
    seeds = {make_seed() for _ in range(8)}
    assert len(seeds) == 8
    for s in seeds:
        assert 0 <= s < 2**63
        SamplingParams(seed=s).validate()


# --- logprobs --------------------------------------------------------------------------------------------------


def test_logprobs_come_from_the_raw_distribution() -> None:
    logits = torch.tensor(
        [
            [1.0, 3.0, 2.0, 0.0, -1.0, 0.5, 0.25, -2.0],
            [1.0, 3.0, 2.0, 0.0, -1.0, 0.5, 0.25, -2.0],
            [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0],
        ]
    )
    rows = [
        row(temperature=0, logprobs=3),
        # forced onto the least likely token by bias and a penalty on the others; scaled by temperature
        row(seed=5, output=(1, 2), logit_bias={7: 100.0}, frequency_penalty=2.0, temperature=0.3, logprobs=0),
        row(temperature=0),  # asked for none, still gets K columns
    ]
    out = sample(logits, rows)
    raw = torch.log_softmax(logits, dim=-1)
    assert out.token_ids.tolist() == [1, 7, 7]
    assert out.logprobs is not None
    assert torch.equal(out.logprobs.sampled_logprob, raw[[0, 1, 2], [1, 7, 7]])
    assert out.logprobs.sampled_rank.tolist() == [1, 8, 1]
    assert out.logprobs.top_ids.tolist() == [[1, 2, 0], [1, 2, 0], [7, 6, 5]]
    assert torch.equal(out.logprobs.top_logprobs, raw.gather(1, out.logprobs.top_ids))


def test_logprobs_are_absent_unless_asked_and_zero_means_only_the_sampled_token() -> None:
    logits = torch.randn(2, 8)
    assert sample(logits, [row(), row(temperature=0)]).logprobs is None
    out = sample(logits, [row(logprobs=0), row(temperature=0)]).logprobs
    assert out is not None
    assert out.top_ids.shape == (2, 0) and out.sampled_logprob.shape == (2,)


def test_rank_counts_strictly_more_likely_tokens() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, 2.0, 0.0, 0.0, 0.0, 0.0]])
    out = sample(logits, [row(temperature=0, logprobs=1, logit_bias={3: 1.5})])
    assert out.token_ids.tolist() == [3]
    assert out.logprobs is not None
    assert out.logprobs.sampled_rank.tolist() == [3]


# --- full vocabulary ------------------------------------------------------------------------------------------------


def test_full_vocabulary_batch_samples_inside_the_tokenizer_id_space() -> None:
    vocab = 248077
    logits = 4 * torch.randn(5, vocab, generator=torch.Generator().manual_seed(11))
    rows = [
        row(temperature=0),
        row(seed=1, temperature=0.7, top_p=0.9, logprobs=5),
        row(seed=2),
        row(
            seed=3, top_k=20, repetition_penalty=1.1, prompt=tuple(range(0, vocab, 997)), output=(vocab - 1,)
        ),
        row(seed=4, logit_bias={vocab - 1: 100.0}),
    ]
    out = sample(logits, rows)
    tokens = out.token_ids.tolist()
    assert tokens[0] == int(logits[0].argmax())
    assert all(0 <= t < vocab for t in tokens)
    assert tokens[4] == vocab - 1
    assert out.logprobs is not None and int(out.logprobs.top_ids.max()) < vocab


def test_bf16_logits_sample_as_their_float32_values() -> None:
    logits = torch.randn(4, 32, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    rows = [row(temperature=0, logprobs=2), row(seed=1, top_p=0.8), row(seed=2, top_k=5), row(seed=3)]
    half, full = sample(logits, rows), sample(logits.float(), rows)
    assert torch.equal(half.token_ids, full.token_ids)
    assert half.logprobs is not None and full.logprobs is not None
    assert torch.equal(half.logprobs.top_logprobs, full.logprobs.top_logprobs)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_draws_match_cpu_without_host_sync() -> None:
    vocab = 4096
    logits = 3 * torch.randn(6, vocab, generator=torch.Generator().manual_seed(2))
    rows = [
        row(temperature=0, logprobs=3),
        row(seed=1, top_p=0.9, output=(1, 2), presence_penalty=0.5),
        row(seed=2, top_k=50, min_p=0.05, logit_bias={9: 3.0}),
        row(seed=3, suppressed=(0, 1)),
        row(seed=4, prompt=(5, 6), repetition_penalty=1.2),
        row(seed=5, temperature=0.6),
    ]
    cpu = sample(logits, rows)
    on_device = logits.cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        gpu = sample(on_device, rows)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert gpu.token_ids.cpu().tolist() == cpu.token_ids.tolist()


def test_allowed_token_ids_restrict_greedy_and_sampled_rows_and_leave_the_others() -> None:
    logits = torch.tensor([[0.0, 1.0, 0.5, 9.0, 0.2, 3.0, 0.1, 0.3]])
    assert sample(logits, [row(temperature=0, allowed_token_ids=[1, 2, 6])]).token_ids.tolist() == [1]
    tokens = draws(logits, 400, allowed_token_ids=[0, 4, 6])
    assert set(tokens) == {0, 4, 6}
    # with logit_bias (it still moves the allowed ones) and beside an unrestricted row
    mixed = sample(
        logits.expand(2, -1),
        [row(temperature=0, allowed_token_ids=[2, 4], logit_bias={4: 5.0}), row(temperature=0)],
    )
    assert mixed.token_ids.tolist() == [4, 3]
    processed = process_logits(logits, [row(allowed_token_ids=[5, 7])])
    assert torch.equal(processed[0, [5, 7]], logits[0, [5, 7]]) and processed[0].isinf().sum() == 6


def test_penalties_counted_on_the_device_equal_penalties_counted_from_the_lists() -> None:
    """A row with a penalty slot starts from the slot's device counts (outputs the host had at the last
    launch) plus its extra tokens (a verify position's drafts) and its fed token (in flight): the same
    logits as counting its whole output list, for every penalty and beside rows counted from lists."""
    from deltaserve.engine.penalty_counts import PenaltyCounts, PenaltyReset

    vocab = 12
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, vocab, generator=gen) * 3
    params = [
        dict(repetition_penalty=1.7),
        dict(frequency_penalty=0.6, presence_penalty=0.4),
        dict(repetition_penalty=1.3, presence_penalty=1.5),
        dict(frequency_penalty=0.2),
    ]
    prompts = [(1, 2, 2), (3,), (4, 5), (6, 6)]
    outputs = [(7, 7, 8), (3, 3, 9, 10), (5, 11), (1, 2, 3, 3, 3)]
    listed = [row(prompt=p, output=o, **kw) for p, o, kw in zip(prompts, outputs, params, strict=True)]
    want = process_logits(logits, listed)

    counts = PenaltyCounts(num_slots=6, vocab=vocab, device=torch.device("cpu"))
    # Slot 5 holds a stale row of someone else's: the reset rewrites it.
    counts.apply([(5, 0), (5, 0)], [PenaltyReset(2, [1, 1], (9,))])
    counts.apply([], [PenaltyReset(5, [7], ())])
    counts.apply([(5, 7)], [])  # slot 5 (row 0) has output 7, 7; 8 is in flight (fed)
    counts.apply([], [PenaltyReset(3, [3, 3], ())])  # row 1: 3, 3 counted; 9 and 10 are drafts
    counts.apply([], [PenaltyReset(4, [5], (4, 5))])  # row 2: 5; 11 in flight
    fed = torch.tensor([8, 0, 11])  # the step's first three rows are fed
    on_device = [
        row(prompt=prompts[0], output=outputs[0][:2], **params[0]),
        row(prompt=prompts[1], output=outputs[1], **params[1]),
        row(prompt=prompts[2], output=outputs[2][:1], **params[2]),
        listed[3],  # counted from its lists, beside the others
    ]
    on_device[0].penalty_slot, on_device[0].penalty_pending = 5, True
    on_device[1].penalty_slot, on_device[1].penalty_extra = 3, (9, 10)
    on_device[2].penalty_slot, on_device[2].penalty_pending = 4, True
    on_device[0].prompt_token_ids = on_device[2].prompt_token_ids = ()  # the device rows hold the prompts
    counts.apply([], [PenaltyReset(5, [7, 7], (1, 2, 2))])  # row 0's prompt, for its repetition penalty
    got = process_logits(logits, on_device, counts, fed)
    torch.testing.assert_close(got, want, rtol=0, atol=0)

    sampler = Sampler(counts)
    assert torch.equal(sampler(logits, on_device, fed).token_ids, Sampler()(logits, listed).token_ids)
    with pytest.raises(ValueError, match="need a sampler with penalty counts"):
        Sampler()(logits, on_device, fed)
    with pytest.raises(ValueError, match="one of the step's fed rows"):
        sampler(logits, on_device, fed[:2])
