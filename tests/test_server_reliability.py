"""No request can stall, starve or crash the server, against the real server process.

The module's server has a 32k context (so a multi-megabyte prompt passes the cheap length bound and is
really tokenized), a 1 s schema compile limit, and small fan-out and queue limits.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from server_fixture import ServerProcess, running_server, wait_until_idle

# Asserts wall-clock bounds: `make test` runs it alone, after the tests it runs side by side.
pytestmark = pytest.mark.serial

RESPONSIVE_S = 1.0  # /health and a small completion answer within this while a large input is in flight
LONG = {"max_tokens": 1500, "ignore_eos": True}
USER = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with running_server(
        "--max-model-len",
        "32768",
        "--structured-output-compile-timeout-s",
        "1",
        "--max-choices-per-request",
        "4",
        "--max-queued-requests",
        "8",
    ) as s:
        yield s


def _timed(fn: Any) -> tuple[float, Any]:
    started = time.monotonic()
    result = fn()
    return time.monotonic() - started, result


def _small_completion(server: ServerProcess) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=30)


def _assert_responsive_while(server: ServerProcess, slow: concurrent.futures.Future[httpx.Response]) -> None:
    """/health and a small completion answer promptly while `slow` is still being worked on."""
    time.sleep(0.5)  # the slow request is being prepared
    health_s, health = _timed(lambda: httpx.get(f"{server.url}/health", timeout=30))
    small_s, small = _timed(lambda: _small_completion(server))
    assert not slow.done(), "the slow request finished too early to show anything"
    assert health.status_code == 200 and health_s < RESPONSIVE_S, health_s
    assert small.status_code == 200 and small_s < RESPONSIVE_S, small_s


def test_a_large_prompt_is_tokenized_off_the_event_loop(server: ServerProcess) -> None:
    digits = "7" * (3 << 20)  # each digit is a token: seconds of tokenization, then too long for 32k
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        slow = pool.submit(
            httpx.post, f"{server.url}/v1/completions", json={"prompt": digits, "max_tokens": 1}, timeout=120
        )
        _assert_responsive_while(server, slow)
        error = slow.result().json()["error"]
    assert error["code"] == "context_length_exceeded" and f"({len(digits)} tokens)" in error["message"]


def test_a_prompt_that_cannot_fit_is_refused_before_it_is_tokenized(server: ServerProcess) -> None:
    text = "7" * (5 << 20)  # 5 MB: tokenizing it takes over ten seconds
    for path, body in (
        ("/v1/completions", {"prompt": text}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": text}]}),
        ("/tokenize", {"prompt": text}),
    ):
        took, response = _timed(lambda p=path, b=body: httpx.post(f"{server.url}{p}", json=b, timeout=120))
        error = response.json()["error"]
        assert response.status_code == 400 and error["code"] == "context_length_exceeded", path
        assert "so at least" in error["message"] and took < 3.0, (path, took)


def test_memory_returns_to_its_baseline_after_large_inputs(server: ServerProcess) -> None:
    """Tokenizing 2M tokens takes about 700 MB of small allocations, which the allocator would keep."""
    _small_completion(server)
    baseline = server.rss_bytes()
    for _ in range(3):
        body = {"messages": [{"role": "user", "content": "7" * (2 << 20)}]}  # refused once tokenized
        response = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120)
        assert response.json()["error"]["code"] == "context_length_exceeded"
    grown = server.rss_bytes() - baseline
    assert grown < 128 << 20, f"the server grew by {grown >> 20} MiB over 3 large inputs"


def _wide_schema(properties: int) -> dict[str, Any]:
    """Optional properties make compile time grow steeply: 1,000 take about 6 s on CPU."""
    return {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(properties)}}


def test_a_slow_schema_is_refused_at_the_compile_limit_while_others_are_served(server: ServerProcess) -> None:
    body = {
        "messages": USER,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "w", "schema": _wide_schema(1000)},
        },
    }
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        slow = pool.submit(httpx.post, f"{server.url}/v1/chat/completions", json=body, timeout=120)
        _assert_responsive_while(server, slow)
        took, response = _timed(slow.result)
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == "response_format"
    assert "--structured-output-compile-timeout-s" in error["message"] and took < 3.0
    # The compiler was restarted: a small schema compiles and constrains the output.
    small = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    body = {
        "messages": USER,
        "max_tokens": 30,
        "chat_template_kwargs": {"enable_thinking": False},
        "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": small}},
    }
    out = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120)
    assert out.status_code == 200, out.text


def test_the_first_structured_output_request_pays_no_compiler_start_up(server: ServerProcess) -> None:
    body = {"messages": USER, "max_tokens": 2, "response_format": {"type": "json_object"}}
    took, response = _timed(lambda: httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60))
    assert response.status_code == 200 and took < RESPONSIVE_S, took


def test_an_amplifying_request_is_refused_and_a_concurrent_request_is_served(server: ServerProcess) -> None:
    amplifying = {"prompt": ["hi"] * 129, "n": 128, "max_tokens": 1}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        refused = pool.submit(httpx.post, f"{server.url}/v1/completions", json=amplifying, timeout=60)
        small_s, small = _timed(lambda: _small_completion(server))
        error = refused.result().json()["error"]
    assert small.status_code == 200 and small_s < RESPONSIVE_S
    assert error["code"] == "too_many_choices" and "--max-choices-per-request" in error["message"]
    assert "at most 4" in error["message"]


async def _open_started_streams(http: httpx.AsyncClient, count: int) -> list[httpx.Response]:
    """`count` long streams, each started in the engine (opened a queue's worth at a time)."""
    opened: list[httpx.Response] = []
    while len(opened) < count:
        for _ in range(min(8, count - len(opened))):
            body = {"prompt": f"slot holder {len(opened)}", "stream": True, **LONG}
            response = await http.send(http.build_request("POST", "/v1/completions", json=body), stream=True)
            assert response.status_code == 200
            opened.append(response)
        deadline = time.monotonic() + 30
        while (await http.get("/load")).json()["server_queued"]:
            assert time.monotonic() < deadline, "the streams never started"
            await asyncio.sleep(0.05)
    return opened


def test_past_the_queue_bound_requests_are_shed_with_503_and_retry_after(server: ServerProcess) -> None:
    shed_before = server.metric("deltaserve:requests_shed_total")

    async def run() -> None:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            holders = await _open_started_streams(http, 16)  # --max-num-seqs 16: every slot taken
            queued = []
            for i in range(8):  # --max-queued-requests 8
                body = {"prompt": f"queued {i}", "stream": True, **LONG}
                queued.append(
                    await http.send(http.build_request("POST", "/v1/completions", json=body), stream=True)
                )
            load = (await http.get("/load")).json()
            assert [r.status_code for r in queued] == [200] * 8 and load["server_queued"] == 8, load
            shed = await http.post("/v1/completions", json={"prompt": "one too many", "max_tokens": 1})
            assert shed.status_code == 503 and shed.headers["retry-after"] == "1"
            assert shed.json()["error"]["code"] == "queue_full"
            assert "--max-queued-requests" in shed.json()["error"]["message"]
            for response in holders + queued:
                await response.aclose()

    asyncio.run(run())
    assert server.metric("deltaserve:requests_shed_total") == shed_before + 1
    wait_until_idle(server, 5.0)
    assert server.get_json("/load")["server_queued"] == 0


def test_a_queued_request_is_counted_in_load_until_it_starts(server: ServerProcess) -> None:
    """A request waiting for a slot is visible in /load: the engine's `waiting` and the server's count."""

    async def run() -> None:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            holders = await _open_started_streams(http, 16)
            body = {"prompt": "waits for a slot", "stream": True, **LONG}
            waiting = await http.send(http.build_request("POST", "/v1/completions", json=body), stream=True)
            deadline = time.monotonic() + 10
            load = (await http.get("/load")).json()
            while not (load["waiting"] == 1 and load["server_queued"] == 1) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
                load = (await http.get("/load")).json()
            assert load["waiting"] == 1 and load["server_queued"] == 1, json.dumps(load)
            await holders[0].aclose()
            deadline = time.monotonic() + 10
            while (await http.get("/load")).json()["server_queued"] and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert (await http.get("/load")).json()["server_queued"] == 0, "it started once a slot freed"
            for response in [*holders[1:], waiting]:
                await response.aclose()

    asyncio.run(run())
    wait_until_idle(server, 5.0)
