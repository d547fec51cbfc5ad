"""The prefix cache through the API: multi-turn chat resumes at the last message boundary, with the
same output as a server without the cache; cached_tokens in every usage; metrics, /load and reset."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from server_fixture import MODEL, ServerProcess, running_server

from deltaserve.server.chat_prompt import ToolChoice, render_chat_prompt
from deltaserve.tiny import default_model_dir
from deltaserve.tokenizer import Tokenizer

SYSTEM = "You are a careful assistant. " * 12
PAGE = 16  # the default page size
GREEDY: dict[str, Any] = {"temperature": 0.0, "max_tokens": 6, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with running_server() as s:
        yield s


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused")


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_dir(default_model_dir())


def _chat(client: openai.OpenAI, messages: list[dict[str, str]]) -> tuple[str, int]:
    out = client.chat.completions.create(model=MODEL, messages=messages, **GREEDY)
    message = out.choices[0].message
    text = (getattr(message, "reasoning_content", None) or "") + (message.content or "")
    return text, out.usage.prompt_tokens_details.cached_tokens


def _last_boundary(tokenizer: Tokenizer, messages: list[dict[str, str]]) -> int:
    prompt = render_chat_prompt(
        tokenizer, messages, tools=None, tool_choice=ToolChoice("auto"), template_kwargs={}
    )
    return prompt.cache_points[-1]


def test_each_chat_turn_resumes_at_the_previous_turns_last_message_and_matches_a_cache_off_server(
    client: openai.OpenAI, tokenizer: Tokenizer
) -> None:
    users = [f"Question {k}: tell me about the number {k * 7}." for k in range(5)]
    with running_server("--no-enable-prefix-caching") as plain:
        reference = openai.OpenAI(base_url=plain.base_url, api_key="unused")
        messages: list[dict[str, str]] = [{"role": "system", "content": SYSTEM}]
        for k, user in enumerate(users):
            messages.append({"role": "user", "content": user})
            ours, cached = _chat(client, messages)
            theirs, plain_cached = _chat(reference, messages)
            assert ours == theirs, f"turn {k + 1}"
            assert plain_cached == 0
            if k > 0:  # everything up to the previous turn's last user message is cached
                assert cached == _last_boundary(tokenizer, messages[:-2]), f"turn {k + 1}"
            messages.append({"role": "assistant", "content": ours})


def test_requests_sharing_only_a_system_prompt_share_it(client: openai.OpenAI, tokenizer: Tokenizer) -> None:
    system = "Shared instructions for every conversation. " * 10
    first = [{"role": "system", "content": system}, {"role": "user", "content": "First conversation."}]
    second = [{"role": "system", "content": system}, {"role": "user", "content": "A different one."}]
    _chat(client, first)
    _, cached = _chat(client, second)
    prompt = render_chat_prompt(
        tokenizer, second, tools=None, tool_choice=ToolChoice("auto"), template_kwargs={}
    )
    assert cached == prompt.cache_points[0] > PAGE  # the system turn's end


def test_a_completion_extending_an_earlier_prompt_reports_it_cached(server: ServerProcess) -> None:
    base = list(range(1000, 1000 + 3 * PAGE + 5))
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 4, "temperature": 0.0, "ignore_eos": True}
    first = httpx.post(f"{server.base_url}/completions", json={**body, "prompt": base}, timeout=60).json()
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    longer = httpx.post(
        f"{server.base_url}/completions", json={**body, "prompt": base + [7, 8, 9]}, timeout=60
    ).json()
    assert longer["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(base) - PAGE
    streamed = httpx.post(
        f"{server.base_url}/completions",
        json={
            **body,
            "prompt": base + [7, 8, 9, 10],
            "stream": True,
            "stream_options": {"include_usage": True},
        },
        timeout=60,
    ).text
    assert '"cached_tokens":' in streamed and '"cached_tokens":0' not in streamed


def test_responses_report_cached_input_tokens(server: ServerProcess) -> None:
    body = {"model": MODEL, "input": "Remember this sentence exactly. " * 8, "max_output_tokens": 4}
    httpx.post(f"{server.base_url}/responses", json=body, timeout=60).raise_for_status()
    again = httpx.post(f"{server.base_url}/responses", json=body, timeout=60).json()
    assert again["usage"]["input_tokens_details"]["cached_tokens"] > PAGE


def test_metrics_and_load_count_prefix_cache_tokens_and_reset_forgets_them(server: ServerProcess) -> None:
    prompt = list(range(2000, 2000 + 4 * PAGE))
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0.0, "ignore_eos": True}
    queries = server.metric("vllm:prefix_cache_queries_total", model_name=MODEL)
    hits = server.metric("vllm:prefix_cache_hits_total", model_name=MODEL)
    longer = {**body, "prompt": prompt + [5, 6]}
    httpx.post(f"{server.base_url}/completions", json=body, timeout=60).raise_for_status()
    httpx.post(f"{server.base_url}/completions", json=longer, timeout=60).raise_for_status()
    assert server.metric("vllm:prefix_cache_queries_total", model_name=MODEL) == queries + 2 * len(prompt) + 2
    assert server.metric("vllm:prefix_cache_hits_total", model_name=MODEL) == hits + len(prompt)
    load = server.get_json("/load")
    assert load["state_snapshots_used"] > 0 and load["prefix_cache_cached_tokens"] >= 3 * PAGE
    assert httpx.post(f"{server.url}/reset_prefix_cache", timeout=30).status_code == 200
    after = httpx.post(f"{server.base_url}/completions", json=longer, timeout=60).json()
    assert after["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
