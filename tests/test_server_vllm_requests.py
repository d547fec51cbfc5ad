"""Request fields vLLM clients send, through the official openai client against the real server: each one
constrains or changes the output, or gets a 400 naming it. On the random tiny model, whose text is noise,
so every constraint seen in the output is the grammar's doing."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from server_fixture import MODEL, ServerProcess, running_server

USER = [{"role": "user", "content": "What is the weather in Paris?"}]
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
BOOKING = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "nights": {"type": "integer", "minimum": 1, "maximum": 9},
        "room": {"type": "string", "enum": ["single", "double"]},
        "breakfast": {"type": "boolean"},
    },
    "required": ["city", "room", "breakfast"],
}
BOOK_TOOLS: list[Any] = [{"type": "function", "function": {"name": "book", "parameters": BOOKING}}]
PING_TOOLS: list[Any] = [
    {"type": "function", "function": {"name": name, "parameters": {"type": "object", "properties": {}}}}
    for name in ("ping", "pong")
]


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with running_server() as s:
        yield s


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0)


def _chat(client: openai.OpenAI, **kwargs: Any) -> Any:
    base: dict[str, Any] = dict(model=MODEL, messages=USER, temperature=1.0, max_tokens=40)
    return client.chat.completions.create(**{**base, **kwargs})


def _contents(out: Any) -> list[str]:
    return [c.message.content or "" for c in out.choices]


# ---- tool calls ---------------------------------------------------------------------------------


def test_forced_tool_calls_satisfy_their_schema_over_many_seeds(client: openai.OpenAI) -> None:
    out = _chat(
        client,
        tools=BOOK_TOOLS,
        tool_choice={"type": "function", "function": {"name": "book"}},
        max_tokens=90,
        seed=100,
        n=10,
    )
    complete = [c for c in out.choices if c.finish_reason == "tool_calls"]
    assert len(complete) >= 6  # the rest ran out of tokens, and then are not calls (below)
    for choice in complete:
        (call,) = choice.message.tool_calls
        jsonschema.validate(json.loads(call.function.arguments), BOOKING)
    for choice in out.choices:
        if choice.finish_reason == "length":
            assert not choice.message.tool_calls


def test_a_call_cut_off_by_max_tokens_is_not_reported_as_a_call(client: openai.OpenAI) -> None:
    out = _chat(client, tools=BOOK_TOOLS, tool_choice="required", max_tokens=6, seed=1)
    assert out.choices[0].finish_reason == "length" and not out.choices[0].message.tool_calls


def test_parallel_tool_calls_false_makes_one_call(client: openai.OpenAI) -> None:
    out = _chat(
        client,
        tools=PING_TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=60,
        seed=5,
        n=4,
    )
    for choice in out.choices:
        assert len(choice.message.tool_calls or []) <= 1
    assert any(c.finish_reason == "tool_calls" for c in out.choices)


# ---- structured output --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fields",
    [{"response_format": {"type": "json_object"}}, {"structured_outputs": {"json_object": True}}],
)
def test_json_object_is_an_object(server: ServerProcess, client: openai.OpenAI, fields: dict) -> None:
    """The grammar holds the reply to one JSON object. With the closing brace pushed to the top
    (logit_bias), a free reply starts with it; a json_object reply opens an object, then closes it and
    ends. (Unbiased, the random tiny model wanders inside a string key to max_tokens: luck, not a test.)"""
    (brace,) = httpx.post(f"{server.url}/tokenize", json={"prompt": "}"}).json()["tokens"]
    bias = {str(brace): 100}
    free = _chat(client, extra_body=NO_THINKING, logit_bias=bias, seed=7, max_tokens=3)
    assert (free.choices[0].message.content or "").startswith("}")
    out = _chat(client, extra_body={**NO_THINKING, **fields}, logit_bias=bias, seed=7, n=6)
    for choice in out.choices:
        assert choice.finish_reason == "stop", choice
        assert isinstance(json.loads(choice.message.content or ""), dict)


CONSTRAINTS: list[tuple[dict[str, Any], Any]] = [
    ({"structured_outputs": {"choice": ["red", "green"]}}, lambda t: t in ("red", "green")),
    ({"guided_choice": ["red", "green"]}, lambda t: t in ("red", "green")),
    ({"structured_outputs": {"regex": "[0-9]{3}-[a-z]{2}"}}, lambda t: re.fullmatch("[0-9]{3}-[a-z]{2}", t)),
    ({"guided_regex": "[0-9]{3}-[a-z]{2}"}, lambda t: re.fullmatch("[0-9]{3}-[a-z]{2}", t)),
    ({"structured_outputs": {"grammar": 'root ::= "yes" | "no"'}}, lambda t: t in ("yes", "no")),
    ({"guided_grammar": 'root ::= "yes" | "no"'}, lambda t: t in ("yes", "no")),
    ({"structured_outputs": {"json": {"enum": [1, 2]}}}, lambda t: json.loads(t) in (1, 2)),
    ({"guided_json": {"type": "boolean"}}, lambda t: isinstance(json.loads(t), bool)),
]


@pytest.mark.parametrize(("fields", "holds"), CONSTRAINTS)
def test_structured_output_fields_constrain_chat(client: openai.OpenAI, fields: dict, holds: Any) -> None:
    out = _chat(client, seed=3, n=3, extra_body={**NO_THINKING, **fields})
    done = [c for c in out.choices if c.finish_reason == "stop"]  # a long JSON object may run out
    assert done and all(holds(c.message.content or "") for c in done)


def test_structured_output_fields_constrain_completions(client: openai.OpenAI) -> None:
    out = client.completions.create(
        model=MODEL,
        prompt="Colour:",
        max_tokens=10,
        n=3,
        seed=2,
        extra_body={"guided_choice": ["red", "green"]},
    )
    assert all(c.text in ("red", "green") for c in out.choices)


def test_with_thinking_on_the_constraint_starts_after_the_reasoning(client: openai.OpenAI) -> None:
    out = _chat(client, seed=4, max_tokens=80, extra_body={"guided_choice": ["red", "green"]})
    message = out.choices[0].message
    if out.choices[0].finish_reason == "stop":
        assert message.reasoning_content and message.content in ("red", "green")  # type: ignore[attr-defined]


BAD_STRUCTURED: list[tuple[dict[str, Any], str]] = [
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
    (
        {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
        "structured_outputs",
    ),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs"),
    ({"guided_json": "[1, 2]"}, "guided_json"),
    ({"guided_choice": []}, "guided_choice"),
]


@pytest.mark.parametrize(("fields", "param"), BAD_STRUCTURED)
def test_bad_structured_output_is_a_400_naming_the_field(
    server: ServerProcess, fields: dict, param: str
) -> None:
    response = httpx.post(
        f"{server.base_url}/chat/completions", json={"messages": USER, **fields}, timeout=60
    )
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


# ---- chat fields --------------------------------------------------------------------------------


def test_continue_final_message_with_echo_continues_the_assistant_turn(
    server: ServerProcess, client: openai.OpenAI
) -> None:
    start = "The weather in Paris is"
    messages = [*USER, {"role": "assistant", "content": start}]
    fields = {"continue_final_message": True, "add_generation_prompt": False}
    ids = httpx.post(f"{server.url}/tokenize", json={"messages": messages, **fields}).json()["tokens"]
    prompt = httpx.post(f"{server.url}/detokenize", json={"tokens": ids}).json()["prompt"]
    assert prompt.endswith(f"{USER[0]['content']}\nassistant\n<think>\n\n</think>\n\n{start}")
    out = _chat(client, messages=messages, max_tokens=4, extra_body={**fields, "echo": True})
    assert (out.choices[0].message.content or "").startswith(start)
    assert getattr(out.choices[0].message, "reasoning_content", None) is None
    streamed = _chat(
        client, messages=messages, max_tokens=4, stream=True, extra_body={**fields, "echo": True}
    )
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert text.startswith(start)


def test_add_generation_prompt_false_ends_the_prompt_after_the_last_turn(server: ServerProcess) -> None:
    body = {"messages": USER, "add_generation_prompt": False, "return_token_strs": True}
    tokens = httpx.post(f"{server.url}/tokenize", json=body).json()
    assert tokens["token_strs"][-2:] == ["<|im_end|>", "Ċ"] and len(tokens["token_strs"]) == tokens["count"]


def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(client: openai.OpenAI) -> None:
    chunks = list(
        _chat(
            client,
            max_tokens=5,
            stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
            extra_body={"ignore_eos": True},
        )
    )
    counts = [c.usage.completion_tokens for c in chunks]
    assert counts == sorted(counts) and counts[0] == 0 and counts[-1] == 5
    completions = list(
        client.completions.create(
            model=MODEL,
            prompt="Hi",
            max_tokens=3,
            stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},  # type: ignore[typeddict-unknown-key]
        )
    )
    assert all(c.usage is not None for c in completions)


def test_reasoning_effort_none_turns_thinking_off(client: openai.OpenAI) -> None:
    out = _chat(client, max_tokens=5, reasoning_effort="none")
    assert (
        out.choices[0].message.content and getattr(out.choices[0].message, "reasoning_content", None) is None
    )
    on = _chat(client, max_tokens=5, reasoning_effort="high")
    assert on.choices[0].message.reasoning_content  # type: ignore[attr-defined]


REFUSED: list[tuple[str, dict[str, Any], str]] = [
    ("/v1/chat/completions", {"messages": USER, "use_beam_search": True}, "use_beam_search"),
    ("/v1/chat/completions", {"messages": USER, "functions": [{"name": "f"}]}, "functions"),
    ("/v1/chat/completions", {"messages": USER, "modalities": ["text", "audio"]}, "modalities"),
    (
        "/v1/chat/completions",
        {"messages": USER, "guided_whitespace_pattern": " "},
        "guided_whitespace_pattern",
    ),
    ("/v1/completions", {"prompt": "x", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ("/v1/chat/completions", {"messages": USER, "truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
    ("/v1/responses", {"input": "x", "truncate_prompt_tokens": 5}, "truncate_prompt_tokens"),
    ("/v1/responses", {"input": "x", "return_token_ids": True}, "return_token_ids"),
    ("/v1/completions", {"prompt": "x", "allowed_token_ids": []}, "allowed_token_ids"),
    ("/v1/chat/completions", {"messages": USER, "priority": 1}, "priority"),
    ("/v1/completions", {"prompt": "x", "allowed_token_ids": [1, 10**9]}, "allowed_token_ids"),
    ("/v1/responses", {"input": "x", "background": True}, "background"),
    ("/v1/responses", {"input": "x", "top_logprobs": 2}, "top_logprobs"),
    ("/v1/responses", {"input": "x", "reasoning": {"effort": "extreme"}}, "reasoning"),
]


@pytest.mark.parametrize(("path", "body", "param"), REFUSED)
def test_a_field_that_would_change_the_request_is_refused_by_name(
    server: ServerProcess, path: str, body: dict, param: str
) -> None:
    response = httpx.post(f"{server.url}{path}", json=body, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_fields_that_change_nothing_are_still_accepted(client: openai.OpenAI) -> None:
    out = _chat(
        client,
        max_tokens=2,
        modalities=["text"],
        extra_body={"priority": 0, "guided_decoding_backend": "xgrammar", "use_beam_search": False},
    )
    assert out.choices


# ---- Responses ----------------------------------------------------------------------------------


def test_responses_echo_text_format_and_tool_choice_and_take_effort_none(client: openai.OpenAI) -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    fmt = {"type": "json_schema", "name": "answer", "schema": schema}
    tools: list[Any] = [
        {"type": "function", "name": "ping", "parameters": {"type": "object", "properties": {}}}
    ]
    out = client.responses.create(
        model=MODEL,
        input="Is it sunny?",
        max_output_tokens=30,
        text={"format": fmt},  # type: ignore[typeddict-item]
        tools=tools,
        tool_choice="auto",
        reasoning={"effort": "none"},
    )
    assert out.text.format.type == "json_schema" and out.text.format.schema_ == schema  # type: ignore[union-attr]
    assert out.tool_choice == "auto"
    assert not [item for item in out.output if item.type == "reasoning"]
    named = client.responses.create(
        model=MODEL,
        input="Ping",
        max_output_tokens=40,
        tools=tools,
        tool_choice={"type": "function", "name": "ping"},
        temperature=0,
    )
    assert named.tool_choice.type == "function" and named.tool_choice.name == "ping"  # type: ignore[union-attr]


# ---- other routes -------------------------------------------------------------------------------


def test_sagemaker_ping_and_invocations(server: ServerProcess) -> None:
    assert httpx.get(f"{server.url}/ping").status_code == 200
    assert httpx.post(f"{server.url}/ping").status_code == 200
    chat = httpx.post(f"{server.url}/invocations", json={"messages": USER, "max_tokens": 2}, timeout=60)
    assert chat.status_code == 200 and chat.json()["object"] == "chat.completion"
    completion = httpx.post(f"{server.url}/invocations", json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
    assert completion.status_code == 200 and completion.json()["object"] == "text_completion"
    bad = httpx.post(f"{server.url}/invocations", json={"prompt": "Hi", "temperature": -1}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "temperature"
    neither = httpx.post(f"{server.url}/invocations", json={"input": "Hi"}, timeout=60)
    assert neither.status_code == 400 and "messages" in neither.json()["error"]["message"]


def test_tokenize_returns_token_strings(server: ServerProcess) -> None:
    tokens = httpx.post(
        f"{server.url}/tokenize", json={"prompt": "Hello world", "return_token_strs": True}
    ).json()
    assert tokens["token_strs"] == ["Hello", "Ġworld"]


def test_the_readme_client_snippet_runs_as_written(server: ServerProcess, capsys) -> None:
    """The README's OpenAI snippet, against a server started as `make serve` starts one (port aside)."""
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    (snippet,) = [b for b in re.findall(r"```python\n(.*?)```", readme, re.S) if "OpenAI(" in b]
    assert "http://127.0.0.1:8000/v1" in snippet
    exec(snippet.replace("http://127.0.0.1:8000", server.url), {})
    assert "ChatCompletionMessage(" in capsys.readouterr().out


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(
    server: ServerProcess, client: openai.OpenAI
) -> None:
    """vLLM's left truncation: the request runs on the prompt's last N tokens, as if only they were sent
    (greedy, so the outputs compare), on completions (text and ids) and on the rendered chat prompt."""
    ids = httpx.post(f"{server.url}/tokenize", json={"prompt": "The weather in Paris is mild today"}).json()[
        "tokens"
    ]
    greedy = {"max_tokens": 6, "temperature": 0, "extra_body": {"ignore_eos": True}}

    def completion(prompt: Any, **extra: Any) -> Any:
        kw = {**greedy, "extra_body": {**greedy["extra_body"], **extra}}
        return client.completions.create(model=MODEL, prompt=prompt, **kw)  # type: ignore[arg-type]

    alone = completion(ids[-3:])
    for prompt in ("The weather in Paris is mild today", ids):
        cut = completion(prompt, truncate_prompt_tokens=3)
        assert cut.usage is not None and cut.usage.prompt_tokens == 3
        assert cut.choices[0].text == alone.choices[0].text
    whole = completion(ids, truncate_prompt_tokens=-1)  # the context window's worth: all of it
    assert whole.usage is not None and whole.usage.prompt_tokens == len(ids)
    chat = client.chat.completions.create(
        model=MODEL, messages=USER, max_tokens=2, extra_body={"truncate_prompt_tokens": 5}
    )
    assert chat.usage is not None and chat.usage.prompt_tokens == 5


