"""/v1/completions through the official openai client against the real server subprocess."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from server_fixture import MODEL, ServerProcess, running_server, token_counts, wait_until_idle

from deltaserve.engine.llm import LLM
from deltaserve.sampling_params import SamplingParams

PROMPTS = [f"Request number {i}: tell me about topic {i * 7 % 13}." for i in range(64)]


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with running_server() as s:
        yield s


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def offline() -> Iterator[LLM]:
    with LLM(None, device="cpu", max_num_seqs=16, max_model_len=2048) as llm:
        yield llm


def test_string_prompt_returns_text_and_exact_usage(client: openai.OpenAI) -> None:
    out = client.completions.create(
        model=MODEL, prompt="Hello there", max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
    )
    assert out.object == "text_completion" and out.model == MODEL
    assert len(out.choices) == 1 and out.choices[0].finish_reason == "length"
    assert out.usage is not None
    assert out.usage.completion_tokens == 6
    assert out.usage.prompt_tokens == 2  # "Hello", " there"
    assert out.usage.total_tokens == 8


def test_list_of_prompts_and_token_ids_give_one_choice_each_in_order(
    server: ServerProcess, client: openai.OpenAI
) -> None:
    single = client.completions.create(model=MODEL, prompt="Hello there", max_tokens=5, temperature=0)
    ids = httpx.post(f"{server.url}/tokenize", json={"prompt": "Hello there"}).json()["tokens"]
    out = client.completions.create(
        model=MODEL, prompt=["Hello there", "Another one", "Third"], max_tokens=5, temperature=0
    )
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert out.choices[0].text == single.choices[0].text
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=5, temperature=0)
    assert by_ids.choices[0].text == single.choices[0].text
    many_ids = client.completions.create(model=MODEL, prompt=[ids, ids], max_tokens=5, temperature=0)
    assert [c.text for c in many_ids.choices] == [single.choices[0].text] * 2
    assert many_ids.usage is not None and many_ids.usage.prompt_tokens == 2 * len(ids)


def test_streaming_with_include_usage_sends_exactly_one_usage_chunk(client: openai.OpenAI) -> None:
    whole = client.completions.create(model=MODEL, prompt="Stream me", max_tokens=8, temperature=0)
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt="Stream me",
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    usage_chunks = [c for c in chunks if c.usage is not None]
    assert len(usage_chunks) == 1 and chunks[-1] is usage_chunks[0] and chunks[-1].choices == []
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert token_counts(usage_chunks[0].usage) == token_counts(whole.usage)


def test_streaming_several_prompts_interleaves_choices_by_index(client: openai.OpenAI) -> None:
    prompts = ["First prompt", "Second prompt", "Third prompt"]
    whole = client.completions.create(model=MODEL, prompt=prompts, max_tokens=6, temperature=0)
    texts = ["", "", ""]
    finished = set()
    for chunk in client.completions.create(
        model=MODEL, prompt=prompts, max_tokens=6, temperature=0, stream=True
    ):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            if choice.finish_reason is not None:
                finished.add(choice.index)
    assert texts == [c.text for c in whole.choices] and finished == {0, 1, 2}


def test_stream_without_include_usage_has_no_usage(client: openai.OpenAI) -> None:
    chunks = list(client.completions.create(model=MODEL, prompt="Stream me", max_tokens=3, stream=True))
    assert chunks and all(c.usage is None for c in chunks)


def test_stop_string_across_token_boundary_is_cut_and_ends_the_request(client: openai.OpenAI) -> None:
    full = client.completions.create(
        model=MODEL,
        prompt="Stop test",
        max_tokens=12,
        temperature=0,
        logprobs=0,
        extra_body={"ignore_eos": True},
    )
    tokens = full.choices[0].logprobs.tokens  # type: ignore[union-attr]
    # A stop string made of the end of token 3 and the start of token 4: it only exists across the boundary.
    i = next(
        i
        for i in range(3, 10)
        if tokens[i].strip() and tokens[i + 1].strip() and "\ufffd" not in tokens[i] + tokens[i + 1]
    )
    stop = tokens[i][-1] + tokens[i + 1][0]
    expected = full.choices[0].text[: full.choices[0].text.index(stop)]
    out = client.completions.create(
        model=MODEL,
        prompt="Stop test",
        max_tokens=12,
        temperature=0,
        stop=[stop],
        extra_body={"ignore_eos": True},
    )
    assert out.choices[0].text == expected
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].stop_reason == stop  # type: ignore[attr-defined]
    assert (
        out.usage is not None and out.usage.completion_tokens == i + 2
    )  # the token that completed the match
    streamed = client.completions.create(
        model=MODEL, prompt="Stop test", max_tokens=12, temperature=0, stop=stop, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == expected


def test_logprobs_in_completions_format(client: openai.OpenAI) -> None:
    out = client.completions.create(
        model=MODEL,
        prompt="Logprobs",
        max_tokens=5,
        temperature=0,
        logprobs=3,
        extra_body={"ignore_eos": True},
    )
    lp = out.choices[0].logprobs
    assert (
        lp is not None
        and lp.tokens is not None
        and lp.token_logprobs is not None
        and lp.top_logprobs is not None
    )
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    offsets = [0]
    for token in lp.tokens[:-1]:
        offsets.append(offsets[-1] + len(token))
    assert lp.text_offset == offsets
    for sampled, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert 3 <= len(top) <= 4 and sampled <= 0
        assert sampled == pytest.approx(max(top.values()))  # greedy: the sampled token is the most likely


def test_echo_with_logprobs_scores_the_prompt_as_evaluation_harnesses_ask(
    server: ServerProcess, client: openai.OpenAI, offline: LLM
) -> None:
    """echo + logprobs + max_tokens=1 (lm-evaluation-harness' loglikelihood request): the prompt text
    comes back first, then the completion; logprobs cover prompt tokens (the first has none) and
    equal the engine's prompt logprobs."""
    text = "The capital of France is Paris"
    out = client.completions.create(
        model=MODEL, prompt=text, max_tokens=1, temperature=0, logprobs=1, echo=True
    )
    choice = out.choices[0]
    assert choice.text.startswith(text) and len(choice.text) > len(text)
    lp = choice.logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
    ids = httpx.post(f"{server.url}/tokenize", json={"prompt": text}).json()["tokens"]
    assert len(lp.tokens) == len(ids) + 1 and "".join(lp.tokens[: len(ids)]) == text
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # type: ignore[index]
    assert lp.text_offset[len(ids)] == len(text)  # type: ignore[index]
    want = offline.generate(text, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1))[0]
    assert want.prompt_logprobs is not None
    for got, ref in zip(lp.token_logprobs[1 : len(ids)], want.prompt_logprobs[1:], strict=True):
        assert got == pytest.approx(ref.logprob, abs=1e-5)
    assert out.usage is not None and out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == 1


