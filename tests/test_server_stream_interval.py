"""`--stream-interval N`: a streamed request's events carry its first token at once, then N tokens each,
the last event the rest; the text and the counts are those of the unbatched stream, and the
inter-token-latency histogram still counts every token. Served over the synthetic engine (no model)."""

from __future__ import annotations

import json
import sys

import httpx

from deltaserve.bench.matrix_server import free_port, start_server, stop_server, wait_ready

ITL_COUNT = "vllm:inter_token_latency_seconds_count"


def _metric(client: httpx.Client, url: str, name: str) -> float:
    for line in client.get(f"{url}/metrics").text.splitlines():
        if line.startswith((name + "{", name + " ")):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _stream(client: httpx.Client, url: str, body: dict) -> list[dict]:
    with client.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}) as stream:
        lines = [line for line in stream.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]


def test_events_carry_the_first_token_then_the_interval_and_the_text_is_the_whole(tmp_path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "deltaserve.cli", "bench", "api-server", "--step-ms", "5"]
    server = start_server(
        [*argv, "--stream-interval", "4", "--port", str(port)], url, tmp_path / "server.log"
    )
    try:
        wait_ready(server, 120)
        body = {"prompt": [1, 2, 3], "max_tokens": 10, "stream_options": {"include_usage": True}}
        with httpx.Client(timeout=30) as client:
            whole = client.post(f"{url}/v1/completions", json={**body, "stream_options": None}).json()
            itl_before = _metric(client, url, ITL_COUNT)
            events = _stream(client, url, body)
            itl_after = _metric(client, url, ITL_COUNT)
        texts = [e["choices"][0]["text"] for e in events if e["choices"]]
        finishes = [e["choices"][0]["finish_reason"] for e in events if e["choices"]]
        assert len(texts) == 4  # 10 tokens: 1, 4, 4, then the last 1 with the finish
        assert finishes == [None, None, None, "length"]
        assert "".join(texts) == whole["choices"][0]["text"]
        assert events[-1]["usage"]["completion_tokens"] == 10
        assert itl_after - itl_before == 9  # every token after the first, not one per event
        # A stop string inside a held group ends the text where the unbatched stream ends it.
        stop = whole["choices"][0]["text"].split()[4]
        with httpx.Client(timeout=30) as client:
            cut = client.post(f"{url}/v1/completions", json={**body, "stop": [stop], "stream_options": None})
            events = _stream(client, url, {**body, "stop": [stop]})
        expected = cut.json()["choices"][0]
        assert expected["finish_reason"] == "stop" and stop not in expected["text"]
        assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == expected["text"]
        assert [e["choices"][0]["finish_reason"] for e in events if e["choices"]][-1] == "stop"
    finally:
        stop_server(server)
