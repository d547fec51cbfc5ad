"""POST /tokenize and /detokenize (vLLM's shapes): count a prompt before sending it."""

from __future__ import annotations

from fastapi import APIRouter, Request

from deltaserve.server.chat_prompt import ToolChoice, render_chat_prompt
from deltaserve.server.errors import bad_request
from deltaserve.server.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from deltaserve.server.state import get_state

router = APIRouter()


@router.post("/tokenize", response_model=TokenizeResponse)
async def tokenize(body: TokenizeRequest, request: Request) -> TokenizeResponse:
    state = get_state(request)
    state.check_model(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("send exactly one of prompt and messages", "prompt")
    if body.prompt is not None:
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
        )
        ids = prompt.token_ids
    strs = [state.tokenizer.id_to_token(i) or "" for i in ids] if body.return_token_strs else None
    return TokenizeResponse(count=len(ids), max_model_len=state.max_model_len, tokens=ids, token_strs=strs)


@router.post("/detokenize", response_model=DetokenizeResponse)
async def detokenize(body: DetokenizeRequest, request: Request) -> DetokenizeResponse:
    state = get_state(request)
    state.check_model(body.model)
    vocab = state.vocab_size
    bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise bad_request(f"tokens must be ids in [0, {vocab}), got {bad}", "tokens")
    return DetokenizeResponse(prompt=state.tokenizer.decode(body.tokens))
