"""`deltaserve serve` server flags and the validated ServerConfig they become."""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass, field
from typing import Any

from deltaserve.engine.liveness import DEFAULT_HEARTBEAT_TIMEOUT_S, DEFAULT_STEP_TIMEOUT_S, HangLimits
from deltaserve.errors import ConfigError

API_KEY_ENV = "DELTASERVE_API_KEY"
DEFAULT_MAX_BODY_BYTES = 32 << 20


@dataclass(frozen=True, slots=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None  # None: derived from --model
    api_key: str | None = None  # None: no authentication
    max_request_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    response_store_size: int = 1000
    log_interval_s: float = 10.0
    shutdown_timeout_s: float = 30.0
    default_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    uvicorn_log_level: str = "warning"
    protect_metrics: bool = False  # with api_key: /metrics needs it too
    body_read_timeout_s: float = 30.0
    max_choices_per_request: int = 256  # prompts x n of one request
    max_queued_requests: int = 1024  # engine requests sent and not yet started
    structured_output_compile_timeout_s: float = 2.0
    engine_heartbeat_timeout_s: float = DEFAULT_HEARTBEAT_TIMEOUT_S
    engine_step_timeout_s: float = DEFAULT_STEP_TIMEOUT_S

    @property
    def hang_limits(self) -> HangLimits:
        return HangLimits(self.engine_heartbeat_timeout_s, self.engine_step_timeout_s)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ServerConfig:
        kwargs = _parse_json_flag("--default-chat-template-kwargs", args.default_chat_template_kwargs)
        config = cls(
            host=args.host,
            port=args.port,
            served_model_name=args.served_model_name,
            api_key=args.api_key or None,
            max_request_body_bytes=args.max_request_body_bytes,
            response_store_size=args.response_store_size,
            log_interval_s=args.log_interval_s,
            shutdown_timeout_s=args.shutdown_timeout_s,
            default_chat_template_kwargs=kwargs,
            uvicorn_log_level=args.uvicorn_log_level,
            protect_metrics=args.protect_metrics,
            body_read_timeout_s=args.body_read_timeout_s,
            max_choices_per_request=args.max_choices_per_request,
            max_queued_requests=args.max_queued_requests,
            structured_output_compile_timeout_s=args.structured_output_compile_timeout_s,
            engine_heartbeat_timeout_s=args.engine_heartbeat_timeout_s,
            engine_step_timeout_s=args.engine_step_timeout_s,
        )
        config.validate()
        return config

    def validate(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"--port must be in [0, 65535], got {self.port}")
        if self.max_request_body_bytes < 1024:
            raise ConfigError(f"--max-request-body-bytes must be >= 1024, got {self.max_request_body_bytes}")
        if self.response_store_size < 0:
            raise ConfigError(f"--response-store-size must be >= 0, got {self.response_store_size}")
        if self.log_interval_s <= 0:
            raise ConfigError(f"--log-interval-s must be > 0, got {self.log_interval_s}")
        if self.shutdown_timeout_s < 0:
            raise ConfigError(f"--shutdown-timeout-s must be >= 0, got {self.shutdown_timeout_s}")
        if self.served_model_name is not None and not self.served_model_name.strip():
            raise ConfigError("--served-model-name must not be empty")
        for flag, value in (
            ("--body-read-timeout-s", self.body_read_timeout_s),
            ("--structured-output-compile-timeout-s", self.structured_output_compile_timeout_s),
            ("--engine-heartbeat-timeout-s", self.engine_heartbeat_timeout_s),
            ("--engine-step-timeout-s", self.engine_step_timeout_s),
        ):
            if not value > 0:
                raise ConfigError(f"{flag} must be > 0, got {value}")
        if self.max_choices_per_request < 1:
            raise ConfigError(f"--max-choices-per-request must be >= 1, got {self.max_choices_per_request}")
        if self.max_queued_requests < self.max_choices_per_request:
            raise ConfigError(
                f"--max-queued-requests ({self.max_queued_requests}) must be >= --max-choices-per-request "
                f"({self.max_choices_per_request}): a request of the largest fan-out must fit the queue"
            )


def _parse_json_flag(flag: str, text: str | None) -> dict[str, Any]:
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{flag} must be a JSON object, got {text!r} ({exc})") from exc
    if not isinstance(value, dict):
        raise ConfigError(f"{flag} must be a JSON object, got {text!r}")
    return value


def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    d = ServerConfig()
    g = parser.add_argument_group("server")
    g.add_argument("--host", default=d.host, help="interface to listen on")
    g.add_argument("--port", type=int, default=d.port, help="TCP port (0: any free port)")
    g.add_argument(
        "--served-model-name",
        default=None,
        help="the model id clients send and /v1/models lists (default: the --model path)",
    )
    g.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV),
        help=f"require 'Authorization: Bearer KEY' on every route but /health, /ping, /version and /metrics "
        f"(default: ${API_KEY_ENV}; unset: no auth)",
    )
    g.add_argument(
        "--protect-metrics", action="store_true", help="with --api-key, /metrics needs the key too"
    )
    g.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=d.max_request_body_bytes,
        help="larger request bodies get HTTP 413",
    )
    g.add_argument(
        "--response-store-size",
        type=int,
        default=d.response_store_size,
        help="completed /v1/responses kept for previous_response_id (least recently used evicted)",
    )
    g.add_argument(
        "--log-interval-s",
        type=float,
        default=d.log_interval_s,
        help="seconds between load log lines while busy",
    )
    g.add_argument(
        "--shutdown-timeout-s",
        type=float,
        default=d.shutdown_timeout_s,
        help="on SIGTERM, seconds in-flight requests may still run before they are ended with an error",
    )
    g.add_argument(
        "--default-chat-template-kwargs",
        default=None,
        help="JSON object merged under each request's chat_template_kwargs, e.g. '{\"enable_thinking\": false}'",
    )
    g.add_argument(
        "--body-read-timeout-s",
        type=float,
        default=d.body_read_timeout_s,
        help="a request body not received in full within this many seconds gets HTTP 408",
    )
    g.add_argument(
        "--max-choices-per-request",
        type=int,
        default=d.max_choices_per_request,
        help="the most choices (prompts x n) one request may ask for; more is HTTP 400",
    )
    g.add_argument(
        "--max-queued-requests",
        type=int,
        default=d.max_queued_requests,
        help="engine requests that may wait to start; a request past it gets HTTP 503 with Retry-After",
    )
    g.add_argument(
        "--structured-output-compile-timeout-s",
        type=float,
        default=d.structured_output_compile_timeout_s,
        help="a JSON schema or grammar that takes longer to compile gets HTTP 400",
    )
    g.add_argument(
        "--engine-heartbeat-timeout-s",
        type=float,
        default=d.engine_heartbeat_timeout_s,
        help="an engine process silent this long (it sends a heartbeat every 0.5 s) is hung: /health "
        "turns 503, in-flight requests fail, the server exits 1",
    )
    g.add_argument(
        "--engine-step-timeout-s",
        type=float,
        default=d.engine_step_timeout_s,
        help="an engine loop that completes no step for this long while requests are pending is hung "
        "(keep it above the longest legitimate step: a full prefill chunk of the model on this device)",
    )
    g.add_argument(
        "--uvicorn-log-level",
        default=d.uvicorn_log_level,
        choices=["critical", "error", "warning", "info", "debug", "trace"],
        help="uvicorn's own log level (access lines at info)",
    )
