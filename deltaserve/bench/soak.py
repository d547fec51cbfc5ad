"""A bounded soak of a running server: overload, disconnect storms and bad traffic, all at once.

    python -m deltaserve.bench.soak --base-url http://127.0.0.1:8000 --duration-s 300 --server-pid PID

Workers loop until the deadline, each on one kind of traffic:
- overload: OVERLOAD_FACTOR x the server's state slots of concurrent small completions and chats
  (streaming and not): 200, or 503 queue_full when the queue bound sheds them;
- disconnects: streams whose client resets the connection mid-stream, and requests it leaves before
  the answer;
- bad: malformed, mistyped, oversized and unservable requests, which must get a 4xx.
Every request has a client timeout; one that runs into it is `hung`. At the end the server must be
idle again. Prints completed / clean errors (4xx) / shed (503 + Retry-After) / hung / 5xx / disconnects
and the server's resident
memory (with its children) before and after; exits 1 if anything hung, a 5xx came back or the server
did not return to idle.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import socket
import struct
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any
from urllib.parse import urlparse

import aiohttp

from deltaserve.bench.proc_stats import tree_rss_mib

OVERLOAD_FACTOR = 8
REQUEST_TIMEOUT_S = 120.0
IDLE_TIMEOUT_S = 60.0
USER = [{"role": "user", "content": "Tell me a story"}]

BAD_BODIES: list[tuple[str, Any]] = [
    ("/v1/completions", b'{"prompt": "x",'),
    ("/v1/completions", {"prompt": "x", "max_tokens": "10"}),
    ("/v1/completions", {"prompt": "x", "n": True}),
    ("/v1/completions", {"prompt": [True]}),
    ("/v1/completions", {"prompt": "\ud800"}),
    ("/v1/completions", {"prompt": "x", "top_k": 2**64}),
    ("/v1/completions", {"prompt": ["hi"] * 129, "n": 128, "max_tokens": 1}),
    ("/v1/completions", {"prompt": "x", "temperature": -1}),
    ("/v1/completions", {"prompt": "7" * (5 << 20)}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a\udc00"}]}),
    ("/v1/chat/completions", {"messages": USER, "stream": "yes"}),
    ("/v1/chat/completions", {"messages": [*USER, {"role": "assistant", "tool_calls": [{"function": "x"}]}]}),
    ("/v1/chat/completions", {"messages": USER, "response_format": {"type": "json_schema", "json_schema": {"schema": {"not": {}}}}}),
    ("/v1/chat/completions", {"messages": USER, "response_format": {"type": "json_schema", "json_schema": {"schema": {"$ref": "http://x/s"}}}}),
    ("/v1/responses", {"input": "\ud800"}),
    ("/v1/responses", {"input": "x", "n": 2}),
    ("/tokenize", {"prompt": 5}),
    ("/detokenize", {"tokens": [True]}),
    ("/v1/nothing", {}),
]  # fmt: skip


@dataclass(slots=True)
class Tally:
    completed: int = 0
    clean_errors: int = 0  # 4xx
    shed: int = 0  # 503 queue_full: the queue bound refused it (the worker asks again at once)
    hung: int = 0
    server_errors: int = 0  # 5xx other than a shed 503, or an error event of a 5xx mid-stream
    disconnects: int = 0
    unexpected: int = 0  # a bad request that got a 2xx


def _encode(body: Any) -> bytes:
    return body if isinstance(body, bytes) else json.dumps(body).encode()  # escapes lone surrogates


async def _post(
    http: aiohttp.ClientSession, tally: Tally, path: str, body: Any, *, bad: bool = False
) -> None:
    headers = {"content-type": "application/json"}
    try:
        async with http.post(path, data=_encode(body), headers=headers) as response:
            text = await response.text()
            status = response.status
    except asyncio.TimeoutError:
        tally.hung += 1
        return
    if status == 503 and '"queue_full"' in text:
        tally.shed += 1
    elif status >= 500:
        tally.server_errors += 1
    elif status >= 400:
        tally.clean_errors += 1
    elif bad:
        tally.unexpected += 1
    elif '"error"' in text and ('"code":5' in text or '"server_error"' in text):
        tally.server_errors += 1  # a stream that ended with a 5xx error event
    else:
        tally.completed += 1


def _good_request() -> tuple[str, dict[str, Any]]:
    stream = random.random() < 0.5
    if random.random() < 0.5:
        body = {"prompt": "Once upon a time", "max_tokens": random.randint(1, 24), "stream": stream}
        return "/v1/completions", body
    return "/v1/chat/completions", {"messages": USER, "max_tokens": random.randint(1, 24), "stream": stream}


async def _overload_worker(http: aiohttp.ClientSession, tally: Tally, deadline: float) -> None:
    while time.monotonic() < deadline:
        await _post(http, tally, *_good_request())


async def _bad_worker(http: aiohttp.ClientSession, tally: Tally, deadline: float) -> None:
    while time.monotonic() < deadline:
        path, body = random.choice(BAD_BODIES)
        await _post(http, tally, path, body, bad=True)


async def _reset_mid_stream(host: str, port: int) -> None:
    """A streaming request whose client reads a little, then resets the connection (RST)."""
    reader, writer = await asyncio.open_connection(host, port)
    body = _encode({"prompt": "Disconnect me", "stream": True, "max_tokens": 200, "ignore_eos": True})
    head = f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
    writer.write(f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body)
    await writer.drain()
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(reader.read(random.randint(1, 4096)), 10)
    sock = writer.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.close()


async def _disconnect_worker(http: aiohttp.ClientSession, tally: Tally, deadline: float, url: str) -> None:
    parsed = urlparse(url)
    host, port = parsed.hostname or "127.0.0.1", parsed.port or 80
    while time.monotonic() < deadline:
        if random.random() < 0.5:
            with contextlib.suppress(OSError):
                await _reset_mid_stream(host, port)
        else:  # leave a non-streaming request before its answer
            body = {"prompt": "Wait for me", "max_tokens": 200, "ignore_eos": True}
            with contextlib.suppress(asyncio.TimeoutError, aiohttp.ClientError):
                await http.post("/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=0.2))
        tally.disconnects += 1


async def _idle(http: aiohttp.ClientSession) -> bool:
    deadline = time.monotonic() + IDLE_TIMEOUT_S
    while time.monotonic() < deadline:
        async with http.get("/load") as response:
            load = await response.json()
        if not (load["running"] or load["waiting"] or load.get("server_queued") or load["kv_pages_used"]):
            return True
        await asyncio.sleep(0.2)
    return False


async def soak(
    url: str, duration_s: float, server_pid: int | None, bad_workers: int, storm_workers: int
) -> int:
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(base_url=url, timeout=timeout, connector=connector) as http:
        async with http.get("/load") as response:
            slots = (await response.json())["state_slots_total"]
        before = tree_rss_mib(server_pid) if server_pid else None
        tally = Tally()
        started = time.monotonic()
        deadline = started + duration_s
        workers = [_overload_worker(http, tally, deadline) for _ in range(OVERLOAD_FACTOR * slots)]
        workers += [_bad_worker(http, tally, deadline) for _ in range(bad_workers)]
        workers += [_disconnect_worker(http, tally, deadline, url) for _ in range(storm_workers)]
        await asyncio.gather(*workers)
        elapsed = time.monotonic() - started
        idle = await _idle(http)
        after = tree_rss_mib(server_pid) if server_pid else None
    result = {**asdict(tally), "duration_s": round(elapsed, 1), "returned_to_idle": idle}
    if before is not None and after is not None:
        result |= {"rss_before_mib": round(before), "rss_after_mib": round(after)}
    print(
        f"soak {elapsed:.0f} s: completed {tally.completed}, clean errors {tally.clean_errors} (4xx), shed "
        f"{tally.shed} (503 queue full), hung {tally.hung}, "
        f"5xx {tally.server_errors}, bad requests accepted {tally.unexpected}, disconnects {tally.disconnects}, "
        f"idle after: {idle}"
        + (f", RSS {before:.0f} -> {after:.0f} MiB" if before is not None and after is not None else "")
    )
    print(json.dumps(result))
    ok = (
        tally.hung == 0
        and tally.server_errors == 0
        and tally.unexpected == 0
        and idle
        and tally.completed > 0
    )
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--duration-s", type=float, default=300.0)
    parser.add_argument("--server-pid", type=int, default=None, help="measure this process's memory")
    parser.add_argument("--bad-workers", type=int, default=4)
    parser.add_argument("--disconnect-workers", type=int, default=8)
    args = parser.parse_args(argv)
    return asyncio.run(
        soak(args.base_url, args.duration_s, args.server_pid, args.bad_workers, args.disconnect_workers)
    )


if __name__ == "__main__":
    sys.exit(main())
