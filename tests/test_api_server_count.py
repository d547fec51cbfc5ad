"""`--api-server-count 2`: two API server processes serve the one port over one engine: requests reach
both and each gets its own outputs; /metrics sums both; SIGTERM drains both and exits 0; a worker that
dies, or the engine, takes the server down with a non-zero exit. The embedded tiny model, on CPU."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import re
import signal
import time
from pathlib import Path

import httpx
import pytest
from server_fixture import MODEL, running_server

from deltaserve.process_name import API_WORKER_NAME
from deltaserve.server.response_store import ResponseStore


def _worker_pids(main_pid: int) -> list[int]:
    children = Path(f"/proc/{main_pid}/task/{main_pid}/children").read_text().split()
    return [int(p) for p in children if Path(f"/proc/{p}/comm").read_text().startswith(API_WORKER_NAME)]


def _complete(url: str, i: int) -> dict:
    body = {"model": MODEL, "prompt": f"prompt {i % 4}", "max_tokens": 4, "temperature": 0}
    # A new connection per request, so that the kernel hands them to both processes.
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=60, headers={"connection": "close"})
    response.raise_for_status()
    return response.json()


def test_two_api_server_processes_share_the_port_the_engine_and_the_metrics() -> None:
    with running_server("--api-server-count", "2", "--enable-log-requests") as server:
        (worker,) = _worker_pids(server.proc.pid)
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            results = list(pool.map(lambda i: _complete(server.url, i), range(48)))
        assert all(r["usage"]["completion_tokens"] == 4 for r in results)
        assert len({r["id"] for r in results}) == 48
        # Both processes answered: each logs the requests it takes, the extra one as api1.
        log = server.log()
        by_worker = len(re.findall(r" api1 .*request cmpl-\S+ finished", log))
        assert 0 < by_worker < 48, log[-3000:]
        # Each request got its own outputs: a greedy prompt's text is the same whichever process took it.
        for k in range(4):
            assert len({results[i]["choices"][0]["text"] for i in range(k, 48, 4)}) == 1
        assert server.metric("vllm:request_success_total", model_name=MODEL, finished_reason="length") == 48
        assert server.metric("vllm:generation_tokens_total", model_name=MODEL) == 48 * 4
        assert server.get_json("/load")["running"] == 0
        assert server.terminate(60) == 0
        assert not Path(f"/proc/{worker}").exists()


def test_a_worker_that_dies_takes_the_server_down_with_a_nonzero_exit() -> None:
    with running_server("--api-server-count", "2") as server:
        (worker,) = _worker_pids(server.proc.pid)
        killed_at = time.monotonic()
        os.kill(worker, signal.SIGKILL)
        assert server.proc.wait(30) == 1
        assert time.monotonic() - killed_at < 30
        assert "API server process 1 exited" in server.log()


def test_engine_death_ends_every_api_server_process_nonzero() -> None:
    with running_server("--api-server-count", "2") as server:
        (worker,) = _worker_pids(server.proc.pid)
        os.kill(server.engine_pid(), signal.SIGKILL)
        assert server.proc.wait(30) != 0
        deadline = time.monotonic() + 10
        while Path(f"/proc/{worker}").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not Path(f"/proc/{worker}").exists()
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{server.url}/health")


def test_sigterm_lets_the_streams_of_every_process_finish_and_exits_0() -> None:
    with running_server(
        "--api-server-count", "2", "--shutdown-timeout-s", "20", "--enable-log-requests"
    ) as server:
        url = f"{server.url}/v1/completions"
        body = {"model": MODEL, "prompt": "drain", "max_tokens": 12, "stream": True}
        with contextlib.ExitStack() as streams:
            events = []
            for _ in range(6):  # one connection each: both processes get some
                response = streams.enter_context(
                    httpx.stream("POST", url, json=body, timeout=60, headers={"connection": "close"})
                )
                lines = (line for line in response.iter_lines() if line)
                next(lines)  # generating
                events.append(lines)
            server.proc.send_signal(signal.SIGTERM)
            ends = [list(lines) for lines in events]
        for rest in ends:
            assert rest[-1] == "data: [DONE]", rest
            assert "choices" in rest[-2], rest
            assert json.loads(rest[-2].removeprefix("data: "))["choices"][0]["finish_reason"] == "length"
        assert server.proc.wait(30) == 0
        log = server.log()
        assert 0 < len(re.findall(r" api1 .*request cmpl-\S+ finished: length", log)) < 6, log[-3000:]


def test_a_stored_response_id_names_the_process_that_holds_it() -> None:
    main, worker = ResponseStore(4, 0, 2), ResponseStore(4, 1, 2)
    rid = worker.new_id()
    assert re.fullmatch(r"resp_p1_[0-9a-f]{32}", rid)
    assert "answered by API server process 1 of 2" in main.elsewhere(rid)
    assert worker.elsewhere(rid) == ""  # its own id: a plain miss (evicted)
    assert main.elsewhere("resp_0123") == "" and main.elsewhere("resp_px_1") == ""
    alone = ResponseStore(4)
    assert re.fullmatch(r"resp_[0-9a-f]{32}", alone.new_id()) and alone.elsewhere(rid) == ""
