"""POST /v1/chat/completions: messages through the chat template; reasoning, content and tool calls out.

Reasoning (text before `</think>` when thinking is on) is `reasoning_content`; Qwen XML tool calls are
`tool_calls` with JSON arguments, streamed as they are generated (chat_prompt.py and assistant_output.py
hold the rules). A turn that ends normally with tool calls has finish_reason "tool_calls".
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
from deltaserve.server.assistant_output import AssistantOutput
from deltaserve.server.chat_prompt import (
    ChatPrompt,
    ToolChoice,
    answer_start_token,
    render_chat_prompt,
    template_kwargs,
)
from deltaserve.server.disconnect import unless_disconnected
from deltaserve.server.errors import APIError, bad_request, unsupported
from deltaserve.server.generation import EngineRequest, generate, merge, terminal_error
from deltaserve.server.logprobs import chat_logprobs, prompt_logprobs
from deltaserve.server.offload import body_size
from deltaserve.server.parsers import ParsedDelta
from deltaserve.server.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatMessageOut,
    ChatStreamChoice,
    DeltaFunction,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
    UsageInfo,
    now,
)
from deltaserve.server.refused_fields import refuse_meaningful_fields
from deltaserve.server.sampling import build_params, check_context_window, structured_field, truncate_prompt
from deltaserve.server.sse import DONE, SSEResponse, data_event
from deltaserve.server.state import ServerState, get_state
from deltaserve.server.tool_grammar import tool_call_output

logger = logging.getLogger("deltaserve.server")
router = APIRouter()


@router.post("/v1/chat/completions", response_model=ChatCompletionResponse)
async def create_chat_completion(
    body: ChatCompletionRequest, request: Request
) -> Response | ChatCompletionResponse:
    arrival = time.monotonic()
    state = get_state(request)
    state.check_model(body.model)
    state.check_available()
    refuse_meaningful_fields("/v1/chat/completions", body.model_extra)
    state.warn_unknown_fields("/v1/chat/completions", body.unknown_fields())
    state.admission.check_fanout(1, body.n)
    prompt, params = await state.workers.run(await body_size(request), _prepare, state, body)
    # a grammar the request did not ask for in a structured-output field comes from its tools
    await state.check_structured_output(params, structured_field(body) or "tools")
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    place = state.admission.reserve(body.n)
    reqs = [
        EngineRequest(
            rid if body.n == 1 else f"{rid}-{j}",
            prompt.text,
            prompt.token_ids,
            choice_params,
            place,
            cache_points=prompt.cache_points,
            cache_salt=body.cache_salt,
        )
        for j, choice_params in enumerate(params.per_choice(body.n))
    ]
    if body.stream:
        return SSEResponse(_stream(state, body, prompt, rid, reqs, arrival), on_close=place.release_all)
    try:
        return await unless_disconnected(request, _complete(state, body, prompt, rid, reqs, arrival))
    finally:
        place.release_all()


def _prepare(state: ServerState, body: ChatCompletionRequest) -> tuple[ChatPrompt, SamplingParams]:
    """The rendered, tokenized prompt and checked parameters (runs on a worker thread)."""
    prompt = _truncated(state, _render(state, body), body.truncate_prompt_tokens)
    params = _params(state, body, prompt)
    max_field = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    check_context_window(
        len(prompt.token_ids), params.max_tokens, state.max_model_len, max_tokens_field=max_field
    )
    return prompt, params


def _truncated(state: ServerState, prompt: ChatPrompt, keep: int | None) -> ChatPrompt:
    """truncate_prompt_tokens on the rendered prompt (vLLM's: its last tokens, system prompt or not)."""
    ids = truncate_prompt(prompt.token_ids, keep, state.max_model_len)
    cut = len(prompt.token_ids) - len(ids)
    if cut == 0:
        return prompt
    points = [p - cut for p in prompt.cache_points if p > cut]
    return dataclasses.replace(prompt, text=state.tokenizer.decode(ids), token_ids=ids, cache_points=points)


def _render(state: ServerState, body: ChatCompletionRequest) -> ChatPrompt:
    if not body.messages:
        raise bad_request("messages must not be empty", "messages")
    tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
    choice = body.tool_choice
    if choice is None:
        tool_choice = ToolChoice("auto" if tools else "none")
    elif isinstance(choice, str):
        tool_choice = ToolChoice(choice)
    else:
        tool_choice = ToolChoice("named", choice.function.name)
    kwargs = template_kwargs(
        state.config.default_chat_template_kwargs, body.chat_template_kwargs, body.reasoning_effort
    )
    messages = [m.model_dump(exclude_none=True) for m in body.messages]
    return render_chat_prompt(
        state.tokenizer,
        messages,
        tools=tools,
        tool_choice=tool_choice,
        template_kwargs=kwargs,
        add_generation_prompt=_adds_generation_prompt(body),
        continue_final_message=body.continue_final_message,
        parallel_tool_calls=body.parallel_tool_calls is not False,
        max_model_len=state.max_model_len,
    )


def _adds_generation_prompt(body: ChatCompletionRequest) -> bool:
    """add_generation_prompt as sent; unsent, continue_final_message turns it off (vLLM asks for both)."""
    if "add_generation_prompt" in body.model_fields_set:
        return body.add_generation_prompt
    return not body.continue_final_message


def _echoed(body: ChatCompletionRequest) -> str:
    """echo: the last message's text starts the answer when that message is the assistant's (vLLM's rule)."""
    last = body.messages[-1]
    if not body.echo or last.role != "assistant":
        return ""
    if isinstance(last.content, str):
        return last.content
    return "".join(p.get("text", "") for p in last.content or () if isinstance(p.get("text"), str))


def _params(state: ServerState, body: ChatCompletionRequest, prompt: ChatPrompt) -> SamplingParams:
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs needs logprobs=true", "top_logprobs")
    if body.prompt_logprobs is not None and body.stream:
        raise unsupported(
            "prompt_logprobs",
            "prompt_logprobs is not supported with stream=true (non-streaming chat completions return "
            "it); omit it or set stream=false",
        )
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    rename = {"logprobs": "top_logprobs"}
    if body.max_completion_tokens is not None:
        rename["max_tokens"] = "max_completion_tokens"
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    calls = tool_call_output(prompt)
    constrained = structured_field(body)
    if calls is not None and constrained is not None:
        what = "strict functions" if prompt.tool_choice.mode == "auto" else "a forced tool call"
        raise bad_request(
            f"{constrained} cannot be combined with {what} (tool_choice {prompt.tool_choice.mode!r}): "
            "the tool calls' grammar constrains the output",
            constrained,
        )
    return build_params(
        body,
        max_tokens=max_tokens,
        logprobs=logprobs,
        vocab_size=state.vocab_size,
        rename=rename,
        allow_n=True,
        structured_start=answer_start_token(state.tokenizer, prompt),
        structured=calls,
        defaults=state.sampling_defaults,
        max_logprobs=state.config.max_logprobs,
        encode=state.tokenizer.encode,
    )


def _delta_tool_calls(parsed: ParsedDelta) -> list[DeltaToolCall] | None:
    calls = [
        DeltaToolCall(
            index=c.index,
            id=c.id,
            type="function" if c.id is not None else None,
            function=DeltaFunction(name=c.name, arguments=c.arguments),
        )
        for c in parsed.tool_calls
    ]
    return calls or None


def stream_choice(
    out: AssistantOutput, delta: OutputDelta, logprobs: ChatLogprobs | None, index: int = 0
) -> ChatStreamChoice | None:
    """The stream choice for one engine delta; None only when it carries nothing: no token, no
    finish. A delta of tokens whose text the stop-string or tag parsers hold back goes out with an
    empty delta, as vLLM sends one: a client sees every engine step that produced tokens."""
    parsed = out.feed(delta.text, final=delta.finished)
    message = ChatDelta(
        content=parsed.content or None,
        reasoning_content=parsed.reasoning or None,
        tool_calls=_delta_tool_calls(parsed),
    )
    if not (
        message.content
        or message.reasoning_content
        or message.tool_calls
        or logprobs
        or delta.finished
        or delta.token_ids
    ):
        return None
    return ChatStreamChoice(
        index=index,
        delta=message,
        logprobs=logprobs,
        finish_reason=out.finish_reason(delta.finish_reason),
        stop_reason=delta.stop_reason,
    )


@dataclass(slots=True)
class _ChoiceState:
    """One choice of a non-streaming chat completion as it accumulates."""

    out: AssistantOutput
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    scored_prompt: list[TokenLogprobs | None] | None = None
    last: OutputDelta | None = None

    def add(self, delta: OutputDelta) -> None:
        self.out.feed(delta.text, final=delta.finished)
        self.token_ids += delta.token_ids
        self.logprobs += delta.logprobs or []
        self.scored_prompt = delta.prompt_logprobs or self.scored_prompt
        self.last = delta

    def choice(self, state: ServerState, body: ChatCompletionRequest, index: int) -> ChatChoice:
        last, out = self.last, self.out
        assert last is not None and last.finished, "generate() ends with a finished delta"
        content = _echoed(body) + out.content
        message = ChatMessageOut(
            content=content or None,
            reasoning_content=out.reasoning or None,
            tool_calls=[
                ToolCall(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments))
                for c in out.complete_calls
            ],
        )
        return ChatChoice(
            index=index,
            message=message,
            logprobs=chat_logprobs(
                state.token_spelling(body.return_tokens_as_token_ids), self.token_ids, self.logprobs
            )
            if body.logprobs
            else None,
            finish_reason=out.finish_reason(last.finish_reason),
            stop_reason=last.stop_reason,
            token_ids=self.token_ids if body.return_token_ids else None,
        )


