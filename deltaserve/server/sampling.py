"""Request fields -> SamplingParams, validated before anything reaches the engine.

Every check the engine would make at admission (field ranges, token ids in the vocabulary, prompt +
max_tokens within the context window) is made here first, so a bad request is a 400 naming its field
and never occupies the engine.
"""

from __future__ import annotations

import json

from deltaserve.engine.schema_rules import SchemaRuleError, check_depth
from deltaserve.errors import RequestValidationError
from deltaserve.sampling_params import SamplingParams, StructuredOutputParams, check_choices
from deltaserve.server.errors import APIError, bad_request, from_validation, unsupported
from deltaserve.server.protocol import SamplingFields

_OPTIONAL_FLOATS = (
    "temperature",
    "top_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)


def build_params(
    req: SamplingFields,
    *,
    max_tokens: int | None,
    logprobs: int | None,
    vocab_size: int,
    rename: dict[str, str] | None = None,
    prompt_logprobs: int | None = None,
    allow_n: bool = False,
    structured_start: int | None = None,
    structured: StructuredOutputParams | None = None,
) -> SamplingParams:
    """SamplingParams for `req`, for ONE engine request (n = 1: with `allow_n` the endpoint fans `req.n`
    choices out itself, see SamplingParams.per_choice); `rename` maps SamplingParams field names to this
    endpoint's wire names (for the `param` of errors). `prompt_logprobs` overrides the request's
    (completions' echo). A JSON response_format is enforced from the start of the output, or after the
    `structured_start` token (the end of a reasoning block); `structured` replaces it (the Responses
    API's text.format)."""
    if not allow_n and req.n != 1:
        raise unsupported("n", f"n > 1 is not supported by this endpoint, got {req.n}; send n requests")
    if structured is None:
        structured = structured_output(req, structured_start)
    kwargs: dict[str, object] = {f: getattr(req, f) for f in _OPTIONAL_FLOATS if getattr(req, f) is not None}
    if req.top_k is not None:
        kwargs["top_k"] = req.top_k
    params = SamplingParams(
        seed=req.seed,
        max_tokens=max_tokens,
        min_tokens=req.min_tokens,
        stop=list(req.stop) if isinstance(req.stop, list) else req.stop,
        stop_token_ids=list(req.stop_token_ids or []),
        ignore_eos=req.ignore_eos,
        logprobs=logprobs,
        logit_bias=_logit_bias(req.logit_bias),
        skip_special_tokens=req.skip_special_tokens,
        include_stop_str_in_output=req.include_stop_str_in_output,
        prompt_logprobs=prompt_logprobs if prompt_logprobs is not None else req.prompt_logprobs,
        structured_output=structured,
        **kwargs,  # type: ignore[arg-type]
    )
    try:
        if allow_n:
            check_choices(req.n)
        params.validate()
        params.validate_token_ids(vocab_size)
    except RequestValidationError as err:
        raise from_validation(err, {"structured_output": "response_format", **(rename or {})}) from err
    return params


def structured_output(req: SamplingFields, start_after: int | None) -> StructuredOutputParams | None:
    """response_format -> the engine's JSON constraint: json_object, or json_schema's `schema`."""
    fmt = req.response_format
    if fmt is None:
        return None
    spec = (fmt.model_extra or {}).get("json_schema")
    schema = spec.get("schema") if isinstance(spec, dict) else None
    return json_constraint(fmt.type, schema, start_after, param="response_format", where="json_schema.schema")


def json_constraint(
    kind: str, schema: object, start_after: int | None, *, param: str, where: str
) -> StructuredOutputParams | None:
    """A format's type ("text", "json_object", "json_schema") and schema (found at `where` in `param`)
    -> the engine's JSON constraint, starting after `start_after` when set."""
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputParams(json_object=True, start_after_token_id=start_after)
    if not isinstance(schema, dict):
        raise bad_request(f"{param} type 'json_schema' needs {where}, a JSON schema object", param)
    try:
        check_depth(schema)  # before json.dumps, which recurses
    except SchemaRuleError as err:
        raise bad_request(f"{param}: {err}", param) from err
    return StructuredOutputParams(json_schema=json.dumps(schema), start_after_token_id=start_after)


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """JSON object keys are strings; the engine wants token ids."""
    if bias is None:
        return None
    out: dict[int, float] = {}
    for key, value in bias.items():
        try:
            out[int(key)] = value
        except ValueError:
            raise bad_request(f"logit_bias keys must be token ids, got {key!r}", "logit_bias") from None
    return out


def check_prompt_text(text: str, max_model_len: int, max_token_chars: int, *, param: str = "prompt") -> None:
    """Refuses, before it is tokenized, a prompt text too long for the context window: no token covers
    more than `max_token_chars` characters, so it has at least len(text) / max_token_chars tokens."""
    at_least = -(-len(text) // max_token_chars)
    if at_least >= max_model_len:
        raise APIError(
            400,
            f"the prompt ({len(text)} characters, so at least {at_least} tokens) leaves no room in the "
            f"context window of {max_model_len} tokens for any output; shorten the prompt",
            param=param,
            code="context_length_exceeded",
        )


def check_context_window(
    prompt_len: int,
    max_tokens: int | None,
    max_model_len: int,
    *,
    max_tokens_field: str = "max_tokens",
    prompt_field: str = "prompt",
) -> None:
    """The prompt, plus max_tokens when given (else at least one output token), fits the context window."""
    if prompt_len == 0:
        raise bad_request("the prompt is empty; send at least one token", prompt_field)
    if prompt_len >= max_model_len:
        raise APIError(
            400,
            f"the prompt ({prompt_len} tokens) leaves no room in the context window of {max_model_len} "
            "tokens for any output; shorten the prompt",
            param=prompt_field,
            code="context_length_exceeded",
        )
    if max_tokens is not None and prompt_len + max_tokens > max_model_len:
        raise APIError(
            400,
            f"prompt ({prompt_len} tokens) + {max_tokens_field} ({max_tokens}) = {prompt_len + max_tokens} "
            f"exceeds the context window of {max_model_len} tokens; lower {max_tokens_field} or shorten "
            "the prompt",
            param=max_tokens_field,
            code="context_length_exceeded",
        )
