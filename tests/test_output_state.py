"""engine/output.py: an update of several tokens gives what one update per token would, stop strings
included (speculative steps emit several tokens; so does a client that fell behind its engine)."""

from __future__ import annotations

import random

import pytest

from deltaserve.engine.output import OutputState
from deltaserve.engine.protocol import RequestUpdate, TokenLogprobs
from deltaserve.sampling_params import SamplingParams
from deltaserve.tiny import default_model_dir
from deltaserve.tokenizer import Tokenizer

TEXT = "The fox jumps over the lazy dog. Then it stops, rests, and runs away again.\n\nThe end."


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_dir(default_model_dir())


def _updates(tokens: list[int], cuts: list[int], finish: str | None) -> list[RequestUpdate]:
    """`tokens` split at `cuts`, each token with a logprob naming its index; the last update ends the
    request with `finish`."""
    bounds = [0, *cuts, len(tokens)]
    updates = []
    for a, b in zip(bounds, bounds[1:], strict=False):
        lps = [TokenLogprobs(-float(i), 1, []) for i in range(a, b)]
        updates.append(RequestUpdate("r", tokens[a:b], lps, num_output_tokens=b))
    updates[-1].finish_reason = finish
    return updates


def _run(tokenizer: Tokenizer, params: SamplingParams, updates: list[RequestUpdate]) -> tuple:
    """What the client sees. (Whether the engine must be told to stop is not compared: an update that
    carries the engine's own end needs no abort, however early in it the stop string matched.)"""
    state = OutputState("r", None, [1], params, tokenizer)
    deltas = [state.apply(u) for u in updates]
    return (
        "".join(d.text for d in deltas),
        state.token_ids,
        [lp.logprob for lp in state.logprobs or []],
        state.finish_reason,
        state.stop_reason,
        sum(len(d.token_ids) for d in deltas),
    )


@pytest.mark.parametrize("stop", [None, ["jumps"], [" it st"], ["\n\n", "rests"], ["never there"], ["."]])
@pytest.mark.parametrize("finish", [None, "length"])
def test_one_update_of_many_tokens_equals_one_update_per_token(tokenizer, stop, finish) -> None:
    tokens = tokenizer.encode(TEXT)
    params = SamplingParams(max_tokens=len(tokens), stop=stop, logprobs=0)
    one_by_one = _run(tokenizer, params, _updates(tokens, list(range(1, len(tokens))), finish))
    rng = random.Random(0)
    for _ in range(8):
        cuts = sorted(rng.sample(range(1, len(tokens)), rng.randint(0, 6)))
        assert _run(tokenizer, params, _updates(tokens, cuts, finish)) == one_by_one, cuts
    assert _run(tokenizer, params, _updates(tokens, [], finish)) == one_by_one


def test_a_stop_string_ends_the_output_at_the_token_that_completed_it(tokenizer) -> None:
    tokens = tokenizer.encode(TEXT)
    params = SamplingParams(max_tokens=len(tokens), stop=["lazy"], logprobs=0)
    state = OutputState("r", None, [1], params, tokenizer)
    delta = state.apply(_updates(tokens, [], None)[0])
    completing = next(n for n in range(1, len(tokens) + 1) if "lazy" in tokenizer.decode(tokens[:n]))
    assert delta.text == TEXT[: TEXT.index("lazy")]
    assert delta.token_ids == tokens[:completing] == state.token_ids
    assert [lp.logprob for lp in delta.logprobs or []] == [-float(i) for i in range(completing)]
    assert (delta.finish_reason, delta.stop_reason) == ("stop", "lazy")
    assert delta.abort_engine  # the engine is still generating


def _reference(tokenizer: Tokenizer, tokens: list[int], stops: list[str], keep: bool) -> str:
    """The output text by prefix decodes: at the first token whose decoded prefix holds a stop string,
    cut at the earliest of those present (after it with `keep`)."""
    for n in range(1, len(tokens) + 1):
        text = tokenizer.decode(tokens[:n])
        found = [(text.find(s), s) for s in stops if s in text]
        if found:
            pos, stop = min(found)
            return text[: pos + len(stop)] if keep else text[:pos]
    return tokenizer.decode(tokens)


@pytest.mark.parametrize(
    "stops",
    [["stop!"], ["g. E", "absent"], ["ïcö"], ["lazy dog", "🙂"], ["数据, the"], [" 🙂"], ["absent"]],
)
@pytest.mark.parametrize("keep", [False, True])
@pytest.mark.parametrize("one_token_updates", [True, False])
def test_streamed_text_equals_the_prefix_decode_cut_at_the_first_stop_string(
    tokenizer, stops, keep, one_token_updates
) -> None:
    # Multi-byte characters and stop strings that span tokens (most of these), lie inside one token, or
    # never occur. The text goes out in pieces (a long output is never copied whole), which must not
    # change a byte; with one token per update every multi-token stop string spans updates.
    text = "Ünïcödé 🙂 数据, the lazy dog. END: stop! " * 3 + "Ünïcödé"
    tokens = tokenizer.encode(text)
    params = SamplingParams(max_tokens=len(tokens), stop=stops, include_stop_str_in_output=keep)
    every = list(range(1, len(tokens)))
    cuts = every if one_token_updates else sorted(random.Random(len(stops)).sample(every, len(every) // 3))
    streamed, *_ = _run(tokenizer, params, _updates(tokens, cuts, "length"))
    assert streamed == _reference(tokenizer, tokens, stops, keep)