async def _complete(
    state: ServerState,
    body: ChatCompletionRequest,
    prompt: ChatPrompt,
    rid: str,
    reqs: list[EngineRequest],
    arrival: float,
) -> ChatCompletionResponse:
    choices = [_ChoiceState(AssistantOutput.for_prompt(prompt)) for _ in reqs]
    async with aclosing(merge([generate(state, r, arrival) for r in reqs])) as deltas:
        async for i, delta in deltas:
            error = terminal_error(delta)
            if error is not None:
                raise error
            choices[i].add(delta)
    outputs = sum(c.last.num_output_tokens for c in choices if c.last is not None)
    scored = choices[0].scored_prompt
    return ChatCompletionResponse(
        id=rid,
        model=state.model_name,
        choices=[c.choice(state, body, i) for i, c in enumerate(choices)],
        # the prompt once: its n choices share it (and the first choice's cached share)
        usage=UsageInfo.of(len(prompt.token_ids), outputs, choices[0].last.num_cached_tokens),
        prompt_logprobs=None
        if scored is None
        else prompt_logprobs(state.token_spelling(body.return_tokens_as_token_ids), prompt.token_ids, scored),
        prompt_token_ids=prompt.token_ids if body.return_token_ids else None,
    )


async def _stream(
    state: ServerState,
    body: ChatCompletionRequest,
    prompt: ChatPrompt,
    rid: str,
    reqs: list[EngineRequest],
    arrival: float,
) -> AsyncIterator[str]:
    created = now()
    model = state.model_name

    outs = [AssistantOutput.for_prompt(prompt) for _ in reqs]
    num_output_tokens = [0] * len(reqs)
    num_cached_tokens = [0] * len(reqs)

    def usage() -> UsageInfo:
        # the first choice's cached share: the n choices share the prompt
        return UsageInfo.of(len(prompt.token_ids), sum(num_output_tokens), num_cached_tokens[0])

    def chunk(choice: ChatStreamChoice, prompt_token_ids: list[int] | None = None) -> str:
        running = usage() if body.continuous_usage else None
        return data_event(
            ChatCompletionChunk(
                id=rid,
                created=created,
                model=model,
                choices=[choice],
                usage=running,
                prompt_token_ids=prompt_token_ids,
            )
        )

    try:
        echoed = _echoed(body)
        for i in range(len(reqs)):
            first = prompt.token_ids if body.return_token_ids and i == 0 else None
            yield chunk(ChatStreamChoice(index=i, delta=ChatDelta(role="assistant", content="")), first)
            if echoed:
                yield chunk(ChatStreamChoice(index=i, delta=ChatDelta(content=echoed)))
        async with aclosing(merge([generate(state, r, arrival) for r in reqs])) as deltas:
            async for i, delta in deltas:
                error = terminal_error(delta)
                if error is not None:
                    raise error
                num_output_tokens[i] = delta.num_output_tokens
                num_cached_tokens[i] = delta.num_cached_tokens
                lp = None
                if body.logprobs and delta.logprobs:
                    lp = chat_logprobs(
                        state.token_spelling(body.return_tokens_as_token_ids), delta.token_ids, delta.logprobs
                    )
                choice = stream_choice(outs[i], delta, lp, i)
                if choice is not None:
                    choice.token_ids = delta.token_ids if body.return_token_ids else None
                    yield chunk(choice)
        if body.include_usage or state.config.force_include_usage:
            yield data_event(
                ChatCompletionChunk(id=rid, created=created, model=model, choices=[], usage=usage())
            )
    except APIError as err:
        yield data_event(err.response())
    except Exception:
        logger.exception("chat stream %s failed", rid)
        yield data_event(APIError(500, "internal error", type="server_error", code=500).response())
    yield DONE
