"""POST /v1/completions: a string, a list of strings, token ids or a list of token-id lists.

Each prompt gives n choices, each its own engine request (choice index = prompt position * n + j);
best_of > 1 and suffix are refused. Usage counts each prompt once and every choice's output. echo=true puts the prompt (its text, or the decoded
token ids) before the completion; with logprobs the prompt tokens' logprobs come first too (None for the
first token), which is how evaluation harnesses score text; max_tokens=0 then returns the prompt alone. vLLM's prompt_logprobs field returns them per
token id instead. Streaming sends the echoed prompt and prompt_logprobs in the first chunk of a choice.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field

from fastapi import APIRouter, Request
from fastapi.responses import Response

from deltaserve.engine.output import OutputDelta
from deltaserve.engine.protocol import TokenLogprobs
from deltaserve.sampling_params import SamplingParams
from deltaserve.server.disconnect import unless_disconnected
from deltaserve.server.errors import APIError, bad_request, unsupported
from deltaserve.server.generation import EngineRequest, generate, merge, terminal_error
from deltaserve.server.logprobs import completion_logprobs, echoed_prompt_logprobs, prompt_logprobs
from deltaserve.server.offload import body_size
from deltaserve.server.protocol import (
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    PromptLogprobs,
    UsageInfo,
    now,
)
from deltaserve.server.refused_fields import refuse_meaningful_fields
from deltaserve.server.sampling import (
    build_params,
    check_context_window,
    check_prompt_text,
    structured_field,
    truncate_prompt,
)
from deltaserve.server.sse import DONE, SSEResponse, data_event
from deltaserve.server.state import ServerState, get_state

logger = logging.getLogger("deltaserve.server")
router = APIRouter()


@router.post("/v1/completions", response_model=CompletionResponse)
async def create_completion(body: CompletionRequest, request: Request) -> Response | CompletionResponse:
    arrival = time.monotonic()
    state = get_state(request)
    state.check_model(body.model)
    state.check_available()
    refuse_meaningful_fields("/v1/completions", body.model_extra)
    state.warn_unknown_fields("/v1/completions", body.unknown_fields())
    _refuse_unsupported(body)
    state.admission.check_fanout(_num_prompts(body), body.n)
    prompts, params = await state.workers.run(await body_size(request), _prepare, state, body)
    await state.check_structured_output(params, structured_field(body))
    rid = f"cmpl-{uuid.uuid4().hex}"
    place = state.admission.reserve(len(prompts) * body.n)
    per_choice = params.per_choice(body.n)
    reqs = [
        EngineRequest(f"{rid}-{i * body.n + j}", text, ids, choice_params, place, cache_salt=body.cache_salt)
        for i, (text, ids) in enumerate(prompts)
        for j, choice_params in enumerate(per_choice)
    ]
    if body.stream:
        return SSEResponse(_stream(state, body, rid, reqs, arrival), on_close=place.release_all)
    try:
        return await unless_disconnected(request, _complete(state, body, rid, reqs, arrival))
    finally:
        place.release_all()


def _prepare(
    state: ServerState, body: CompletionRequest
) -> tuple[list[tuple[str | None, list[int]]], SamplingParams]:
    """Tokenized prompts and checked parameters (runs on a worker thread: it scales with the input)."""
    prompts = _prompts(state, body)
    echo_scores = body.logprobs if body.echo else None
    params = build_params(
        body,
        max_tokens=1 if _scores_only(body) else body.max_tokens,
        logprobs=body.logprobs,
        vocab_size=state.vocab_size,
        prompt_logprobs=max(echo_scores, body.prompt_logprobs or 0) if echo_scores is not None else None,
        allow_n=True,
        defaults=state.sampling_defaults,
        max_logprobs=state.config.max_logprobs,
        encode=state.tokenizer.encode,
    )
    for _, ids in prompts:
        check_context_window(len(ids), body.max_tokens, state.max_model_len)
    return prompts, params


def _num_prompts(body: CompletionRequest) -> int:
    prompt = body.prompt
    return 1 if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)) else len(prompt)


def _scores_only(body: CompletionRequest) -> bool:
    """echo with max_tokens=0: the prompt and its logprobs, no completion. The engine samples the one
    token every prefill produces anyway; it is dropped (completion_tokens 0, finish_reason "length")."""
    return body.echo and body.max_tokens == 0


def carries_output(delta: OutputDelta, echo_text: str, logprobs: bool) -> bool:
    """Whether a delta goes out as a chunk. One of tokens whose text is held back (a character split
    across tokens, a possible stop string) does, with empty text, as vLLM sends it: a client sees every
    engine step that produced tokens, not a gap of several. Only a delta with nothing at all is dropped."""
    return bool(echo_text or delta.text or delta.token_ids or logprobs or delta.finished)


def _without_output(delta: OutputDelta) -> OutputDelta:
    return dataclasses.replace(
        delta,
        text="",
        token_ids=[],
        logprobs=None,
        num_output_tokens=0,
        finish_reason="length" if delta.finished and delta.error is None else delta.finish_reason,
        stop_reason=None,
        abort_engine=False,
    )


def _choice_streams(
    state: ServerState, body: CompletionRequest, reqs: list[EngineRequest], arrival: float
) -> list[AsyncIterator[OutputDelta]]:
    """Each choice's deltas; for echo with max_tokens=0 without the sampled token."""
    streams = [generate(state, r, arrival) for r in reqs]
    return [_outputless(s) for s in streams] if _scores_only(body) else streams


