"""POST /tokenize and /detokenize (vLLM's shapes): count a prompt before sending it.

Both run on a worker thread and answer with JSON encoded there: their work and their answer grow with
the input. A text that cannot fit the context window is refused before it is tokenized, as for
generation.
"""

from __future__ import annotations

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import Response

from deltaserve.server.chat_prompt import ToolChoice, render_chat_prompt
from deltaserve.server.errors import bad_request
from deltaserve.server.offload import body_size
from deltaserve.server.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from deltaserve.server.sampling import check_prompt_text
from deltaserve.server.state import ServerState, get_state

router = APIRouter()


def _json(payload: object) -> Response:
    return Response(msgspec.json.encode(payload), media_type="application/json")


@router.post("/tokenize", response_model=TokenizeResponse)
async def tokenize(body: TokenizeRequest, request: Request) -> Response:
    state = get_state(request)
    state.check_model(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("send exactly one of prompt and messages", "prompt")
    return await state.workers.run(await body_size(request), _tokenize, state, body)


def _tokenize(state: ServerState, body: TokenizeRequest) -> Response:
    if body.prompt is not None:
        check_prompt_text(body.prompt, state.max_model_len, state.tokenizer.max_token_chars)
        ids = state.tokenizer.encode(body.prompt)
    else:
        tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
        kwargs = {**state.config.default_chat_template_kwargs, **(body.chat_template_kwargs or {})}
        messages = [m.model_dump(exclude_none=True) for m in body.messages or ()]
        add_generation_prompt = (
            body.add_generation_prompt
            if "add_generation_prompt" in body.model_fields_set
            else not body.continue_final_message
        )
        prompt = render_chat_prompt(
            state.tokenizer,
            messages,
            tools=tools,
            tool_choice=ToolChoice("auto" if tools else "none"),
            template_kwargs=kwargs,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=body.continue_final_message,
            max_model_len=state.max_model_len,
        )
        ids = prompt.token_ids
    payload: dict[str, object] = {"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids}
    if body.return_token_strs:
        payload["token_strs"] = [state.tokenizer.id_to_token(i) or "" for i in ids]
    return _json(payload)


@router.post("/detokenize", response_model=DetokenizeResponse)
async def detokenize(body: DetokenizeRequest, request: Request) -> Response:
    state = get_state(request)
    state.check_model(body.model)
    return await state.workers.run(await body_size(request), _detokenize, state, body)


def _detokenize(state: ServerState, body: DetokenizeRequest) -> Response:
    vocab = state.vocab_size
    bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise bad_request(f"tokens must be ids in [0, {vocab}), got {bad}", "tokens")
    return _json({"prompt": state.tokenizer.decode(body.tokens)})