def test_cache_salt_keeps_tenants_cached_prefixes_apart(server: ServerProcess, client: openai.OpenAI) -> None:
    messages = [{"role": "system", "content": "You are a terse assistant for tenant work."}, *USER]

    def cached(salt: str | None) -> int:
        extra = {"cache_salt": salt} if salt is not None else {}
        out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, extra_body=extra)  # type: ignore[arg-type]
        assert out.usage is not None and out.usage.prompt_tokens_details is not None
        return out.usage.prompt_tokens_details.cached_tokens or 0

    assert cached("tenant-1") == 0
    assert cached("tenant-1") > 0  # the same tenant reuses its own prefix
    assert cached("tenant-2") == 0 and cached(None) == 0  # no other tenant, and no unsalted request, does
    empty = httpx.post(
        f"{server.url}/v1/chat/completions", json={"messages": USER, "cache_salt": ""}, timeout=60
    )
    assert empty.status_code == 400 and empty.json()["error"]["param"] == "cache_salt"


def test_return_token_ids_gives_the_prompt_and_output_ids(
    server: ServerProcess, client: openai.OpenAI
) -> None:
    """vLLM's return_token_ids: the prompt's ids (a stream: in its first chunk) and each choice's output
    ids (a stream: each chunk's new ones), on completions and chat; absent unless asked for."""
    text = "The weather in Paris"
    prompt_ids = httpx.post(f"{server.url}/tokenize", json={"prompt": text}).json()["tokens"]
    ask = {"return_token_ids": True, "ignore_eos": True}
    out = client.completions.create(model=MODEL, prompt=text, max_tokens=5, temperature=0, extra_body=ask)
    choice: Any = out.choices[0]
    assert choice.prompt_token_ids == prompt_ids and len(choice.token_ids) == 5
    detok = httpx.post(f"{server.url}/detokenize", json={"tokens": choice.token_ids}).json()["prompt"]
    assert detok == choice.text
    chunks: list[Any] = list(
        client.completions.create(
            model=MODEL, prompt=text, max_tokens=5, temperature=0, stream=True, extra_body=ask
        )
    )
    assert chunks[0].choices[0].prompt_token_ids == prompt_ids
    assert all(c.choices[0].prompt_token_ids is None for c in chunks[1:])
    assert [t for c in chunks for t in c.choices[0].token_ids] == choice.token_ids
    plain: Any = client.completions.create(model=MODEL, prompt=text, max_tokens=2).choices[0]
    assert plain.token_ids is None and plain.prompt_token_ids is None

    chat_ids = httpx.post(f"{server.url}/tokenize", json={"messages": USER}).json()["tokens"]
    reply: Any = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=4, extra_body=ask)  # type: ignore[arg-type]
    assert reply.prompt_token_ids == chat_ids and len(reply.choices[0].token_ids) == 4
    stream: list[Any] = list(
        client.chat.completions.create(model=MODEL, messages=USER, max_tokens=4, stream=True, extra_body=ask)  # type: ignore[arg-type]
    )
    assert stream[0].prompt_token_ids == chat_ids and all(c.prompt_token_ids is None for c in stream[1:])
    assert len([t for c in stream for ch in c.choices for t in (ch.token_ids or [])]) == 4


