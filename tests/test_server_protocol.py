"""Request models of the API: what they accept, and what accepting it costs."""

from __future__ import annotations

import timeit

import pytest
from pydantic import TypeAdapter

from deltaserve.server.protocol import CompletionRequest


@pytest.mark.parametrize("prompt", ["text", [1, 2, 3], ["a", "b"], [[1, 2], [3]], []])
def test_each_prompt_form_is_accepted_as_sent(prompt) -> None:
    assert CompletionRequest.model_validate({"model": "m", "prompt": prompt}).prompt == prompt


def test_a_long_token_id_prompt_validates_at_the_speed_of_a_list_of_ints() -> None:
    # Ahead of the handler (and of the server's clock): tried as strings first, 8,192 ids built 8,192
    # errors, ~18x a plain list[int] validation.
    ids = list(range(100_000, 108_192))
    body = {"model": "m", "prompt": ids, "max_tokens": 1}
    ints = TypeAdapter(list[int])

    def best(fn) -> float:
        return min(timeit.repeat(fn, number=20, repeat=5))

    assert best(lambda: CompletionRequest.model_validate(body)) < 4 * best(lambda: ints.validate_python(ids))
