"""Structured output: JSON schemas enforced while sampling (xgrammar), on the embedded tiny model whose
random weights would never produce JSON by themselves."""

from __future__ import annotations

import json

import pytest
import torch

from deltaserve.engine.llm import LLM
from deltaserve.engine.structured import (
    CompiledGrammars,
    GrammarBackend,
    StructuredOutputError,
    apply_grammars,
)
from deltaserve.errors import RequestValidationError
from deltaserve.sampling_params import SamplingParams, StructuredOutputParams
from deltaserve.tiny import default_model_dir
from deltaserve.tokenizer import Tokenizer

OBJECT_SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}, "b": {"enum": [True, False]}},
    "required": ["a", "b"],
    "additionalProperties": False,
}


def schema(value: dict) -> StructuredOutputParams:
    return StructuredOutputParams(json_schema=json.dumps(value))


@pytest.fixture(scope="module")
def llm():
    with LLM(None, max_num_seqs=8) as engine:
        yield engine


@pytest.fixture(scope="module")
def backend() -> GrammarBackend:
    tokenizer = Tokenizer.from_dir(default_model_dir())
    return GrammarBackend(
        lambda: [tokenizer.id_to_token(i) or "" for i in range(tokenizer.vocab_size)], [248046, 248044]
    )


def test_sampled_output_follows_the_schema_beside_free_requests(llm) -> None:
    enum = SamplingParams(
        max_tokens=20, temperature=1.0, seed=4, structured_output=schema({"enum": ["yes", "no"]})
    )
    obj = SamplingParams(max_tokens=60, temperature=1.0, seed=5, structured_output=schema(OBJECT_SCHEMA))
    free = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outs = llm.generate(["Answer:", "Give JSON:", "Free text:", "More JSON:"], [enum, obj, free, obj])
    assert outs[0].outputs[0].text in ('"yes"', '"no"') and outs[0].outputs[0].finish_reason == "stop"
    for out in (outs[1], outs[3]):
        value = json.loads(out.outputs[0].text)
        assert set(value) == {"a", "b"} and 0 <= value["a"] <= 9 and isinstance(value["b"], bool)
        assert out.outputs[0].finish_reason == "stop"
    assert len(outs[2].outputs[0].token_ids) == 12  # the free request is untouched
    alone = llm.generate(["Free text:"], free)[0]
    assert alone.outputs[0].token_ids == outs[2].outputs[0].token_ids


def test_a_schema_that_cannot_compile_is_rejected_naming_the_field(llm) -> None:
    out = llm.generate(["x"], SamplingParams(max_tokens=4, structured_output=schema({"type": "nope"})))[0]
    assert out.error is not None and out.error_field == "structured_output"
    assert "cannot be compiled" in out.error


def test_the_specification_is_validated(llm) -> None:
    with pytest.raises(
        RequestValidationError,
        match="exactly one of json_object, json_schema, ebnf, regex, choice or structural_tag",
    ):
        llm.generate(["x"], SamplingParams(structured_output=StructuredOutputParams()))
    with pytest.raises(RequestValidationError, match="json_schema as JSON text"):
        llm.generate(["x"], SamplingParams(structured_output=StructuredOutputParams(json_schema="{nope")))
    with pytest.raises(RequestValidationError, match="min_tokens must be 0 with structured_output"):
        llm.generate(["x"], SamplingParams(min_tokens=5, structured_output=schema({"enum": ["a"]})))


def test_a_grammar_with_a_start_token_constrains_nothing_before_it(backend: GrammarBackend) -> None:
    think_end = Tokenizer.from_dir(default_model_dir()).token_to_id("</think>")
    grammar = backend.grammar(StructuredOutputParams(json_object=True, start_after_token_id=think_end))
    logits = torch.zeros(2, backend.vocab_size)
    apply_grammars(logits, [grammar, None])
    assert torch.isfinite(logits).all()  # inactive: reasoning text is free
    assert grammar.accept(1234) and not grammar.active
    assert grammar.accept(think_end) and grammar.active
    apply_grammars(logits, [grammar, None])
    allowed = torch.isfinite(logits[0]).nonzero().flatten().tolist()
    tokenizer = Tokenizer.from_dir(default_model_dir())
    assert tokenizer.token_to_id("{") in allowed and tokenizer.token_to_id("x") not in allowed
    assert torch.isfinite(logits[1]).all()  # an unconstrained row of the same step


def test_compile_errors_are_structured_output_errors() -> None:
    with pytest.raises(StructuredOutputError, match="cannot be compiled"):
        GrammarBackend(lambda: ["a", "b"], [1]).grammar(schema({"type": "nope"}))


def test_grammar_rows_launch_ahead_and_sample_after_the_tokens_before_them(monkeypatch) -> None:
    """A step with grammar rows launches its forward ahead and samples once the step before it is
    dispatched (its masks need the matchers advanced): the tokens of steps read one at a time, for
    the constrained requests and the free ones beside them."""
    from deltaserve.engine.scheduler import steps

    deferred = []
    sample_after_dispatch = steps._sample_after_dispatch

    def recording(step):
        deferred.append(step.pending.awaits_sampling)
        sample_after_dispatch(step)

    monkeypatch.setattr(steps, "_sample_after_dispatch", recording)
    obj = SamplingParams(max_tokens=60, temperature=1.0, seed=5, structured_output=schema(OBJECT_SCHEMA))
    enum = SamplingParams(
        max_tokens=20, temperature=1.0, seed=4, structured_output=schema({"enum": ["yes", "no"]})
    )
    free = SamplingParams(max_tokens=24, temperature=0.8, seed=9, ignore_eos=True)
    prompts, params = ["Give JSON:", "Answer:", "Free text:", "More JSON:"], [obj, enum, free, obj]
    outs = {}
    for ahead in (False, True):
        deferred.clear()
        with LLM(None, max_num_seqs=8, decode_ahead=ahead) as engine:
            outs[ahead] = [o.outputs[0].token_ids for o in engine.generate(prompts, params)]
        assert any(deferred) == ahead
    assert outs[True] == outs[False]
    tokenizer = Tokenizer.from_dir(default_model_dir())
    for i in (0, 3):
        assert set(json.loads(tokenizer.decode(outs[True][i]))) == {"a", "b"}


class _Sized:
    def __init__(self, nbytes: int) -> None:
        self.memory_size_bytes = nbytes


def test_compiled_grammars_keep_the_most_recently_used_within_their_byte_limit() -> None:
    cache = CompiledGrammars(limit_bytes=100)
    a, b, c, big = _Sized(40), _Sized(40), _Sized(40), _Sized(500)
    cache.put(("a",), a)
    cache.put(("b",), b)
    assert cache.get(("a",)) is a  # now the most recent: b is the least
    cache.put(("c",), c)  # 120 bytes > 100: b goes
    assert cache.get(("b",)) is None and cache.get(("a",)) is a and cache.get(("c",)) is c
    assert cache.nbytes == 80 and len(cache) == 2
    cache.put(("big",), big)  # past the limit alone: it stays, the rest goes
    assert len(cache) == 1 and cache.get(("big",)) is big and cache.nbytes == 500


def test_a_backend_forgets_the_least_recent_grammar_past_its_limit() -> None:
    backend = GrammarBackend(lambda: ["", "a", "b", "ab"], [0], cache_bytes=1)
    first = StructuredOutputParams(choice=["a"])
    second = StructuredOutputParams(choice=["b"])
    backend.grammar(first)
    assert backend.cached(first) is not None
    backend.grammar(second)  # each grammar is more than one byte: only the newest stays
    assert backend.cached(first) is None and backend.cached(second) is not None
