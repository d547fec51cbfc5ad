"""`deltaserve serve --speculative-config` (vLLM's flag) on the embedded checkpoint: streamed and unstreamed
outputs agree, logprobs per token, structured output beside speculating requests, and vLLM's spec-decode
metrics. (That speculation gives exactly the tokens of plain decoding is proven on the engine in
test_speculative_decoding.py; one server keeps this module cheap.)"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from server_fixture import MODEL, ServerProcess, running_server

SPEC = '{"method": "mtp", "num_speculative_tokens": 2, "adaptive": false}'
BODY = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 9, "temperature": 0.0}


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with running_server("--speculative-config", SPEC) as s:
        yield s


def _complete(server: ServerProcess, **extra) -> dict:
    r = httpx.post(f"{server.base_url}/completions", json={**BODY, "ignore_eos": True, **extra}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def _stream_text(server: ServerProcess) -> str:
    body = {**BODY, "ignore_eos": True, "stream": True}
    text = []
    with httpx.stream("POST", f"{server.base_url}/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = httpx.Response(200, content=line[6:]).json()
                text += [c["text"] for c in chunk["choices"]]
    return "".join(text)


def test_streamed_and_unstreamed_outputs_agree_with_a_logprob_per_token(server) -> None:
    out = _complete(server, logprobs=2)
    choice = out["choices"][0]
    assert out["usage"]["completion_tokens"] == 9 and choice["finish_reason"] == "length"
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == 9
    assert all(lp <= 0.0 for lp in logprobs["token_logprobs"])
    assert _stream_text(server) == choice["text"]


def test_spec_decode_metrics_count_drafts_with_vllms_names(server) -> None:
    fast = server
    _complete(fast)
    drafts = fast.metric("vllm:spec_decode_num_drafts_total", model_name=MODEL)
    draft_tokens = fast.metric("vllm:spec_decode_num_draft_tokens_total", model_name=MODEL)
    accepted = fast.metric("vllm:spec_decode_num_accepted_tokens_total", model_name=MODEL)
    assert drafts > 0 and draft_tokens >= drafts and 0 <= accepted <= draft_tokens
    per_position = [
        fast.metric("vllm:spec_decode_num_accepted_tokens_per_pos_total", model_name=MODEL, position=str(i))
        for i in range(2)
    ]
    assert sum(per_position) == accepted


def test_structured_output_next_to_speculating_requests_follows_its_schema(server) -> None:
    """A request under a grammar decodes plainly beside verify rows; its output follows the schema."""
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Name a city as JSON."}],
        "max_tokens": 40,
        "temperature": 0.0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": schema}},
        "chat_template_kwargs": {"enable_thinking": False},
    }
    free_body = {**BODY, "ignore_eos": True, "max_tokens": 40}
    before = server.metric("vllm:spec_decode_num_drafts_total", model_name=MODEL)
    with ThreadPoolExecutor(1) as pool:
        free = pool.submit(httpx.post, f"{server.base_url}/completions", json=free_body, timeout=60)
        r = httpx.post(f"{server.base_url}/chat/completions", json=body, timeout=60)
        assert free.result().status_code == 200
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    if choice["finish_reason"] == "stop":
        assert "city" in json.loads(choice["message"]["content"])
    else:  # cut by max_tokens: still a prefix of a schema-valid object
        assert choice["message"]["content"].startswith("{")
    assert server.metric("vllm:spec_decode_num_drafts_total", model_name=MODEL) > before