async def _outputless(deltas: AsyncIterator[OutputDelta]) -> AsyncIterator[OutputDelta]:
    async with aclosing(deltas) as source:
        async for delta in source:
            yield _without_output(delta)


def _refuse_unsupported(body: CompletionRequest) -> None:
    if body.best_of is not None and body.best_of != 1:
        raise unsupported("best_of", f"best_of > 1 is not supported, got {body.best_of}; omit best_of")
    if body.suffix is not None:
        raise unsupported("suffix", "suffix (fill-in-the-middle) is not supported; omit suffix")


def _prompts(state: ServerState, body: CompletionRequest) -> list[tuple[str | None, list[int]]]:
    """(text, ids) per prompt; the text is None for token-id prompts and for texts that
    truncate_prompt_tokens cut (their ids are the prompt then)."""
    prompt = body.prompt
    if isinstance(prompt, str):
        return [_encoded(state, body, prompt)]
    if not prompt:
        raise bad_request("prompt must not be an empty list", "prompt")
    if isinstance(prompt[0], int):
        return [(None, _checked_ids(state, body, prompt))]  # type: ignore[arg-type]
    if isinstance(prompt[0], str):
        return [_encoded(state, body, p) for p in prompt]  # type: ignore[arg-type]
    return [(None, _checked_ids(state, body, ids)) for ids in prompt]  # type: ignore[arg-type]


def _encoded(state: ServerState, body: CompletionRequest, text: str) -> tuple[str | None, list[int]]:
    check_prompt_text(text, state.max_model_len, state.tokenizer.max_token_chars)
    ids = state.tokenizer.encode(text)
    kept = truncate_prompt(ids, body.truncate_prompt_tokens, state.max_model_len)
    return (text if len(kept) == len(ids) else None), kept


