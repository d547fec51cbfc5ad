"""HTTP errors in the OpenAI shape: `{"error": {"message", "type", "param", "code"}}`.

Handlers raise APIError; app.py turns it (and FastAPI's own validation and routing errors) into that
shape. Request faults are 4xx and never reach the engine; 5xx means the engine failed or is gone.
"""

from __future__ import annotations

from fastapi.responses import JSONResponse

from deltaserve.errors import RequestValidationError, UnsupportedRequestError
from deltaserve.server.protocol import ErrorBody, ErrorResponse

INVALID_REQUEST = "invalid_request_error"
NOT_FOUND = "not_found_error"
AUTHENTICATION = "authentication_error"
SERVER_ERROR = "server_error"
UNAVAILABLE = "service_unavailable_error"


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = INVALID_REQUEST,
        param: str | None = None,
        code: str | int | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def response(self) -> ErrorResponse:
        return ErrorResponse(
            error=ErrorBody(message=self.message, type=self.type, param=self.param, code=self.code)
        )

    def response_json(self) -> JSONResponse:
        return JSONResponse(self.response().model_dump(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def unsupported(param: str, message: str) -> APIError:
    return APIError(400, message, param=param, code="unsupported")


def from_validation(err: RequestValidationError, rename: dict[str, str] | None = None) -> APIError:
    """A SamplingParams/tokenizer validation error as a 400; `rename` maps internal field names to the
    wire names of this endpoint (e.g. max_tokens -> max_completion_tokens)."""
    param = (rename or {}).get(err.field, err.field)
    message = err.message
    if param != err.field:
        message = message.replace(err.field, param)
    code = "unsupported" if isinstance(err, UnsupportedRequestError) else None
    return APIError(400, message, param=param, code=code)


def engine_unavailable(reason: str) -> APIError:
    return APIError(503, f"the engine is not available: {reason}", type=UNAVAILABLE, code=503)
