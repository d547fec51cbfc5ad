"""Service endpoints: /health (and SageMaker's /ping), /v1/models, /metrics, /load, /version,
/reset_prefix_cache."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from deltaserve import __version__
from deltaserve.server.errors import NOT_FOUND, APIError
from deltaserve.server.metrics import CONTENT_TYPE
from deltaserve.server.protocol import ModelCard, ModelList
from deltaserve.server.state import get_state

router = APIRouter()


@router.get("/health")
@router.get("/ping")  # SageMaker's name (vLLM serves both)
@router.post("/ping")
async def health(request: Request) -> Response:
    """200 while the engine runs and the server takes work; 503 once the engine died or a shutdown began."""
    state = get_state(request)
    if state.healthy:
        return JSONResponse({"status": "ok"})
    reason = state.dead_reason or state.client.dead_reason or "the server is shutting down"
    return JSONResponse({"status": "unavailable", "reason": reason}, status_code=503)


def _cards(request: Request) -> list[ModelCard]:
    """One card per served name (--served-model-name A B: both), the reported one first."""
    state = get_state(request)
    root = state.client.info.model_dir
    return [ModelCard(id=name, root=root, max_model_len=state.max_model_len) for name in state.model_names]


@router.get("/v1/models", response_model=ModelList)
async def list_models(request: Request) -> ModelList:
    return ModelList(data=_cards(request))


@router.get("/v1/models/{model_id:path}", response_model=ModelCard)
async def retrieve_model(model_id: str, request: Request) -> ModelCard:
    card = next((c for c in _cards(request) if c.id == model_id), None)
    if card is None:
        raise APIError(
            404,
            f"the model {model_id!r} does not exist",
            type=NOT_FOUND,
            param="model",
            code="model_not_found",
        )
    return card


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(get_state(request).metrics.render(), media_type=CONTENT_TYPE)


@router.get("/load")
async def load(request: Request) -> dict[str, Any]:
    """The scheduler's latest load snapshot (at most a heartbeat old) plus the server's counts: engine
    requests in flight, and those of them queued (sent, not started: what --max-queued-requests bounds)."""
    state = get_state(request)
    snapshot = state.client.load
    return {
        **asdict(snapshot),
        "kv_cache_usage": snapshot.kv_usage,
        "prefix_cache_cached_tokens": snapshot.kv_pages_cached * state.client.info.page_size,
        "server_inflight": state.inflight,
        "server_queued": state.admission.queued,
    }


@router.post("/reset_prefix_cache")
async def reset_prefix_cache(request: Request) -> Response:
    """Forgets every cached page and state snapshot; requests in flight keep theirs (safe at any time)."""
    await get_state(request).client.reset_prefix_cache()
    return Response(status_code=200)


@router.get("/version")
async def version() -> dict[str, str]:
    return {"version": __version__}