@pytest.mark.parametrize("stream", [False, True])
def test_echo_with_max_tokens_0_returns_only_the_scored_prompt(server: ServerProcess, stream: bool) -> None:
    """Scoring text without generating (echo, logprobs, max_tokens=0), as scoring scripts ask."""
    body = {"model": MODEL, "prompt": "Scoring only", "max_tokens": 0, "echo": True, "logprobs": 2}
    if not stream:
        out = httpx.post(f"{server.base_url}/completions", json=body, timeout=60).json()
        choice = out["choices"][0]
        assert choice["text"] == "Scoring only" and choice["finish_reason"] == "length"
        assert (
            choice["logprobs"]["token_logprobs"][0] is None
            and "".join(choice["logprobs"]["tokens"]) == "Scoring only"
        )
        assert out["usage"]["completion_tokens"] == 0 and out["usage"]["prompt_tokens"] == 3
        return
    with httpx.stream(
        "POST", f"{server.base_url}/completions", json={**body, "stream": True}, timeout=60
    ) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert "".join(e["choices"][0]["text"] for e in events) == "Scoring only"
    assert events[-1]["choices"][0]["finish_reason"] == "length"


def test_max_tokens_0_without_echo_is_still_refused(server: ServerProcess) -> None:
    body = {"model": MODEL, "prompt": "x", "max_tokens": 0}
    response = httpx.post(f"{server.base_url}/completions", json=body, timeout=60)
    assert response.status_code == 400 and response.json()["error"]["param"] == "max_tokens"


def test_echo_streams_the_prompt_first_and_prompt_logprobs_by_token_id(server: ServerProcess) -> None:
    body = {"model": MODEL, "prompt": [11, 22, 33, 44], "max_tokens": 3, "temperature": 0, "echo": True}
    full = httpx.post(
        f"{server.base_url}/completions", json={**body, "prompt_logprobs": 2}, timeout=60
    ).json()
    choice = full["choices"][0]
    plp = choice["prompt_logprobs"]
    assert plp[0] is None and len(plp) == 4
    for token, entry in zip([22, 33, 44], plp[1:], strict=True):
        assert str(token) in entry and len(entry) <= 3  # the token itself and up to 2 alternatives
        ranks = sorted(e["rank"] for e in entry.values())
        assert ranks[0] >= 1 and all("decoded_token" in e for e in entry.values())
    with httpx.stream(
        "POST", f"{server.base_url}/completions", json={**body, "stream": True}, timeout=60
    ) as r:
        texts = [
            json.loads(line[6:])["choices"][0]["text"]
            for line in r.iter_lines()
            if line.startswith("data: {")
        ]
    prompt_text = choice["text"][: len(choice["text"]) - len("".join(texts[1:]))]
    assert texts[0].startswith(prompt_text) and "".join(texts) == choice["text"]


