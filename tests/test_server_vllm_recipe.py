"""The usual Qwen3.5 `vllm serve` command line, copied as a user would, starts deltaserve and each flag
does what vLLM's does; driven with the official openai client."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from server_fixture import ServerProcess, running_server

from deltaserve.tiny import default_model_dir

NAMES = ["qwen3.5-tiny", "tiny"]
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
KEY = "sk-recipe"
ROOT = "/api"
ORIGIN = "http://ui.example"
TEMPLATE_MARK = "You are served by a custom template."
UNIT_TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"unit": {"enum": ["c", "f"]}},
                "required": ["unit"],
            },
        },
    }
]


def recipe(generation_dir: Path, template: Path) -> list[str]:
    """`vllm serve MODEL ...` as the Qwen3.5 recipes write it."""
    return [
        str(default_model_dir()),
        "--served-model-name",
        *NAMES,
        "--dtype",
        "float",
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "qwen3_coder",
        "--reasoning-parser",
        "qwen3",
        "--enable-chunked-prefill",
        "--enable-prefix-caching",
        "--max-logprobs",
        "5",
        "--enable-log-requests",
        "--disable-log-stats",
        "--log-interval-s",
        "0.2",
        "--generation-config",
        str(generation_dir),
        "--chat-template",
        str(template),
        "--trust-remote-code",
        "--async-scheduling",
        "--language-model-only",
        "--limit-mm-per-prompt",
        '{"image": 0, "video": 0}',
        "--kv-cache-dtype",
        "auto",
        "--uvicorn-log-level",
        "INFO",
        "--api-key",
        KEY,
        "--allowed-origins",
        json.dumps([ORIGIN]),
        "--root-path",
        ROOT,
        # Flags of other recipes and tuning guides: accepted (logged as configuring nothing here) or honoured.
        "--tokenizer",
        str(default_model_dir()),
        "--tokenizer-mode",
        "auto",
        "--mamba-cache-mode",
        "align",
        "--block-size",
        "16",
        "--max-cudagraph-capture-size",
        "256",
        "-O3",
        "--swap-space",
        "4",
        "--enable-expert-parallel",
        "--disable-custom-all-reduce",
        "--data-parallel-size",
        "1",
        "--distributed-executor-backend",
        "mp",
        "--performance-mode",
        "throughput",
        "--structured-outputs-config",
        '{"backend": "xgrammar"}',
        "--enable-prompt-tokens-details",
        "--override-generation-config",
        '{"top_k": 1}',
        "--enable-force-include-usage",
    ]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    folder = tmp_path_factory.mktemp("recipe")
    # --override-generation-config's top_k 1 (over this file's 20) makes every request that leaves top_k out
    # greedy: visible in its output.
    (folder / "generation_config.json").write_text(json.dumps({"temperature": 0.9, "top_k": 20}))
    original = (default_model_dir() / "tokenizer_config.json").read_text()
    template = folder / "chat_template.jinja"
    template.write_text(TEMPLATE_MARK + json.loads(original)["chat_template"])
    with running_server(*recipe(folder, template)) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0)


def test_every_served_name_is_listed_and_responses_report_the_first(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == NAMES
    out = client.chat.completions.create(model=NAMES[1], messages=USER, max_tokens=3)  # type: ignore[arg-type]
    assert out.model == NAMES[0]


def test_reasoning_and_forced_tool_calls_are_parsed(client: openai.OpenAI) -> None:
    thinking = client.chat.completions.create(model=NAMES[0], messages=USER, max_tokens=4)  # type: ignore[arg-type]
    assert thinking.choices[0].message.reasoning_content  # type: ignore[attr-defined]
    call = client.chat.completions.create(
        model=NAMES[0],
        messages=USER,  # type: ignore[arg-type]
        tools=UNIT_TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        temperature=0,
        max_tokens=60,
    )
    (tool_call,) = call.choices[0].message.tool_calls or []
    assert json.loads(tool_call.function.arguments)["unit"] in ("c", "f")


def test_generation_config_defaults_apply_to_omitted_fields(client: openai.OpenAI) -> None:
    def text(**fields: Any) -> str:
        out = client.completions.create(
            model=NAMES[0], prompt="The weather", max_tokens=8, extra_body={"ignore_eos": True, **fields}
        )
        return out.choices[0].text

    greedy = text(temperature=0)
    assert text() == text() == greedy  # top_k 1 from --override-generation-config
    assert {text(seed=s, top_k=0) for s in range(3)} != {greedy}  # a request's own top_k wins


def test_max_logprobs_caps_requests(client: openai.OpenAI) -> None:
    ok = client.chat.completions.create(
        model=NAMES[0],
        messages=USER,
        max_tokens=2,
        logprobs=True,
        top_logprobs=5,  # type: ignore[arg-type]
    )
    assert ok.choices[0].logprobs is not None
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model=NAMES[0],
            messages=USER,
            max_tokens=2,
            logprobs=True,
            top_logprobs=6,  # type: ignore[arg-type]
        )
    assert err.value.body["param"] == "top_logprobs" and "--max-logprobs" in err.value.body["message"]  # type: ignore[index]


def test_chat_template_file_replaces_the_model_template(server: ServerProcess) -> None:
    auth = {"Authorization": f"Bearer {KEY}"}  # every route that does work needs the key
    ids = httpx.post(f"{server.url}/tokenize", json={"messages": USER}, headers=auth).json()["tokens"]
    text = httpx.post(f"{server.url}/detokenize", json={"tokens": ids}, headers=auth).json()["prompt"]
    assert text.startswith(TEMPLATE_MARK)


def test_request_log_lines_on_and_stats_lines_off(server: ServerProcess, client: openai.OpenAI) -> None:
    out = client.completions.create(model=NAMES[0], prompt="Log me", max_tokens=2)
    time.sleep(0.5)  # several --log-interval-s periods
    log = server.log()
    assert re.search(rf"request {out.id}-0: \d+ prompt tokens", log)
    assert f"request {out.id}-0 finished: length, 2 output tokens" in log
    assert "generation throughput" not in log
    assert "nothing to trust" in log
    for flag in (
        "--max-cudagraph-capture-size",
        "--compilation-config",
        "--swap-space",
        "--enable-expert-parallel",
    ):
        assert f"{flag}: accepted, configures nothing here" in log, flag


def test_every_stream_ends_with_usage_under_force_include_usage(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(model=NAMES[0], messages=USER, max_tokens=3, stream=True)  # type: ignore[arg-type]
    chunks = list(stream)
    assert all(c.usage is None for c in chunks[:-1])
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None and last.usage.completion_tokens == 3


def test_root_path_keeps_the_api_key_required(server: ServerProcess) -> None:
    """Behind a proxy that strips /api, routes answer at their own paths and the docs link under /api."""
    assert httpx.get(f"{server.url}/v1/models").status_code == 401
    assert httpx.get(f"{server.url}/v1/models", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    docs = httpx.get(f"{server.url}/docs", headers={"Authorization": f"Bearer {KEY}"}).text
    assert f"{ROOT}/openapi.json" in docs


def test_cors_for_the_allowed_origin_only(server: ServerProcess) -> None:
    preflight = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST"}
    answer = httpx.options(f"{server.url}/v1/chat/completions", headers=preflight)
    assert answer.status_code == 200 and answer.headers["access-control-allow-origin"] == ORIGIN
    other = httpx.options(f"{server.url}/v1/chat/completions", headers={**preflight, "Origin": "http://evil"})
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
