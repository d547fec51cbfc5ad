"""POST /v1/responses and GET /v1/responses/{id}.

Input (a string or items) plus `instructions` plus, with `previous_response_id`, the stored conversation
of that response, rendered through the chat template. Output: a reasoning item, a message item and
function_call items, streamed as Responses events. A completed (or incomplete) response with
store=true is kept in the bounded store; `instructions` are not carried to follow-ups (OpenAI's rule).
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from deltaserve.sampling_params import StructuredOutputParams
from deltaserve.server.assistant_output import AssistantOutput
from deltaserve.server.chat_prompt import (
    ChatPrompt,
    ToolChoice,
    answer_start_token,
    render_chat_prompt,
    template_kwargs,
)
from deltaserve.server.disconnect import unless_disconnected
from deltaserve.server.errors import NOT_FOUND, APIError, bad_request, unsupported
from deltaserve.server.generation import EngineRequest, generate, terminal_error
from deltaserve.server.offload import body_size
from deltaserve.server.refused_fields import refuse_meaningful_fields
from deltaserve.server.response_store import StoredResponse
from deltaserve.server.responses_items import chat_tools, input_messages
from deltaserve.server.responses_protocol import (
    REASONING_EFFORTS,
    Event,
    InputTokensDetails,
    OutputTokensDetails,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
    TextConfig,
)
from deltaserve.server.responses_stream import ResponseBuilder
from deltaserve.server.sampling import build_params, check_context_window, json_constraint, structured_field
from deltaserve.server.sse import SSEResponse, typed_event
from deltaserve.server.state import ServerState, get_state
from deltaserve.server.tool_grammar import tool_call_output

logger = logging.getLogger("deltaserve.server")
router = APIRouter()


@dataclass(slots=True)
class _Run:
    """One response being generated."""

    state: ServerState
    store: bool
    prompt: ChatPrompt
    req: EngineRequest
    builder: ResponseBuilder
    conversation: list[dict[str, Any]]  # history + this input, instructions excluded
    arrival: float
    structured_field: str | None  # the field a structured-output error names


@router.post("/v1/responses", response_model=ResponseObject)
async def create_response(body: ResponsesRequest, request: Request) -> Response | ResponseObject:
    arrival = time.monotonic()
    state = get_state(request)
    state.check_model(body.model)
    state.check_available()
    refuse_meaningful_fields("/v1/responses", body.model_extra)
    state.warn_unknown_fields("/v1/responses", body.unknown_fields())
    history = _history(state, body.previous_response_id)  # the store is the event loop's
    run = await state.workers.run(await body_size(request), _prepare, state, body, history, arrival)
    await state.check_structured_output(run.req.params, run.structured_field)
    place = state.admission.reserve(1)
    run.req.queue_place = place
    if body.stream:
        return SSEResponse(_stream(run), on_close=place.release_all)
    try:
        return await unless_disconnected(request, _complete(run))
    finally:
        place.release_all()


def _text_format(
    state: ServerState, body: ResponsesRequest, prompt: ChatPrompt
) -> StructuredOutputParams | None:
    """text.format json_object / json_schema (its `schema`) -> the engine's JSON constraint, applied to
    the answer after the reasoning block when thinking is on."""
    if body.text is None:
        return None
    fmt = body.text.format
    schema = (fmt.model_extra or {}).get("schema")
    start = answer_start_token(state.tokenizer, prompt)
    return json_constraint(fmt.type, schema, start, param="text.format", where="schema")


def _prepare(
    state: ServerState, body: ResponsesRequest, history: list[dict[str, Any]], arrival: float
) -> _Run:
    """Renders and validates everything (on a worker thread); raises APIError before anything reaches
    the engine. Errors in the rendered conversation name `input`, the field that carries it."""
    conversation = history + input_messages(body.input)
    instructions = [{"role": "system", "content": body.instructions}] if body.instructions else []
    tools = chat_tools(body.tools)
    prompt = render_chat_prompt(
        state.tokenizer,
        instructions + conversation,
        tools=tools,
        tool_choice=_tool_choice(body, tools),
        template_kwargs=template_kwargs(
            state.config.default_chat_template_kwargs, body.chat_template_kwargs, _effort(body)
        ),
        parallel_tool_calls=body.parallel_tool_calls is not False,
        max_model_len=state.max_model_len,
        messages_field="input",
    )
    if body.prompt_logprobs is not None:
        raise unsupported(
            "prompt_logprobs",
            "prompt_logprobs is not supported by the Responses API; use /v1/completions or /v1/chat/completions",
        )
    if body.return_token_ids:
        raise unsupported(
            "return_token_ids",
            "return_token_ids is not supported by the Responses API; use /v1/completions or /v1/chat/completions",
        )
    if body.truncate_prompt_tokens is not None:
        raise unsupported(
            "truncate_prompt_tokens",
            "truncate_prompt_tokens is not supported by the Responses API; shorten the input or use "
            "/v1/chat/completions",
        )
    text_format = _text_format(state, body, prompt)
    constrained = "text.format" if text_format is not None else structured_field(body)
    tool_calls = tool_call_output(prompt)
    if tool_calls is not None and constrained is not None:
        raise bad_request(
            f"{constrained} cannot be combined with the tool calls' grammar "
            f"(tool_choice {prompt.tool_choice.mode!r}): it constrains the output",
            constrained,
        )
    if text_format is not None and structured_field(body) is not None:
        raise bad_request(
            f"text.format and {structured_field(body)} each constrain the output; send only one of them",
            structured_field(body),
        )
    params = build_params(
        body,
        max_tokens=body.max_output_tokens,
        logprobs=None,
        vocab_size=state.vocab_size,
        rename={"max_tokens": "max_output_tokens", "structured_output": constrained or "text.format"},
        structured_start=answer_start_token(state.tokenizer, prompt),
        structured=text_format or tool_calls,
        defaults=state.sampling_defaults,
        max_logprobs=state.config.max_logprobs,
        encode=state.tokenizer.encode,
    )
    check_context_window(
        len(prompt.token_ids),
        body.max_output_tokens,
        state.max_model_len,
        max_tokens_field="max_output_tokens",
        prompt_field="input",
    )
    rid = state.responses.new_id()
    response = ResponseObject(
        id=rid,
        model=state.model_name,
        instructions=body.instructions,
        previous_response_id=body.previous_response_id,
        tools=body.tools or [],
        tool_choice=body.tool_choice if body.tool_choice is not None else ("auto" if tools else "none"),
        parallel_tool_calls=body.parallel_tool_calls is not False,
        temperature=body.temperature,
        top_p=body.top_p,
        max_output_tokens=body.max_output_tokens,
        metadata=body.metadata or {},
        store=body.store,
        text=body.text if body.text is not None else TextConfig(),
        reasoning=body.reasoning,
    )
    req = EngineRequest(
        rid,
        prompt.text,
        prompt.token_ids,
        params,
        cache_points=prompt.cache_points,
        cache_salt=body.cache_salt,
    )
    structured = "tools" if tool_calls is not None else constrained
    return _Run(state, body.store, prompt, req, ResponseBuilder(response), conversation, arrival, structured)


@router.get("/v1/responses/{response_id}", response_model=ResponseObject)
async def retrieve_response(response_id: str, request: Request) -> ResponseObject:
    store = get_state(request).responses
    entry = store.get(response_id)
    if entry is None:
        raise APIError(
            404,
            f"no stored response with id {response_id!r}{store.elsewhere(response_id)}",
            type=NOT_FOUND,
            param="response_id",
        )
    return entry.response


def _effort(body: ResponsesRequest) -> str | None:
    """reasoning.effort: "none" turns thinking off; the other levels leave it on."""
    effort = (body.reasoning or {}).get("effort")
    if effort is not None and effort not in REASONING_EFFORTS:
        raise bad_request(
            f"reasoning.effort must be one of {list(REASONING_EFFORTS)}, got {effort!r}", "reasoning"
        )
    return effort


def _history(state: ServerState, previous_id: str | None) -> list[dict[str, Any]]:
    if previous_id is None:
        return []
    entry = state.responses.get(previous_id)
    if entry is None:
        raise APIError(
            400,
            f"previous response {previous_id!r} was not found (never stored, or evicted from the store of "
            f"{state.responses.capacity} responses){state.responses.elsewhere(previous_id)}",
            param="previous_response_id",
            code="previous_response_not_found",
        )
    return [dict(m) for m in entry.history]


def _tool_choice(body: ResponsesRequest, tools: list[dict[str, Any]] | None) -> ToolChoice:
    choice = body.tool_choice
    if choice is None:
        return ToolChoice("auto" if tools else "none")
    if isinstance(choice, str):
        return ToolChoice(choice)
    return ToolChoice("named", choice.name)


async def _events(run: _Run) -> AsyncIterator[Event]:
    """Every event of the response, start to terminal; stores the response when it completes."""
    builder = run.builder
    out = AssistantOutput.for_prompt(run.prompt)
    for event in builder.start():
        yield event
    token_ids: list[int] = []
    async with aclosing(generate(run.state, run.req, run.arrival)) as deltas:
        async for delta in deltas:
            error = terminal_error(delta)
            if error is not None:
                raise error
            token_ids += delta.token_ids
            for event in builder.add(out.feed(delta.text, final=delta.finished)):
                yield event
            if delta.finished:
                usage = _usage(run, out, token_ids, delta.num_cached_tokens)
                for event in builder.finish(delta.finish_reason, usage):
                    yield event
    if run.store:
        assistant: dict[str, Any] = {"role": "assistant", "content": out.content}
        if out.reasoning:
            assistant["reasoning_content"] = out.reasoning
        if out.calls:
            assistant["tool_calls"] = out.tool_call_dicts()
        history = (*run.conversation, assistant)
        run.state.responses.put(
            builder.response.id, StoredResponse(builder.response.model_copy(deep=True), history)
        )


def _usage(run: _Run, out: AssistantOutput, token_ids: list[int], cached_tokens: int) -> ResponseUsage:
    """Reasoning tokens: output tokens up to and including `</think>` (all of them if it never came)."""
    reasoning_tokens = 0
    if run.prompt.thinking:
        end = run.state.tokenizer.token_to_id("</think>")
        reasoning_tokens = (
            token_ids.index(end) + 1 if end in token_ids else (len(token_ids) if out.reasoning else 0)
        )
    n_in, n_out = len(run.req.prompt_token_ids), len(token_ids)
    return ResponseUsage(
        input_tokens=n_in,
        input_tokens_details=InputTokensDetails(cached_tokens=cached_tokens),
        output_tokens=n_out,
        output_tokens_details=OutputTokensDetails(reasoning_tokens=reasoning_tokens),
        total_tokens=n_in + n_out,
    )


async def _complete(run: _Run) -> ResponseObject:
    async with aclosing(_events(run)) as events:
        async for _ in events:
            pass
    return run.builder.response


async def _stream(run: _Run) -> AsyncIterator[str]:
    try:
        async with aclosing(_events(run)) as events:
            async for event in events:
                yield typed_event(event.type, event)
    except APIError as err:
        for event in run.builder.fail(str(err.code or err.status), err.message):
            yield typed_event(event.type, event)
    except Exception:
        logger.exception("response stream %s failed", run.req.request_id)
        for event in run.builder.fail("server_error", "internal error"):
            yield typed_event(event.type, event)
