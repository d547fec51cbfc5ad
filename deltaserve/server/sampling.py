"""Request fields -> SamplingParams, validated before anything reaches the engine.

Every check the engine would make at admission (field ranges, token ids in the vocabulary, prompt +
max_tokens within the context window) is made here first, so a bad request is a 400 naming its field
and never occupies the engine.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping

from deltaserve.engine.schema_rules import SchemaRuleError, check_depth
from deltaserve.errors import RequestValidationError
from deltaserve.sampling_params import (
    MAX_LOGPROBS,
    SamplingParams,
    StructuredOutputParams,
    bad_word_sequences,
    check_choices,
)
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
    defaults: Mapping[str, float | int] | None = None,
    max_logprobs: int = MAX_LOGPROBS,
    encode: Callable[[str], list[int]],
) -> SamplingParams:
    """SamplingParams for `req`, for ONE engine request (n = 1: with `allow_n` the endpoint fans `req.n`
    choices out itself, see SamplingParams.per_choice); `rename` maps SamplingParams field names to this
    endpoint's wire names (for the `param` of errors). `prompt_logprobs` overrides the request's
    (completions' echo). The request's structured output (response_format, structured_outputs or a
    guided_* field) is enforced from the start of the output, or after the `structured_start` token (the
    end of a reasoning block); `structured` replaces it (the Responses API's text.format, a forced tool
    call). `defaults` (generation_config.json's) fill the sampling fields the request omits; logprobs
    beyond `max_logprobs` (--max-logprobs) are refused."""
    if not allow_n and req.n != 1:
        raise unsupported("n", f"n > 1 is not supported by this endpoint, got {req.n}; send n requests")
    source = "response_format"
    if structured is None:
        source = structured_field(req) or source
        structured = structured_output(req, structured_start)
    kwargs: dict[str, object] = {f: getattr(req, f) for f in _OPTIONAL_FLOATS if getattr(req, f) is not None}
    if req.top_k is not None:
        kwargs["top_k"] = req.top_k
    for name, value in (defaults or {}).items():
        kwargs.setdefault(name, value)
    params = SamplingParams(
        seed=req.seed,
        max_tokens=max_tokens,
        min_tokens=req.min_tokens,
        stop=list(req.stop) if isinstance(req.stop, list) else req.stop,
        stop_token_ids=list(req.stop_token_ids or []),
        ignore_eos=req.ignore_eos,
        logprobs=logprobs,
        logit_bias=_logit_bias(req.logit_bias),
        allowed_token_ids=None if req.allowed_token_ids is None else list(req.allowed_token_ids),
        bad_words_token_ids=_bad_words(req.bad_words, encode),
        skip_special_tokens=req.skip_special_tokens,
        spaces_between_special_tokens=req.spaces_between_special_tokens,
        include_stop_str_in_output=req.include_stop_str_in_output,
        prompt_logprobs=prompt_logprobs if prompt_logprobs is not None else req.prompt_logprobs,
        structured_output=structured,
        **kwargs,  # type: ignore[arg-type]
    )
    names = {"structured_output": source, **(rename or {})}
    try:
        if allow_n:
            check_choices(req.n)
        params.validate()
        params.validate_token_ids(vocab_size)
    except RequestValidationError as err:
        raise from_validation(err, names) from err
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(params, name)
        if value is not None and value > max_logprobs:
            wire = names.get(name, name)
            raise bad_request(
                f"{wire} must be <= {max_logprobs} (the server's --max-logprobs), got {value}", wire
            )
    return params


def _bad_words(words: list[str] | None, encode: Callable[[str], list[int]]) -> list[list[int]] | None:
    if not words:
        return None
    try:
        return bad_word_sequences(words, encode)
    except RequestValidationError as err:
        raise from_validation(err) from err


_GUIDED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


def structured_field(req: SamplingFields) -> str | None:
    """The one request field that asks for structured output (None: none does); 400 when several do."""
    fmt = req.response_format
    given = ["response_format"] if fmt is not None and fmt.type != "text" else []
    if req.structured_outputs is not None:
        given.append("structured_outputs")
    given += [name for name in _GUIDED if getattr(req, name) is not None]
    if len(given) > 1:
        raise bad_request(f"{' and '.join(given)} each constrain the output; send only one of them", given[1])
    return given[0] if given else None


def structured_output(req: SamplingFields, start_after: int | None) -> StructuredOutputParams | None:
    """The request's structured output -> the engine's constraint: response_format (json_object, or
    json_schema's `schema`), vLLM's structured_outputs, or its older guided_json / guided_regex /
    guided_choice / guided_grammar."""
    field = structured_field(req)
    if field is None:
        return None
    if field == "response_format":
        fmt = req.response_format
        assert fmt is not None
        spec = (fmt.model_extra or {}).get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        return json_constraint(fmt.type, schema, start_after, param=field, where="json_schema.schema")
    if field == "structured_outputs":
        outputs = req.structured_outputs
        assert outputs is not None
        given = {
            key: value
            for key in ("json_schema", "regex", "choice", "grammar", "json_object", "structural_tag")
            if (value := getattr(outputs, key)) is not None and value is not False
        }
        if len(given) != 1:
            wire = sorted("json" if k == "json_schema" else k for k in given)
            raise bad_request(
                "structured_outputs must set exactly one of json, regex, choice, grammar, json_object or "
                f"structural_tag, got {wire}",
                field,
            )
        ((kind, value),) = given.items()
        return _constraint(kind, value, start_after, field)
    return _constraint(_GUIDED[field], getattr(req, field), start_after, field)


def _constraint(kind: str, value: object, start_after: int | None, param: str) -> StructuredOutputParams:
    """One vLLM structured-output key (json, regex, choice, grammar, json_object, structural_tag)."""
    if kind in ("json", "json_schema", "structural_tag"):
        text = value if isinstance(value, str) else json.dumps(value)
        try:
            parsed = json.loads(text)
        except ValueError as err:
            raise bad_request(f"{param} must be a JSON object or its JSON text ({err})", param) from None
        if not isinstance(parsed, dict):
            raise bad_request(f"{param} must be a JSON object, got {type(parsed).__name__}", param)
        key = "structural_tag" if kind == "structural_tag" else "json_schema"
        return StructuredOutputParams(**{key: text}, start_after_token_id=start_after)
    if kind == "json_object":
        return StructuredOutputParams(json_object=True, start_after_token_id=start_after)
    if kind == "grammar":
        return StructuredOutputParams(ebnf=value, start_after_token_id=start_after)  # type: ignore[arg-type]
    return StructuredOutputParams(**{kind: value}, start_after_token_id=start_after)  # type: ignore[arg-type]


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


def truncate_prompt(ids: list[int], keep: int | None, max_model_len: int) -> list[int]:
    """vLLM's truncate_prompt_tokens: the prompt's last `keep` tokens (-1: as many as the context window
    holds); None keeps the whole prompt."""
    if keep is None:
        return ids
    if keep == -1:
        keep = max_model_len
    if keep < 1:
        raise bad_request(
            f"truncate_prompt_tokens must be -1 or an integer >= 1, got {keep}", "truncate_prompt_tokens"
        )
    return ids[-keep:] if len(ids) > keep else ids


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