def test_allowed_token_ids_are_the_only_ids_sampled(client: openai.OpenAI) -> None:
    allowed = [11, 220, 1000, 4999]
    extra = {"allowed_token_ids": allowed, "return_token_ids": True, "ignore_eos": True}
    out = client.completions.create(model=MODEL, prompt="Count:", max_tokens=24, n=3, extra_body=extra)
    for choice in out.choices:
        ids = choice.token_ids  # type: ignore[attr-defined]
        assert len(ids) == 24 and set(ids) <= set(allowed), ids
    chat: Any = client.chat.completions.create(
        model=MODEL, messages=USER, max_tokens=8, temperature=0, extra_body=extra
    )
    assert set(chat.choices[0].token_ids) <= set(allowed)


def test_return_tokens_as_token_ids_spells_logprob_tokens_by_id(client: openai.OpenAI) -> None:
    ask = {"return_tokens_as_token_ids": True, "return_token_ids": True}
    chat: Any = client.chat.completions.create(
        model=MODEL, messages=USER, max_tokens=5, logprobs=True, top_logprobs=2, extra_body=ask
    )
    content = chat.choices[0].logprobs.content
    assert [c.token for c in content] == [f"token_id:{t}" for t in chat.choices[0].token_ids]
    assert all(alt.token.startswith("token_id:") for c in content for alt in c.top_logprobs)
    assert content[0].bytes == list(content[0].token.encode())
    out: Any = client.completions.create(
        model=MODEL, prompt="The weather", max_tokens=4, logprobs=1, extra_body=ask
    )
    assert out.choices[0].logprobs.tokens == [f"token_id:{t}" for t in out.choices[0].token_ids]
    plain: Any = client.completions.create(model=MODEL, prompt="The weather", max_tokens=2, logprobs=1)
    assert not any(t.startswith("token_id:") for t in plain.choices[0].logprobs.tokens)


