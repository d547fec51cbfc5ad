"""One streamed request as `vllm bench serve` sends and times it, plus the server checks before a run.

`send_payload` posts a request body, reads the SSE stream and returns a RequestRecord (times, text,
usage counts); `completion_payload` builds the body for one BenchRequest, `chat_payload` for a list of
chat messages (the multi-turn workload).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from deltaserve.bench.datasets import BenchRequest
from deltaserve.bench.metrics import RequestRecord


@dataclass(slots=True)
class Endpoint:
    session: aiohttp.ClientSession
    url: str
    headers: dict[str, str]
    model: str
    chat: bool
    ignore_eos: bool
    temperature: float
    chat_template_kwargs: dict[str, Any] | None = None  # sent with chat requests when set
    # The other sampling fields asked for on the command line (top_p, presence_penalty, ..., and
    # --extra-body's): sent with every request; the server's defaults apply to the rest.
    sampling: dict[str, Any] = field(default_factory=dict)


def completion_payload(endpoint: Endpoint, request: BenchRequest) -> dict[str, Any]:
    if endpoint.chat:
        assert isinstance(request.prompt, str), "chat prompts are text"
        return chat_payload(endpoint, [{"role": "user", "content": request.prompt}], request.output_len)
    payload: dict[str, Any] = {"model": endpoint.model, "prompt": request.prompt}
    payload["max_tokens"] = request.output_len
    return payload | _sampling_fields(endpoint)


def chat_payload(endpoint: Endpoint, messages: list[dict[str, str]], output_len: int) -> dict[str, Any]:
    payload: dict[str, Any] = {"model": endpoint.model, "messages": list(messages)}
    payload["max_completion_tokens"] = output_len
    if endpoint.chat_template_kwargs is not None:
        payload["chat_template_kwargs"] = endpoint.chat_template_kwargs
    return payload | _sampling_fields(endpoint)


def _sampling_fields(endpoint: Endpoint) -> dict[str, Any]:
    fields: dict[str, Any] = {
        "temperature": endpoint.temperature,
        **endpoint.sampling,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if endpoint.ignore_eos:
        fields["ignore_eos"] = True
    return fields


async def send(endpoint: Endpoint, request: BenchRequest) -> RequestRecord:
    return await send_payload(endpoint, completion_payload(endpoint, request), request.prompt_len)


async def send_payload(endpoint: Endpoint, payload: dict[str, Any], prompt_len: int) -> RequestRecord:
    """Stream one request. Success needs HTTP 200, a `choices` chunk, a usage chunk and `[DONE]`.

    `prompt_len` is the client's count of prompt tokens (0 if unknown), used only when the usage chunk
    has no `prompt_tokens` and for failed requests."""
    chunk_times: list[float] = []
    texts: list[str] = []
    usage: UsageCounts | None = None
    done = False
    error = ""
    send_time = time.perf_counter()
    try:
        async with endpoint.session.post(endpoint.url, json=payload, headers=endpoint.headers) as resp:
            if resp.status != 200:
                error = f"HTTP {resp.status}: {(await resp.text())[:2000]}"
            else:
                # SSE: "data: {...}" lines separated by blank lines; ":" lines are keep-alive comments.
                async for raw in resp.content:
                    line = raw.strip()
                    if not line.startswith(b"data:"):
                        continue
                    data = line[len(b"data:") :].strip()
                    if data == b"[DONE]":
                        done = True
                        continue
                    arrival = time.perf_counter()
                    chunk = json.loads(data)
                    if chunk.get("error"):
                        error = f"error event in stream: {json.dumps(chunk['error'])[:2000]}"
                        break
                    if (choices := chunk.get("choices")) and _carries_output(choices[0], endpoint.chat):
                        chunk_times.append(arrival)
                        texts.append(_chunk_text(choices[0], endpoint.chat))
                    if chunk.get("usage"):
                        usage = usage_counts(chunk["usage"], prompt_len) or usage
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
        error = f"{type(exc).__name__}: {exc}"
    if not error:
        error = _stream_error(done, len(chunk_times), usage is not None)
    text = "".join(texts)
    if error or usage is None:
        return RequestRecord(False, error, send_time, chunk_times, prompt_len, 0, text)
    return RequestRecord(
        True,
        "",
        send_time,
        chunk_times,
        usage.prompt_tokens,
        usage.completion_tokens,
        text,
        usage.cached_tokens,
    )


@dataclass(frozen=True, slots=True)
class UsageCounts:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int | None  # usage.prompt_tokens_details.cached_tokens; None when the server omits it


def usage_counts(usage: dict[str, Any], default_prompt_len: int) -> UsageCounts | None:
    """The token counts of a usage object; None without `completion_tokens` (not a final usage)."""
    if "completion_tokens" not in usage:
        return None
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return UsageCounts(
        prompt_tokens=usage.get("prompt_tokens", default_prompt_len),
        completion_tokens=usage["completion_tokens"],
        cached_tokens=cached if isinstance(cached, int) else None,
    )


def _stream_error(done: bool, num_chunks: int, has_usage: bool) -> str:
    if not done:
        return f"stream ended without [DONE] after {num_chunks} chunks with choices"
    if num_chunks == 0:
        return "stream had no chunk with choices"
    if not has_usage:
        return "stream had no usage chunk with completion_tokens; the server must honour stream_options.include_usage"
    return ""


def _carries_output(choice: dict[str, Any], chat: bool) -> bool:
    """False only for a chat chunk whose delta announces the role and nothing else (no content,
    reasoning, tool call, logprobs or finish reason): it carries no token, so it is not timed.

    vLLM's server sends that chunk together with the first token, so skipping it moves vLLM's TTFT by
    microseconds; a server that sends it before the prefill would otherwise report a TTFT that times
    only request parsing.
    """
    if not chat:
        return True
    delta = choice.get("delta") or {}
    if "role" not in delta:
        return True
    output_keys = ("content", "reasoning_content", "reasoning", "tool_calls")
    return any(delta.get(k) for k in output_keys) or bool(
        choice.get("finish_reason") or choice.get("logprobs")
    )


def _chunk_text(choice: dict[str, Any], chat: bool) -> str:
    if chat:
        return (choice.get("delta") or {}).get("content") or ""
    return choice.get("text") or ""


async def wait_for_health(session: aiohttp.ClientSession, base_url: str, timeout_s: float) -> None:
    if timeout_s <= 0:
        return
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while True:
        try:
            async with session.get(f"{base_url}/health", timeout=aiohttp.ClientTimeout(total=5)) as resp:
                if resp.status == 200:
                    return
                last = f"HTTP {resp.status}"
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            last = f"{type(exc).__name__}: {exc}"
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(
                f"GET {base_url}/health did not answer 200 within {timeout_s:g} s (last: {last}); "
                "start the server, check --base-url, or raise --ready-check-timeout-sec"
            )
        await asyncio.sleep(min(0.5, remaining))


async def first_model(session: aiohttp.ClientSession, base_url: str, headers: dict[str, str]) -> str:
    async with session.get(f"{base_url}/v1/models", headers=headers) as resp:
        if resp.status != 200:
            raise RuntimeError(f"GET {base_url}/v1/models answered HTTP {resp.status}; pass --model")
        models = (await resp.json()).get("data") or []
    if not models:
        raise RuntimeError(f"GET {base_url}/v1/models lists no models; pass --model")
    return models[0]["id"]
