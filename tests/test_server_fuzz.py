"""A bounded fuzz pass against the app in-process: no request body, however malformed, gets a 5xx.

The app runs on a real engine process (the embedded tiny model) and is called through httpx's ASGI
transport, so an unhandled exception fails the test with its traceback. Bodies are valid requests
with fields replaced by arbitrary JSON (lone surrogates, huge integers, NaN, deep nesting, wrong
types) and arbitrary extra fields. Generation is kept short: every length field is either small or
invalid. 1,500 examples, about 20 s on a 2-core CPU machine.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deltaserve.engine_config import EngineConfig
from deltaserve.server.app import build_app
from deltaserve.server.args import ServerConfig
from deltaserve.server.lifecycle import close_workers, open_state

T = TypeVar("T")

USER = [{"role": "user", "content": "Hi"}]
BASES: dict[str, dict[str, Any]] = {
    "/v1/completions": {"prompt": "Hello", "max_tokens": 2},
    "/v1/chat/completions": {"messages": USER, "max_tokens": 2},
    "/v1/responses": {"input": "Hello", "max_output_tokens": 2},
    "/tokenize": {"prompt": "Hello"},
    "/detokenize": {"tokens": [1, 2, 3]},
}
FIELDS = [
    "prompt", "messages", "input", "tokens", "model", "n", "temperature", "top_p", "top_k", "min_p",
    "presence_penalty", "frequency_penalty", "repetition_penalty", "seed", "logit_bias", "stop",
    "stop_token_ids", "ignore_eos", "min_tokens", "skip_special_tokens", "include_stop_str_in_output",
    "prompt_logprobs", "stream", "stream_options", "response_format", "logprobs", "top_logprobs", "echo",
    "best_of", "suffix", "tools", "tool_choice", "parallel_tool_calls", "chat_template_kwargs",
    "instructions", "previous_response_id", "text", "reasoning", "metadata", "truncation", "store",
    "truncate_prompt_tokens", "cache_salt", "return_token_ids", "allowed_token_ids",
]  # fmt: skip
LENGTH_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens")

# Any code point, lone surrogates (which JSON can escape) made frequent, and the template's own tags.
characters = st.characters(codec=None, exclude_categories=()) | st.sampled_from(["\ud800", "\udfff", "\x00"])
text = st.text(alphabet=characters, max_size=12) | st.sampled_from(["<|im_end|>", "</think>", "<tool_call>"])
scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | text
)
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(text, inner, max_size=4),
    max_leaves=12,
)
# Lengths that are small enough to generate quickly (most of the time, so bodies get past validation),
# or invalid.
lengths = (
    st.integers(1, 3)
    | st.integers(1, 3)
    | st.integers(1, 3)
    | st.integers(-3, 0)
    | st.integers(min_value=10**6)
)
lengths = lengths | st.booleans() | text | st.floats()
# Values of the right shape for most fields, so that bodies reach tokenization, templates and the engine.
plausible = text | st.integers(-2, 5) | st.floats(-2, 2) | st.booleans() | st.lists(text, max_size=3)
messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "assistant", "tool", "developer"]) | text},
        optional={
            "content": json_values,
            "tool_calls": st.lists(
                st.fixed_dictionaries(
                    {"function": json_values | st.fixed_dictionaries({"name": text, "arguments": text})}
                ),
                max_size=2,
            ),
            "name": json_values,
        },
    ),
    max_size=3,
)
DEEP = "__deep__"  # replaced, after encoding, by JSON nested this many levels (json.dumps would recurse)


@st.composite
def bodies(draw: st.DrawFn) -> tuple[str, bytes]:
    path = draw(st.sampled_from(sorted(BASES)))
    body = dict(BASES[path])
    for field in draw(st.lists(st.sampled_from(FIELDS), max_size=3, unique=True)):
        body[field] = draw(messages | json_values) if field == "messages" else draw(plausible | json_values)
    for field in LENGTH_FIELDS:
        if field in body or draw(st.integers(0, 4)) == 0:
            body[field] = draw(lengths)
    body.update(draw(st.dictionaries(text, json_values, max_size=2)))
    if draw(st.integers(0, 4)) == 0:  # text the tokenizer or the template would see, spiked
        spiked = draw(text) + draw(st.sampled_from(["\ud800", "\udc00", "\x00", "<|im_start|>"]))
        target = draw(st.sampled_from(["prompt", "input", "stop", "messages", "instructions"]))
        body[target] = [{"role": "user", "content": spiked}] if target == "messages" else spiked
    deep_field = draw(st.none() | st.sampled_from(FIELDS))
    if deep_field is not None:
        body[deep_field] = DEEP
    encoded = json.dumps(body)  # escapes lone surrogates as clients send them
    depth = draw(st.integers(1, 3000))
    return path, encoded.replace(f'"{DEEP}"', "[" * depth + "]" * depth).encode()


class _AppInThread:
    """The app and its engine on one event loop in a background thread (hypothesis calls are sync)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        config = ServerConfig(max_request_body_bytes=1 << 20)
        engine = EngineConfig(device="cpu", max_num_seqs=16, max_model_len=2048)
        self.state = self.run(open_state(config, engine))
        self.http = httpx.AsyncClient(
            transport=httpx.ASGITransport(app=build_app(self.state)), base_url="http://app", timeout=60
        )

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=120)

    def close(self) -> None:
        self.run(self.http.aclose())
        self.run(self.state.client.shutdown())
        close_workers(self.state)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def app() -> Iterator[_AppInThread]:
    app = _AppInThread()
    try:
        yield app
    finally:
        app.close()


def _server_errors(response: httpx.Response) -> list[str]:
    """5xx statuses, and 5xx error events inside a 200 stream."""
    if response.status_code >= 500:
        return [f"{response.status_code}: {response.text[:500]}"]
    found = []
    for line in response.text.splitlines():
        payload = line.removeprefix("data: ")
        if line.startswith("data: {") and '"error"' in payload:
            error = json.loads(payload).get("error") or {}
            if isinstance(error, dict) and (error.get("type") == "server_error" or error.get("code") == 500):
                found.append(payload[:500])
    return found


@settings(max_examples=1500, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(request=bodies())
def test_no_request_body_gets_a_5xx(app: _AppInThread, request: tuple[str, bytes]) -> None:
    path, body = request
    response = app.run(app.http.post(path, content=body, headers={"content-type": "application/json"}))
    assert not _server_errors(response), (path, body[:500])
    if response.status_code >= 400:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]