def test_chat_returns_prompt_logprobs_of_the_rendered_prompt(server: ServerProcess) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 2,
        "prompt_logprobs": 0,
    }
    out = httpx.post(f"{server.base_url}/chat/completions", json=body, timeout=60).json()
    plp = out["prompt_logprobs"]
    assert plp[0] is None and len(plp) == out["usage"]["prompt_tokens"]
    assert all(len(entry) == 1 for entry in plp[1:])


def test_n_choices_per_prompt_in_order_with_the_prompt_counted_once(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = dict(
        model=MODEL,
        prompt=["One", "Two words"],
        n=3,
        max_tokens=8,
        temperature=1.0,
        seed=5,
        extra_body={"ignore_eos": True},
    )
    out = client.completions.create(**kwargs)
    assert [c.index for c in out.choices] == list(range(6))
    assert len({c.text for c in out.choices[:3]}) > 1  # seeded choices differ from each other
    again = client.completions.create(**kwargs)
    assert [c.text for c in again.choices] == [c.text for c in out.choices]  # and reproduce
    assert out.usage is not None and out.usage.prompt_tokens == 1 + 2 and out.usage.completion_tokens == 48


def test_json_schema_response_format_on_completions(server: ServerProcess) -> None:
    body = {
        "model": MODEL,
        "prompt": "Pick one:",
        "max_tokens": 10,
        "response_format": {"type": "json_schema", "json_schema": {"schema": {"enum": ["red", "blue"]}}},
    }
    out = httpx.post(f"{server.base_url}/completions", json=body, timeout=60).json()
    assert out["choices"][0]["text"] in ('"red"', '"blue"') and out["choices"][0]["finish_reason"] == "stop"


def test_seeded_sampling_is_reproducible(client: openai.OpenAI) -> None:
    def sample(seed: int) -> str:
        out = client.completions.create(
            model=MODEL,
            prompt="Seeded",
            max_tokens=8,
            temperature=1.0,
            top_p=0.9,
            seed=seed,
            extra_body={"top_k": 50, "min_p": 0.0, "repetition_penalty": 1.1},
        )
        return out.choices[0].text

    assert sample(1234) == sample(1234)
    assert sample(1234) != sample(4321)


def test_logit_bias_reaches_the_sampler(server: ServerProcess, client: openai.OpenAI) -> None:
    forced = 151  # a plain byte-level token
    out = client.completions.create(
        model=MODEL, prompt="Bias", max_tokens=4, temperature=0, logit_bias={str(forced): 100}, logprobs=0
    )
    assert out.choices[0].logprobs is not None
    assert out.usage is not None and out.usage.completion_tokens == 4
    text = httpx.post(f"{server.url}/detokenize", json={"tokens": [forced] * 4}).json()["prompt"]
    assert out.choices[0].text == text


def test_sixty_four_concurrent_streams_equal_the_offline_llm(server: ServerProcess, offline: LLM) -> None:
    expected = offline.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=8))
    aclient = openai.AsyncOpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=120)

    async def one(prompt: str) -> tuple[str, int, int, str | None]:
        stream = await aclient.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        text, usage, finish = "", None, None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
                finish = chunk.choices[0].finish_reason or finish
            if chunk.usage is not None:
                usage = chunk.usage
        assert usage is not None
        return text, usage.prompt_tokens, usage.completion_tokens, finish

    async def all_of_them() -> list[tuple[str, int, int, str | None]]:
        try:
            return await asyncio.gather(*(one(p) for p in PROMPTS))
        finally:
            await aclient.close()

    results = asyncio.run(all_of_them())
    for (text, n_prompt, n_out, finish), want in zip(results, expected, strict=True):
        assert text == want.outputs[0].text
        assert n_prompt == len(want.prompt_token_ids)
        assert n_out == len(want.outputs[0].token_ids)
        assert finish == want.outputs[0].finish_reason
    wait_until_idle(server)


def test_async_client_non_streaming(server: ServerProcess) -> None:
    async def run() -> openai.types.Completion:
        async with openai.AsyncOpenAI(base_url=server.base_url, api_key="none", max_retries=0) as aclient:
            return await aclient.completions.create(model=MODEL, prompt="Async", max_tokens=3)

    out = asyncio.run(run())
    assert out.usage is not None and 1 <= out.usage.completion_tokens <= 3
