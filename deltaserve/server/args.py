"""`deltaserve serve` server flags and the validated ServerConfig they become."""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deltaserve.config import sampling_defaults
from deltaserve.engine.liveness import DEFAULT_HEARTBEAT_TIMEOUT_S, DEFAULT_STEP_TIMEOUT_S, HangLimits
from deltaserve.errors import ConfigError
from deltaserve.sampling_params import MAX_LOGPROBS
from deltaserve.vllm_flags import parse_json_flag

API_KEY_ENV = "DELTASERVE_API_KEY"
DEFAULT_MAX_BODY_BYTES = 32 << 20


@dataclass(frozen=True, slots=True)
class CorsConfig:
    """CORS headers for browser clients (`--allowed-origins` and friends); absent: no CORS headers."""

    allowed_origins: tuple[str, ...] = ("*",)
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False


@dataclass(frozen=True, slots=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    # The ids clients may send; the first is the one responses report. Empty: derived from --model.
    served_model_names: tuple[str, ...] = ()
    api_key: str | None = None  # None: no authentication
    max_request_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    response_store_size: int = 1000
    log_interval_s: float = 10.0
    shutdown_timeout_s: float = 30.0
    default_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    uvicorn_log_level: str = "warning"
    max_logprobs: int = MAX_LOGPROBS
    log_requests: bool = False  # one log line when a request arrives and one when it ends
    log_stats: bool = True  # the periodic load line
    generation_config: str = "auto"  # auto: the model's generation_config.json; vllm: none; else a folder
    # --override-generation-config: sampling defaults over generation_config's (validated keys and types)
    generation_overrides: dict[str, float | int] = field(default_factory=dict)
    fastapi_docs: bool = True  # /docs, /redoc and /openapi.json (--disable-fastapi-docs: none)
    force_include_usage: bool = False  # every stream ends with a usage chunk, asked for or not
    return_tokens_as_token_ids: bool = False  # logprob tokens spelled "token_id:N" for every request
    chat_template: str | None = None  # the template text (--chat-template FILE, read at start-up)
    chat_template_source: str | None = None  # where it came from, for error messages
    cors: CorsConfig | None = None
    root_path: str = ""
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    protect_metrics: bool = False  # with api_key: /metrics needs it too
    body_read_timeout_s: float = 30.0
    max_choices_per_request: int = 256  # prompts x n of one request
    max_queued_requests: int = 1024  # engine requests sent and not yet started
    # A request's tokens reach its endpoint (an SSE event when streaming) this many at a time, the first
    # token and the last at once: fewer, larger events cost the API process less per token.
    stream_interval: int = 1
    # API server processes sharing the listening socket and the engine (server/api_workers.py).
    api_server_count: int = 1
    structured_output_compile_timeout_s: float = 2.0
    engine_heartbeat_timeout_s: float = DEFAULT_HEARTBEAT_TIMEOUT_S
    engine_step_timeout_s: float = DEFAULT_STEP_TIMEOUT_S

    @property
    def served_model_name(self) -> str | None:
        return self.served_model_names[0] if self.served_model_names else None

    @property
    def hang_limits(self) -> HangLimits:
        return HangLimits(self.engine_heartbeat_timeout_s, self.engine_step_timeout_s)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ServerConfig:
        kwargs = parse_json_flag("--default-chat-template-kwargs", args.default_chat_template_kwargs)
        overrides = parse_json_flag("--override-generation-config", args.override_generation_config)
        template, template_source = _chat_template(args.chat_template)
        config = cls(
            host=args.host,
            port=args.port,
            served_model_names=tuple(args.served_model_name or ()),
            api_key=args.api_key or None,
            max_request_body_bytes=args.max_request_body_bytes,
            response_store_size=args.response_store_size,
            log_interval_s=args.log_interval_s,
            shutdown_timeout_s=args.shutdown_timeout_s,
            default_chat_template_kwargs=kwargs,
            uvicorn_log_level=args.uvicorn_log_level,
            max_logprobs=args.max_logprobs,
            log_requests=args.log_requests,
            log_stats=not args.disable_log_stats,
            generation_config=args.generation_config,
            generation_overrides=sampling_defaults(
                overrides, "--override-generation-config", only_sampling_keys=True
            ),
            fastapi_docs=not args.disable_fastapi_docs,
            force_include_usage=args.enable_force_include_usage,
            return_tokens_as_token_ids=args.return_tokens_as_token_ids,
            chat_template=template,
            chat_template_source=template_source,
            cors=_cors(args),
            root_path=args.root_path,
            ssl_keyfile=args.ssl_keyfile,
            ssl_certfile=args.ssl_certfile,
            protect_metrics=args.protect_metrics,
            body_read_timeout_s=args.body_read_timeout_s,
            max_choices_per_request=args.max_choices_per_request,
            max_queued_requests=args.max_queued_requests,
            stream_interval=args.stream_interval,
            api_server_count=args.api_server_count,
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
        for name in self.served_model_names:
            if not name.strip():
                raise ConfigError(f"--served-model-name must not be empty, got {name!r}")
        if not 0 <= self.max_logprobs <= MAX_LOGPROBS:
            raise ConfigError(
                f"--max-logprobs must be in [0, {MAX_LOGPROBS}] (the most this engine returns), "
                f"got {self.max_logprobs}"
            )
        if self.root_path and (not self.root_path.startswith("/") or self.root_path.endswith("/")):
            raise ConfigError(f"--root-path must start with '/' and not end with one, got {self.root_path!r}")
        if (self.ssl_keyfile is None) != (self.ssl_certfile is None):
            raise ConfigError("--ssl-keyfile and --ssl-certfile must be given together")
        for flag, path in (("--ssl-keyfile", self.ssl_keyfile), ("--ssl-certfile", self.ssl_certfile)):
            if path is not None and not os.path.isfile(path):
                raise ConfigError(f"{flag} must be a readable file, got {path!r} (no such file)")
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
        if self.api_server_count < 1:
            raise ConfigError(f"--api-server-count must be an integer >= 1, got {self.api_server_count}")
        if self.stream_interval < 1:
            raise ConfigError(
                f"--stream-interval must be an integer >= 1 (tokens per event), got {self.stream_interval}"
            )
        if self.max_queued_requests < self.max_choices_per_request:
            raise ConfigError(
                f"--max-queued-requests ({self.max_queued_requests}) must be >= --max-choices-per-request "
                f"({self.max_choices_per_request}): a request of the largest fan-out must fit the queue"
            )


def _chat_template(value: str | None) -> tuple[str | None, str | None]:
    """--chat-template: a file, or (as vLLM allows) the template itself on one line."""
    if value is None:
        return None, None
    if os.path.isfile(value):
        try:
            return Path(value).read_text(encoding="utf-8"), value
        except OSError as exc:
            raise ConfigError(f"--chat-template {value}: cannot be read ({exc.strerror})") from exc
    if "{" in value:
        return value, "--chat-template"
    raise ConfigError(f"--chat-template must be a jinja template file or the template text, got {value!r}")


def _json_list(flag: str, text: str | None) -> tuple[str, ...] | None:
    if text is None:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{flag} must be a JSON list of strings, got {text!r} ({exc})") from exc
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"{flag} must be a JSON list of strings, got {text!r}")
    return tuple(value)


def _cors(args: argparse.Namespace) -> CorsConfig | None:
    """CORS is on once any CORS flag is given; the others keep vLLM's defaults (everything allowed)."""
    lists = {
        name: _json_list(f"--{name.replace('_', '-')}", getattr(args, name))
        for name in ("allowed_origins", "allowed_methods", "allowed_headers")
    }
    if all(v is None for v in lists.values()) and not args.allow_credentials:
        return None
    given = {k: v for k, v in lists.items() if v is not None}
    return CorsConfig(**given, allow_credentials=args.allow_credentials)  # type: ignore[arg-type]


def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    d = ServerConfig()
    g = parser.add_argument_group("server")
    g.add_argument(
        "--host", default=d.host, help="interface to listen on (0.0.0.0: all interfaces; default: local only)"
    )
    g.add_argument("--port", type=int, default=d.port, help="TCP port (0: any free port)")
    g.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="the model ids clients may send, listed by /v1/models; responses report the first "
        "(default: the --model path)",
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
        "--api-server-count",
        type=int,
        default=d.api_server_count,
        help="API server processes serving the port, each with its own event loop, beside one engine: "
        "more streams per second of output at high concurrency (metrics are summed over them; a stored "
        "response is found by the process that answered it)",
    )
    g.add_argument(
        "--stream-interval",
        type=int,
        default=d.stream_interval,
        help="tokens per streamed event after the first (the last event may hold fewer): larger values "
        "cost the API process less per token at high concurrency, as vLLM's flag",
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
        type=str.lower,
        choices=["critical", "error", "warning", "info", "debug", "trace"],
        help="uvicorn's own log level (access lines at info)",
    )
    g.add_argument(
        "--max-logprobs",
        type=int,
        default=d.max_logprobs,
        help=f"the most logprobs / top_logprobs / prompt_logprobs a request may ask for (<= {MAX_LOGPROBS})",
    )
    g.add_argument(
        "--enable-log-requests",
        dest="log_requests",
        action="store_true",
        default=d.log_requests,
        help="log a line when each request arrives and when it ends",
    )
    g.add_argument(
        "--disable-log-requests",
        dest="log_requests",
        action="store_false",
        default=argparse.SUPPRESS,
        help="no per-request log lines (the default)",
    )
    g.add_argument("--disable-log-stats", action="store_true", help="no periodic load line")
    g.add_argument(
        "--generation-config",
        default=d.generation_config,
        help="sampling defaults for fields a request omits: auto (the model's generation_config.json), "
        "vllm (none: the API defaults), or a folder holding a generation_config.json",
    )
    g.add_argument(
        "--override-generation-config",
        default=None,
        help="JSON sampling defaults over --generation-config's, e.g. '{\"temperature\": 0.6}'",
    )
    g.add_argument("--disable-fastapi-docs", action="store_true", help="no /docs, /redoc or /openapi.json")
    g.add_argument(
        "--return-tokens-as-token-ids",
        action="store_true",
        help='logprob tokens spelled "token_id:N" for every request (a request may ask with the same field)',
    )
    g.add_argument(
        "--enable-force-include-usage",
        action="store_true",
        help="every stream ends with a usage chunk, whether stream_options asked for it or not",
    )
    g.add_argument(
        "--chat-template", default=None, help="a jinja chat template file replacing the model's own"
    )
    g.add_argument("--allowed-origins", default=None, help="CORS: JSON list of origins, e.g. '[\"*\"]'")
    g.add_argument("--allowed-methods", default=None, help="CORS: JSON list of methods (default all)")
    g.add_argument("--allowed-headers", default=None, help="CORS: JSON list of headers (default all)")
    g.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials")
    g.add_argument(
        "--root-path", default=d.root_path, help="the path prefix a proxy serves this server under"
    )
    g.add_argument("--ssl-keyfile", default=None, help="serve HTTPS with this private key (PEM)")
    g.add_argument("--ssl-certfile", default=None, help="serve HTTPS with this certificate (PEM)")
