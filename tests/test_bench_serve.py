"""The benchmark client against a stub OpenAI server that streams with known delays over a real socket."""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest
from aiohttp import web

from deltaserve.bench.client import Endpoint, UsageCounts, usage_counts
from deltaserve.bench.datasets import load_custom_jsonl, random_token_prompts
from deltaserve.bench.multi_turn import (
    Conversation,
    MultiTurnDataset,
    TurnRecord,
    converse,
    multi_turn_dataset,
)
from deltaserve.bench.serve import add_bench_serve_arguments, arrival_offsets, main, run_bench_serve

# Asserts wall-clock bounds: `make test` runs it alone, after the tests it runs side by side.
pytestmark = pytest.mark.serial

TTFT_S = 0.060  # stub delay before the first chunk
ITL_S = 0.020  # stub delay between later chunks


class StubServer:
    """Streams `max_tokens` chunks "t0 ", "t1 ", ...: the first after TTFT_S, the rest ITL_S apart, then a
    usage chunk and [DONE]; chat streams open with a role-only chunk sent at once. A chat request's prompt
    is its last message, and its prompt_tokens count the words of all messages. Prompt "bad" gets HTTP 400; prompt "cut" stops after two chunks without
    [DONE]; prompt "nousage" omits the usage chunk. Counts concurrent streams and records every payload."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.reset()

    def reset(self) -> None:
        self.payloads: list[dict[str, Any]] = []
        self.active = self.max_active = 0
        self.unhealthy_polls = self.health_polls = 0

    def start(self) -> None:
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(timeout=10)

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(timeout=10)
        self.loop.call_soon_threadsafe(self.loop.stop)

    async def _start(self) -> None:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._stream)
        app.router.add_post("/v1/chat/completions", self._stream)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        await web.SockSite(self.runner, self.sock).start()

    async def _health(self, request: web.Request) -> web.Response:
        self.health_polls += 1
        return web.Response(status=503 if self.health_polls <= self.unhealthy_polls else 200)

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "stub-model", "object": "model"}]})

    async def _stream(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.payloads.append(body)
        chat = request.path == "/v1/chat/completions"
        prompt = body["messages"][-1]["content"] if chat else body["prompt"]
        if prompt == "bad":
            return web.json_response({"error": {"message": "prompt rejected by stub"}}, status=400)
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        try:
            counted = " ".join(m["content"] for m in body["messages"]) if chat else prompt
            return await self._write_chunks(request, body, chat, prompt, counted)
        finally:
            self.active -= 1

    async def _write_chunks(
        self,
        request: web.Request,
        body: dict[str, Any],
        chat: bool,
        prompt: str | list[int],
        counted: str | list[int],
    ) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)

        async def event(data: object) -> None:
            await resp.write(f"data: {json.dumps(data)}\n\n".encode())

        num_tokens = body["max_completion_tokens" if chat else "max_tokens"]
        if chat:  # the opening chat chunk: the role and empty content, sent before any token
            await event({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
        await asyncio.sleep(TTFT_S)
        for i in range(num_tokens):
            if i:
                await asyncio.sleep(ITL_S)
            choice = {"index": 0, "delta": {"content": f"t{i} "}} if chat else {"index": 0, "text": f"t{i} "}
            await event({"choices": [choice]})
            if prompt == "cut" and i == 1:
                await resp.write_eof()
                return resp
        await resp.write(b": keep-alive comment\n\n")
        if prompt != "nousage":
            await event({"choices": [], "usage": self._usage(counted, num_tokens)})
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    @staticmethod
    def _usage(prompt: str | list[int], num_tokens: int) -> dict[str, Any]:
        """A prompt starting with "cached" reports all its tokens but the first as cached."""
        prompt_tokens = len(prompt) if isinstance(prompt, list) else len(prompt.split())
        usage: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": num_tokens}
        if isinstance(prompt, str) and prompt.startswith("cached"):
            usage["prompt_tokens_details"] = {"cached_tokens": prompt_tokens - 1}
        return usage


@pytest.fixture(scope="module")
def server() -> Iterator[StubServer]:
    stub = StubServer()
    stub.start()
    yield stub
    stub.stop()


@pytest.fixture
def stub(server: StubServer) -> StubServer:
    server.reset()
    return server


def _args(stub: StubServer, *flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_bench_serve_arguments(parser)
    return parser.parse_args(["--base-url", stub.url, "--ready-check-timeout-sec", "5", *flags])


def _jsonl(path: Path, rows: list[dict[str, Any]]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_random_run_measures_the_servers_delays_within_the_concurrency_cap(stub, tmp_path):
    args = _args(
        stub,
        *("--num-prompts", "6", "--random-input-len", "8", "--random-output-len", "4"),
        *(
            "--max-concurrency",
            "2",
            "--save-result",
            "--result-dir",
            str(tmp_path),
            "--result-filename",
            "r.json",
        ),
    )
    result = run_bench_serve(args)

    assert (result.completed, result.failed) == (6, 0)
    assert (result.total_input_tokens, result.total_output_tokens) == (6 * 8, 6 * 4)
    assert stub.max_active == 2 and result.max_concurrent_requests == 2
    # The stub cannot answer sooner than its sleeps; the upper bounds leave room for a slow CI box.
    assert TTFT_S * 1000 <= result.latency["ttft"].mean_ms < TTFT_S * 1000 + 500
    assert 0.75 * ITL_S * 1000 <= result.latency["itl"].median_ms < ITL_S * 1000 + 200
    assert result.latency["e2el"].mean_ms >= (TTFT_S + 3 * ITL_S) * 1000
    assert 0.75 * ITL_S * 1000 <= result.latency["tpot"].median_ms < ITL_S * 1000 + 200
    assert all(len(r.chunk_times) == 4 and r.generated_text == "t0 t1 t2 t3 " for r in result.records)

    for payload in stub.payloads:
        assert payload["model"] == "stub-model"  # taken from GET /v1/models
        assert len(payload["prompt"]) == 8 and all(0 <= t < 248044 for t in payload["prompt"])
        assert payload["max_tokens"] == 4 and payload["ignore_eos"] is True and payload["temperature"] == 0.0
        assert payload["stream"] is True and payload["stream_options"] == {"include_usage": True}

    saved = json.loads((tmp_path / "r.json").read_text())
    for key in ["completed", "failed", "duration", "total_input_tokens", "total_output_tokens"]:
        assert saved[key] == getattr(result, key)
    for key in [
        "request_throughput",
        "output_throughput",
        "total_token_throughput",
        "max_concurrent_requests",
    ]:
        assert key in saved
    for metric in ["ttft", "tpot", "itl", "e2el"]:
        for stat in ["mean", "median", "std", "p50", "p90", "p99"]:
            assert f"{stat}_{metric}_ms" in saved
    assert saved["request_rate"] == "inf" and saved["max_concurrency"] == 2
    assert saved["config"]["random_input_len"] == 8 and "date" in saved["environment"]
    assert "ttfts" not in saved  # only with --save-detailed
    worst_ms = max(gap for r in result.records for gap in r.itls) * 1e3
    assert saved["worst_itl_gap"]["ms"] == pytest.approx(worst_ms)  # the ITL max, located


def test_http_400_a_stream_without_done_or_usage_are_failures_with_their_error_text(stub, tmp_path):
    rows = [
        {"prompt": "hello world", "output_len": 3},
        {"prompt": "bad", "output_len": 3},
        {"prompt": "cut", "output_len": 3},
        {"prompt": "nousage", "output_len": 3},
    ]
    args = _args(
        stub,
        *(
            "--dataset-name",
            "custom",
            "--dataset-path",
            _jsonl(tmp_path / "d.jsonl", rows),
            "--num-prompts",
            "4",
        ),
        *("--save-result", "--save-detailed", "--result-dir", str(tmp_path), "--result-filename", "r.json"),
    )
    result = run_bench_serve(args)

    assert (result.completed, result.failed) == (1, 3)
    assert (result.total_input_tokens, result.total_output_tokens) == (2, 3)
    errors = json.loads((tmp_path / "r.json").read_text())["errors"]
    assert errors[0] == ""
    assert errors[1].startswith("HTTP 400") and "prompt rejected by stub" in errors[1]
    assert errors[2] == "stream ended without [DONE] after 2 chunks with choices"
    assert errors[3].startswith("stream had no usage chunk")
    assert all("ignore_eos" not in p for p in stub.payloads)  # off by default for custom prompts


def test_chat_ttft_ends_at_the_first_token_not_at_the_role_only_chunk(stub, tmp_path):
    rows = [{"prompt": "hi there", "output_len": 3}]
    path = _jsonl(tmp_path / "d.jsonl", rows)
    args = _args(
        stub, "--endpoint", "/v1/chat/completions", "--dataset-name", "custom", "--dataset-path", path
    )
    args.num_prompts = 2
    result = run_bench_serve(args)

    assert (result.completed, result.total_output_tokens) == (2, 6)
    assert stub.payloads[0]["messages"] == [{"role": "user", "content": "hi there"}]
    assert stub.payloads[0]["max_completion_tokens"] == 3
    record = result.records[0]
    # The stub sends the role chunk at once and the first token TTFT_S later: only the 3 tokens are timed.
    assert len(record.chunk_times) == 3 and record.generated_text == "t0 t1 t2 "
    assert TTFT_S * 1000 <= result.latency["ttft"].mean_ms < TTFT_S * 1000 + 500
    assert 0.75 * ITL_S * 1000 <= result.latency["itl"].median_ms < ITL_S * 1000 + 200


def test_cached_share_comes_from_usage_prompt_tokens_details(stub, tmp_path):
    # "cached a b c" reports 3 of its 4 prompt tokens cached; "x y" has no prompt_tokens_details (0 of 2).
    rows = [{"prompt": "cached a b c", "output_len": 2}, {"prompt": "x y", "output_len": 2}]
    args = _args(
        stub,
        *("--dataset-name", "custom", "--dataset-path", _jsonl(tmp_path / "d.jsonl", rows)),
        *(
            "--num-prompts",
            "2",
            "--save-result",
            "--result-dir",
            str(tmp_path),
            "--result-filename",
            "r.json",
        ),
    )
    result = run_bench_serve(args)

    assert [r.cached_tokens for r in result.records] == [3, None]
    assert (result.total_cached_tokens, result.total_input_tokens) == (3, 6)
    assert json.loads((tmp_path / "r.json").read_text())["cached_token_share"] == pytest.approx(3 / 6)


def test_usage_counts_read_cached_tokens_and_tolerate_their_absence():
    usage = {"prompt_tokens": 9, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 8}}
    assert usage_counts(usage, 0) == UsageCounts(9, 2, 8)
    assert usage_counts({"prompt_tokens": 9, "completion_tokens": 2}, 0) == UsageCounts(9, 2, None)
    assert usage_counts({"completion_tokens": 2, "prompt_tokens_details": None}, 5) == UsageCounts(5, 2, None)
    assert usage_counts({"prompt_tokens": 9}, 0) is None  # not a final usage object


def test_multi_turn_sends_each_turn_with_the_history_and_the_answers_returned(stub):
    flags = ["--dataset-name", "multi-turn", "--num-prompts", "2", "--max-concurrency", "1"]
    flags += ["--multi-turn-num-turns", "3", "--multi-turn-system-prompt-len", "5"]
    flags += ["--multi-turn-user-len", "3", "--multi-turn-output-len", "2", "--num-warmups", "1"]
    result = run_bench_serve(_args(stub, *flags))

    assert (result.completed, result.failed) == (6, 0)
    data = multi_turn_dataset(2, 3, system_prompt_len=5, user_len=3, output_len=2, seed=0)
    warm, *timed = stub.payloads
    # The warm-up is a first turn drawn with another seed: it shares no prefix with the timed run.
    assert len(warm["messages"]) == 2 and warm["messages"][0]["content"] != data.system_prompt
    for c, conversation in enumerate(data.conversations):  # one at a time: conversation 0's turns first
        history = [{"role": "system", "content": data.system_prompt}]
        for k, user_message in enumerate(conversation.user_messages):
            history.append({"role": "user", "content": user_message})
            payload = timed[3 * c + k]
            assert payload["messages"] == history
            assert payload["max_completion_tokens"] == 2 and payload["ignore_eos"] is True
            assert payload["chat_template_kwargs"] == {"enable_thinking": False}
            assert payload["stream_options"] == {"include_usage": True}
            history.append({"role": "assistant", "content": "t0 t1 "})  # the stub's answer, as returned
    # The stub counts the words of all messages: 5 + 3, then + 2 (answer) + 3 (user) per turn.
    assert [t.mean_prompt_tokens for t in result.turns] == [8.0, 13.0, 18.0]
    assert [t.completed for t in result.turns] == [2, 2, 2]
    assert all(t.cached_token_share is None for t in result.turns)


def test_a_failed_turn_ends_its_conversation_and_its_later_turns_count_as_failed(stub):
    dataset = MultiTurnDataset("sys", (Conversation(0, ("hello", "bad", "after")),), output_len=2)

    async def run() -> list[TurnRecord]:
        async with aiohttp.ClientSession() as session:
            endpoint = Endpoint(session, stub.url + "/v1/chat/completions", {}, "m", True, True, 0.0)
            return await converse(endpoint, dataset, dataset.conversations[0])

    turns = asyncio.run(run())
    assert [(t.turn, t.record.success) for t in turns] == [(1, True), (2, False), (3, False)]
    assert turns[1].record.error.startswith("HTTP 400")
    assert turns[2].record.error == "not sent: turn 2 of conversation 0 failed"
    assert len(stub.payloads) == 2


def test_multi_turn_refuses_the_completions_endpoint(stub):
    args = _args(stub, "--dataset-name", "multi-turn", "--endpoint", "/v1/completions")
    with pytest.raises(ValueError, match="--endpoint /v1/chat/completions"):
        run_bench_serve(args)


def test_warmups_run_first_and_are_not_measured(stub):
    args = _args(stub, "--num-warmups", "2", "--num-prompts", "3", "--random-input-len", "4")
    args.random_output_len = 2
    result = run_bench_serve(args)

    assert len(stub.payloads) == 5 and result.completed == 3 and len(result.records) == 3


def test_the_measured_run_and_only_it_runs_with_the_collector_paused(stub, monkeypatch, capsys):
    from deltaserve.bench import serve

    seen = []
    run_workload = serve._run_workload

    async def recording(*args, **kwargs):
        seen.append(gc.isenabled())
        return await run_workload(*args, **kwargs)

    monkeypatch.setattr(serve, "_run_workload", recording)
    args = _args(stub, "--num-warmups", "1", "--num-prompts", "2", "--random-input-len", "4")
    assert run_bench_serve(args).completed == 2
    assert seen == [True, False]  # the warm-up with it, the measured run without
    assert gc.isenabled() and gc.get_freeze_count() == 0
    assert "Worst ITL gap: " in capsys.readouterr().out  # the report names where the ITL max came from


def test_finite_request_rate_spreads_sends_until_n_over_rate(stub):
    args = _args(stub, "--request-rate", "20", "--num-prompts", "4", "--random-input-len", "4")
    args.random_output_len = 1
    result = run_bench_serve(args)

    sends = [r.send_time for r in result.records]
    assert sends == sorted(sends)
    # The last request leaves 4/20 = 0.2 s after the start and still waits TTFT_S for its chunk.
    assert result.duration >= 0.2 + TTFT_S
    assert result.completed == 4 and result.latency["tpot"].mean_ms == 0.0  # 1-token outputs have no TPOT


def test_waits_for_health_to_answer_200(stub):
    stub.unhealthy_polls = 1
    args = _args(stub, "--num-prompts", "1", "--random-input-len", "4", "--random-output-len", "1")
    assert run_bench_serve(args).completed == 1
    assert stub.health_polls == 2


def test_health_timeout_names_the_flag():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead_url = f"http://127.0.0.1:{s.getsockname()[1]}"
    with pytest.raises(TimeoutError, match="--ready-check-timeout-sec"):
        main(["--base-url", dead_url, "--ready-check-timeout-sec", "0.2", "--num-prompts", "1"])


def test_chat_endpoint_refuses_token_id_prompts(stub):
    with pytest.raises(ValueError, match="token ids"):
        run_bench_serve(_args(stub, "--endpoint", "/v1/chat/completions", "--num-prompts", "1"))


def test_arrival_offsets_follow_vllms_schedule():
    rng = np.random.default_rng(0)
    assert arrival_offsets(3, float("inf"), 1.0, rng) == [0.0, 0.0, 0.0]
    assert arrival_offsets(4, 10.0, float("inf"), rng) == pytest.approx([0.1, 0.2, 0.3, 0.4])
    poisson = arrival_offsets(50, 10.0, 1.0, np.random.default_rng(1))
    assert poisson == sorted(poisson) and poisson[-1] == pytest.approx(5.0)
    assert poisson == arrival_offsets(50, 10.0, 1.0, np.random.default_rng(1))
    with pytest.raises(ValueError, match="--burstiness"):
        arrival_offsets(2, 10.0, 0.0, rng)


def test_random_prompts_are_consecutive_id_runs_of_the_drawn_lengths():
    fixed = random_token_prompts(3, input_len=5, output_len=7, seed=0, token_id_low=100, token_id_high=110)
    assert [(r.prompt_len, r.output_len) for r in fixed] == [(5, 7)] * 3
    for r in fixed:
        assert r.prompt == [100 + (r.prompt[0] - 100 + k) % 10 for k in range(5)]

    ranged = random_token_prompts(200, input_len=10, output_len=4, range_ratio=0.25, seed=3)
    # [floor(10·0.75), ceil(10·1.25)] = [7, 13] and [floor(4·0.75), ceil(4·1.25)] = [3, 5]
    assert {r.prompt_len for r in ranged} == set(range(7, 14))
    assert {r.output_len for r in ranged} == {3, 4, 5}
    assert all(len(r.prompt) == r.prompt_len and max(r.prompt) < 248044 for r in ranged)
    assert ranged == random_token_prompts(200, input_len=10, output_len=4, range_ratio=0.25, seed=3)
    assert ranged != random_token_prompts(200, input_len=10, output_len=4, range_ratio=0.25, seed=4)


def test_random_prompts_reject_ranges_that_can_draw_empty_prompts():
    with pytest.raises(ValueError, match="--random-input-len 1"):
        random_token_prompts(1, input_len=1, output_len=1, range_ratio=0.5)
    with pytest.raises(ValueError, match="--random-range-ratio"):
        random_token_prompts(1, input_len=8, output_len=1, range_ratio=1.0)


def test_custom_jsonl_cycles_to_num_prompts_and_names_the_bad_line(tmp_path):
    path = _jsonl(
        tmp_path / "d.jsonl", [{"prompt": "Hello", "output_len": 2}, {"prompt": [1, 2, 3], "output_len": 1}]
    )
    got = load_custom_jsonl(path, 3)
    assert [(r.prompt, r.prompt_len, r.output_len) for r in got] == [
        ("Hello", 0, 2),
        ([1, 2, 3], 3, 1),
        ("Hello", 0, 2),
    ]
    bad = _jsonl(tmp_path / "bad.jsonl", [{"prompt": "ok", "output_len": 1}, {"prompt": "x"}])
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: 'output_len'"):
        load_custom_jsonl(bad, 1)


def test_sampling_flags_given_are_sent_with_every_request_and_the_others_are_not(stub):
    """vLLM's names: `--presence-penalty 1.5 --top-p 0.95 --top-k 20` (Qwen3.5's card) reach the server
    in each request; a flag not given leaves the server's default."""
    args = _args(
        stub, "--num-prompts", "2", "--random-input-len", "4", "--presence-penalty", "1.5", "--top-p", "0.95"
    )
    args.top_k = 20
    args.random_output_len = 2
    assert run_bench_serve(args).completed == 2
    for payload in stub.payloads:
        assert payload["presence_penalty"] == 1.5 and payload["top_p"] == 0.95 and payload["top_k"] == 20
        assert "frequency_penalty" not in payload and "min_p" not in payload


def test_extra_body_is_merged_into_every_request_and_must_be_a_json_object(stub):
    constraint = {"structured_outputs": {"regex": "[a-z ]+"}}
    args = _args(
        stub, "--num-prompts", "2", "--random-input-len", "4", "--extra-body", json.dumps(constraint)
    )
    args.random_output_len = 2
    assert run_bench_serve(args).completed == 2
    assert all(
        p["structured_outputs"] == constraint["structured_outputs"] and p["stream"] for p in stub.payloads
    )
    for bad in ("[1, 2]", "{not json"):
        with pytest.raises(SystemExit):
            _args(stub, "--extra-body", bad)