def _checked_ids(state: ServerState, body: CompletionRequest, ids: list[int]) -> list[int]:
    ids = truncate_prompt(ids, body.truncate_prompt_tokens, state.max_model_len)
    check_context_window(len(ids), None, state.max_model_len)
    vocab = state.vocab_size
    bad = next((t for t in ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise bad_request(f"prompt token ids must be in [0, {vocab}), got {bad}", "prompt")
    return list(ids)


@dataclass(slots=True)
class _Choice:
    """One prompt's completion as it accumulates (its text as pieces: a long output is never copied
    whole per delta)."""

    pieces: list[str] = field(default_factory=list)
    num_chars: int = 0
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    scored_prompt: list[TokenLogprobs | None] | None = None
    seen: bool = False  # a delta arrived (the echo goes out with the first)

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    def add(self, delta: OutputDelta) -> None:
        self.seen = True
        if delta.prompt_logprobs is not None:
            self.scored_prompt = delta.prompt_logprobs
        if delta.text:
            self.pieces.append(delta.text)
            self.num_chars += len(delta.text)
        self.token_ids += delta.token_ids
        self.logprobs += delta.logprobs or []
        self.num_prompt_tokens = delta.num_prompt_tokens
        self.num_output_tokens = delta.num_output_tokens
        self.num_cached_tokens = delta.num_cached_tokens
        if delta.finished:
            self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason


def _usage(choices: list[_Choice], n: int) -> UsageInfo:
    """Each prompt once (its n choices share it), every choice's output."""
    prompt_tokens = sum(c.num_prompt_tokens for c in choices[::n])
    cached = sum(c.num_cached_tokens for c in choices[::n])
    return UsageInfo.of(prompt_tokens, sum(c.num_output_tokens for c in choices), cached)


async def _complete(
    state: ServerState, body: CompletionRequest, rid: str, reqs: list[EngineRequest], arrival: float
) -> CompletionResponse:
    choices = [_Choice(num_prompt_tokens=len(r.prompt_token_ids)) for r in reqs]
    async with aclosing(merge(_choice_streams(state, body, reqs, arrival))) as deltas:
        async for i, delta in deltas:
            error = terminal_error(delta)
            if error is not None:
                raise error
            choices[i].add(delta)
    out = []
    for i, (c, req) in enumerate(zip(choices, reqs, strict=True)):
        echoed = _echo(state, body, req, c.scored_prompt)
        lp = None
        if body.logprobs is not None:
            lp = completion_logprobs(
                state.token_spelling(body.return_tokens_as_token_ids),
                c.token_ids,
                c.logprobs,
                len(echoed.text),
            )
            lp = _joined(echoed.logprobs, lp)
        out.append(
            CompletionChoice(
                index=i,
                text=echoed.text + c.text,
                logprobs=lp,
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
                prompt_logprobs=_prompt_logprobs(state, body, req, c.scored_prompt),
                prompt_token_ids=req.prompt_token_ids if body.return_token_ids else None,
                token_ids=c.token_ids if body.return_token_ids else None,
            )
        )
    return CompletionResponse(id=rid, model=state.model_name, choices=out, usage=_usage(choices, body.n))


@dataclass(slots=True)
class _Echo:
    text: str = ""
    logprobs: CompletionLogprobs | None = None


def _echo(
    state: ServerState, body: CompletionRequest, req: EngineRequest, scored: list[TokenLogprobs | None] | None
) -> _Echo:
    """The echoed prompt of a choice (empty without echo)."""
    if not body.echo:
        return _Echo()
    text = req.prompt if req.prompt is not None else state.tokenizer.decode(req.prompt_token_ids)
    if body.logprobs is None:
        return _Echo(text)
    assert scored is not None, "echo with logprobs asks the engine for prompt logprobs"
    return _Echo(
        text,
        echoed_prompt_logprobs(
            state.token_spelling(body.return_tokens_as_token_ids), req.prompt_token_ids, scored
        ),
    )


def _joined(first: CompletionLogprobs | None, second: CompletionLogprobs) -> CompletionLogprobs:
    if first is None:
        return second
    return CompletionLogprobs(
        tokens=first.tokens + second.tokens,
        token_logprobs=first.token_logprobs + second.token_logprobs,
        top_logprobs=first.top_logprobs + second.top_logprobs,
        text_offset=first.text_offset + second.text_offset,
    )


def _prompt_logprobs(
    state: ServerState, body: CompletionRequest, req: EngineRequest, scored: list[TokenLogprobs | None] | None
) -> PromptLogprobs | None:
    if body.prompt_logprobs is None or scored is None:
        return None
    return prompt_logprobs(
        state.token_spelling(body.return_tokens_as_token_ids), req.prompt_token_ids, scored
    )


async def _stream(
    state: ServerState, body: CompletionRequest, rid: str, reqs: list[EngineRequest], arrival: float
) -> AsyncIterator[str]:
    created = now()
    choices = [_Choice(num_prompt_tokens=len(r.prompt_token_ids)) for r in reqs]
    echoed = [0] * len(reqs)  # characters of each choice's echoed prompt
    ids_pending = [bool(body.return_token_ids)] * len(reqs)  # the prompt's ids go in a choice's first chunk
    try:
        async with aclosing(merge(_choice_streams(state, body, reqs, arrival))) as deltas:
            async for i, delta in deltas:
                error = terminal_error(delta)
                if error is not None:
                    raise error
                first = not choices[i].seen
                offset = echoed[i] + choices[i].num_chars
                choices[i].add(delta)
                echo = _echo(state, body, reqs[i], choices[i].scored_prompt) if first else _Echo()
                echoed[i] += len(echo.text)
                offset += len(echo.text)
                lp = None
                if body.logprobs is not None and (delta.logprobs or echo.logprobs is not None):
                    lp = completion_logprobs(
                        state.token_spelling(body.return_tokens_as_token_ids),
                        delta.token_ids,
                        delta.logprobs or [],
                        offset,
                    )
                    lp = _joined(echo.logprobs, lp)
                prompt_lps = _prompt_logprobs(state, body, reqs[i], delta.prompt_logprobs)
                if carries_output(delta, echo.text, lp is not None or prompt_lps is not None):
                    choice = CompletionChoice(
                        index=i,
                        text=echo.text + delta.text,
                        logprobs=lp,
                        finish_reason=delta.finish_reason,
                        stop_reason=delta.stop_reason,
                        prompt_logprobs=prompt_lps,
                        prompt_token_ids=reqs[i].prompt_token_ids if ids_pending[i] else None,
                        token_ids=delta.token_ids if body.return_token_ids else None,
                    )
                    ids_pending[i] = False
                    running = _usage(choices, body.n) if body.continuous_usage else None
                    chunk = CompletionChunk(
                        id=rid, created=created, model=state.model_name, choices=[choice], usage=running
                    )
                    yield data_event(chunk)
        if body.include_usage or state.config.force_include_usage:
            chunk = CompletionChunk(
                id=rid, created=created, model=state.model_name, choices=[], usage=_usage(choices, body.n)
            )
            yield data_event(chunk)
    except APIError as err:
        yield data_event(err.response())
    except Exception:
        logger.exception("completion stream %s failed", rid)
        yield data_event(APIError(500, "internal error", type="server_error", code=500).response())
    yield DONE
