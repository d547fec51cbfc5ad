"""POST /invocations (SageMaker's inference route, as vLLM serves it): a chat completion body (it has
`messages`) or a completion body (it has `prompt`), answered exactly as its own route answers it."""

from __future__ import annotations

import json
from typing import Any

from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from deltaserve.server import chat, completions
from deltaserve.server.errors import bad_request
from deltaserve.server.protocol import ChatCompletionRequest, CompletionRequest

router = APIRouter()


@router.post("/invocations", response_model=None)
async def invocations(request: Request) -> Any:
    try:
        payload = json.loads(await request.body())
    except ValueError as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(payload, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(payload).__name__}")
    if "messages" in payload:
        body = _validated(ChatCompletionRequest, payload)
        return await chat.create_chat_completion(body, request)  # type: ignore[arg-type]
    if "prompt" in payload:
        body = _validated(CompletionRequest, payload)
        return await completions.create_completion(body, request)  # type: ignore[arg-type]
    raise bad_request(
        "/invocations takes a chat completion body (with messages) or a completion body (with prompt), "
        f"got one with {sorted(payload)}",
        "messages",
    )


def _validated(model: type[BaseModel], payload: dict[str, Any]) -> BaseModel:
    """Validation errors in the shape FastAPI reports them for the body of the endpoint's own route."""
    try:
        return model.model_validate(payload)
    except ValidationError as exc:
        raise RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in exc.errors()]) from None
