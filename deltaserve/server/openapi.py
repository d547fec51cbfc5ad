"""The OpenAPI document as the server behaves: errors are `ErrorResponse` with the statuses it sends.

FastAPI documents a 422 with its own validation schema for every route that takes input; this server
answers request faults with 400 in the OpenAI error shape (app.py), so that entry is replaced, and the
other statuses a route can answer are listed with the same schema.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from deltaserve.server.protocol import ErrorResponse

_GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/responses")
_OPEN_PATHS = ("/health", "/ping", "/version", "/metrics")
_ERROR_REF = {"$ref": "#/components/schemas/ErrorResponse"}
_STATUSES = {
    "400": "Invalid request: a field has the wrong type or value (`param` names it), or the body is not JSON",
    "401": "Missing or wrong API key (when the server runs with --api-key)",
    "404": "The model or the object named does not exist",
    "408": "The request body did not arrive in time (--body-read-timeout-s)",
    "413": "The request body is larger than --max-request-body-bytes",
    "503": "The engine is not available (it died, hung, or the server is shutting down), or the queue is "
    "full (--max-queued-requests; the Retry-After header says when to retry)",
}


def _error(description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": _ERROR_REF}}}


def _statuses(path: str, takes_input: bool) -> list[str]:
    statuses = [] if path in _OPEN_PATHS else ["401"]
    if takes_input:
        statuses += ["400", "404", "408", "413"]
    if path in _GENERATION_PATHS:
        statuses.append("503")
    return statuses


def openapi_document(app: FastAPI) -> dict[str, Any]:
    if app.openapi_schema is not None:
        return app.openapi_schema
    doc = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
    for path, operations in doc.get("paths", {}).items():
        for operation in operations.values():
            responses = operation.setdefault("responses", {})
            takes_input = responses.pop("422", None) is not None
            for status in _statuses(path, takes_input):
                responses[status] = _error(_STATUSES[status])
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    schemas.pop("HTTPValidationError", None)
    schemas.pop("ValidationError", None)
    error_schema = ErrorResponse.model_json_schema(ref_template="#/components/schemas/{model}")
    schemas.update(error_schema.pop("$defs", {}))
    schemas["ErrorResponse"] = error_schema
    app.openapi_schema = doc
    return doc
