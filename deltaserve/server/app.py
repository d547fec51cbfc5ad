"""The FastAPI app (routes, error shapes, auth, body limits) and `run_server`, what `deltaserve serve` runs.

Every error leaves as `{"error": {"message", "type", "param", "code"}}`: APIError from handlers,
FastAPI's request validation (400, `param` = the top-level field), unknown routes (404), oversized
bodies (413), bodies that do not arrive in time (408), missing or wrong API key (401), an unavailable
engine or a full queue (503), anything unexpected (500, logged). The OpenAPI document says so
(openapi.py).
"""

from __future__ import annotations

import asyncio
import logging
import socket
from multiprocessing.connection import Connection
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from deltaserve import __version__
from deltaserve.engine.process import EngineLaunch
from deltaserve.engine_config import EngineConfig
from deltaserve.server import chat, completions, invocations, responses, service, tokenize
from deltaserve.server.api_workers import ApiWorker, WorkerAttach, set_up_worker_process
from deltaserve.server.args import ServerConfig
from deltaserve.server.disconnect import ClientDisconnected
from deltaserve.server.errors import AUTHENTICATION, INVALID_REQUEST, NOT_FOUND, SERVER_ERROR, APIError
from deltaserve.server.middleware import APIKeyAuth, BodyReadTimeout, BodySizeLimit
from deltaserve.server.openapi import openapi_document
from deltaserve.server.pacing import AdmissionPacer, PacedAdmission
from deltaserve.server.state import ServerState
from deltaserve.server.text_checks import LONE_SURROGATE, format_path

logger = logging.getLogger("deltaserve.server")

CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client that left; never actually sent


def build_app(state: ServerState) -> FastAPI:
    app = FastAPI(
        title="deltaserve",
        version=__version__,
        description="OpenAI-compatible server for Qwen3.5 hybrid models",
        **({} if state.config.fastapi_docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}),
    )
    app.state.server = state
    for module in (completions, chat, responses, tokenize, service, invocations):
        app.include_router(module.router)
    app.openapi = lambda: openapi_document(app)  # type: ignore[method-assign]
    app.add_exception_handler(APIError, _api_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, _validation_error)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, _http_error)  # type: ignore[arg-type]
    app.add_exception_handler(ClientDisconnected, _client_gone)
    app.add_exception_handler(Exception, _unexpected)
    app.add_middleware(BodySizeLimit, max_bytes=state.config.max_request_body_bytes)
    app.add_middleware(BodyReadTimeout, timeout_s=state.config.body_read_timeout_s)
    # Outside the body timeout (a wait for a turn is not a slow body), inside auth (a refused request
    # waits for nothing).
    app.add_middleware(PacedAdmission, pacer=AdmissionPacer())
    if state.config.api_key:  # checked before any body is read
        app.add_middleware(
            APIKeyAuth, api_key=state.config.api_key, protect_metrics=state.config.protect_metrics
        )
    cors = state.config.cors
    if cors is not None:  # outermost: preflights and error responses get the CORS headers too
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(cors.allowed_origins),
            allow_methods=list(cors.allowed_methods),
            allow_headers=list(cors.allowed_headers),
            allow_credentials=cors.allow_credentials,
        )
    return app


def _error(status: int, message: str, type: str, param: str | None = None, code: Any = None) -> JSONResponse:
    return APIError(status, message, type=type, param=param, code=code).response_json()


async def _api_error(request: Request, exc: APIError) -> JSONResponse:
    return exc.response_json()


_SHOWN_CHARS = 80  # of a found value quoted in an error message
_UNION_TAGS = frozenset({"str", "int", "float", "bool", "dict", "list", "none"})


def _is_union_tag(part: object) -> bool:
    """pydantic names the member of a union in `loc` ('str', 'list[int]', 'function-after[...]')."""
    return isinstance(part, str) and (part in _UNION_TAGS or "[" in part or part[:1].isupper())


def _describe(error: dict[str, Any]) -> tuple[str | None, str]:
    """(param, message) of one pydantic error: param is the top-level body field."""
    loc = list(error.get("loc", ()))
    if error.get("type") == LONE_SURROGATE:
        return (error.get("ctx") or {}).get("field"), error.get("msg", "invalid text")
    if error.get("type") == "json_invalid":
        reason = (error.get("ctx") or {}).get("error", "invalid JSON")
        position = loc[1] if len(loc) > 1 else "?"
        return None, f"the request body is not valid JSON: {reason} at position {position}"
    fields = loc[1:] if loc and loc[0] == "body" else loc
    fields = [part for part in fields if not _is_union_tag(part)]
    if not fields:
        return None, f"the request body must be a JSON object ({error.get('msg', 'invalid')})"
    path = format_path(fields)
    if error.get("type") == "missing":
        return str(fields[0]), f"{path} is required"
    found = error.get("input")
    shown = repr(found) if isinstance(found, str | int | float | bool | type(None)) else type(found).__name__
    if len(shown) > _SHOWN_CHARS:
        shown = f"{shown[:_SHOWN_CHARS]}... ({len(shown)} characters)"
    message = str(error.get("msg", "invalid value")).removeprefix("Value error, ")
    return str(fields[0]), f"{path}: {message} (got {shown})"


def _most_specific(errors: list[dict[str, Any]]) -> dict[str, Any]:
    """Of the errors of one body (a union reports one per member), the one deepest in the body."""
    return max(errors, key=lambda e: len([p for p in e.get("loc", ()) if not _is_union_tag(p)]))


async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = list(exc.errors())
    param, message = _describe(_most_specific(errors)) if errors else (None, "invalid request")
    return _error(400, message, INVALID_REQUEST, param)


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    kind = {401: AUTHENTICATION, 404: NOT_FOUND}.get(exc.status_code, INVALID_REQUEST)
    if exc.status_code >= 500:
        kind = SERVER_ERROR
    code = {413: "request_too_large", 408: "request_timeout"}.get(exc.status_code)
    message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
    if exc.status_code == 404 and message == "Not Found":
        message = f"no route for {request.method} {request.url.path}"
    return _error(exc.status_code, message, kind, code=code)


async def _client_gone(request: Request, exc: Exception) -> Response:
    return Response(status_code=CLIENT_CLOSED_REQUEST)


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    logger.exception("unhandled error in %s %s", request.method, request.url.path)
    return _error(500, f"internal server error ({type(exc).__name__})", SERVER_ERROR, code=500)


def run_server(
    config: ServerConfig,
    engine_config: EngineConfig,
    *,
    sock: socket.socket | None = None,
    launch: EngineLaunch | None = None,
) -> int:
    """Serves until SIGTERM/SIGINT (exit 0) or the engine dies (exit 1). `sock` and `launch`: the
    listening socket and the engine process when the caller started them already."""
    from deltaserve.server.lifecycle import serve

    return asyncio.run(
        serve(config, engine_config, build_app, sock=sock, launch=launch, worker_entry=run_api_worker)
    )


def run_api_worker(
    config: ServerConfig,
    engine_config: EngineConfig,
    sock: socket.socket,
    attach: WorkerAttach,
    channel: Connection,
) -> None:
    """An extra API server process (--api-server-count): spawned, it serves beside the main one."""
    from deltaserve.server.lifecycle import serve

    set_up_worker_process(attach)
    worker = ApiWorker(attach, channel)
    raise SystemExit(asyncio.run(serve(config, engine_config, build_app, sock=sock, api_worker=worker)))