def test_bad_words_are_never_completed(server: ServerProcess, client: openai.OpenAI) -> None:
    """Only " Paris" and " London" may be sampled (allowed_token_ids); banning the word Paris leaves London."""
    (paris,) = httpx.post(f"{server.url}/tokenize", json={"prompt": " Paris"}).json()["tokens"]
    (london,) = httpx.post(f"{server.url}/tokenize", json={"prompt": " London"}).json()["tokens"]
    extra = {"allowed_token_ids": [paris, london], "return_token_ids": True, "ignore_eos": True}
    free = client.completions.create(
        model=MODEL, prompt="Cities:", max_tokens=24, temperature=1.0, seed=1, extra_body=extra
    )
    assert paris in free.choices[0].token_ids  # type: ignore[attr-defined]
    banned = client.completions.create(
        model=MODEL,
        prompt="Cities:",
        max_tokens=24,
        temperature=1.0,
        seed=1,
        extra_body={**extra, "bad_words": ["Paris"]},
    )
    assert set(banned.choices[0].token_ids) == {london}  # type: ignore[attr-defined]
    refused = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", "bad_words": [""]}, timeout=60)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "bad_words"
    nothing_left = {"prompt": "x", "allowed_token_ids": [paris], "bad_words": ["Paris"]}
    refused = httpx.post(f"{server.url}/v1/completions", json=nothing_left, timeout=60)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "allowed_token_ids", (
        refused.text
    )
