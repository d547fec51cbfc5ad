"""Everything a request handler needs, built once at start-up and kept on `app.state.server`."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from fastapi import Request

from deltaserve.engine.client import AsyncEngineClient
from deltaserve.sampling_params import SamplingParams
from deltaserve.server.admission import Admission
from deltaserve.server.args import ServerConfig
from deltaserve.server.errors import NOT_FOUND, APIError, bad_request, engine_unavailable
from deltaserve.server.grammar_check import GrammarChecker
from deltaserve.server.logprobs import TOKEN_ID_TEXTS, TokenSpelling, TokenTexts
from deltaserve.server.metrics import ServerMetrics
from deltaserve.server.offload import TextWorkers
from deltaserve.server.response_store import ResponseStore
from deltaserve.tokenizer import Tokenizer

logger = logging.getLogger("deltaserve.server")


@dataclass(slots=True)
class ServerState:
    config: ServerConfig
    client: AsyncEngineClient
    tokenizer: Tokenizer
    model_name: str  # the id responses report
    metrics: ServerMetrics
    responses: ResponseStore
    token_texts: TokenTexts
    workers: TextWorkers
    grammars: GrammarChecker
    admission: Admission
    # Set once, never cleared: a draining (SIGTERM) or dead-engine server takes no new work.
    draining: bool = False
    dead_reason: str | None = None
    inflight: int = 0  # engine requests between submission and their terminal
    model_aliases: tuple[str, ...] = ()  # further ids clients may send (--served-model-name A B ...)
    # generation_config.json sampling defaults, for the fields a request omits (--generation-config)
    sampling_defaults: dict[str, float | int] = field(default_factory=dict)

    @property
    def model_names(self) -> tuple[str, ...]:
        return (self.model_name, *self.model_aliases)

    @property
    def max_model_len(self) -> int:
        return self.client.info.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.client.info.vocab_size

    @property
    def healthy(self) -> bool:
        return self.dead_reason is None and not self.client.dead and not self.draining

    async def check_structured_output(
        self, params: SamplingParams, param: str | None = "response_format"
    ) -> None:
        """A specification the engine could not compile, or not within the time limit, is a 400 (naming
        `param`) here, before the engine sees it."""
        spec = params.structured_output
        if spec is None:
            return
        error = await self.grammars.check(spec)
        if error is not None:
            raise bad_request(error, param)

    def check_model(self, name: str | None) -> None:
        """404 for a model id this server does not serve; a missing id means the served model."""
        if name is not None and name not in self.model_names:
            served = self.model_name if not self.model_aliases else list(self.model_names)
            raise APIError(
                404,
                f"the model {name!r} does not exist; this server serves {served!r}",
                type=NOT_FOUND,
                param="model",
                code="model_not_found",
            )

    def token_spelling(self, as_ids: bool | None) -> TokenSpelling:
        """How this request's logprobs spell tokens: "token_id:N" when it (or --return-tokens-as-token-ids)
        asks for ids, else their text."""
        return TOKEN_ID_TEXTS if as_ids or self.config.return_tokens_as_token_ids else self.token_texts

    def check_available(self) -> None:
        if self.client.dead or self.dead_reason is not None:
            raise engine_unavailable(self.dead_reason or self.client.dead_reason or "the engine died")
        if self.draining:
            raise engine_unavailable("the server is shutting down")

    def warn_unknown_fields(self, endpoint: str, fields: list[str]) -> None:
        if fields:
            logger.warning("%s: ignoring unknown request fields %s", endpoint, fields)


def get_state(request: Request) -> ServerState:
    return request.app.state.server
