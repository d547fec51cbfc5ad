"""Client disconnects, metrics and load, SIGTERM, engine death and start-up failures of the real server."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

import httpx
import openai
import pytest
from server_fixture import MODEL, SMALL_ENGINE, ServerProcess, running_server, wait_until_idle

# Asserts wall-clock bounds: `make test` runs it alone, after the tests it runs side by side.
pytestmark = pytest.mark.serial

LONG = {"max_tokens": 1500, "ignore_eos": True}  # runs for many seconds unless something stops it
FREED_WITHIN_S = 1.0  # a step of the tiny model on CPU is ~30 ms; this leaves room for a loaded CI host

METRIC_NAMES = [
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:time_to_first_token_seconds_count",
    "vllm:inter_token_latency_seconds_count",
    "vllm:e2e_request_latency_seconds_count",
    "vllm:request_queue_time_seconds_count",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:request_success_total",
]


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with running_server("--log-interval-s", "0.5") as s:
        yield s


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0)


def _sse(response: httpx.Response) -> Iterator[str]:
    for line in response.iter_lines():
        if line.startswith("data: "):
            yield line[len("data: ") :]


def test_disconnect_mid_stream_frees_pages_and_slot_and_server_keeps_serving(
    server: ServerProcess, client: openai.OpenAI
) -> None:
    aborted = server.metric("vllm:request_success_total", finished_reason="abort")
    stream = client.completions.create(model=MODEL, prompt="Disconnect me", stream=True, extra_body=LONG)
    for _, _chunk in zip(range(3), stream, strict=False):
        pass
    busy = server.get_json("/load")
    assert (
        busy["running"] == 1
        and busy["kv_pages_used"] > 0
        and busy["state_slots_free"] == busy["state_slots_total"] - 1
    )
    stream.close()
    load = wait_until_idle(server, FREED_WITHIN_S)
    assert load["state_slots_free"] == load["state_slots_total"]
    assert server.metric("vllm:request_success_total", finished_reason="abort") == aborted + 1
    out = client.completions.create(model=MODEL, prompt="Still here?", max_tokens=3)
    assert out.usage is not None and out.usage.completion_tokens >= 1


def test_disconnect_of_a_non_streaming_request_aborts_it(server: ServerProcess) -> None:
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json={"prompt": "Wait for me", **LONG}, timeout=0.5)
    wait_until_idle(server, FREED_WITHIN_S)


def test_disconnect_while_queued_leaves_the_queue_without_a_single_write(server: ServerProcess) -> None:
    """A queued stream writes nothing, so only listening for the disconnect can notice it."""

    async def run() -> None:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:

            async def open_stream(prompt: str) -> httpx.Response:
                request = http.build_request(
                    "POST", "/v1/completions", json={"prompt": prompt, "stream": True, **LONG}
                )
                return await http.send(request, stream=True)

            running = [await open_stream(f"slot holder {i}") for i in range(16)]  # --max-num-seqs 16
            queued = await open_stream("queued")
            load = await _wait_load(http, lambda load: load["running"] == 16 and load["waiting"] == 1)
            await queued.aclose()
            load = await _wait_load(http, lambda load: load["waiting"] == 0, FREED_WITHIN_S)
            assert load["running"] == 16
            for response in running:
                await response.aclose()

    asyncio.run(run())
    wait_until_idle(server, FREED_WITHIN_S)


async def _wait_load(http: httpx.AsyncClient, ok: Callable[[dict], bool], timeout_s: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        load = (await http.get("/load")).json()
        if ok(load):
            return load
        assert time.monotonic() < deadline, f"load never matched: {load}"
        await asyncio.sleep(0.02)


def test_metrics_have_vllm_names_and_exact_token_counts(server: ServerProcess, client: openai.OpenAI) -> None:
    prompt_before = server.metric("vllm:prompt_tokens_total", model_name=MODEL)
    generated_before = server.metric("vllm:generation_tokens_total", model_name=MODEL)
    length_before = server.metric("vllm:request_success_total", finished_reason="length")
    out = client.completions.create(
        model=MODEL, prompt="Count my tokens", max_tokens=5, extra_body={"ignore_eos": True}
    )
    assert out.usage is not None
    assert (
        server.metric("vllm:prompt_tokens_total", model_name=MODEL) == prompt_before + out.usage.prompt_tokens
    )
    assert server.metric("vllm:generation_tokens_total", model_name=MODEL) == generated_before + 5
    assert server.metric("vllm:request_success_total", finished_reason="length") == length_before + 1
    text = httpx.get(f"{server.url}/metrics").text
    for name in METRIC_NAMES:
        assert any(
            line.startswith(name + "{") and f'model_name="{MODEL}"' in line for line in text.splitlines()
        ), name


def test_load_snapshot_and_service_endpoints(server: ServerProcess) -> None:
    load = server.get_json("/load")
    assert {
        "running",
        "waiting",
        "kv_pages_used",
        "kv_pages_total",
        "state_slots_free",
        "kv_cache_usage",
    } <= set(load)
    assert load["state_slots_total"] == 16
    assert server.get_json("/version")["version"]
    assert server.get_json("/health") == {"status": "ok"}
    assert httpx.get(f"{server.url}/docs").status_code == 200
    assert server.get_json("/v1/models")["data"][0]["max_model_len"] == 2048


def test_periodic_load_line_while_busy(server: ServerProcess, client: openai.OpenAI) -> None:
    client.completions.create(model=MODEL, prompt="Keep busy", max_tokens=40, extra_body={"ignore_eos": True})
    time.sleep(0.6)
    lines = [line for line in server.log().splitlines() if "generation throughput" in line]
    assert lines and "KV cache usage" in lines[-1] and "running:" in lines[-1]


def test_sigterm_finishes_in_flight_requests_and_exits_0() -> None:
    # 3 s: the short request (15 tokens, ~1 s on a loaded 2-core machine) finishes inside the drain;
    # the long one (1500 tokens) cannot and gets the shutdown error.
    with running_server("--shutdown-timeout-s", "3") as server:
        url = f"{server.url}/v1/completions"
        with (
            httpx.stream(
                "POST", url, json={"prompt": "long", "stream": True, **LONG}, timeout=60
            ) as long_response,
            httpx.stream(
                "POST", url, json={"prompt": "short", "stream": True, "max_tokens": 15}, timeout=60
            ) as short_response,
        ):
            long_events, short_events = _sse(long_response), _sse(short_response)
            next(long_events), next(short_events)  # both are generating
            server.proc.send_signal(signal.SIGTERM)
            short_rest = list(short_events)
            long_rest = list(long_events)
        assert (
            short_rest[-1] == "[DONE]"
            and json.loads(short_rest[-2])["choices"][0]["finish_reason"] == "length"
        )
        assert long_rest[-1] == "[DONE]" and "shutting down" in json.loads(long_rest[-2])["error"]["message"]
        assert server.proc.wait(15) == 0
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{server.url}/health")


def test_engine_death_fails_in_flight_requests_turns_health_503_and_exits_nonzero() -> None:
    with running_server() as server:
        with httpx.stream(
            "POST",
            f"{server.url}/v1/completions",
            json={"prompt": "doomed", "stream": True, **LONG},
            timeout=60,
        ) as response:
            events = _sse(response)
            next(events)
            killed_at = time.monotonic()
            os.kill(server.engine_pid(), signal.SIGKILL)
            rest = list(events)
        assert rest[-1] == "[DONE]" and "engine" in json.loads(rest[-2])["error"]["message"]
        statuses = set()
        while server.proc.poll() is None and time.monotonic() - killed_at < 10:
            with contextlib.suppress(httpx.TransportError):  # the port closes as the server exits
                statuses.add(httpx.get(f"{server.url}/health", timeout=1).status_code)
            time.sleep(0.05)
        assert statuses == {503}
        assert server.proc.wait(10) != 0
        assert time.monotonic() - killed_at < 10


def test_taken_port_fails_before_loading_the_model() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(
            [sys.executable, "-m", "deltaserve.cli", "serve", *SMALL_ENGINE, "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert result.returncode == 2
    assert f"127.0.0.1:{port}" in result.stderr and "--port" in result.stderr
    assert "model loaded" not in result.stderr
